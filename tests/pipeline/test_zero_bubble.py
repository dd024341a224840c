"""The ZB-H1 zero-bubble schedule (--pipeline-schedule zero-bubble-h1).

Without processes: its plans run every F, B and W once, each W after its B, with matched exchanges
(no deadlock); each rank holds at most PP micro-batches; the simulated bubble is the analytic one and
smaller than 1F1B's. In one process: the deferred weight gradients (with and without recomputation,
with MoE, in compiled layers, FP8 with either recipe) equal a plain backward's. With processes: PP=2
(with DP=2 and overlapped gradient reduction, with TP=2 and sequence parallelism, eager and compiled: the
compiled case marked slow) and PP=4 equal the one-process run in losses, gradients and parameters, and
equal 1F1B on the same layout; FP8 with TP=2 and sequence parallelism (its FP8 collectives) equals
1F1B; and through the trainer, PP=2 with DP=2 and with TP=2 log the losses and gradient norms of one
process.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from meshtron.build import build_model_chunks, gpt_forward_step
from meshtron.config import MeshtronConfig
from meshtron.errors import ConfigError
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import RNGTracker
from meshtron.pipeline.schedules import (WeightGrad, max_in_flight, pipeline_plans, simulated_bubble)
from meshtron.pipeline.zero_bubble import WeightGradStore, attach_weight_grad_store, zero_bubble_h1_order
from meshtron.validation import validate_config
from pipeline_helpers import VOCAB, model_config, rank_micro_batches, run_config, train_and_collect
from test_pipeline_parallel import OVERLAP, assert_close_dict, reference
from test_pipeline_schedules import assert_split_passes_once_in_order, execute_like_nccl
from tests.distributed.launch import run_distributed

ZB = "zero-bubble-h1"
#: torch.compile on CPU needs a C++ compiler; the compiled cases run only where there is one.
HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None
ORDER_LAYOUTS = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


# ------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("stages,m", ORDER_LAYOUTS, ids=[f"pp{p}-m{m}" for p, m in ORDER_LAYOUTS])
def test_plans_run_every_pass_once_in_dependency_order(stages, m):
    plans = pipeline_plans(stages, 1, m, False, 1, ZB)
    for stage, plan in enumerate(plans):
        assert_split_passes_once_in_order(plan, stage, 1, m)
        # A micro-batch's activations live until its W: at most PP of them, the peak of 1F1B's first stage.
        assert max_in_flight(plan) == min(stages, m)
    # W passes exchange nothing: without them the plans must still run under NCCL's matching rules.
    execute_like_nccl([[s for s in plan if not isinstance(s, WeightGrad)] for plan in plans], stages, 1)
    forward_only = pipeline_plans(stages, 1, m, True, 1, ZB)
    assert forward_only == pipeline_plans(stages, 1, m, True, 1, "1f1b")


def test_order_keeps_one_f_one_b_and_defers_w_by_stage():
    """The last stage keeps PP - 1 W in hand for the tail; the first runs each W right after its B."""
    def names(order):
        return " ".join(("W" if isinstance(c, WeightGrad) else "B" if c.backward else "F") + str(c.micro_batch)
                        for c in order)

    assert names(zero_bubble_h1_order(4, 0, 5)) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 B2 W2 B3 W3 B4 W4"
    assert names(zero_bubble_h1_order(4, 3, 5)) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 W2 W3 W4"


@pytest.mark.parametrize("stages,m", [(2, 8), (4, 8), (4, 16), (8, 16), (3, 7)])
@pytest.mark.parametrize("backward_ticks", [1, 2])
def test_bubble_is_the_analytic_one_and_smaller_than_one_f_one_b(stages, m, backward_ticks):
    """(PP - 1) / ((1 + b) M) with a backward of b forwards split evenly into B and W: a third of
    1F1B's (PP - 1) / M when B and W each last a forward (b = 2)."""
    zb = simulated_bubble(stages, 1, m, backward_ticks, schedule=ZB)
    assert zb == pytest.approx((stages - 1) / ((1 + backward_ticks) * m))
    one_f_one_b = simulated_bubble(stages, 1, m, backward_ticks)
    assert one_f_one_b == simulated_bubble(stages, 1, m, backward_ticks, schedule="1f1b")
    assert zb < one_f_one_b
    if backward_ticks == 2:
        assert zb == pytest.approx(one_f_one_b / 3)


