"""torch.compile'd gated DeltaNet, sink attention, gated attention and clamped-SwiGLU MLP: one graph each
(``fullgraph=True``, no graph break inside the layer) whose outputs and gradients equal the eager layer's.
Slow on the CPU (tens of seconds of compilation per layer)."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.gated_attention import GatedAttention
from meshtron.layers.gated_deltanet import GatedDeltaNet
from meshtron.layers.gpt_oss_mlp import ClampedSwiGLUMLP
from meshtron.layers.rotary import inverse_frequencies, rope_tables
from meshtron.layers.sink_attention import SinkAttention
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters

S = 70  # two DeltaNet chunks, the second padded


def _layer(name: str):
    ctx = ParallelContext()
    return {"deltanet": lambda: GatedDeltaNet(ctx, "d", 32, 2, 4, 8, 6, kernel="chunk"),
            "sink": lambda: SinkAttention(ctx, "s", 32, 4, 2, 8, sliding_window=5),
            "gated": lambda: GatedAttention(ctx, "g", 32, 4, 2, 8),
            "mlp": lambda: ClampedSwiGLUMLP(ctx, "m", 32, 24)}[name]()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deltanet", "sink", "gated", "mlp"])
def test_compiled_layer_equals_eager(name):
    torch._dynamo.reset()
    layer = _layer(name)
    initialize_parameters(layer, 1, torch.device("cpu"), torch.float32)
    args = () if name in ("deltanet", "mlp") else (
        rope_tables(torch.arange(S), inverse_frequencies(8, 1e4, torch.device("cpu")), torch.float32),)
    x = torch.randn(S, 2, 32, generator=torch.Generator().manual_seed(0))

    def run(fn):
        xi = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = fn(xi, *args)
        (y * y).sum().backward()
        return [y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]

    ref = run(layer)
    got = run(torch.compile(layer, fullgraph=True))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
