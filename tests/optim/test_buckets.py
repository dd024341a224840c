"""Bucket layout, offload split, memory accounting and param-gather hook placement (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from meshtron.optim.accounting import bytes_per_parameter
from meshtron.optim.buckets import build_layout, default_bucket_size
from meshtron.optim.distributed_optimizer import owned_segments
from meshtron.optim.offload import Segment, split_for_offload
from meshtron.optim.param_buffer import _owner_modules
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import SPEC_ATTR, ShardSpec, whole


def spec_param(name: str, numel: int, expert: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.randn(numel))
    setattr(p, SPEC_ATTR, ShardSpec((whole(name, (numel,)),), expert=expert))
    return p


def fake_ctx(dp: int) -> ParallelContext:
    """Sizes of a DP group without process groups (layout arithmetic only reads sizes and ranks)."""
    return ParallelContext(dp=dp)


def test_layout_reverse_order_buckets_and_padding():
    params = [spec_param(f"p{i}", n) for i, n in enumerate([10, 300, 150, 700, 20])]
    layout = build_layout([params], ParallelContext(), bucket_size=400, align=8)
    # Reverse order: the last parameter first; a bucket closes once it reaches the bucket size.
    assert [b.param_indices for b in layout.buckets] == [[4, 3], [2, 1], [0]]
    assert layout.offsets[4][0] == 0 and layout.offsets[3][0] == 20
    for b in layout.buckets:
        assert b.numel % 8 == 0 and b.numel >= sum(params[i].numel() for i in b.param_indices)
        assert all(layout.bucket_of_param[i] == b.index for i in b.param_indices)
    assert layout.buckets[-1].end == layout.numel
    starts = sorted(start for start, _ in layout.offsets)
    assert len(set(starts)) == len(params)  # no overlaps
    for (s1, n1), (s2, _) in zip(sorted(layout.offsets), sorted(layout.offsets)[1:]):
        assert s1 + n1 <= s2


def test_shards_split_buckets_evenly_and_partition_parameters():
    params = [spec_param(f"p{i}", n) for i, n in enumerate([33, 129, 7, 250, 64])]
    dp = 4
    ctx = fake_ctx(dp)
    layout = build_layout([params], ctx, bucket_size=200, align=4)
    owned = [0] * len(params)
    for rank in range(dp):
        for b in layout.buckets:
            assert b.numel % (dp * 4) == 0
            lo, hi = b.shard_range(rank)
            assert hi - lo == b.numel // dp
        for b in layout.buckets:
            b.reduce.rank = rank
        for seg in owned_segments(layout, shard=True):
            owned[seg.param_index] += seg.length
    assert owned == [p.numel() for p in params]


def test_isolated_and_expert_parameters_get_their_own_buckets():
    dense = [spec_param("a", 10), spec_param("emb", 40), spec_param("b", 10)]
    expert = [spec_param("e0", 30, expert=True), spec_param("e1", 30, expert=True)]
    params = dense[:1] + expert[:1] + dense[1:] + expert[1:]
    layout = build_layout([params], ParallelContext(), bucket_size=10_000, isolate=lambda p: p is dense[1])
    kinds = [(b.reduce.expert, b.isolated, sorted(b.param_indices)) for b in layout.buckets]
    assert (False, True, [2]) in kinds
    assert (True, False, [1, 4]) in kinds
    assert (False, False, [0, 3]) in kinds


def test_model_chunks_never_share_a_bucket():
    chunks = [[spec_param("a", 5), spec_param("b", 5)], [spec_param("c", 5)]]
    layout = build_layout(chunks, ParallelContext(), bucket_size=1000)
    assert [(b.chunk, sorted(b.param_indices)) for b in layout.buckets] == [(0, [0, 1]), (1, [2])]


def test_default_bucket_size_follows_megatron():
    assert default_bucket_size(8) == 40_000_000
    assert default_bucket_size(64) == 64_000_000


def test_offload_split_is_exact_and_cuts_segments():
    segs = [Segment(0, 0, 0, 10, True), Segment(1, 0, 10, 30, False), Segment(2, 5, 40, 20, True)]
    device, host = split_for_offload(segs, 0.5)
    assert sum(s.length for s in host) == 30 and sum(s.length for s in device) == 30
    assert host[-1] == Segment(1, 0, 10, 20, False)
    assert device[0] == Segment(1, 20, 30, 10, False)
    assert split_for_offload(segs, 0.0) == (segs, [])
    assert split_for_offload(segs, 1.0) == ([], segs)
    with pytest.raises(ValueError, match="--optimizer-offload-fraction"):
        split_for_offload(segs, 1.5)


def test_bytes_per_parameter_accounting():
    bf16 = bytes_per_parameter(2, 4, state_shards=8)
    assert bf16.device_total == 6 + 12 / 8
    assert bytes_per_parameter(2, 4).device_total == 18
    assert bytes_per_parameter(4, 4).device_total == 16  # fp32 weights are their own masters
    half = bytes_per_parameter(2, 4, state_shards=2, offload_fraction=0.5)
    assert half.optimizer_device == 3 and half.optimizer_host == 3
    assert bytes_per_parameter(2, 2, 4).device_total == 4 + 3  # --grad-reduce-in-bf16


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.zeros(2)) for _ in range(2)])


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(2)
        self.experts = _Experts()


def test_param_gather_hooks_land_on_called_modules():
    model = nn.Module()
    model.first = _Layer()
    model.second = _Layer()
    model.second.compile()  # hooks inside a compiled module move up to it
    targets = {id(m): ps for m, ps in _owner_modules(model)}
    # ParameterList has no forward: its parameters are waited for by _Experts, which is called.
    assert id(model.first.experts) in targets and id(model.first.experts.weights) not in targets
    assert id(model.first.norm) in targets
    assert id(model.second) in targets and len(targets[id(model.second)]) == 4
    assert id(model.second.norm) not in targets


class _Chunk(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.a = spec_param(f"{name}.a", 4)
        self.b = spec_param(f"{name}.b", 4)

    def forward(self, x):
        return (x * self.a).sum() + (x * self.b).sum()


def _overlap_sync(chunks):
    from meshtron.optim.grad_buffer import GradBuffer
    from meshtron.optim.grads import GradientSync

    params = [p for c in chunks for p in c.parameters()]
    layout = build_layout([list(c.parameters()) for c in chunks], ParallelContext(), bucket_size=4)
    buffer = GradBuffer(params, layout=layout)
    return GradientSync(chunks, params, ParallelContext(), buffer, overlap=True), layout


def test_overlap_starts_only_armed_chunks_buckets_in_backward():
    chunks = [_Chunk("c0"), _Chunk("c1")]
    sync, layout = _overlap_sync(chunks)
    x = torch.ones(4)
    chunks[0](x).backward()  # an earlier micro-batch: nothing starts
    sync.start_overlap(chunk=1)
    chunks[1](x).backward()
    chunks[0](x).backward()  # chunk 0 not armed: its buckets wait for finish()
    assert sync.buckets_started_in_backward == sum(b.chunk == 1 for b in layout.buckets) == 2
    sync.finish()
    torch.testing.assert_close(chunks[0].a.main_grad, 2 * x)
    torch.testing.assert_close(chunks[1].b.main_grad, x)


def test_overlap_refuses_gradients_after_their_bucket_started():
    chunks = [_Chunk("c0")]
    sync, _ = _overlap_sync(chunks)
    sync.start_overlap()
    chunks[0](torch.ones(4)).backward()
    with pytest.raises(RuntimeError, match="--overlap-grad-reduce"):
        chunks[0](torch.ones(4)).backward()


def test_new_iteration_overwrites_gradients_and_zeroes_the_unused():
    """zero() does no device work: the first gradient of an iteration is copied, later ones added, and
    a parameter without a gradient reads zero once the reduction has run, not last iteration's value."""
    chunks = [_Chunk("c0")]
    sync, _ = _overlap_sync(chunks)
    buffer, (a, b) = sync.buffer, list(chunks[0].parameters())
    x = torch.arange(1.0, 5.0)
    buffer.zero()
    chunks[0](x).backward()
    chunks[0](x).backward()  # a second micro-batch accumulates
    sync.finish()
    torch.testing.assert_close(a.main_grad, 2 * x)
    buffer.zero()
    (x * a).sum().backward()  # b gets no gradient this iteration
    assert torch.equal(b.main_grad, 2 * x)  # not zero-filled by zero() ...
    sync.finish()
    torch.testing.assert_close(a.main_grad, x)  # ... a's first gradient replaced the old sum
    assert torch.equal(b.main_grad, torch.zeros(4))  # ... and b reads zero after the reduction