def test_schedule_names_are_checked_against_the_chunks():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        simulated_bubble(4, 1, 8, schedule="zb-v")
    with pytest.raises(ValueError, match="model chunk"):
        pipeline_plans(4, 2, 8, False, 1, ZB)


# ------------------------------------------------------------------------------------------- configuration
def _cfg(**parallel) -> MeshtronConfig:
    cfg = run_config(model_config(), pp=2, **parallel)
    cfg.parallel.pipeline_schedule = ZB
    return cfg


@pytest.mark.parametrize("change,message", [
    (lambda c: setattr(c.parallel, "virtual_pipeline_model_parallel_size", 2), "--pipeline-schedule interleaved"),
    (lambda c: setattr(c.parallel, "pipeline_schedule", "interleaved"), "--virtual-pipeline-model-parallel-size"),
    (lambda c: setattr(c.parallel, "pipeline_schedule", "dualpipe"), "--pipeline-schedule .dualpipe. is not known"),
], ids=["virtual-stages", "interleaved-without-virtual-stages", "unknown"])
def test_config_refuses_what_the_schedule_cannot_run(change, message, monkeypatch):
    monkeypatch.setattr("meshtron.validation._cuda_available", lambda: True)
    cfg = _cfg()
    change(cfg)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 4)


def test_config_accepts_recomputation_experts_compiled_layers_and_fp8():
    cfg = _cfg()
    cfg.train.recompute_granularity, cfg.train.compile = "full", True
    cfg.train.bf16, cfg.train.fp8_format = True, "hybrid"
    cfg.model = dataclasses.replace(cfg.model, num_experts=4, moe_ffn_hidden_size=16)
    validate_config(cfg, 4)


# ------------------------------------------------------------------------------------------- deferral, one process
def _moe_model():
    return dataclasses.replace(model_config(tied=False), num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                               moe_shared_expert_intermediate_size=32)


def _gradients(cfg: MeshtronConfig, defer: bool, hold: bool = False) -> dict:
    """Every parameter's gradient after two micro-batches, plainly or with the weight GEMMs deferred
    and run afterwards (in the other order)."""
    ctx = ParallelContext()
    tracker = RNGTracker(cfg.train.seed, 0, 0, ctx.device)
    tracker.seed_default()
    chunks = build_model_chunks(cfg, ctx, VOCAB, tracker, torch.float32)
    store = WeightGradStore()
    if defer:
        assert attach_weight_grad_store(chunks, store) > 0
        store.enabled = True
    names = {id(p): n for n, p in chunks[0].named_parameters()}
    deferred_names = set()
    for i, mb in enumerate(rank_micro_batches(cfg, ctx, 0)[:2]):
        _, loss = gpt_forward_step(chunks[0], mb, None)
        with store.collecting((0, i)):
            loss.backward()
        deferred_names |= {names[id(p)] for entries in store._deferred.values() for p, _ in entries}
    if defer:
        for n, p in chunks[0].named_parameters():  # deferred weights have no gradient before their W
            assert (p.grad is None) == (n in deferred_names), n
        assert any("mlp" in n for n in deferred_names) and not any("norm" in n for n in deferred_names)
        store.compute((0, 1), hold=hold)
        store.compute((0, 0), hold=hold)
        if hold:
            store.accumulate_held()
        assert store.pending_units() == []
    return {n: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute,moe,compiled,fp8", [
    (None, False, False, None), ("full", False, False, None), ("selective", True, False, None),
    pytest.param(None, False, True, None,
                 marks=pytest.mark.skipif(not HAS_CXX, reason="torch.compile on CPU needs g++")),
    (None, False, False, "tensorwise"), (None, False, False, "rowwise"),
], ids=["dense", "dense-full-recompute", "moe-selective-recompute", "dense-compiled", "fp8-tensorwise",
        "fp8-rowwise"])
