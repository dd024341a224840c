"""Context parallelism equals the one-process run: attention (ring and all-gather), the model
(logits, loss, every gradient) with CP 2 and 4 and TP 2 x CP 2, and the trainer's losses."""

from __future__ import annotations

import os

import pytest
import torch

from tests.context_parallel import cp_cases as cases
from tests.distributed.launch import run_distributed

# Trainer runs inside the worlds of 2 and 4 processes (keyword arguments of cases.trainer_config).
TRAINER_RUNS = {
    2: [dict(cp=2, comm_type="p2p"), dict(cp=2, comm_type="allgather")],
    4: [dict(cp=2, comm_type="p2p", distributed_optimizer=True), dict(cp=2, comm_type="allgather", pp=2)],
}


@pytest.fixture(scope="module")
def worlds() -> dict:
    """Results of every rank, by world size (one start of the processes per world)."""
    return {}


def _results(worlds: dict, world: int) -> list[dict]:
    if world not in worlds:
        worlds[world] = run_distributed(cases.suite_worker, world, TRAINER_RUNS[world], timeout=300)
    return worlds[world]


def _assert_close(got, want, what: str, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm_type,documents", cases.ATTENTION_CASES,
                         ids=[f"{c}-{'documents' if d else 'causal'}" for c, d in cases.ATTENTION_CASES])
def test_attention_matches_full_attention(worlds, world, comm_type, documents):
    ref = cases.attention_reference(3, documents)
    for rank, res in enumerate(_results(worlds, world)):
        for name, got, want in zip(("out", "dq", "dk", "dv"), res[("attention", comm_type, documents)], ref):
            _assert_close(got, want, f"cp={world} rank {rank} {name}")


@pytest.mark.parametrize("world,case", [(w, c) for w in (2, 4) for c in cases.MODEL_CASES[w]],
                         ids=[c[0] for w in (2, 4) for c in cases.MODEL_CASES[w]])
def test_model_matches_single_process(worlds, world, case):
    name, model, _, _, _, documents = case
    ref_logits, ref_total, ref_losses, ref_grads = cases.model_reference(model, documents)
    for rank, res in enumerate(_results(worlds, world)):
        logits, total, losses, grads = res[("model", name)]
        _assert_close(logits, ref_logits, f"rank {rank} logits")
        _assert_close(total, ref_total, f"rank {rank} loss", rtol=1e-6, atol=1e-6)
        _assert_close(losses, ref_losses, f"rank {rank} token losses")
        assert grads.keys() == ref_grads.keys()
        for key in ref_grads:
            _assert_close(grads[key], ref_grads[key], f"rank {rank} grad {key}", atol=1e-6)


@pytest.mark.parametrize("world,index", [(w, i) for w in (2, 4) for i in range(len(TRAINER_RUNS[w]))],
                         ids=[f"{w}procs-" + "-".join(f"{k}={v}" for k, v in run.items())
                              for w in (2, 4) for run in TRAINER_RUNS[w]])
def test_trainer_logs_the_single_process_losses(worlds, world, index):
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref = run_training(cases.trainer_config())
    assert len(ref.train_losses) == 3 and len(ref.eval_losses) == 2  # iteration 0 and the end
    for rank, res in enumerate(_results(worlds, world)):
        train, evals = res[("trainer", index)]
        assert train.keys() == ref.train_losses.keys() and evals.keys() == ref.eval_losses.keys()
        for it in ref.train_losses:
            assert train[it] == pytest.approx(ref.train_losses[it], rel=1e-5), f"rank {rank} iteration {it}"
        for it in ref.eval_losses:
            assert evals[it] == pytest.approx(ref.eval_losses[it], rel=1e-5), f"rank {rank} eval {it}"
