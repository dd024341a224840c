"""meshtron emulate on CPU: one rank of a larger world built and run here, its prediction, and the link model."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.emulation.predict import CommSummary, collective_seconds, fit_passes, predict_rank, summarise_step
from meshtron.planning.profiles import builtin_profile

REPO = Path(__file__).resolve().parents[2]
H100 = builtin_profile("H100")
TINY = ["--device", "cpu", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "32", "--vocab-size", "128", "--micro-batch-size", "1"]


def test_ring_times_follow_the_bus_bandwidth():
    bw, lat = 100e9, 10e-6
    assert collective_seconds("all_reduce", 10**9, 8, bw, lat) == pytest.approx(2 * 10**9 * 7 / 8 / bw + lat)
    assert collective_seconds("all_gather", 10**9, 4, bw, lat) == pytest.approx(10**9 * 3 / 4 / bw + lat)
    assert collective_seconds("send", 10**6, 2, bw, lat) == pytest.approx(10**6 / bw + lat)
    assert collective_seconds("all_reduce", 10**9, 1, bw, lat) == 0.0


def _rec(op, group, nbytes, size=8, is_async=False):
    return {"iteration": 3, "phase": "x", "op": op, "group": group, "group_size": size, "bytes": nbytes,
            "dtype": "bfloat16", "async": is_async}


def test_overlap_rules_expose_tp_and_hide_overlapped_data_parallel_reduction():
    records = [_rec("all_gather", "tp", 10**8), _rec("reduce_scatter", "dp_cp", 10**9, is_async=True),
               _rec("all_reduce", "dp_cp", 10**9, is_async=False)]
    comm = summarise_step(records, {"tp": False, "dp_cp": True}, H100, forward_s=1.0, backward_s=2.0, pp=1)
    assert comm.exposed_by_group["tp"] == pytest.approx(comm.seconds_by_group["tp"])
    network = collective_seconds("reduce_scatter", 10**9, 8, H100.network_gbps * 1e9, H100.collective_latency_us * 1e-6)
    blocking = collective_seconds("all_reduce", 10**9, 8, H100.network_gbps * 1e9, H100.collective_latency_us * 1e-6)
    assert comm.seconds_by_group["dp_cp"] == pytest.approx(network + blocking)
    # The asynchronous reduce-scatter hides behind the 2 s backward except overlap_cost of it; the all-reduce is exposed.
    assert comm.exposed_by_group["dp_cp"] == pytest.approx(blocking + H100.overlap_cost * network)


def test_a_context_parallel_ring_hop_costs_one_transfer_not_its_send_and_receive():
    """Each hop of the CP ring sends this rank's key/value block and receives its neighbour's in one batched call
    over full-duplex links: the trace notes both, the time is one transfer per hop."""
    hops = 7
    records = [_rec(op, "cp", 10**8) for _ in range(hops) for op in ("send", "recv")]
    comm = summarise_step(records, {"cp": True}, H100, forward_s=10.0, backward_s=20.0, pp=1)
    one = collective_seconds("send", 10**8, 8, H100.network_gbps * 1e9, H100.collective_latency_us * 1e-6)
    assert comm.seconds_by_group["cp"] == pytest.approx(hops * one)
    assert comm.bytes_by_group["cp"] == 2 * hops * 10**8  # the trace's bytes stay what moved each way
    assert comm.exposed_by_group["cp"] == pytest.approx(H100.overlap_cost * hops * one)  # behind the attention


def test_per_micro_batch_operations_scale_with_the_jobs_micro_batches():
    records = [_rec("all_gather", "tp", 10**7), _rec("all_reduce", "dp", 10**8)]
    one = summarise_step(records, {}, H100, 1.0, 1.0, pp=1, micro_batch_scale=1.0)
    four = summarise_step(records, {}, H100, 1.0, 1.0, pp=1, micro_batch_scale=4.0)
    assert four.seconds_by_group["tp"] == pytest.approx(4 * one.seconds_by_group["tp"])
    assert four.seconds_by_group["dp"] == pytest.approx(one.seconds_by_group["dp"])
    # a tensor-parallel all-reduce after the backward (the sequence-parallel norms' gradients) comes once per step
    once = dict(_rec("all_reduce", "tp", 10**7), phase="gradient-sync")
    with_once = summarise_step(records + [once], {}, H100, 1.0, 1.0, pp=1, micro_batch_scale=4.0)
    alone = summarise_step([once], {}, H100, 1.0, 1.0, pp=1)
    assert with_once.seconds_by_group["tp"] == pytest.approx(four.seconds_by_group["tp"] + alone.seconds_by_group["tp"])


def test_predicted_step_adds_bubble_communication_and_optimizer():
    comm = summarise_step([_rec("all_gather", "tp", 10**8)], {}, H100, 1.0, 2.0, pp=1)
    pred = predict_rank(1.0, 2.0, 0.5, 0.1, comm, bubble_fraction=0.25)
    assert pred.step_s == pytest.approx(3.0 * 1.25 + comm.exposed_s + 0.5 + 0.1)


def test_passes_timed_one_by_one_are_held_to_the_whole_step():
    """Synchronised passes that add up to more than the whole step (each pays its launch latency alone: 17% on
    the Qwen3.5 row of 2026-12-07, 10% on mixtral's rank) are scaled down to it, in proportion; passes inside the
    step are kept. A world of one then predicts its own whole step, whichever way the passes came out."""
    assert fit_passes(0.3, 0.6, 1.0, 0.02) == (0.3, 0.6)
    fwd, bwd = fit_passes(0.4, 0.8, 1.0, 0.04)
    assert fwd + bwd == pytest.approx(0.96) and bwd == pytest.approx(2 * fwd)
    no_comm = CommSummary()
    for passes, optimizer in (((0.3, 0.6), 0.08), ((0.4, 0.8), 0.0)):  # the bench's remainder, as it reports it
        fwd, bwd = fit_passes(*passes, 1.0, 0.02)
        other = max(0.0, 1.0 - fwd - bwd - optimizer)
        assert predict_rank(fwd, bwd, optimizer, other, no_comm, bubble_fraction=0.0).step_s == pytest.approx(1.0)


def _emulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", "emulate", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def _rank0_trace(trace: str, world_size: int, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Emulate rank 0 of ``world_size`` for one cold step, recording its collectives to ``trace``: the run and the
    trace's records."""
    run = _emulate("--world-size", str(world_size), "--ranks", "0", "--json", "--warmup", "0", "--steps", "1",
                   "--split-repeats", "1", "--record-collectives", trace, *args)
    assert run.returncode == 0, run.stderr[-2000:]
    return run, [json.loads(line) for line in Path(f"{trace}.rank0.jsonl").read_text().splitlines()]


def test_one_stage_of_a_64_rank_layout_runs_here_and_is_predicted(tmp_path):
    out = tmp_path / "emulated.jsonl"
    run = _emulate("--world-size", "64", "--gpus-per-node", "8", "--ranks", "56", "--json", "--out", str(out),
                   "--warmup", "1", "--steps", "1", "--record-collectives", str(tmp_path / "trace"), *TINY,
                   "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                   "--use-distributed-optimizer", "--global-batch-size", "64", "--measure-micro-batches", "2")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "every collective is emulated" in run.stderr
    row = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][0])
    assert row["layout"] == "TP=2 CP=1 DP=16 PP=2 EP=1" and row["coordinates"]["pp"] == 1
    # 64 / (1 x DP 16); asked for 2, run at 3: PP + 1 reach the steady state (a forward after a backward)
    assert row["micro_batches"] == 4 and row["measured_micro_batches"] == 3
    groups = row["modelled"]["comm_bytes_by_group"]
    assert {"tp", "pp", "dp_cp"} <= set(groups)  # SP gathers, pipeline transfers, the distributed optimizer
    assert row["predicted"]["step_s"] > row["measured"]["forward_s"] + row["measured"]["backward_s"]
    assert row["planner"]["step_s"] is not None and row["planner"]["est_mem_gib"] > 0
    assert json.loads(out.read_text().splitlines()[0])["rank"] == 56
    trace = [json.loads(line) for line in (tmp_path / "trace.rank56.jsonl").read_text().splitlines()]
    assert trace and {r["group"] for r in trace} >= {"tp", "pp"}
    assert all(r["iteration"] == 3 for r in trace if r["phase"] != "setup")


