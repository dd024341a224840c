"""Context parallelism equals the one-process run: attention (ring and all-gather), the model
(logits, loss, every gradient) with CP 2 and 4 and TP 2 x CP 2, and the trainer's losses."""

from __future__ import annotations

import os

import pytest

from tests.context_parallel import cp_cases as cases

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
    return cases.results_of(worlds, world, cases.suite_worker, TRAINER_RUNS[world])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm_type,documents", cases.ATTENTION_CASES,
                         ids=[f"{c}-{'documents' if d else 'causal'}" for c, d in cases.ATTENTION_CASES])
def test_attention_matches_full_attention(worlds, world, comm_type, documents):
    ref = cases.attention_reference(3, documents)
    for rank, res in enumerate(_results(worlds, world)):
        for name, got, want in zip(("out", "dq", "dk", "dv"), res[("attention", comm_type, documents)], ref):
            cases.assert_close(got, want, f"cp={world} rank {rank} {name}")


@pytest.mark.parametrize("world,case", [(w, c) for w in (2, 4) for c in cases.MODEL_CASES[w]],
                         ids=[c[0] for w in (2, 4) for c in cases.MODEL_CASES[w]])
def test_model_matches_single_process(worlds, world, case):
    name, model, _, _, _, documents = case
    cases.assert_model_matches(_results(worlds, world), name, cases.model_reference(model, documents))


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