def test_deferred_weight_gradients_equal_a_plain_backward(recompute, moe, compiled, fp8):
    cfg = run_config(_moe_model() if moe else model_config(tied=False), compile=compiled)
    cfg.train.recompute_granularity = recompute
    if fp8:  # FP8 matmuls on fp32 weights here (the run's --bf16 is for validation only)
        cfg.train.bf16, cfg.train.fp8_format, cfg.train.fp8_recipe = True, "e4m3", fp8
    validate_config(cfg, 1)
    plain = _gradients(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False)), defer=False)
    assert_close_dict(_gradients(cfg, defer=True), plain, "deferred", rtol=1e-6, atol=1e-7)
    if recompute is None and not compiled:
        assert_close_dict(_gradients(cfg, defer=True, hold=True), plain, "held", rtol=1e-6, atol=1e-7)


def test_a_deferring_backward_outside_a_b_pass_is_refused():
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match="outside a zero-bubble B pass"):
        store.defer(torch.nn.Parameter(torch.zeros(1)), lambda: torch.zeros(1))


# ------------------------------------------------------------------------------------------- processes
def _zb(cfg: MeshtronConfig) -> MeshtronConfig:
    cfg.parallel.pipeline_schedule = ZB
    return cfg


def _fp8(cfg: MeshtronConfig) -> MeshtronConfig:
    cfg.train.fp8_format = "hybrid"  # e5m2 output gradients: the gradient dtype differs from the input's
    return cfg


LLAMA = model_config(tied=True)
#: Four processes, one launch: (name, config).
WORLD_4 = [
    ("pp2-dp2-zb-overlapped-grad-reduce", _zb(run_config(LLAMA, pp=2, **OVERLAP))),
    ("tp2-pp2-zb-sp", _zb(run_config(model_config(tied=False), tp=2, pp=2, sp=True, overlap_p2p_comm=True))),
    ("pp4-zb-8-micro-batches", _zb(run_config(LLAMA, pp=4))),
    ("pp2-dp2-1f1b-overlapped-grad-reduce", run_config(LLAMA, pp=2, **OVERLAP)),  # for the comparison with 1F1B
    # FP8 (the sequence-parallel FP8 linears): its roundings depend on the TP split, so against 1F1B only.
    ("tp2-pp2-fp8-zb-sp", _zb(_fp8(run_config(model_config(tied=False), tp=2, pp=2, sp=True)))),
    ("tp2-pp2-fp8-1f1b-sp", _fp8(run_config(model_config(tied=False), tp=2, pp=2, sp=True))),
] + ([  # compiled layers: the deferring matmuls run between the compiled regions (meshtron/layers/linear.py)
    ("tp2-pp2-zb-sp-compiled", _zb(run_config(model_config(tied=False), tp=2, pp=2, sp=True, compile=True))),
] if HAS_CXX else [])
ONE_F_ONE_B = {0: 3, 4: 5}  # zero-bubble case -> the 1F1B case of the same layout
ZERO_BUBBLE_CASES = [i for i, (name, _) in enumerate(WORLD_4) if "-zb" in name and "fp8" not in name]
#: Marked slow (its layout, tp2-pp2-zb-sp, runs eager by default, and test_deferred_weight_gradients_equal_a_plain_
#: backward[dense-compiled] defers the weight gradients of compiled layers in one process); the launch leaves it
#: out unless a slow case runs.
SLOW = ("tp2-pp2-zb-sp-compiled",)


def _slow_cases_run(request) -> bool:
    """Whether this session runs one of this module's cases marked slow (deselected by default)."""
    return any(item.get_closest_marker("slow") for item in request.session.items
               if getattr(item, "module", None) is request.module)


@pytest.fixture(scope="module")
def world4(request):
    """One launch of four processes (their start-up dominates on CPU) for every case below:
    per rank, the results of the schedule-level cases (None for a slow case left out), then those of the
    trainer runs."""
    slow = _slow_cases_run(request)
    cases = [cfg if slow or name not in SLOW else None for name, cfg in WORLD_4]
    return run_distributed(_worker, 4, cases, TRAINER_RUNS, timeout=300)


def _worker(rank: int, world: int, cases: list, trainer_runs: list) -> tuple[list[dict], list[tuple[dict, dict]]]:
    from meshtron.parallel.context import build_groups
    from meshtron.training.trainer import run_training

    out = []
    for cfg in cases:
        if cfg is None:  # a slow case this session does not run
            out.append(None)
            continue
        p = cfg.parallel
        ctx = build_groups(p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                           p.expert_model_parallel_size, torch.device("cpu"))
        out.append(train_and_collect(cfg, ctx))
    trained = [run_training(_trainer_config(*run)) for run in trainer_runs]
    return out, [(r.train_losses, r.grad_norms) for r in trained]


