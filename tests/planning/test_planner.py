"""The layout planner: the step-time model against every measured row, the search, --calibrate, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import pytest

from meshtron.errors import ConfigError
from meshtron.planning.measured import load_records, step_errors, timed_records
from meshtron.planning.profiles import H100, H200, builtin_profile, load_profile

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "measured.jsonl")
# Target: every timed row within 10%, met: worst d23 (llama3-8b DP=2, +9.8%), median 2.5%. Rows measured at
# code that has changed since (``code_changed``: a6 before the fused loss's compiled passes, the FP8 rows before
# b3ecf7b, the DeepSeek/Qwen MoE rows before 0d04f82, h18 among them, and before 2aa326e) are left out, with the
# reason printed; rows measured while the layers kept more (``layer_saves``, e.g. SwiGLU's product) are
# predicted with that code's saves and recomputations. The median bound is today's median rounded up, so the test fails when the model
# drifts (docs/planning.md lists the error per feature).
STEP_TOLERANCE = 0.10
MEDIAN_TOLERANCE = 0.026


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_records(PATH)


def test_step_time_against_every_timed_row(records):
    from meshtron.planning.measured import left_out, step_model_gaps

    print("left out:", "; ".join(f"{i} ({why})" for i, why in sorted(left_out(records).items())))
    print("not modelled yet:", "; ".join(f"{i} ({why})" for i, why in sorted(step_model_gaps(records).items())))
    errors = step_errors(records, H200)
    assert len(errors) >= 115 and len(errors) == len(timed_records(records))
    worst = max(errors, key=lambda e: abs(e.relative))
    print(f"worst row: {worst.id}: measured {worst.measured_s:.3f} s, predicted {worst.predicted_s:.3f} s "
          f"({worst.relative:+.1%}); median |error| {statistics.median(abs(e.relative) for e in errors):.1%}")
    assert abs(worst.relative) <= STEP_TOLERANCE, worst
    assert statistics.median(abs(e.relative) for e in errors) <= MEDIAN_TOLERANCE


def test_superseded_rows_are_left_out(records):
    ids = {r["id"] for r in timed_records(records)}
    assert "c2" not in ids and "d12" not in ids and "e4" in ids  # e4 measured d12's flags at today's FP8 code


def _search(model, gpus, seq, gbs, profile=H100, top=3, **fixed):
    from meshtron.cli import build_config
    from meshtron.planning.search import SearchSpace, search

    argv = ["--model", model, "--seq-length", str(seq), "--global-batch-size", str(gbs)]
    plans, considered, fitting = search(build_config(argv), argv, gpus, profile, top=top,
                                        space=SearchSpace(allow_fp8=False, fixed=fixed))
    return plans, considered, fitting


# The guide's table (/work/shared/reference/megatron-core-user-guide.md), on 80 GB H100s, and its Mixtral example.
GUIDE = [("llama2-7b", 8, 4096, 1024, dict(tp=1, pp=1, cp=1), True),
         ("llama2-13b", 8, 4096, 1024, dict(tp=2, pp=1, cp=1), True),
         ("llama3-70b", 64, 4096, 1024, dict(tp=4, pp=4, cp=1), True),
         # Both fit only with the gradients sharded too (ZeRO-2): with ZeRO-1 the 405B's weights, fp32 gradients
         # and Adam state take ~71 GiB per GPU, and Mixtral's experts' fp32 gradients are not sharded.
         ("llama3-405b", 128, 8192, 256, dict(tp=8, pp=8, cp=2), True),
         ("mixtral-8x7b", 32, 4096, 1024, dict(tp=2, pp=1, ep=4), True)]


# The 70B and Mixtral searches are slow (the 70B layouts are searched again below, fast).
@pytest.mark.parametrize("model,gpus,seq,gbs,guide,guide_fits",
                         [pytest.param(*g, marks=pytest.mark.slow) if g[0] in ("llama3-70b", "mixtral-8x7b") else g
                          for g in GUIDE], ids=[g[0] for g in GUIDE])
def test_search_proposes_fitting_layouts_for_the_guide(model, gpus, seq, gbs, guide, guide_fits):
    plans, considered, fitting = _search(model, gpus, seq, gbs, top=2)
    limit = H100.memory_gib * 0.9 * 2**30
    assert plans and considered > fitting > 0
    assert all(p.memory_bytes <= limit for p in plans)
    assert plans[0].tokens_per_sec_per_gpu >= plans[-1].tokens_per_sec_per_gpu
    best = plans[0]
    assert 0.2 < best.step.mfu < 0.8
    guide_plans, _, _ = _search(model, gpus, seq, gbs, top=1, **guide)
    assert bool(guide_plans) == guide_fits
    if guide_plans:  # the planner's first choice is at least as fast as the guide's layout at its best
        assert best.tokens_per_sec_per_gpu >= guide_plans[0].tokens_per_sec_per_gpu


def test_printed_command_is_a_valid_train_command():
    from meshtron.cli import parse_train_args
    from meshtron.planning.validate import validate_for_plan

    plans, _, _ = _search("llama3-70b", 64, 4096, 256, top=2, tp=4, pp=4)
    command = plans[0].command
    assert command[:2] == ["meshtron", "train"] and "--nnodes" in command
    cfg = parse_train_args(command[2:]).config  # the real parser
    validate_for_plan(cfg, 64)  # the real configuration check
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (4, 4)
    assert cfg.train.micro_batch_size == plans[0].layout.micro_batch


def test_first_choice_on_two_h200s_is_as_fast_as_the_fastest_measured(records):
    """llama3-8b on two H200s: the first choice is predicted at least as fast as every layout measured by
    hand on two GPUs (each predicted by the same model), and within the model's error of the fastest."""
    from meshtron.cli import build_config
    from meshtron.planning.measured import record_config, record_links
    from meshtron.planning.search import SearchSpace, search
    from meshtron.planning.step_time import predict_step

    argv = ["--model", "llama3-8b", "--seq-length", "4096", "--global-batch-size", "24"]
    plans, _, _ = search(build_config(argv), argv, 2, H200, top=1, space=SearchSpace())
    first = plans[0].tokens_per_sec_per_gpu
    hand = [r for r in timed_records(records) if r["model"] == "llama3-8b" and r["gpu_count"] == 2
            and r["seq"] == 4096 and "--num-layers" not in r["flags"]]
    assert len(hand) > 20
    for r in hand:
        assert first >= predict_step(record_config(r), 2, H200, links=record_links(r)).tokens_per_sec_per_gpu, r["id"]
    fastest = max(r["tokens_per_sec_per_gpu"] for r in hand)
    assert first >= fastest * (1 - STEP_TOLERANCE)


