"""Model weights as views of one flat buffer, kept identical over data-parallel ranks.

With the distributed optimizer each data-parallel rank updates only its shard of
every bucket; an all-gather per bucket then gives every rank the whole updated
bucket. That needs the weights of a bucket to be one contiguous tensor, so the
parameters are re-pointed (``param.data``) to views of a flat buffer laid out
exactly like the gradient buffer. The ``nn.Parameter`` objects stay the same (their
sharding descriptions, hooks and optimizer references remain valid).

With ``overlap`` (``--overlap-param-gather``) the all-gathers start after the step
and each is waited for just before the first forward use of its bucket, through
forward pre-hooks on the transformer layers and on the other modules that own
parameters (:func:`_owner_modules`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from meshtron.optim.buckets import BufferLayout
from meshtron.optim.collectives import all_gather_single
from meshtron.optim.sharded_params import unit_modules
from meshtron.optim.shards import CompactShards


class ParamBuffer:
    """One flat tensor holding every parameter of ``layout`` at the layout's offsets."""

    def __init__(self, layout: BufferLayout, device: Optional[torch.device] = None):
        self.layout = layout
        dtypes = {p.dtype for p in layout.params}
        if len(dtypes) != 1:
            raise ValueError(f"a flat parameter buffer needs one dtype; the model has {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        device = device or layout.params[0].device
        self.data = torch.zeros(layout.numel, dtype=self.dtype, device=device)
        with torch.no_grad():
            for p, (start, n) in zip(layout.params, layout.offsets):
                view = self.data[start:start + n].view(p.shape)
                view.copy_(p.data)
                p.data = view

    def view_of(self, index: int) -> torch.Tensor:
        start, n = self.layout.offsets[index]
        return self.data[start:start + n]


_CONTAINERS = (nn.ParameterList, nn.ParameterDict, nn.ModuleList, nn.ModuleDict)


def _owner_modules(chunk: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module whose forward pre-hook waits, parameters it needs) for every parameter of ``chunk``.

    A transformer layer waits for all of its parameters before its forward: inside a layer a
    module's weight may be read without that module being called (SwiGLU's fused down projection,
    the shared experts' output matmul, the grouped expert GEMM), and a weight read before its wait
    would be last step's. The layer is also the unit of ZeRO-3 and of recomputation. Outside the
    layers (embedding, final norm, output layer) a parameter is waited for before the forward of
    the module that owns it; containers (``nn.ParameterList`` and the like) have no forward of their
    own, so their parameters are waited for by the nearest ancestor that is called. Inside a module
    compiled with ``nn.Module.compile`` the hook moves up to the outermost compiled ancestor, so that
    the wait never lands inside a compiled graph.
    """
    parent: dict[int, Optional[nn.Module]] = {id(chunk): None}
    for module in chunk.modules():
        for child in module.children():
            parent.setdefault(id(child), module)
    targets: dict[int, tuple[nn.Module, list[nn.Parameter]]] = {}
    in_layers: set[int] = set()
    for layer in unit_modules(chunk)[:-1]:
        params = [p for p in layer.parameters() if id(p) not in in_layers]
        in_layers.update(id(p) for p in params)
        if params:
            target = _outermost_compiled(layer, parent)
            targets.setdefault(id(target), (target, []))[1].extend(params)
    for module in chunk.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in in_layers]
        if not own:
            continue
        target = module
        while isinstance(target, _CONTAINERS) and parent.get(id(target)) is not None:
            target = parent[id(target)]
        target = _outermost_compiled(target, parent)
        targets.setdefault(id(target), (target, []))[1].extend(own)
    return list(targets.values())


def _outermost_compiled(module: nn.Module, parent: dict[int, Optional[nn.Module]]) -> nn.Module:
    """``module``, or its outermost ancestor compiled with ``nn.Module.compile``."""
    target, node = module, module
    while node is not None:
        if getattr(node, "_compiled_call_impl", None) is not None:
            target = node
        node = parent.get(id(node))
    return target


class ParamGather:
    """All-gathers each bucket's weights from the rank that updated them (the optimizer's shards).

    ``start()`` after every optimizer step; with ``overlap`` it returns at once and the
    forward pre-hooks wait per bucket. ``wait_all()`` completes every pending gather
    (before anything reads or rewrites the weights outside a forward pass).
    """

    def __init__(self, layout: BufferLayout, buffer: ParamBuffer, model_chunks: Sequence[nn.Module],
                 overlap: bool = False, shards: Optional[CompactShards] = None):
        """``shards`` (``optim_grads``): the optimizer writes this rank's weights into a compact shard tensor
        (``shard_data``, laid out by ``shards``), which the all-gather reads; without it, into the buffer itself."""
        self.layout = layout
        self.buffer = buffer
        self.overlap = overlap
        self.shards = shards
        self._handles: dict[int, object] = {}
        # Launch order: the order buckets are first needed in a forward pass, learnt from the first
        # overlapped forward; until then, the reverse of the layout (the forward order of parameters).
        self._order = list(reversed(range(len(layout.buckets))))
        self._first_uses: list[int] = []
        self._learning = True
        self._hooks = []
        if overlap:
            index_of = {id(p): i for i, p in enumerate(layout.params)}
            for chunk in model_chunks:
                for module, params in _owner_modules(chunk):
                    buckets = sorted({layout.bucket_of_param[index_of[id(p)]] for p in params if id(p) in index_of})
                    if buckets:
                        self._hooks.append(module.register_forward_pre_hook(self._pre_hook(buckets)))
        self.shard_data: Optional[torch.Tensor] = None
        if shards is not None:
            self.shard_data = torch.empty(shards.numel, dtype=buffer.dtype, device=buffer.data.device)
            self.commit()

    def _pre_hook(self, buckets: list[int]):
        def hook(module, args):
            if self._handles:
                self.wait(buckets, first_use=True)
        return hook

    def start(self) -> None:
        """Launch the all-gather of every sharded bucket (waits for them unless ``overlap``)."""
        self.wait_all()
        for b in self._order:
            bucket = self.layout.buckets[b]
            group = bucket.reduce.group
            if group is None:
                continue
            work = all_gather_single(self.buffer.data[bucket.start:bucket.end], self._shard_of(b), group,
                                     async_op=self.overlap)
            if self.overlap:
                self._handles[b] = work

    def wait(self, buckets: Sequence[int], first_use: bool = False) -> None:
        """Wait for the gathers of ``buckets`` (``first_use``: called by a forward pre-hook)."""
        for b in buckets:
            work = self._handles.pop(b, None)
            if work is not None:
                work.wait()
                if self._learning and first_use:
                    self._first_uses.append(b)
        if self._learning and not self._handles and self._first_uses:
            seen = set(self._first_uses)
            self._order = self._first_uses + [b for b in self._order if b not in seen]
            self._learning = False

    def _shard_of(self, b: int) -> torch.Tensor:
        if self.shards is None:
            s, e = self.layout.buckets[b].shard_range()
            return self.buffer.data[s:e]
        lo, hi = self.shards.range_of(b)
        return self.shard_data[lo:hi]

    def wait_all(self) -> None:
        self.wait(list(self._handles))

    def materialize(self) -> None:
        """Make the full weights readable outside a forward pass (waits for pending gathers)."""
        self.wait_all()

    @torch.no_grad()
    def commit(self) -> None:
        """After the weights were written outside the optimizer: copy this rank's part into the shards."""
        self.wait_all()
        if self.shards is None:
            return  # the optimizer's shards are views of the buffer
        for b, bucket in enumerate(self.layout.buckets):
            s, e = bucket.shard_range()
            lo, hi = self.shards.range_of(b)
            self.shard_data[lo:hi].copy_(self.buffer.data[s:e])

    @property
    def pending(self) -> int:
        return len(self._handles)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
