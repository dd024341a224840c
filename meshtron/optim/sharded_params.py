"""Sharded weights, gathered per layer just before use and freed after it (ZeRO-3, ``optim_grads_params``).

Units: every transformer layer of a model chunk is one unit; the chunk's other parameters
(embedding, final norm, output layer) form the chunk's root unit. The flat layout gives each
unit buckets of its own (:func:`unit_layout`), so a unit's weights are whole buckets. Between uses
a rank keeps only its shard of every bucket (``data``, compact, in the weights' dtype), which is
what the distributed optimizer steps. Each bucket has a full-size tensor whose storage is empty
except while the unit is in use; the parameters are views of it (``param.data``), so autograd's
saved weights stay valid across a free and a re-gather (they share the storage).

* forward: a forward pre-hook on the unit's module all-gathers its buckets (or waits for the
  prefetched gather) and starts the next unit's gather asynchronously; a forward post-hook frees
  them, and puts a hook on the module's outputs that gathers them again (and prefetches the
  previous unit) when backward reaches the module. A unit compiled with ``nn.Module.compile`` (whose
  compiled region would contain its hooks) gets the same two steps around its compiled call instead,
  run eagerly (:meth:`ShardedParams._wrap_compiled`);
* backward: once a bucket's gradients have all arrived (:mod:`meshtron.optim.sharded_grads`),
  its weights are freed again. A forward re-run during backward (recomputation) keeps the weights
  (they are needed by the backward that follows);
* after the optimizer step every full bucket is freed (its contents are stale);
  :meth:`ShardedParams.materialize` gathers every bucket, for reading or writing the weights
  outside a forward pass (checkpoints, norms); :meth:`ShardedParams.commit` copies written
  weights back into the shards (after loading a checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from meshtron.optim.buckets import BufferLayout, DEFAULT_ALIGN, dense_group, expert_group, place_buckets
from meshtron.optim.collectives import all_gather_single
from meshtron.optim.shards import CompactShards, parameter_view
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of


def _layer_class() -> type:
    from meshtron.model import TransformerLayer

    return TransformerLayer


def unit_modules(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's units in forward order: its outermost transformer layers, then the chunk (root)."""
    layer = _layer_class()
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, layer):
                out.append(child)
            else:
                visit(child)

    visit(chunk)
    return out + [chunk]


