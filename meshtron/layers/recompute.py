"""Activation recomputation policies for a transformer layer.

``full``: the layer keeps only its input; everything is recomputed in backward.
``selective``: the layer keeps the outputs of its matrix multiplications and attention kernels,
and recomputes the cheap, memory-heavy element-wise work in backward (norms,
rotary embeddings, the SwiGLU/GeLU activation, residual adds). Recomputing those costs a few
percent of the step; the tensors they would have kept (two normalised copies of the hidden state,
the rotated queries/keys and the MLP's activation output) are about a fifth of a layer's activations.
Implemented with torch's selective activation checkpointing, which torch.compile traces. With tensor
parallelism the recomputation also re-runs the layer's forward collectives (an extra all-gather /
all-reduce per parallel linear in backward).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten


def _saved_ops() -> set:
    names = ["mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


_SAVED = _saved_ops()


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVED:  # matmuls and attention are never recomputed
        return CheckpointPolicy.MUST_SAVE
    # Everything else is, tensor-parallel collectives included: they write their outputs in place
    # (asynchronously), which the checkpoint cache cannot hold, so the recomputation runs them again.
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all_but_saved_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # Eagerly the backward replays the whole region, so a matmul's output must come from the cache. Compiled,
    # the partitioner recomputes only what the backward reads, which never includes a matmul's output here;
    # marking it saved made it keep the output whole ([s, b, h] before the sequence-parallel reduce-scatter).
    if op in _SAVED and not torch.compiler.is_compiling():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def recompute_all_but_matmuls(fn: Callable, *args):
    """``fn(*args)`` whose backward recomputes everything but its matmul and attention outputs.

    Unlike ``selective`` (whose other ops the compiler may still choose to keep), the recomputation is
    forced: a compiled graph would otherwise merge a recomputation written into a backward with the
    forward's result and keep it. ``fn`` must contain no collective (it would run again)."""
    context = functools.partial(create_selective_checkpoint_contexts, _recompute_all_but_saved_ops)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)


def run_with_recompute(fn: Callable, mode: str, *args):
    """Run ``fn(*args)`` under ``full`` or ``selective`` activation recomputation."""
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False)
    if mode == "selective":
        context = functools.partial(create_selective_checkpoint_contexts, _policy)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context)
    raise ValueError(f"unknown recomputation mode {mode!r}")