def test_calibrate_on_cpu_writes_a_profile_that_plan_reads(tmp_path, capsys):
    from meshtron.planning.cli import plan_main

    out = str(tmp_path / "profile.json")
    assert plan_main(["--calibrate", "--out", out]) == 0
    with open(out) as f:
        data = json.load(f)
    assert data["matmul_tflops"] > 0 and data["hbm_gbps"] > 0 and data["attention_tflops"] > 0
    assert data["extra"]["matmul"] and data["extra"]["allreduce_busbw_gbps"] is None  # one rank: skipped
    profile = load_profile(out)
    assert profile.matmul_tflops == data["matmul_tflops"]
    capsys.readouterr()
    assert plan_main(["--model", "qwen3-0.6b", "--gpus", "1", "--profile", out, "--seq-length", "1024",
                      "--global-batch-size", "4", "--top", "1", "--json", "--no-fp8"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert row["rank"] == 1 and row["command"].startswith("meshtron train --model qwen3-0.6b")


def test_saturating_fit_recovers_its_constants():
    from meshtron.planning.calibrate import fit_saturating

    sizes = [1.0, 4.0, 16.0, 64.0]
    peak, half = fit_saturating(sizes, [700 * s / (s + 3.0) for s in sizes])
    assert peak == pytest.approx(700) and half == pytest.approx(3.0)


def test_bad_planner_flags_name_the_flag(tmp_path):
    from meshtron.planning.cli import plan_main
    from meshtron.planning.search_cli import parse_compare

    with pytest.raises(ConfigError, match="--gpu"):
        builtin_profile("A100")
    with pytest.raises(ConfigError, match="--profile"):
        load_profile(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"matmul_tflops": -1}))
    with pytest.raises(ConfigError, match="matmul_tflops"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="--compare"):
        parse_compare("TP=four")
    with pytest.raises(ConfigError, match="--global-batch-size"):
        plan_main(["--model", "llama3-1b", "--gpus", "2"])
    with pytest.raises(ConfigError, match="--gpus"):
        plan_main(["--model", "llama3-1b", "--gpus", "0", "--global-batch-size", "8"])
    # Flags each layout sets itself would leak into the commands of layouts that chose otherwise.
    with pytest.raises(ConfigError, match="chooses --pipeline-schedule, --no-sequence-parallel for each layout"):
        plan_main(["--model", "llama3-1b", "--gpus", "2", "--global-batch-size", "8", "--pipeline-schedule=1f1b",
                   "--no-sequence-parallel"])
    with pytest.raises(ConfigError, match="chooses --data-parallel-sharding-strategy for each layout itself"):
        plan_main(["--model", "llama3-1b", "--gpus", "2", "--global-batch-size", "8",
                   "--data-parallel-sharding-strategy", "optim_grads"])


