"""The step-time model's gradient accumulation (:func:`meshtron.planning.step_time.gradient_accumulation_bytes`)
against the operations the gradient buffer runs: the bytes its post-accumulate hooks move, counted per operator
while backward runs, per parameter and micro-batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.cli import build_config
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.planning.profiles import H100
from meshtron.planning.step_time import Links, gradient_accumulation_bytes, predict_step
from meshtron.planning.validate import validate_for_plan


class _HookBytes(TorchDispatchMode):
    """HBM bytes of the copies and additions into fp32 tensors: what the buffer's hooks do (autograd's own
    kernels write bf16 gradients here)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("copy_", "_foreach_copy_"):
            dst, src = (args[0], args[1]) if name == "copy_" else (args[0][0], args[1][0])
            if dst.dtype == torch.float32:
                self.bytes += src.nbytes + dst.nbytes  # read the gradient, write the buffer
        elif name == "add_" and args[0].dtype == torch.float32:
            self.bytes += 2 * args[0].nbytes + args[1].nbytes  # read both, write the buffer
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_the_model_counts_what_the_gradient_buffer_moves(micro_batches):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 16, bias=False)).to(torch.bfloat16)
    params = list(model.parameters())
    buffer = GradBuffer(params, dtype=torch.float32)
    buffer.zero()
    counter = _HookBytes()
    with counter:
        for _ in range(micro_batches):
            model(torch.randn(8, 32, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    buffer.remove_hooks()
    n = sum(p.numel() for p in params)
    cfg = validate_for_plan(build_config(["--model", "llama3-1b", "--bf16"]), 1)
    assert counter.bytes == pytest.approx(n * micro_batches * gradient_accumulation_bytes(cfg, "optim", micro_batches))


def test_bf16_buffers_and_sharded_gradients_move_their_own_bytes():
    bf16 = validate_for_plan(build_config(["--model", "llama3-1b", "--bf16"]), 8)
    assert gradient_accumulation_bytes(bf16, "optim", 1) == 6  # bf16 read, fp32 written
    assert gradient_accumulation_bytes(bf16, "optim", 4) == (6 + 3 * 10) / 4
    assert gradient_accumulation_bytes(bf16, "optim_grads", 4) == 14  # a zeroed fp32 bucket, then the add
    half = validate_for_plan(build_config(["--model", "llama3-1b", "--bf16", "--grad-reduce-in-bf16"]), 8)
    assert gradient_accumulation_bytes(half, "optim", 2) == (4 + 6) / 2


def test_each_micro_batch_pays_a_pass_over_the_ranks_gradients():
    """Going from 8 to 16 micro-batches adds 8 micro-batches' layers and gradient additions, no more."""
    def step(gbs: int):
        argv = ["--model", "llama3-8b", "--bf16", "--seq-length", "4096", "--micro-batch-size", "1",
                "--global-batch-size", str(gbs)]
        cfg = validate_for_plan(build_config(argv), 1)
        return cfg, predict_step(cfg, 1, H100, links=Links(8))

    cfg8, p8 = step(8)
    cfg16, p16 = step(16)
    params = 8.03e9
    adds = params * 10 / (H100.hbm_gbps * 1e9 * H100.hbm_efficiency)
    per_micro_layers = (p16.compute_s - p8.compute_s) / 8 - adds
    # the layers' time per micro-batch is what a one-micro-batch step's compute less its gradient copy is
    cfg1, p1 = step(1)
    copy = params * 6 / (H100.hbm_gbps * 1e9 * H100.hbm_efficiency)
    assert per_micro_layers == pytest.approx(p1.compute_s - copy, rel=0.01)
