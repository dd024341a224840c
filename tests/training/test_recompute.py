"""Activation recomputation: same gradients; full recomputes matmuls in backward, selective does not."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.config import ModelConfig
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from meshtron.presets import apply_preset


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def run(mode):
    m = ModelConfig()
    apply_preset(m, "tiny")
    m.num_layers = 2
    layers = [0, 1] if mode == "full" else []
    model = GPTModel(m, ParallelContext(), 128, recompute_layers=layers, selective_recompute=mode == "selective")
    initialize_parameters(model, 3, torch.device("cpu"), torch.float32)
    model.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    total, _ = model(tokens, labels=tokens.roll(-1, 1), loss_weight=torch.full((2, 32), 1 / 64))
    counter = CountOps()
    with counter:
        total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return total.detach(), grads, counter.counts


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_gives_the_same_gradients(mode):
    ref_loss, ref_grads, ref_counts = run(None)
    loss, grads, counts = run(mode)
    torch.testing.assert_close(loss, ref_loss)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    mm = lambda c: c.get("mm", 0) + c.get("addmm", 0)  # noqa: E731
    norms = lambda c: c.get("_fused_rms_norm", 0) + c.get("rms_norm", 0) + c.get("rsqrt", 0)  # noqa: E731
    if mode == "full":
        assert mm(counts) > mm(ref_counts)  # the forward matmuls run again in backward
    else:
        assert mm(counts) == mm(ref_counts)  # matmul outputs are kept
        assert norms(counts) > norms(ref_counts)  # the norms are recomputed
