"""--check-for-nan-in-loss-and-grad under ZeRO-2/3 (--data-parallel-sharding-strategy optim_grads /
optim_grads_params): each rank's gradient shard and own loss are checked and the verdict is shared by
every rank, so an injected NaN is re-run as with unsharded gradients."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.parallel.context import ParallelContext
from meshtron.resilience.rerun import nonfinite_on_any_rank
from tests.distributed.launch import run_distributed
from tests.resilience.cli_runs import Run, clean_run, train


@pytest.fixture(scope="session")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return clean_run(str(tmp_path_factory.getbasetemp()))


def _flags(rank: int, world: int) -> list[float]:
    """Three cases, each rank's shard: all finite; NaN on rank 1 only; inf on rank 0 only (loss finite)."""
    import torch.distributed as dist

    ctx = ParallelContext(dp=world, rank=rank, dp_rank=rank)
    loss = torch.tensor(2.0).reshape(1)
    out = []
    for bad_rank, value in ((None, 0.0), (1, float("nan")), (0, float("inf"))):
        shard = torch.ones(5)
        if rank == bad_rank:
            shard[3] = value
        out.append(float(nonfinite_on_any_rank([loss, shard, torch.empty(0)], ctx)))
    dist.barrier()
    return out


def test_a_nonfinite_shard_on_one_rank_is_seen_by_every_rank() -> None:
    assert run_distributed(_flags, 2, timeout=120) == [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]


def test_one_process_checks_its_own_tensors() -> None:
    ctx = ParallelContext()
    assert float(nonfinite_on_any_rank([torch.zeros(3), torch.tensor([1.0, -2.0]).bfloat16()], ctx)) == 0.0
    assert float(nonfinite_on_any_rank([torch.tensor([1.0, float("-inf")]).bfloat16()], ctx)) == 1.0
    assert float(nonfinite_on_any_rank([], ctx)) == 0.0


# ZeRO-3 (parameters sharded too) is the fast representative; ZeRO-2 is slow.
@pytest.mark.parametrize("strategy", [pytest.param("optim_grads", marks=pytest.mark.slow), "optim_grads_params"])
def test_injected_nan_is_rerun_under_sharded_gradients(tmp_path, clean: Run, strategy: str) -> None:
    run = train(tmp_path, 2, "--data-parallel-sharding-strategy", strategy, "--inject-fault", "nan:1:4")
    assert run.returncode == 0, run.stderr
    [event] = run.of_type("rerun")  # before: no re-run at all, the NaN step was applied
    assert (event["iteration"], event["rank"], event["result"], event["action"]) == (4, 1, "transient", "continued")
    assert "iteration 4" in run.stderr and "first on rank 1" in run.stderr
    losses = run.losses()
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(x) for x in losses.values())
    for it, want in clean.losses().items():  # the re-run's result: the fault-free run's losses
        assert losses[it] == pytest.approx(want, rel=1e-5), it


# -- a NaN where the gradient norm does not look -------------------------------------------------

def _replicated_norm_offset(trainer) -> int:
    """Where, in this rank's gradient shard, the first TP-replicated norm weight starts: without sequence
    parallelism its gradient is not summed over TP, and the norm counts TP rank 0's copy only."""
    from meshtron.parallel.sharding import spec_of

    layout = trainer.dp_strategy.layout
    i = next(i for i, p in enumerate(layout.params) if spec_of(p).tp_replicated and spec_of(p).grad_sync is None)
    return trainer.dp_strategy.compact.compact_offset(layout.bucket_of_param[i], layout.offsets[i][0])


def _train_with_hidden_nan(rank: int, world: int, runs: list[tuple[str, str]], iteration: int) -> list[bool]:
    """Train with TP=2 under each strategy; at ``iteration``'s first execution TP rank 1's reduced shard gets
    a NaN in its copy of a norm weight's gradient. Returns, per run, whether the weights stayed finite."""
    from meshtron.cli import build_config
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer, TrainingError
    from tests.resilience.cli_runs import TINY

    out = []
    for strategy, metrics in runs:
        cfg = build_config(TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "4", "--global-batch-size",
                                   "2", "--data-parallel-sharding-strategy", strategy, "--metrics-file", metrics])
        trainer = Trainer(cfg, context_from_config(cfg))
        finish, fired = trainer.dp_strategy.finish, []

        def finish_then_corrupt(trainer=trainer, finish=finish, fired=fired) -> None:
            finish()
            if trainer.progress.iteration == iteration and not fired:
                fired.append(True)
                if trainer.ctx.tp_rank == 1:
                    trainer.dp_strategy.grad_data[_replicated_norm_offset(trainer)] = float("nan")

        trainer.dp_strategy.finish = finish_then_corrupt
        try:
            trainer.train()
            out.append(True)
        except TrainingError:  # the NaN reached the weights
            out.append(False)
        finally:
            trainer.close()
            trainer.logger.close()
    return out


def test_a_nan_the_gradient_norm_does_not_count_is_rerun(tmp_path) -> None:
    from meshtron.training.logging_sinks import read_metrics

    runs = [(s, str(tmp_path / f"{s}.jsonl")) for s in ("optim_grads", "optim_grads_params")]
    finite = run_distributed(_train_with_hidden_nan, 2, runs, 3, timeout=240)
    assert finite == [[True, True], [True, True]]
    for strategy, metrics in runs:
        events = [r for r in read_metrics(metrics) if r["type"] == "rerun"]
        # Before the shard check: no re-run, and TP rank 1 stepped its norm weight with a NaN gradient.
        assert [(e["iteration"], e["result"], e["action"]) for e in events] == [(3, "transient", "continued")], \
            strategy