def test_zb_h1_is_ranked_above_1f1b_at_the_same_layout():
    plans, _, _ = _search("llama2-13b", 8, 4096, 1024, top=2, tp=1, pp=4, vpp=1, cp=1)
    zb, f1b = plans
    assert zb.layout.zb_h1 and not f1b.layout.zb_h1
    assert zb.layout == dataclasses.replace(f1b.layout, zb_h1=True)
    assert zb.step.bubble_fraction < f1b.step.bubble_fraction / 2  # about a third of 1F1B's
    assert zb.tokens_per_sec_per_gpu > f1b.tokens_per_sec_per_gpu
    assert zb.command[zb.command.index("--pipeline-schedule") + 1] == "zero-bubble-h1"


def test_every_printed_command_passes_the_configuration_check():
    from meshtron.cli import parse_train_args
    from meshtron.planning.validate import validate_for_plan

    # Its top plans are TP=2 x PP=8 with zero-bubble schedules; searched among TP=2 layouts (the full 70B search is
    # slow).
    plans, _, _ = _search("llama3-70b", 64, 4096, 1024, top=5, tp=2)
    assert any(p.layout.zb_h1 for p in plans)
    for plan in plans:
        validate_for_plan(parse_train_args(plan.command[2:]).config, 64)


def _fake_estimate(totals):
    """An estimate function over ``{(sharding, offload): total GiB}`` (weights 10, gradients 20 GiB,
    activations 30 GiB each) that records what it was asked."""
    from meshtron.memory import MemoryEstimate

    asked = []

    def estimate(lay):
        asked.append(lay)
        total = totals[(lay.sharding, lay.offload)] * 2**30
        return MemoryEstimate(10 * 2**30, 20 * 2**30, 0, 30 * 2**30, total - 60 * 2**30)
    return estimate, asked


