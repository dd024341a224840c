"""The one-device training loop: learning, exact resume, schedules, clipping, non-finite steps, generation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from meshtron.cli import build_config
from meshtron.config import ModelConfig, OptimConfig
from meshtron.model import GPTModel
from meshtron.optim.clip import clip_coefficient
from meshtron.optim.lr_schedule import learning_rate
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from meshtron.presets import PRESETS, apply_preset, count_parameters
from meshtron.training.trainer import TrainingError, run_training

MOCK = ["--mock-data", "--vocab-size", "256", "--model", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--device", "cpu", "--log-interval", "1", "--no-generate-sample"]


def train(args: list[str]):
    cfg = build_config(args)
    return run_training(cfg)


def test_loss_falls_on_the_default_corpus(tmp_path):
    result = train(["--model", "tiny", "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "8",
                    "--train-iters", "100", "--lr", "3e-3", "--lr-warmup-iters", "5", "--eval-interval", "50",
                    "--eval-iters", "2", "--log-interval", "10", "--device", "cpu", "--no-generate-sample",
                    "--metrics-file", str(tmp_path / "m.jsonl")])
    losses = result.train_losses
    assert losses[100] < losses[10] - 1.0, losses
    assert result.eval_losses[100] < result.eval_losses[50] < result.eval_losses[0] - 1.0, result.eval_losses
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert {r["type"] for r in records} == {"train", "eval"}


def test_resume_equals_uninterrupted(tmp_path):
    full = train(MOCK + ["--train-iters", "6", "--eval-interval", "0"])
    save = str(tmp_path / "ckpt")
    train(MOCK + ["--train-iters", "6", "--exit-interval", "3", "--save", save, "--eval-interval", "0"])
    resumed = train(MOCK + ["--train-iters", "6", "--load", save, "--eval-interval", "0"])
    assert sorted(resumed.train_losses) == [4, 5, 6]
    for it in (4, 5, 6):
        assert resumed.train_losses[it] == pytest.approx(full.train_losses[it], rel=1e-6, abs=1e-7)


def test_metrics_file_schema(tmp_path):
    path = tmp_path / "metrics.jsonl"
    train(MOCK + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--metrics-file", str(path)])
    records = [json.loads(line) for line in open(path)]
    train_rec = [r for r in records if r["type"] == "train"]
    assert [r["iteration"] for r in train_rec] == [1, 2]
    keys = {"type", "iteration", "consumed_samples", "loss", "lr", "grad_norm", "step_time_s",
            "tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gib"}
    assert keys <= set(train_rec[0])
    assert train_rec[1]["consumed_samples"] == 8
    assert isinstance(train_rec[0]["loss"], float) and math.isfinite(train_rec[0]["loss"])
    ev = [r for r in records if r["type"] == "eval"][0]
    assert ev["ppl"] == pytest.approx(math.exp(ev["loss"]), rel=1e-6)


def test_nonfinite_steps_are_skipped_then_stop(tmp_path):
    with pytest.raises(TrainingError, match="consecutive iterations"):
        train(MOCK + ["--train-iters", "5", "--init-method-std", "1e30", "--max-nonfinite-steps", "2",
                      "--eval-interval", "0"])


@pytest.mark.parametrize("style,checks", [
    # Iteration i runs at schedule position i - 1 (Megatron-LM steps its scheduler after each iteration).
    ("cosine", {1: 0.0, 2: 0.1, 11: 1.0, 56: 0.55, 100: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)),
                101: 0.1, 201: 0.1}),
    ("linear", {6: 0.5, 11: 1.0, 56: 0.55, 101: 0.1}),
    ("constant", {6: 0.5, 51: 1.0, 101: 1.0}),
    ("inverse-square-root", {11: 1.0, 41: 0.5, 101: 1.0 / math.sqrt(10), 1001: 0.1}),
    ("WSD", {11: 1.0, 91: 1.0, 96: 0.55, 101: 0.1}),
])
def test_learning_rate_schedules(style, checks):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style=style, lr_decay_iters=100,
                      lr_wsd_decay_iters=10, lr_wsd_decay_style="linear")
    for it, expected in checks.items():
        assert learning_rate(cfg, it, 100) == pytest.approx(expected, abs=1e-9), (style, it)


def test_clip_coefficient():
    assert clip_coefficient(torch.tensor(4.0), 1.0).item() == pytest.approx(0.25, rel=1e-5)
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(9.0), 0.0).item() == 1.0


def test_clipping_bounds_the_applied_update():
    """With --clip-grad tiny, the first AdamW step still moves weights by lr (Adam normalises), but the logged
    norm is the unclipped one and later steps see clipped gradients: losses differ from the unclipped run."""
    a = train(MOCK + ["--train-iters", "3", "--clip-grad", "1e-4", "--eval-interval", "0"])
    b = train(MOCK + ["--train-iters", "3", "--clip-grad", "0", "--eval-interval", "0"])
    assert a.grad_norms[1] == pytest.approx(b.grad_norms[1], rel=1e-6)
    assert a.train_losses[3] != pytest.approx(b.train_losses[3], rel=1e-6)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_built_model_has_the_counted_parameters(name):
    """The model built on the meta device holds exactly the parameters count_parameters computes."""
    m = ModelConfig()
    apply_preset(m, name)
    if m.num_experts:
        pytest.skip("MoE layers are counted by the MoE tests")
    vocab = m.vocab_size or 4096
    model = GPTModel(m, ParallelContext(), vocab)
    padding = (model.padded_vocab - vocab) * m.hidden_size * (2 if m.untie_embeddings_and_output_weights else 1)
    assert sum(p.numel() for p in model.parameters()) - padding == count_parameters(m, vocab)["total"]


def test_bf16_initialisation_gives_bf16_parameters_with_the_fp32_values():
    m = ModelConfig()
    apply_preset(m, "tiny")
    a = GPTModel(m, ParallelContext(), 300)
    b = GPTModel(m, ParallelContext(), 300)
    initialize_parameters(a, 3, torch.device("cpu"), torch.bfloat16)
    initialize_parameters(b, 3, torch.device("cpu"), torch.float32)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pa.dtype == torch.bfloat16, name
        torch.testing.assert_close(pa.float(), pb.to(torch.bfloat16).float())


def test_kv_cache_generation_equals_no_cache():
    from meshtron.generate import generate_ids

    m = ModelConfig()
    apply_preset(m, "tiny")
    model = GPTModel(m, ParallelContext(), 300)
    initialize_parameters(model, 5, torch.device("cpu"), torch.float32)
    prompt = [5, 17, 42, 7]
    for temperature in (0.0, 1.0):
        cached = generate_ids(model, prompt, 20, temperature=temperature, top_k=50, seed=3, use_cache=True)
        plain = generate_ids(model, prompt, 20, temperature=temperature, top_k=50, seed=3, use_cache=False)
        assert cached == plain
