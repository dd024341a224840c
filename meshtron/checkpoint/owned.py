"""Checkpoint chunks straight from what a rank owns: ZeRO-3 weight shards and the distributed optimizer's state.

With ``--data-parallel-sharding-strategy optim_grads_params`` (ZeRO-3) a rank keeps, of every bucket of
the flat layout, one contiguous shard of the weights; with the distributed optimizer (ZeRO-1/2/3) its
fp32 masters and moments cover only the parameter elements inside its shards (the *segments*). A
segment is a contiguous range of a parameter's flattened elements, which :func:`flat_range_shards`
cuts into at most ``2 * ndim - 1`` rectangular boxes per piece of the parameter: each becomes a chunk
of the canonical tensor at its global offsets, a view of the rank's own memory. A save therefore
gathers nothing (no full weight, no full optimizer state is built on any rank), a load reads each
rank's regions straight into its shards, and any other layout assembles any canonical tensor from
the chunks, as DCP does for every chunked tensor.

Chunks several ranks hold identically (TP-replicated norms, whose flat layout is the same on every
tensor-parallel rank; a tied output layer in a bucket of its own) are written once, as before.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from meshtron.checkpoint.pieces import SavedShard, flat_range_shards, model_key, optim_key
from meshtron.parallel.sharding import spec_of


def owns_state_segments(optimizer) -> bool:
    """Whether ``optimizer`` keeps its state as segments of flat shards (the distributed optimizer)."""
    from meshtron.optim.distributed_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def sharded_weights(optimizer):
    """The ZeRO-3 weight store (:class:`~meshtron.optim.sharded_params.ShardedParams`) of ``optimizer``, or None
    when the rank holds its weights whole."""
    from meshtron.optim.sharded_params import ShardedParams

    gather = getattr(optimizer, "param_gather", None) if optimizer is not None else None
    return gather if isinstance(gather, ShardedParams) else None


def _segments(optimizer) -> Iterator[tuple[object, int, object]]:
    """(partition, position, segment) of every segment this rank steps, in partition order."""
    for part in optimizer.parts:
        for pos, seg in enumerate(part.segments):
            yield part, pos, seg


def weight_shards(optimizer) -> list[SavedShard]:
    """This rank's chunks of the model's weights under ZeRO-3: views of its compact weight shards."""
    data = optimizer.param_data
    out: list[SavedShard] = []
    for seg in optimizer.segments:
        param = optimizer.params[seg.param_index]
        flat = data[seg.buffer_offset:seg.buffer_offset + seg.length]
        out += flat_range_shards(spec_of(param), param.shape, seg.param_offset, seg.param_offset + seg.length, flat,
                                 model_key)
    return out


def _flat(t: torch.Tensor, fp32: bool) -> torch.Tensor:
    t = t.reshape(-1)
    return t.float() if fp32 and t.dtype != torch.float32 else t


def state_shards_by_segment(optimizer, for_load: bool = False) -> Iterator[list[SavedShard]]:
    """This rank's chunks of the optimizer state, one list per segment: views of the states themselves.

    States kept in another dtype (e.g. bf16 moments) are saved as fp32, converted one segment at a time;
    for a load (``for_load``) the chunks are the states themselves (the read converts)."""
    optimizer.ensure_state()
    for part, pos, seg in _segments(optimizer):
        state = part.state_of(pos)
        param = optimizer.params[seg.param_index]
        spec = spec_of(param)
        chunks: list[SavedShard] = []
        for key in optimizer.state_names(seg.param_index):
            flat = _flat(state[key], not for_load)
            chunks += flat_range_shards(spec, param.shape, seg.param_offset, seg.param_offset + seg.length, flat,
                                        lambda n, k=key: optim_key(k, n))
        yield chunks


@torch.no_grad()
def masters_follow_loaded_state(optimizer) -> None:
    """After a load into the states: the weights follow the masters (where they are separate tensors)."""
    for part, pos, _ in _segments(optimizer):
        master = part.state_of(pos)["master"]
        part.load_segment(pos, "master", master)


@torch.no_grad()
def masters_from_weight_shards(optimizer) -> None:
    """Without optimizer state to load (ZeRO-3): each master is set from this rank's weight shard."""
    optimizer.ensure_state()
    data = optimizer.param_data
    for part, pos, seg in _segments(optimizer):
        part.load_segment(pos, "master", data[seg.buffer_offset:seg.buffer_offset + seg.length].float())


def first_weight_gather_done(optimizer) -> None:
    """Wait for weight gathers in flight (their landing must not race a read or write of the shards)."""
    gather = getattr(optimizer, "param_gather", None)
    if gather is not None:
        gather.wait_all()


def release_stale_weights(optimizer) -> None:
    """ZeRO-3 after its shards were loaded: the full buckets are stale; the next use gathers them again."""
    store: Optional[object] = sharded_weights(optimizer)
    if store is not None:
        store.free_all()