def test_zero_and_offload_variants_are_tried_only_where_they_may_fit():
    from meshtron.planning.search import Layout, SearchSpace, _fitting_variants

    lay = Layout(1, 1, 1, 1, 1, 8, 1, "selective", "optim", False)
    # ZeRO-1 fits: nothing else is tried.
    estimate, asked = _fake_estimate({("optim", False): 70})
    candidates: list = []
    assert [v.sharding for v, _ in _fitting_variants(lay, estimate, 72 * 2**30, SearchSpace(), candidates)] == ["optim"]
    assert len(asked) == 1 and not candidates
    # ZeRO-1 does not fit, ZeRO-2 could (20 GiB of gradients, 7/8 sharded) and does: ZeRO-3 is not tried.
    estimate, asked = _fake_estimate({("optim", False): 80, ("optim_grads", False): 65})
    fits = list(_fitting_variants(lay, estimate, 72 * 2**30, SearchSpace(), candidates))
    assert [v.sharding for v, _ in fits] == ["optim_grads"] and len(asked) == 2
    # Only sharding the weights too could fit: ZeRO-2 is skipped, ZeRO-3 tried and kept.
    estimate, asked = _fake_estimate({("optim", False): 90, ("optim_grads_params", False): 70})
    fits = list(_fitting_variants(lay, estimate, 72 * 2**30, SearchSpace(), candidates))
    assert [v.sharding for v, _ in fits] == ["optim_grads_params"] and [a.sharding for a in asked][1:] == ["optim_grads_params"]
    assert "zero3" in fits[0][0].describe() and "--data-parallel-sharding-strategy" in fits[0][0].flags()
    # Nothing fits even with ZeRO-3, but without the activations it could: an offloading candidate.
    estimate, asked = _fake_estimate({("optim", False): 95, ("optim_grads_params", False): 85})
    candidates = []
    assert not list(_fitting_variants(lay, estimate, 72 * 2**30, SearchSpace(), candidates))
    assert [(c.sharding, c.offload) for c in candidates] == [("optim", True), ("optim_grads_params", True)]
    # Switched off: only the layout itself.
    estimate, asked = _fake_estimate({("optim", False): 80})
    off = SearchSpace(allow_zero=False, allow_offload=False)
    assert not list(_fitting_variants(lay, estimate, 72 * 2**30, off, [])) and len(asked) == 1


