"""Megatron-LM flags with an effect in meshtron: --log-params-norm, --exit-on-missing-checkpoint,
--skip-train, --train-samples, --moe-router-topk-scaling-factor."""

from __future__ import annotations

import json

import pytest
import torch

from meshtron.cli import build_config
from meshtron.config import ModelConfig
from meshtron.layers.moe.router import TopKRouter
from meshtron.parallel.sharding import initialize_parameters
from meshtron.training.trainer import TrainingError, run_training
from meshtron.validation import validate_config
from tests.distributed.launch import run_distributed

ARGS = ["--mock-data", "--vocab-size", "200", "--model", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--device", "cpu", "--train-iters", "3", "--log-interval", "1",
        "--eval-interval", "0", "--make-vocab-size-divisible-by", "64", "--no-generate-sample", "--log-params-norm"]


def _params_norms(path) -> list[float]:
    return [r["params_norm"] for r in map(json.loads, open(path)) if r["type"] == "train"]


def _zeros(path) -> list[int]:
    return [r["num_zeros_in_grad"] for r in map(json.loads, open(path)) if r["type"] == "train"]


def _train(rank, world, extra, path):
    run_training(build_config(ARGS + extra + ["--metrics-file", path]))


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--use-distributed-optimizer"]], ids=["tp2", "dp2-distributed-optimizer"])
def test_params_norm_is_the_whole_models_in_every_layout(tmp_path, layout):
    """Each weight counted once over the ranks (TP shards summed, DP replicas once), so the logged norm
    equals the one-process run's, which is the norm of all its weights; the same for the count of zero
    gradient elements (--log-num-zeros-in-grad: the padded vocabulary rows of the output layer get none)."""
    one = tmp_path / "one.jsonl"
    zeros = ["--log-num-zeros-in-grad"]
    result = run_training(build_config(ARGS + zeros + ["--metrics-file", str(one)]))
    assert sorted(result.train_losses) == [1, 2, 3]
    reference = _params_norms(one)
    assert len(reference) == 3 and reference[0] != reference[2]  # the weights move
    assert all(z > 0 for z in _zeros(one))
    two = tmp_path / "two.jsonl"
    run_distributed(_train, 2, layout + zeros, str(two))
    assert _params_norms(two) == pytest.approx(reference, rel=1e-6)
    assert _zeros(two) == _zeros(one)


def test_exit_on_missing_checkpoint(tmp_path):
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(TrainingError, match="--exit-on-missing-checkpoint"):
        run_training(build_config(ARGS + ["--load", str(empty), "--exit-on-missing-checkpoint"]))
    assert run_training(build_config(ARGS + ["--load", str(empty)])).final_iteration == 3  # from scratch


def test_topk_scaling_factor_multiplies_the_combine_weights():
    cfg = ModelConfig(hidden_size=16, num_attention_heads=2, num_experts=4, moe_router_topk=2,
                      moe_router_score_function="sigmoid")
    tokens = torch.randn(10, 16, generator=torch.Generator().manual_seed(2))
    routings = []
    for factor in (None, 2.5):
        cfg.moe_router_topk_scaling_factor = factor
        with torch.device("meta"):
            router = TopKRouter(cfg, "r")
        initialize_parameters(router, 3, torch.device("cpu"), torch.float32)
        routings.append(router.eval()(tokens, 1))
    assert torch.equal(routings[0].indices, routings[1].indices)
    torch.testing.assert_close(routings[1].probs, 2.5 * routings[0].probs)


def test_skip_train_evaluates_the_loaded_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    trained = run_training(build_config(ARGS + ["--save", save, "--eval-interval", "3", "--eval-iters", "2"]))
    only_eval = run_training(build_config(ARGS + ["--load", save, "--skip-train", "--eval-iters", "2"]))
    assert only_eval.train_losses == {} and only_eval.final_iteration == 3
    assert only_eval.eval_losses[3] == pytest.approx(trained.eval_losses[3], rel=1e-6)


def test_train_samples_sets_the_iterations():
    result = run_training(build_config(ARGS + ["--train-samples", "10"]))  # global batch 4: 2 iterations
    assert sorted(result.train_losses) == [1, 2]


def test_profile_writes_a_torch_profiler_trace_of_the_chosen_steps(tmp_path):
    out = tmp_path / "trace"
    run_training(build_config(ARGS + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                                      "--profile-step-end", "3", "--profile-dir", str(out)]))
    traces = list(out.glob("*.pt.trace.json*"))
    assert len(traces) == 1 and traces[0].name.startswith("rank0")
    text = traces[0].read_text()
    assert "ProfilerStep" in text or "aten::" in text  # operators of the profiled step were recorded
    with pytest.raises(Exception, match="--profile-step-start"):
        validate_config(build_config(ARGS + ["--profile", "--profile-step-start", "3", "--profile-step-end", "3"]), 1)


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    shape = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96"]
    trained = run_training(build_config(ARGS + shape + ["--save", save, "--eval-interval", "3", "--eval-iters", "2"]))
    # no shape flags: the tiny preset would not fit the checkpoint, its saved model configuration does
    cfg = build_config(ARGS + ["--load", save, "--use-checkpoint-args", "--skip-train", "--eval-iters", "2"])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (3, 64)
    evaluated = run_training(cfg)
    assert evaluated.eval_losses[3] == pytest.approx(trained.eval_losses[3], rel=1e-6)
    with pytest.raises(Exception, match="--num-layers 5 contradicts the checkpoint's 3"):
        build_config(ARGS + ["--load", save, "--use-checkpoint-args", "--num-layers", "5"])
    with pytest.raises(Exception, match="--use-checkpoint-args needs --load"):
        build_config(ARGS + ["--use-checkpoint-args"])


def test_no_save_optim_and_rng_write_weights_only_checkpoints(tmp_path):
    from meshtron.checkpoint import resolve_checkpoint
    from meshtron.checkpoint.metadata import read_meta

    full, light = str(tmp_path / "full"), str(tmp_path / "light")
    run_training(build_config(ARGS + ["--save", full]))
    trained = run_training(build_config(ARGS + ["--save", light, "--no-save-optim", "--no-save-rng"]))
    meta = read_meta(resolve_checkpoint(light))
    assert not meta["optimizer"]["present"] and not meta["rng"]["present"]
    assert read_meta(resolve_checkpoint(full))["optimizer"]["present"]

    def size(path):
        return sum(f.stat().st_size for f in (tmp_path / path).rglob("*") if f.is_file())

    assert size("light") < size("full") / 2  # fp32 masters and two moments are most of a checkpoint
    resumed = run_training(build_config(ARGS + ["--load", light, "--train-iters", "4"]))  # fresh moments
    assert sorted(resumed.train_losses) == [4] and trained.final_iteration == 3