def test_bad_ranks_name_the_flag():
    run = _emulate("--world-size", "4", "--ranks", "7", *TINY)
    assert run.returncode == 2 and "--ranks" in run.stderr and "0..3" in run.stderr
    run = _emulate("--world-size", "4", "--ranks", "first", *TINY)
    assert run.returncode == 2 and "comma-separated" in run.stderr


def test_plan_emulates_its_first_layouts_beside_the_planner():
    run = subprocess.run([sys.executable, "-m", "meshtron", "plan", "--model", "tiny", "--vocab-size", "256",
                          "--gpus", "4", "--global-batch-size", "8", "--seq-length", "64", "--device", "cpu",
                          "--top", "2", "--emulate", "1", "--measure-micro-batches", "2"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    table = run.stdout.split("planner against emulation", 1)[1].splitlines()
    rows = [line for line in table if line.startswith("| 1 |")]
    assert len(rows) == 1 and "| 2 |" not in "\n".join(table)  # only the first layout was emulated
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[3]) >= 0 and int(cells[6].replace(",", "")) > 0  # emulated memory and tok/s/GPU


def test_an_emulated_rank_holds_its_optimizer_state_when_every_step_is_skipped(monkeypatch):
    """Emulated values can be NaN (stale bits in the outputs of torch 2.11's fake single-tensor collectives on the
    GPU): every step is then skipped, and the moments, which the optimizers create at their first step, must be
    there all the same (runner.hold_optimizer_state), as in the real job's steady state, and made where the real
    rank makes them: at the first step."""
    import math

    from meshtron.emulation.runner import emulate_rank
    from meshtron.training.trainer import Trainer

    held = {}
    monkeypatch.setattr(Trainer, "_synced", lambda self, norm, loss: [math.nan, math.nan])
    close, train_step = Trainer.close, Trainer.train_step

    def moments(trainer) -> int:
        return sum(t.numel() for state in trainer.optimizer.inner.state.values() for key, t in state.items()
                   if key.startswith("exp_avg"))

    def first_step_sees(self, *args, **kwargs):
        held.setdefault("before_first_step", moments(self))
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", first_step_sees)

    def record_then_close(self):
        held["steps"] = self.optimizer.step_count
        held["moments"] = sum(t.numel() for i in range(len(self.optimizer.params))
                              for key, t in self.optimizer.state_tensors(i).items() if key != "master")
        held["params"] = sum(p.numel() for p in self.optimizer.params)
        close(self)

    monkeypatch.setattr(Trainer, "close", record_then_close)
    emulate_rank([*TINY, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "2"],
                 2, 0, warmup=1, steps=1, split_repeats=1)  # (no warm-up would time an optimizer step alone)
    assert held["steps"] == 0  # no step was applied
    assert held["before_first_step"] == 0  # made where the real rank makes them: at the first step, not before
    assert held["moments"] == 2 * held["params"]  # Adam's two moments of every parameter of this rank


def test_a_routing_skew_sends_the_hot_rank_more_rows_than_it_sends(tmp_path):
    """--emulate-routing skew:S: expert 0 is hottest, so expert-parallel rank 0 receives from every rank what it
    routes to itself; the last EP rank receives less."""
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
           "--global-batch-size", "4", "--disable-bias-linear"]
    trace = str(tmp_path / "trace")
    run = _emulate("--world-size", "4", "--ranks", "0,3", "--json", "--warmup", "0", "--steps", "1",
                   "--split-repeats", "1", "--emulate-routing", "skew:1.5", "--record-collectives", trace, *TINY, *moe)
    assert run.returncode == 0, run.stderr[-2000:]

    def a2a_bytes(rank: int) -> int:
        records = [json.loads(line) for line in Path(f"{trace}.rank{rank}.jsonl").read_text().splitlines()]
        return sum(r["bytes"] for r in records if r["op"] == "all_to_all" and r["group"] == "ep"
                   and r["dtype"] != "int64" and r["phase"] != "setup")

    assert a2a_bytes(0) > 1.5 * a2a_bytes(3)
    bad = _emulate("--world-size", "4", "--emulate-routing", "hot", *TINY, *moe)
    assert bad.returncode == 2 and "skew:S" in bad.stderr