def test_zero3_step_time_adds_per_layer_gathers_only_over_dp():
    from meshtron.cli import build_config
    from meshtron.planning.search import Layout, apply_layout
    from meshtron.planning.step_time import predict_step
    from meshtron.validation import resolve

    base = build_config(["--model", "llama2-7b", "--seq-length", "4096", "--global-batch-size", "64",
                         "--device", "cuda"])
    resolve(base, None)

    def step(sharding, dp):
        cfg = apply_layout(base, Layout(1, 1, 8 // dp, 1, 1, dp, 1, "selective", sharding, False))
        return predict_step(cfg, 8, H100, base.model.vocab_size)

    z1, z2, z3 = (step(s, 8) for s in ("optim", "optim_grads", "optim_grads_params"))
    assert z1.comm_by_kind_s["dp"] < z2.comm_by_kind_s["dp"] < z3.comm_by_kind_s["dp"]
    assert z3.step_s > z1.step_s
    # TP=8, DP=1: no gathers, no reductions; only the sharded gradients' own accumulation (a zeroed bucket per
    # micro-batch, then an addition) against the whole buffer's (a copy, then additions) over the 1/8 of
    # llama2-7b's 6.74 billion parameters a TP=8 rank holds, for each of the step's 64 micro-batches.
    from meshtron.planning.step_time import gradient_accumulation_bytes

    one = [predict_step(apply_layout(base, Layout(8, 1, 1, 1, 1, 1, 1, "selective", s, False)), 8, H100,
                        base.model.vocab_size) for s in ("optim", "optim_grads_params")]
    assert one[0].comm_by_kind_s["dp"] == one[1].comm_by_kind_s["dp"] == 0
    extra = 64 * (gradient_accumulation_bytes(base, "optim_grads_params", 64)
                  - gradient_accumulation_bytes(base, "optim", 64)) / (H100.hbm_gbps * 1e9 * H100.hbm_efficiency)
    assert (one[1].step_s - one[0].step_s) / extra == pytest.approx(6.74e9 / 8, rel=0.02)


def test_precision_aware_optimizer_given_to_plan_flows_into_memory_and_command():
    from meshtron.cli import build_config
    from meshtron.planning.search import SearchSpace, search

    argv = ["--model", "llama2-7b", "--seq-length", "4096", "--global-batch-size", "64"]
    low = argv + ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    fixed = dict(tp=2, pp=1, cp=1, dp=4, micro_batch=1, recompute="full", sharding="optim", fp8=False,
                 async_tp=False)
    (plain,), _, _ = search(build_config(argv), argv, 8, H100, top=1, space=SearchSpace(fixed=fixed))
    (bf16,), _, _ = search(build_config(low), low, 8, H100, top=1, space=SearchSpace(fixed=fixed))
    assert plain.layout == bf16.layout
    # Adam moments at 2 + 2 bytes instead of 4 + 4 per parameter, of 6.7e9 / TP parameters sharded over DP=4.
    assert plain.memory_bytes - bf16.memory_bytes == pytest.approx(4 * 6.74e9 / 2 / 4, rel=0.05)
    assert "--exp-avg-dtype" in bf16.command


def test_zero3_makes_a_dp_only_layout_fit():
    # llama2-13b on 8 x 80 GB, DP only: bf16 weights + fp32 gradients alone are ~73 GiB per GPU with ZeRO-1.
    plans, _, _ = _search("llama2-13b", 8, 4096, 64, top=1, tp=1, pp=1, cp=1)
    assert plans and plans[0].layout.sharding in ("optim_grads", "optim_grads_params")


def test_offloading_layouts_fit_with_the_copies_still_running():
    """With --offload-activations the device also holds the blocks of freed activations whose copies to the
    host have not run yet: the planner counts them (``device_bytes``) where it checks the fit and prints."""
    from meshtron.cli import build_config
    from meshtron.memory import estimate_memory
    from meshtron.planning.search import apply_layout, search
    from meshtron.validation import resolve

    argv = ["--model", "llama3-3b", "--seq-length", "65536", "--max-position-embeddings", "65536",
            "--global-batch-size", "1"]
    plans, _, _ = search(build_config(argv), argv, 1, H200, top=4)
    base = build_config(argv)
    base.train.device = "cuda"
    resolve(base, None)
    offloading = [p for p in plans if p.layout.offload]
    assert offloading  # at 64k tokens only full recomputation fits without it
    pending = []
    for p in offloading:
        est = estimate_memory(apply_layout(base, p.layout), base.model.vocab_size, world_size=1, profile=H200)
        assert p.memory_bytes == est.device_bytes == est.total + est.pending_copies
        pending.append(est.pending_copies)
    assert max(pending) > 0  # the FP8 layers' forwards outrun their copies (the slower bf16 ones need not)


def test_attention_rate_moves_to_the_head_dim_64_pair_below_head_dim_128():
    from meshtron.planning.step_time import attention_rate

    p = H200.with_(attention_tflops=560.0, attention_half_seq=2300.0, attention_tflops_d64=430.0,
                   attention_half_seq_d64=700.0)
    s = 131072
    assert attention_rate(p, s, 128) == attention_rate(p, s, 192) == 560e12 * s / (s + 2300)
    assert attention_rate(p, s, 64) == attention_rate(p, s, 32) == 430e12 * s / (s + 700)
    x = 128 / 96 - 1  # between, linearly in 128 / head dim
    assert attention_rate(p, s, 96) == pytest.approx((560 - 130 * x) * 1e12 * s / (s + 2300 - 1600 * x))
    same = H200.with_(attention_tflops_d64=0.0, attention_half_seq_d64=0.0)  # an older profile file: no pair
    assert attention_rate(same, 4096, 64) == attention_rate(same, 4096, 128)


def test_a_selectively_recomputed_moe_layer_runs_its_routing_and_permutations_again():
    """Selective recomputation makes every op of a layer again but its matmuls and attention: for a MoE layer that
    is its routing, the permutation copies around the experts and SwiGLU over the routed rows (k x the expert
    width per token), not a dense MLP's SwiGLU."""
    from meshtron.cli import build_config
    from meshtron.planning.layer_costs import Links, layer_cost
    from meshtron.planning.validate import validate_for_plan

    base = ["--model", "mixtral-8x7b", "--seq-length", "4096", "--bf16", "--expert-model-parallel-size", "8"]

    def compute(*recompute: str) -> float:
        return layer_cost(validate_for_plan(build_config([*base, *recompute]), 8), 0, False, H100, Links(8)).compute

    m = validate_for_plan(build_config(base), 8).model
    tokens, k, h, fe = 4096, m.moe_router_topk, m.hidden_size, m.moe_ffn_hidden_size or m.ffn_hidden_size
    hbm = H100.hbm_gbps * 1e9 * H100.hbm_efficiency
    rerun = compute("--recompute-granularity", "selective") - compute()
    assert rerun > tokens * 2 * (8 * k * h + 3 * k * fe) / hbm  # the permutation copies and the routed SwiGLU
