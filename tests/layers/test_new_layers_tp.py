"""Gated DeltaNet, sink attention, gated attention and the clamped-SwiGLU MLP with TP=2 (with and without sequence
parallelism) equal one process: outputs, input gradients and every canonical gradient (one spawn for all)."""

from __future__ import annotations

from dataclasses import replace

import torch

from meshtron.layers.gated_attention import GatedAttention
from meshtron.layers.gated_deltanet import GatedDeltaNet
from meshtron.layers.gpt_oss_mlp import ClampedSwiGLUMLP
from meshtron.layers.rotary import inverse_frequencies, rope_tables
from meshtron.layers.sink_attention import SinkAttention
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.sharding import cut, gather_canonical, generate_canonical, initialize_parameters, spec_of
from tests.distributed.launch import run_distributed
from tests.layers.canonical import close, sum_tp_partial_grads

S, B, H = 24, 2, 32
CPU = torch.device("cpu")


def _layers(ctx, sp):
    return {
        "deltanet": GatedDeltaNet(ctx, "deltanet", H, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                                  value_head_dim=6, sequence_parallel=sp, kernel="chunk"),
        "sink": SinkAttention(ctx, "sink", H, 4, 2, 8, sliding_window=5, sequence_parallel=sp),
        "gated": GatedAttention(ctx, "gated", H, 4, 2, 8, sequence_parallel=sp),
        "mlp": ClampedSwiGLUMLP(ctx, "mlp", H, 24, sequence_parallel=sp),
    }


def _run(ctx, sp):
    rope = rope_tables(torch.arange(S), inverse_frequencies(8, 10000.0, torch.device("cpu")), torch.float32)
    results = {}
    for name, layer in _layers(ctx, sp).items():
        initialize_parameters(layer, 5, torch.device("cpu"), torch.float32)
        with torch.no_grad():  # sinks, biases and norm weights away from their zero start, the same in every layout
            for p in layer.parameters():
                spec = spec_of(p)
                p.add_(torch.cat([cut(generate_canonical(replace(piece, init="normal", std=0.1), 9, CPU), piece)
                                  for piece in spec.pieces], dim=spec.cat_dim))
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
        if sp:
            x = x.chunk(ctx.tp)[ctx.tp_rank]
        x.requires_grad_()
        y = layer(x) if name == "mlp" else layer(x, rope)
        (y * y).sum().backward()
        sum_tp_partial_grads(layer, ctx.tp_group)
        results[name] = (y.detach(), x.grad, gather_canonical([layer], "grad"))
    return results


def _worker(rank, world):
    ctx = build_groups(world, 1, 1, 1, torch.device("cpu"))
    return [_run(ctx, sp) for sp in (False, True)]


def test_tensor_parallel_equals_one_process():
    ref = _run(ParallelContext(), False)
    runs = run_distributed(_worker, 2)
    for sp in (False, True):
        for name, (ref_y, ref_dx, ref_grads) in ref.items():
            got = [r[sp][name] for r in runs]
            y = torch.cat([g[0] for g in got]) if sp else got[0][0]
            dx = torch.cat([g[1] for g in got]) if sp else got[0][1]
            close(y, ref_y, f"{name} output (sp={sp})")
            close(dx, ref_dx, f"{name} input gradient (sp={sp})")
            assert got[0][2].keys() == ref_grads.keys()
            for pname, g in ref_grads.items():
                close(got[0][2][pname], g, f"{pname} (sp={sp})")
