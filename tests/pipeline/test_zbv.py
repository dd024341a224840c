"""The ZB-V zero-bubble schedule (--pipeline-schedule zbv: two chunks per rank in a V).

Without processes: its plans run every F, B and W of both chunks once, each B after its forward and each W
after its B, with matched exchanges under NCCL's rules (the last stage's turn of the V needs none); every
rank holds at most 2 PP chunk-forwards of activations (PP micro-batches of its layers, 1F1B's first stage);
the simulated bubble is half of ZB-H1's. The layout puts the embedding and the loss on the first stage.
The configuration refuses what it cannot run. With processes: PP=2 with DP=2 and an overlapped gradient
reduction (also against 1F1B on the same layout), TP=2 x PP=2 with sequence parallelism and overlapped
transfers, and PP=4 equal the one-process run (losses, gradients, parameters, evaluation loss); through the
trainer, PP=2 with DP=2 and with TP=2 log the one-process losses, gradient norms and evaluation losses.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import ConfigError
from meshtron.pipeline.partition import partition_layers
from meshtron.pipeline.schedules import Compute, WeightGrad, max_in_flight, pipeline_plans, simulated_bubble
from meshtron.validation import validate_config
from pipeline_helpers import model_config, run_config
from test_pipeline_schedules import assert_split_passes_once_in_order, execute_like_nccl

ZBV = "zbv"
LAYOUTS = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize("stages,m", LAYOUTS, ids=[f"pp{p}-m{m}" for p, m in LAYOUTS])
def test_plans_run_every_pass_once_in_dependency_order(stages, m):
    plans = pipeline_plans(stages, 2, m, False, 1, ZBV)
    for stage, plan in enumerate(plans):
        assert_split_passes_once_in_order(plan, stage, 2, m)
        assert max_in_flight(plan) <= 2 * stages  # chunk-forwards: PP micro-batches of the stage's layers
    execute_like_nccl([[s for s in plan if not isinstance(s, WeightGrad)] for plan in plans], stages, 2, v_shape=True)
    forward_only = pipeline_plans(stages, 2, m, True, 1, ZBV)
    execute_like_nccl(forward_only, stages, 2, v_shape=True)
    assert all(sum(isinstance(s, Compute) for s in plan) == 2 * m for plan in forward_only)


@pytest.mark.parametrize("stages,m", [(2, 2), (2, 8), (3, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
def test_bubble_is_half_of_zb_h1(stages, m):
    """With F, B and W of equal length and at least PP micro-batches: (PP - 1) / (6 M), half of ZB-H1's."""
    zbv = simulated_bubble(stages, 2, m, 2, schedule=ZBV)
    zb_h1 = simulated_bubble(stages, 1, m, 2, schedule="zero-bubble-h1")
    assert zbv == pytest.approx(zb_h1 / 2)
    assert zbv == pytest.approx((stages - 1) / (6 * m))


def test_layout_puts_embedding_and_loss_on_the_first_stage():
    layout = partition_layers(8, 2, v_shape=True)
    assert layout.stage_layers(0) == [[0, 1], [6, 7]] and layout.stage_layers(1) == [[2, 3], [4, 5]]
    assert layout.has_embedding(0, 0) and layout.has_loss(0, 1) and layout.loss_stage == 0
    assert not any(layout.has_loss(1, v) or layout.has_embedding(1, v) for v in (0, 1))


def _cfg(**model) -> "object":
    cfg = run_config(dataclasses.replace(model_config(tied=False), **model), pp=2)
    cfg.parallel.pipeline_schedule = ZBV
    return cfg


@pytest.mark.parametrize("change,message", [
    (lambda c: setattr(c, "model", dataclasses.replace(c.model, untie_embeddings_and_output_weights=False)),
     "--untie-embeddings-and-output-weights"),
    (lambda c: setattr(c, "model", dataclasses.replace(c.model, mtp_num_layers=1)), "--mtp-num-layers"),
    (lambda c: setattr(c.parallel, "virtual_pipeline_model_parallel_size", 3), "two model chunks"),
    (lambda c: setattr(c.parallel, "account_for_loss_in_pipeline_split", True), "--account-for-loss"),
], ids=["tied", "mtp", "three-chunks", "loss-slot"])
def test_config_refuses_what_zbv_cannot_run(change, message, monkeypatch):
    monkeypatch.setattr("meshtron.validation._cuda_available", lambda: True)
    cfg = _cfg()
    change(cfg)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 4)


# ------------------------------------------------------------------------------------------- processes
def _zbv(cfg):
    cfg.parallel.pipeline_schedule = ZBV
    return cfg