def unit_of_params(model_chunks: Sequence[nn.Module]) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (chunk, unit index within the chunk); the root unit is the last index."""
    owner: dict[int, tuple[int, int]] = {}
    for c, chunk in enumerate(model_chunks):
        units = unit_modules(chunk)
        for u, module in enumerate(units[:-1]):
            for p in module.parameters():
                owner.setdefault(id(p), (c, u))
        for p in chunk.parameters():
            owner.setdefault(id(p), (c, len(units) - 1))
    return owner


def unit_layout(model_chunks: Sequence[nn.Module], ctx: ParallelContext,
                isolate: Callable[[nn.Parameter], bool] = lambda p: False, align: int = DEFAULT_ALIGN,
                whole: bool = False) -> BufferLayout:
    """A flat layout whose buckets never span two units: one bucket per (unit, dense/expert), plus the
    isolated tied embedding. Parameters in the chunks' registration order (the optimizer's and the
    checkpoint's index order); offsets and buckets in backward order, as :func:`build_layout` lays them.
    ``whole``: no parameter straddles two ranks' shards (:func:`meshtron.optim.buckets.place_buckets`)."""
    dense, expert = dense_group(ctx), expert_group(ctx)
    owner = unit_of_params(model_chunks)
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    groups: dict[tuple, list[int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        c, u = owner[id(p)]
        key = (c, u, spec_of(p).expert, isolate(p), i if isolate(p) else -1)
        groups.setdefault(key, []).append(i)
    ordered = sorted(groups.items(), key=lambda item: -item[1][0])  # by first gradient ready
    return place_buckets(params, [(c, expert if is_expert else dense, isolated, members)
                                  for (c, _, is_expert, isolated, _), members in ordered], align, whole=whole)


@dataclass
class _Unit:
    module: nn.Module
    buckets: list[int] = field(default_factory=list)
    previous: Optional["_Unit"] = None
    following: Optional["_Unit"] = None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ShardedParams:
    """This rank's weight shards and the per-unit gather / free of the full weights."""

    def __init__(self, layout: BufferLayout, model_chunks: Sequence[nn.Module], device: Optional[torch.device] = None,
                 prefetch: bool = True):
        self.layout = layout
        self.shards = CompactShards(layout)
        dtypes = {p.dtype for p in layout.params}
        if len(dtypes) != 1:
            raise ValueError(f"sharded weights need one dtype; the model has {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        device = device or layout.params[0].device
        self.prefetch = prefetch
        self.data = torch.zeros(self.shards.numel, dtype=self.dtype, device=device)
        self.full = [torch.zeros(b.numel, dtype=self.dtype, device=device) for b in layout.buckets]
        with torch.no_grad():
            for i, p in enumerate(layout.params):
                view = parameter_view(layout, i, self.full[layout.bucket_of_param[i]])
                view.copy_(p.data)
                p.data = view
            for b in range(len(layout.buckets)):
                self._store_shard(b)
        self._gathered = [True] * len(layout.buckets)
        self._handles: dict[int, object] = {}
        self._units = self._build_units(model_chunks)
        self._hooks: list = []
        self._compiled: list[tuple[nn.Module, Callable]] = []  # (unit, its own compiled call) to restore
        for unit in self._units:
            if getattr(unit.module, "_compiled_call_impl", None) is not None:
                self._wrap_compiled(unit)
            else:
                self._hooks.append(unit.module.register_forward_pre_hook(self._pre_forward(unit)))
                self._hooks.append(unit.module.register_forward_hook(self._post_forward(unit)))
        self.free_all()

    def _build_units(self, model_chunks: Sequence[nn.Module]) -> list[_Unit]:
        owner = unit_of_params(model_chunks)
        units: list[_Unit] = []
        for c, chunk in enumerate(model_chunks):
            chunk_units = [_Unit(m) for m in unit_modules(chunk)]
            for i, b in enumerate(self.layout.buckets):
                _, u = owner[id(self.layout.params[b.param_indices[0]])]
                chunk_units[u].buckets.append(i) if b.chunk == c else None
            layers = [u for u in chunk_units[:-1] if u.buckets]
            for a, z in zip(layers, layers[1:]):
                a.following, z.previous = z, a
            units += [u for u in chunk_units if u.buckets]
        return units

    # ----------------------------------------------------------------------------------- storage
    def _store_shard(self, b: int) -> None:
        s, e = self.layout.buckets[b].shard_range()
        lo, hi = self.shards.range_of(b)
        start = self.layout.buckets[b].start
        self.data[lo:hi].copy_(self.full[b][s - start:e - start])

    def _free(self, b: int) -> None:
        self._wait(b)
        if self._gathered[b]:
            self.full[b].untyped_storage().resize_(0)
            self._gathered[b] = False

    def _start_gather(self, b: int) -> None:
        """Allocate bucket ``b``'s full storage and launch its all-gather (asynchronous)."""
        if self._gathered[b] or b in self._handles:
            return
        full = self.full[b]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        bucket = self.layout.buckets[b]
        lo, hi = self.shards.range_of(b)
        if bucket.reduce.group is None:
            with torch.no_grad():
                full.copy_(self.data[lo:hi])
            self._gathered[b] = True
            return
        with torch.no_grad():
            self._handles[b] = all_gather_single(full, self.data[lo:hi], bucket.reduce.group, async_op=True)

    def _wait(self, b: int) -> None:
        work = self._handles.pop(b, None)
        if work is not None:
            work.wait()
            self._gathered[b] = True

    def gather(self, buckets: Sequence[int]) -> None:
        """Make ``buckets``' full weights readable (launch the missing gathers, wait for all of them)."""
        for b in buckets:
            self._start_gather(b)
        for b in buckets:
            self._wait(b)

    # ----------------------------------------------------------------------------------- hooks
    def _pre_forward(self, unit: _Unit):
        def hook(module, args):
            self.gather(unit.buckets)
            if self.prefetch and unit.following is not None:
                for b in unit.following.buckets:
                    self._start_gather(b)
        return hook

    def _post_forward(self, unit: _Unit):
        def hook(module, args, output):
            if _in_backward():  # a recomputed forward: its backward comes next and needs the weights
                return output
            for b in unit.buckets:
                self._free(b)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in tensors:
                    t.register_hook(self._pre_backward(unit))
            return output
        return hook

    def _wrap_compiled(self, unit: _Unit) -> None:
        """Gather and free around a unit compiled with ``nn.Module.compile``, outside its compiled region.

        ``nn.Module.compile`` compiles the module's ``_call_impl``, hooks included, so forward hooks
        would be traced (their collectives and storage resizes are graph breaks, or worse). The module's
        call goes through ``_compiled_call_impl``: this replaces it by the same compiled function between
        the eager gather and free, so the compiled graph sees ordinary parameters whose storage is filled
        (the same tensors every step: no new guard fails, nothing recompiles)."""
        module = unit.module
        compiled = module._compiled_call_impl
        before, after = self._pre_forward(unit), self._post_forward(unit)

        def call(*args, **kwargs):
            before(module, args)
            return after(module, args, compiled(*args, **kwargs))

        module._compiled_call_impl = call
        self._compiled.append((module, compiled))

    def _pre_backward(self, unit: _Unit):
        def hook(grad):
            self.gather(unit.buckets)
            if self.prefetch and unit.previous is not None:
                for b in unit.previous.buckets:
                    self._start_gather(b)
            return grad
        return hook

    def release_after_backward(self, b: int) -> None:
        """Bucket ``b``'s gradients are all in: its full weights are not needed until the next use."""
        if _in_backward():
            self._free(b)

    # ----------------------------------------------------------------------------------- whole model
    def free_all(self) -> None:
        """Free every full bucket (after the step: their contents are stale)."""
        for b in range(len(self.layout.buckets)):
            self._free(b)

    def start(self) -> None:
        """After the optimizer step: the full weights are stale; the next use gathers them."""
        self.free_all()

    def materialize(self) -> None:
        """Gather every bucket (weights read or written outside a forward pass)."""
        self.gather(range(len(self.layout.buckets)))

    @torch.no_grad()
    def commit(self) -> None:
        """Copy the full weights (written by a checkpoint load) into this rank's shards."""
        self.materialize()
        for b in range(len(self.layout.buckets)):
            self._store_shard(b)

    def wait_all(self) -> None:
        for b in list(self._handles):
            self._wait(b)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module, compiled in self._compiled:
            module._compiled_call_impl = compiled
        self._compiled.clear()