def test_the_planners_expert_all_to_alls_are_the_emulated_ranks(tmp_path):
    """TP=2 with SP and EP=2, selective recomputation: every TP rank dispatches its micro-batch's whole sequence
    (the MoE layer gathers the shards first), six all-to-alls per MoE layer and micro-batch (dispatch and
    combine, forward, backward and the recomputed forward): the planner counts what the trace records."""
    from meshtron.cli import build_config
    from meshtron.layer_kinds.base import StepInputs
    from meshtron.layer_kinds.pattern import layer_at
    from meshtron.planning.layer_costs import expert_all_to_alls
    from meshtron.planning.validate import validate_for_plan

    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
           "--moe-router-force-load-balancing", "--disable-bias-linear", "--tensor-model-parallel-size", "2",
           "--sequence-parallel", "--recompute-granularity", "selective", "--global-batch-size", "2",
           "--attention-dropout", "0", "--hidden-dropout", "0"]
    run, records = _rank0_trace(str(tmp_path / "trace"), 4, *TINY, *moe)
    moved = [r["bytes"] for r in records
             if r["op"] == "all_to_all" and r["group"] == "ep" and r["dtype"] != "int64" and r["phase"] != "setup"]
    cfg = validate_for_plan(build_config([*TINY, *moe]), 4)
    layers = 4
    row = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][0])
    micro_batches = row["measured_micro_batches"]
    assert len(moved) == layers * micro_batches * expert_all_to_alls(cfg, recomputed=False) == 4 * micro_batches * 6
    m = cfg.model
    work = layer_at(m, 0).mlp.step_work(m, StepInputs(tokens=32, tp=2, ep=2, expert_tp=2, rep_div=2, e=4, fp8=False,
                                                      fp8_experts=False, bf16=False, saves=7, fc2_recomputes=True,
                                                      gemm=lambda *a, **k: 0.0))
    assert set(moved) == {work.ep_bytes} == {32 * 2 * 32 * 4}  # 32 tokens x 2 choices x 32 wide, fp32