UNTIED = model_config(tied=False)
#: Four processes, one launch: (name, config); the first ZBV case's 1F1B twin follows it (the others are compared
#: with one process only, which the 1F1B cases of tests/pipeline/test_pipeline_parallel.py equal as well).
WORLD_4 = [
    ("pp2-dp2-zbv-overlapped-grad-reduce", _zbv(run_config(UNTIED, pp=2, overlap_grad_reduce=True,
                                                           ddp_bucket_size=2048))),
    ("pp2-dp2-1f1b-overlapped-grad-reduce", run_config(UNTIED, pp=2, overlap_grad_reduce=True, ddp_bucket_size=2048)),
    ("tp2-pp2-zbv-sp-overlapped-p2p", _zbv(run_config(UNTIED, tp=2, pp=2, sp=True, overlap_p2p_comm=True))),
    ("pp4-zbv-8-layers", _zbv(run_config(model_config(tied=False, layers=8), pp=4))),
]
TRAINER_RUNS = [(1, 2), (2, 2)]  # (TP, PP) under ZBV through the trainer on 4 processes: DP 2, then 1


def _trainer_config(tp: int, pp: int, schedule):
    from test_pipeline_trainer import _config

    cfg = _config(pp)
    cfg.model.untie_embeddings_and_output_weights = True
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_schedule = tp, schedule
    cfg.parallel.overlap_grad_reduce = True
    cfg.train.train_iters, cfg.train.eval_interval = 3, 2
    return cfg


def _worker(rank: int, world: int, cases: list, trainer_runs: list):
    import torch

    from meshtron.parallel.context import build_groups
    from meshtron.training.trainer import run_training
    from pipeline_helpers import train_and_collect

    out = []
    for cfg in cases:
        p = cfg.parallel
        ctx = build_groups(p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                           p.expert_model_parallel_size, torch.device("cpu"))
        out.append(train_and_collect(cfg, ctx))
    trained = [run_training(_trainer_config(tp, pp, ZBV)) for tp, pp in trainer_runs]
    return out, [(r.train_losses, r.grad_norms, r.eval_losses) for r in trained]


@pytest.fixture(scope="module")
def world4():
    from tests.distributed.launch import run_distributed

    return run_distributed(_worker, 4, [cfg for _, cfg in WORLD_4], TRAINER_RUNS, timeout=300)


@pytest.mark.parametrize("index", [0, 2, 3], ids=[WORLD_4[i][0] for i in (0, 2, 3)])
def test_zbv_matches_single_process_and_one_f_one_b(world4, index):
    import torch

    from test_pipeline_parallel import assert_close_dict, reference

    name, cfg = WORLD_4[index]
    ref = reference(cfg)
    for rank, (per_rank, _) in enumerate(world4):
        out, where = per_rank[index], f"{name} rank {rank}"
        torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5, atol=1e-6, msg=lambda s: f"{where}: {s}")
        torch.testing.assert_close(out["norms"], ref["norms"], rtol=1e-5, atol=1e-6, msg=lambda s: f"{where}: {s}")
        torch.testing.assert_close(out["eval_loss"], ref["eval_loss"], rtol=1e-5, atol=1e-6)
        assert_close_dict(out["grads"], ref["grads"], f"{where} gradient")
        assert_close_dict(out["params"], ref["params"], f"{where} parameter", rtol=1e-4, atol=1e-5)
        assert out["deferred_gemms"] > 0, where
        if index == 0:  # against its 1F1B twin
            twin = per_rank[1]
            assert_close_dict(out["grads"], twin["grads"], f"{where} gradient against 1F1B", rtol=1e-5, atol=1e-6)
            assert_close_dict(out["params"], twin["params"], f"{where} parameter against 1F1B", rtol=1e-5, atol=1e-6)
            assert twin["deferred_gemms"] == 0, where
        assert out["max_in_flight"] <= 2 * cfg.parallel.pipeline_model_parallel_size, where


def test_trainer_zbv_logs_the_losses_of_one_process(world4):
    import os

    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref = run_training(_trainer_config(1, 1, None))
    assert len(ref.train_losses) == 3
    for i, (tp, pp) in enumerate(TRAINER_RUNS):
        for rank, (_, per_rank) in enumerate(world4):
            losses, norms, evals = per_rank[i]
            where = f"tp={tp} pp={pp} zbv rank {rank}"
            assert losses == pytest.approx(ref.train_losses, rel=1e-5), where
            assert norms == pytest.approx(ref.grad_norms, rel=1e-5), where
            assert evals == pytest.approx(ref.eval_losses, rel=1e-5), where
