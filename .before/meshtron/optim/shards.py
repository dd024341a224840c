"""This rank's shards of every bucket, packed into one compact tensor (the sharded strategies' storage).

With ``optim_grads`` and ``optim_grads_params`` a rank keeps, of every bucket of the flat layout
(buckets.py), only its own contiguous shard ``[start + r*s, start + (r+1)*s)``: the reduced fp32
gradients, and with ``optim_grads_params`` the weights too. The shards are stored back to back in
bucket order, so bucket ``b``'s shard sits at ``[compact_start[b], compact_start[b] + s_b)``.
The distributed optimizer's segments then address that compact tensor instead of the full buffer.
"""

from __future__ import annotations

import torch.nn as nn

from meshtron.optim.buckets import BufferLayout


class CompactShards:
    """Offsets of this rank's bucket shards in a compact tensor of ``numel`` elements."""

    def __init__(self, layout: BufferLayout):
        self.layout = layout
        self.starts: list[int] = []
        cursor = 0
        for bucket in layout.buckets:
            self.starts.append(cursor)
            cursor += bucket.shard_size
        self.numel = cursor

    def range_of(self, bucket_index: int) -> tuple[int, int]:
        """[lo, hi) of bucket ``bucket_index``'s shard in the compact tensor."""
        lo = self.starts[bucket_index]
        return lo, lo + self.layout.buckets[bucket_index].shard_size

    def compact_offset(self, bucket_index: int, buffer_offset: int) -> int:
        """Where element ``buffer_offset`` of the full layout (inside this rank's shard) sits compactly."""
        shard_start, shard_end = self.layout.buckets[bucket_index].shard_range()
        if not shard_start <= buffer_offset <= shard_end:
            raise ValueError(f"offset {buffer_offset} is outside this rank's shard of bucket {bucket_index}")
        return self.starts[bucket_index] + buffer_offset - shard_start


def param_index(layout: BufferLayout) -> dict[int, int]:
    """id(parameter) -> its index in ``layout.params``."""
    return {id(p): i for i, p in enumerate(layout.params)}


def parameter_view(layout: BufferLayout, index: int, bucket_data) -> object:
    """Parameter ``index``'s view of its bucket's full tensor ``bucket_data`` (shaped like the parameter)."""
    p: nn.Parameter = layout.params[index]
    start, n = layout.offsets[index]
    rel = start - layout.buckets[layout.bucket_of_param[index]].start
    return bucket_data[rel:rel + n].view(p.shape)
