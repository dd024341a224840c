"""``meshtron emulate [train flags] --world-size N``: chosen ranks of an N-GPU layout, run for real here.

Each chosen rank (default: the first rank of every pipeline stage) builds exactly what it would build in the
real job and runs warm-up + timed iterations of its real schedule on the local device, every collective
emulated (:mod:`meshtron.emulation.runner`). For each rank it prints the measured peak memory and pass times,
the recorded communication per group, and the predicted step time (measured compute + modelled
communication + the simulated pipeline bubble, :mod:`meshtron.emulation.predict`), with ``meshtron plan``'s
prediction beside it. Nothing here measures a cluster: see docs/emulation.md for what is measured and what is
modelled.

``--as-train`` runs the ``meshtron train`` program itself as each chosen rank (for trace comparisons with
``--record-collectives``), without timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Sequence

from meshtron.errors import ConfigError


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="meshtron emulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="GPUs of the layout (N)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs that share NVLink (default 8)")
    parser.add_argument("--ranks", default="stages",
                        help="global ranks to run, comma-separated, 'stages' (the first rank of each pipeline stage, "
                             "the default) or 'all'")
    parser.add_argument("--gpu", choices=("H100", "H200", "B200"), help="device profile of the links and the "
                        "planner (default: the local GPU's kind, else H100)")
    parser.add_argument("--profile", help="a device profile JSON (meshtron plan --calibrate --out FILE)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed iterations per rank (median)")
    parser.add_argument("--split-repeats", type=int, default=3,
                        help="runs of the forward and the forward-backward pass that time the step's split "
                             "(median; 1 for steps that take minutes, e.g. a million tokens)")
    parser.add_argument("--measure-micro-batches", type=int, metavar="K",
                        help="run steps of K micro-batches instead of the job's (faster for large global batches): "
                             "passes and per-micro-batch communication are scaled to the job's count, the bubble "
                             "is simulated at it")
    parser.add_argument("--record-collectives", metavar="PATH", help="write each rank's trace to PATH.rank<r>.jsonl")
    parser.add_argument("--emulate-routing", default="balanced", metavar="balanced|data|skew:S",
                        help="MoE routing of the emulated steps: balanced (default: experts chosen from random logits, "
                             "--moe-router-force-load-balancing, as in a trained, balanced model), data (the "
                             "freshly initialised router on random tokens) or skew:S (hot experts: expert e's "
                             "random logit shifted by -S ln(e + 1), --moe-router-force-skew; the first "
                             "expert-parallel rank holds the hottest, and receives from every rank what it "
                             "routes to itself)")
    parser.add_argument("--as-train", action="store_true",
                        help="run the meshtron train program itself as each chosen rank (no timing)")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank instead of a table")
    parser.add_argument("--out", metavar="FILE", help="also append each rank as a record to FILE "
                                                      "(benchmarks/emulated.jsonl)")
    return parser.parse_known_args(list(argv))


def _ranks(spec: str, world: int, pp: int) -> list[int]:
    from meshtron.emulation.runner import default_ranks

    if spec == "stages":
        return default_ranks(world, 1, 1, pp)
    if spec == "all":
        return list(range(world))
    try:
        ranks = [int(r) for r in spec.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--ranks {spec!r}: give comma-separated integers, 'stages' or 'all'") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ConfigError(f"--ranks {spec!r}: ranks must lie in 0..{world - 1}")
    return ranks


def _routing_skew(spec: str) -> float:
    """The S of ``--emulate-routing skew:S`` (0 for balanced and data); ConfigError for anything else."""
    if spec in ("balanced", "data"):
        return 0.0
    kind, _, value = spec.partition(":")
    try:
        skew = float(value) if kind == "skew" else -1.0
    except ValueError:
        skew = -1.0
    if not skew > 0:
        raise ConfigError(f"--emulate-routing {spec!r}: give balanced, data or skew:S with S > 0 (e.g. skew:1.0)")
    return skew


def _profile(args):
    from meshtron.planning.profiles import builtin_profile, choose_profile

    if args.gpu or args.profile:
        return choose_profile(args.gpu, args.profile)
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return builtin_profile("H200" if "H200" in name else ("B200" if "B200" in name else "H100"))


def emulate_main(argv: Sequence[str]) -> int:
    args, train_argv = _parse(argv)
    from meshtron.cli import build_config
    from meshtron.emulation import runner

    if args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: give the layout's number of GPUs (>= 1)")
    for flag, value, least in (("--warmup", args.warmup, 0), ("--steps", args.steps, 1),
                               ("--split-repeats", args.split_repeats, 1)):
        if value < least:
            raise ConfigError(f"{flag} {value}: give at least {least}")
    skew = _routing_skew(args.emulate_routing)
    probe = build_config(train_argv)
    pp = probe.parallel.pipeline_model_parallel_size
    ranks = _ranks(args.ranks, args.world_size, pp)
    print(runner.NOTICE, file=sys.stderr)
    if args.as_train:
        for rank in ranks:
            argv_rank = train_argv + (["--record-collectives", args.record_collectives]
                                      if args.record_collectives else [])
            runner.emulate_training(argv_rank, args.world_size, rank)
        return 0
    import torch

    profile = _profile(args)
    if probe.model.num_experts and args.emulate_routing != "data":
        train_argv = train_argv + ["--moe-router-force-load-balancing"]
        if skew:
            train_argv = train_argv + ["--moe-router-force-skew", str(skew)]
    rows = []
    for rank in ranks:
        try:
            emulated = runner.emulate_rank(train_argv, args.world_size, rank, args.gpus_per_node, args.warmup,
                                           args.steps, args.record_collectives, args.measure_micro_batches,
                                           args.split_repeats)
        except torch.OutOfMemoryError as err:  # the answer "does not fit" is a result, not a crash
            rows.append({"rank": rank, "world_size": args.world_size, "argv": " ".join(train_argv),
                         "error": "out of memory: " + " ".join(str(err).split())[:300]})
            print(json.dumps(rows[-1]) if args.json else f"rank {rank}: {rows[-1]['error']}", flush=True)
            continue
        rows.append(report_row(emulated, train_argv, args.world_size, args.gpus_per_node, profile))
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print(format_rows([r for r in rows if "error" not in r]))
    if args.out:
        from meshtron.bench import current_commit

        stamp = {"device_kind": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "commit": current_commit(), "torch": torch.__version__, "date": datetime.date.today().isoformat()}
        with open(args.out, "a", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps({**row, **stamp}) + "\n")
    return 0


def report_row(emulated, train_argv: Sequence[str], world: int, gpus_per_node: int, profile) -> dict:
    """The measured figures of one emulated rank, its prediction, and the planner's beside it."""
    from meshtron.emulation.predict import fit_passes, predict_rank, summarise_step
    from meshtron.emulation.runner import _config
    from meshtron.planning.step_time import DATASHEET_PEAK_TFLOPS, Links, bubble_fraction, predict_step
    from meshtron.training.metrics import compute_throughput, flops_per_token

    cfg = _config(train_argv, world, 1)
    p, t = cfg.parallel, cfg.train
    pp, vp = p.pipeline_model_parallel_size, (p.virtual_pipeline_model_parallel_size or 1)
    scale = emulated.micro_batches / emulated.measured_micro_batches
    measured_fwd, measured_bwd = fit_passes(emulated.forward_s, emulated.backward_s, emulated.step_s,
                                            emulated.data_s)
    forward, backward = measured_fwd * scale, measured_bwd * scale
    comm = summarise_step(emulated.records, emulated.spans_nodes, profile, forward, backward, pp, scale)
    bubble = bubble_fraction(pp, vp, emulated.micro_batches, p.pipeline_schedule)
    other = max(0.0, emulated.step_s - measured_fwd - measured_bwd - emulated.optimizer_s)
    pred = predict_rank(forward, backward, emulated.optimizer_s, other, comm, bubble)
    vocab = cfg.model.vocab_size or 32000
    tokens = t.global_batch_size * cfg.model.seq_length
    fpt = flops_per_token(cfg.model, vocab)
    speed = compute_throughput(tokens, world, pred.step_s, fpt, DATASHEET_PEAK_TFLOPS.get(profile.name))
    try:
        planner = predict_step(cfg, world, profile, vocab, Links(gpus_per_node))
        planner_step = planner.step_s
    except Exception as err:  # noqa: BLE001 - the planner's own refusal is reported, not fatal
        planner_step, planner = None, err
    return {
        "rank": emulated.rank, "coordinates": emulated.coordinates, "layout": emulated.layout, "world_size": world,
        "gpus_per_node": gpus_per_node, "argv": " ".join(train_argv), "device": emulated.device,
        "profile": profile.name, "micro_batches": emulated.micro_batches,
        "measured_micro_batches": emulated.measured_micro_batches,
        "optimizer_state_held": True,  # made at the first step, skipped or not (runner.hold_optimizer_state)
        "measured": {"peak_mem_gib": emulated.peak_mem_gib, "peak_reserved_gib": emulated.peak_reserved_gib,
                     "alloc_retries": emulated.alloc_retries,
                     "step_s_comm_emulated": emulated.step_s, "forward_s": emulated.forward_s,
                     "backward_s": emulated.backward_s, "optimizer_s": emulated.optimizer_s},
        "modelled": {"comm_bytes_by_group": comm.bytes_by_group, "comm_s_by_group": comm.seconds_by_group,
                     "exposed_comm_s_by_group": comm.exposed_by_group, "bubble_fraction": bubble,
                     "bubble_s": pred.bubble_s},
        "predicted": {"step_s": pred.step_s, "tokens_per_sec_per_gpu": speed.tokens_per_sec_per_gpu,
                      "mfu": speed.mfu, "exposed_comm_s": pred.exposed_comm_s},
        "planner": {"step_s": planner_step, "est_mem_gib": emulated.est_mem_gib,
                    "tokens_per_sec_per_gpu": None if planner_step is None else planner.tokens_per_sec_per_gpu},
    }