@pytest.mark.parametrize("index", [pytest.param(i, marks=pytest.mark.slow) if WORLD_4[i][0] in SLOW else i
                                   for i in ZERO_BUBBLE_CASES], ids=[WORLD_4[i][0] for i in ZERO_BUBBLE_CASES])
def test_zero_bubble_matches_single_process(world4, index):
    name, cfg = WORLD_4[index]
    ref = reference(cfg)
    pp = cfg.parallel.pipeline_model_parallel_size
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * (4 // (pp * cfg.parallel.tensor_model_parallel_size)))
    for rank, (per_rank, _) in enumerate(world4):
        out, where = per_rank[index], f"{name} rank {rank}"
        torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5, atol=1e-6, msg=lambda s: f"{where}: {s}")
        torch.testing.assert_close(out["norms"], ref["norms"], rtol=1e-5, atol=1e-6, msg=lambda s: f"{where}: {s}")
        torch.testing.assert_close(out["eval_loss"], ref["eval_loss"], rtol=1e-5, atol=1e-6)
        assert_close_dict(out["grads"], ref["grads"], f"{where} gradient")
        assert_close_dict(out["params"], ref["params"], f"{where} parameter", rtol=1e-4, atol=1e-5)
        assert out["max_in_flight"] == min(pp, m), where  # activations held until each W
        assert out["deferred_gemms"] == _linear_gemms(cfg, m), where
        if cfg.parallel.overlap_grad_reduce:  # reductions still start before the schedule returns
            assert out["buckets_in_backward"] > 0, where


def _linear_gemms(cfg: MeshtronConfig, m: int) -> int:
    """Weight-gradient GEMMs a stage defers in an iteration: its layers' four linears (QKV, output,
    gate+up, down) for each of its ``m`` micro-batches."""
    return 4 * cfg.model.num_layers // cfg.parallel.pipeline_model_parallel_size * m


def test_zero_bubble_matches_one_f_one_b(world4):
    for zb, one_f_one_b in ONE_F_ONE_B.items():
        cfg = WORLD_4[zb][1]
        p = cfg.parallel
        m = cfg.train.global_batch_size // (cfg.train.micro_batch_size
                                            * (4 // (p.pipeline_model_parallel_size * p.tensor_model_parallel_size)))
        for rank, (per_rank, _) in enumerate(world4):
            got, want, where = per_rank[zb], per_rank[one_f_one_b], f"{WORLD_4[zb][0]} rank {rank} against 1F1B"
            assert got["deferred_gemms"] == _linear_gemms(cfg, m) and want["deferred_gemms"] == 0, where
            torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=1e-7)
            assert_close_dict(got["grads"], want["grads"], f"{where} gradient", rtol=1e-5, atol=1e-6)
            assert_close_dict(got["params"], want["params"], f"{where} parameter", rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- through the trainer
def _trainer_config(tp: int, pp: int, schedule) -> MeshtronConfig:
    from test_pipeline_trainer import _config

    cfg = _config(pp)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_schedule = tp, schedule
    cfg.parallel.overlap_grad_reduce = True
    cfg.train.train_iters, cfg.train.eval_interval = 3, 0  # 0: no evaluation
    return cfg


TRAINER_RUNS = [(1, 2, ZB), (2, 2, ZB)]  # (TP, PP, schedule) on 4 processes: DP 2, then 1


def test_trainer_zero_bubble_logs_the_losses_of_one_process(world4):
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref = run_training(_trainer_config(1, 1, None))
    assert len(ref.train_losses) == 3
    for i, (tp, pp, schedule) in enumerate(TRAINER_RUNS):
        for rank, (_, per_rank) in enumerate(world4):
            losses, norms = per_rank[i]
            where = f"tp={tp} pp={pp} {schedule} rank {rank}"
            assert losses == pytest.approx(ref.train_losses, rel=1e-5), where
            assert norms == pytest.approx(ref.grad_norms, rel=1e-5), where