# Without SP (the attention's all-reduce) slow: the SP case is the fast representative.
@pytest.mark.parametrize("sequence_parallel", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["sp", "no-sp"])
def test_recomputation_runs_the_forwards_tensor_parallel_collectives_the_planner_counts(tmp_path, sequence_parallel):
    """Selective recomputation runs a layer's forward again only as far as backward needs it: with SP both
    all-gathers and the attention's reduce-scatter (not the MLP's), without SP the attention's all-reduce. The
    trace of a TP=2 rank shows it, and the planner adds exactly those collectives' time."""
    from meshtron.cli import build_config
    from meshtron.planning.layer_costs import Links, layer_cost
    from meshtron.planning.validate import validate_for_plan

    base = [*TINY, "--tensor-model-parallel-size", "2", "--global-batch-size", "1", "--attention-dropout", "0",
            "--hidden-dropout", "0"] + (["--sequence-parallel"] if sequence_parallel else [])
    counts = {}
    for name, extra in (("none", []), ("selective", ["--recompute-granularity", "selective"])):
        _, records = _rank0_trace(str(tmp_path / name), 2, *base, *extra)
        counts[name] = {op: sum(1 for r in records if r["group"] == "tp" and r["op"] == op
                                and r["phase"] == "forward-backward" and r["bytes"] == 32 * 32 * 4)
                        for op in ("all_gather", "reduce_scatter", "all_reduce")}
    again = {op: (counts["selective"][op] - counts["none"][op]) / 4 for op in counts["none"]}  # per layer
    assert again == ({"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0} if sequence_parallel
                     else {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1})

    gpu = ["--model", "llama3-8b", "--seq-length", "4096", "--tensor-model-parallel-size", "2", "--bf16"]
    gpu += ["--sequence-parallel"] if sequence_parallel else []

    def tp_seconds(recompute):
        cfg = validate_for_plan(build_config(gpu + recompute), 8)
        return layer_cost(cfg, 0, False, H100, Links(8)).comm_kind["tp"]

    act, bw, lat = 4096 * 4096 * 2, H100.nvlink_gbps * 1e9, H100.collective_latency_us * 1e-6
    expected = sum(n * collective_seconds(op, act, 2, bw, lat) for op, n in again.items())
    assert tp_seconds(["--recompute-granularity", "selective"]) - tp_seconds([]) == pytest.approx(expected)


def _cp_records(trace: str, *args: str) -> collections.Counter:
    """The context-parallel operations of rank 0 of a CP=2 world's one step: (op, bytes) -> count."""
    _, records = _rank0_trace(trace, 2, *TINY, "--seq-length", "64", "--context-parallel-size", "2",
                              "--global-batch-size", "1", "--attention-dropout", "0", "--hidden-dropout", "0", *args)
    return collections.Counter((r["op"], r["bytes"]) for r in records if r["group"] == "cp" and r["phase"] != "setup")


def _planned_cp_seconds(model: list[str], recompute: list[str], recomputed: bool = False) -> float:
    from meshtron.cli import build_config
    from meshtron.planning.layer_costs import Links, layer_cost
    from meshtron.planning.validate import validate_for_plan

    cfg = validate_for_plan(build_config([*model, "--context-parallel-size", "2", "--bf16", *recompute]), 8)
    return layer_cost(cfg, 0, recomputed, H100, Links(8)).comm_kind["cp"]


SELECTIVE = ["--recompute-granularity", "selective"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def test_selective_recomputation_runs_the_context_parallel_ring_again_and_the_planner_counts_it(tmp_path):
    """CP=2: selective recomputation runs each layer's forward ring hop again in backward (the trace of the rank
    has one more send per layer); the planner adds the forward ring once more, as for a fully recomputed layer."""
    none = _cp_records(str(tmp_path / "none"))
    selective = _cp_records(str(tmp_path / "selective"), *SELECTIVE)

    def sends(records: collections.Counter) -> int:
        return sum(n for (op, _), n in records.items() if op == "send")

    assert sends(selective) - sends(none) == 4  # one hop per layer (a ring of two)

    model = ["--model", "llama3-8b", "--seq-length", "32768"]
    assert _planned_cp_seconds(model, SELECTIVE) == pytest.approx(_planned_cp_seconds(model, FULL, recomputed=True))
    assert _planned_cp_seconds(model, SELECTIVE) > _planned_cp_seconds(model, [])


@pytest.mark.slow  # the context-parallel ring's test is the fast representative
def test_selective_recomputation_runs_the_context_parallel_all_to_alls_again_and_the_planner_counts_them(tmp_path):
    """--cp-comm-type a2a (Ulysses): a layer exchanges its queries, keys, values and output in its forward and
    their gradients in its backward (8 all-to-alls); selective recomputation exchanges the forward's four again,
    none of them saved. The planner adds the forward's exchange once more, as for a fully recomputed layer."""
    a2a = ["--cp-comm-type", "a2a"]
    none = _cp_records(str(tmp_path / "none"), *a2a)
    selective = _cp_records(str(tmp_path / "selective"), *a2a, *SELECTIVE)
    assert set(none) == set(selective) == {("all_to_all", 4096)}
    assert none[("all_to_all", 4096)] == 4 * 8 and selective[("all_to_all", 4096)] == 4 * 12

    model = ["--model", "llama3-8b", "--seq-length", "32768", *a2a]
    assert _planned_cp_seconds(model, SELECTIVE) == pytest.approx(_planned_cp_seconds(model, FULL, recomputed=True))
    assert _planned_cp_seconds(model, SELECTIVE) == pytest.approx(1.5 * _planned_cp_seconds(model, []))


@pytest.mark.slow  # the context-parallel ring's test is the fast representative
def test_selective_recomputation_gathers_the_gated_deltanet_states_again_and_the_planner_counts_it(tmp_path):
    """A gated DeltaNet layer under CP all-gathers its chunks' states and convolution halos in the forward (two
    collectives) and reduce-scatters their gradients in the backward; selective recomputation gathers again, as a
    fully recomputed layer does. The planner counts the gathers once more for both."""
    gdn = ["--layer-pattern", "gdn+dense*4", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
           "--linear-key-head-dim", "16", "--linear-value-head-dim", "8"]
    none = _cp_records(str(tmp_path / "none"), *gdn)
    selective = _cp_records(str(tmp_path / "selective"), *gdn, *SELECTIVE)
    gathers = {key: n for key, n in none.items() if key[0] == "all_gather"}
    assert len(gathers) == 2 and all(n == 4 for n in gathers.values())  # two per layer
    assert all(selective[key] == 2 * n for key, n in gathers.items())
    assert {k: n for k, n in selective.items() if k[0] != "all_gather"} == {k: n for k, n in none.items()
                                                                          if k[0] != "all_gather"}

    model = ["--model", "qwen3.5-9b", "--seq-length", "32768"]
    assert _planned_cp_seconds(model, SELECTIVE) == pytest.approx(_planned_cp_seconds(model, FULL, recomputed=True))
    assert _planned_cp_seconds(model, SELECTIVE) == pytest.approx(1.5 * _planned_cp_seconds(model, []))
    assert _planned_cp_seconds(model, FULL, recomputed=False) == pytest.approx(_planned_cp_seconds(model, []))