def format_rows(rows: Sequence[dict]) -> str:
    """A table: one line per emulated rank, the planner beside it."""
    head = ("| rank | stage | peak GiB (measured) | est GiB (planner) | fwd ms | bwd ms | opt ms | exposed comm ms "
            "| bubble ms | step ms (predicted) | tok/s/GPU (predicted) | step ms (planner) |")
    lines = [head, "|" + "---|" * 12]

    def ms(v):
        return "-" if v is None else f"{v * 1000:,.1f}"

    for r in rows:
        m, pr, pl = r["measured"], r["predicted"], r["planner"]
        peak = "-" if m["peak_mem_gib"] is None else f"{m['peak_mem_gib']:.2f}"
        lines.append(f"| {r['rank']} | {r['coordinates']['pp']} | {peak} | {pl['est_mem_gib']:.2f} | "
                     f"{ms(m['forward_s'])} | {ms(m['backward_s'])} | {ms(m['optimizer_s'])} | "
                     f"{ms(pr['exposed_comm_s'])} | {ms(r['modelled']['bubble_s'])} | {ms(pr['step_s'])} | "
                     f"{pr['tokens_per_sec_per_gpu']:,.0f} | {ms(pl['step_s'])} |")
    lines.append("measured: memory and pass times of each rank on this device; modelled: communication from the "
                 "device profile's links and the pipeline bubble from the schedule simulator (docs/emulation.md)")
    return "\n".join(lines)
