"""ZeRO-3 and distributed-optimizer checkpoints written from each rank's own shards, read back into shards.

A segment (a contiguous range of a parameter's flattened elements) becomes rectangular chunks of the
canonical tensors at their global offsets (``flat_range_shards``): every cut of a parameter, fused or
padded, reassembles the canonical tensors exactly. Four gloo processes save a ZeRO-3 model with its
optimizer state while a dispatch mode counts the live tensor bytes of the save: the peak stays within
twice the rank's largest chunk (DCP copies one chunk at a time), far below the model and optimizer
state a gather-first save materialised; the checkpoint then loads, exactly, in one process and back
into ZeRO-3 on four.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from ckpt_helpers import assert_same_state, build_chunks, canonical_state, run_ranks, tiny_config
from meshtron.checkpoint.pieces import SavedShard, _shards_of, flat_range_shards, model_key
from meshtron.parallel.sharding import Piece, ShardSpec


def _assemble(chunks: list[SavedShard]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for c in chunks:
        full = out.setdefault(c.key, torch.full(c.global_shape, float("nan")))
        region = full
        for d, (o, n) in enumerate(zip(c.offsets, c.data.shape)):
            region = region.narrow(d, o, n)
        assert torch.isnan(region).all(), f"{c.key}: chunks overlap at {c.offsets}"
        region.copy_(c.data)
    return out


def test_flat_ranges_of_fused_and_padded_parameters_reassemble_the_canonical_tensors():
    rng = random.Random(0)
    specs = [  # a fused q/k/v slice, a padded vocabulary shard, a column slice, a 3-D and a 1-D tensor
        (ShardSpec((Piece("q", (8, 6), 0, 4, 4), Piece("k", (4, 6), 0, 2, 2), Piece("v", (4, 6), 0, 2, 2))), (8, 6)),
        (ShardSpec((Piece("emb", (10, 5), 0, 8, 4),)), (4, 5)),  # rows 8-9 real, 10-11 padding
        (ShardSpec((Piece("w", (3, 8), 1, 4, 4),)), (3, 4)),
        (ShardSpec((Piece("e", (2, 3, 4), 0, 0, 2),)), (2, 3, 4)),
        (ShardSpec((Piece("n", (7,), 0, 0, 7),)), (7,)),
    ]
    for spec, shape in specs:
        local = torch.randn(shape)
        want = _assemble(list(_shards_of(local, spec, model_key)))
        n = local.numel()
        for _ in range(20):
            cuts = sorted({0, n, *(rng.randrange(1, n) for _ in range(rng.randrange(0, 4)))})
            flat = local.reshape(-1)
            chunks = [c for lo, hi in zip(cuts, cuts[1:])
                      for c in flat_range_shards(spec, shape, lo, hi, flat[lo:hi], model_key)]
            for c in chunks:  # views of the rank's memory, not copies
                assert c.data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            got = _assemble(chunks)
            assert sorted(got) == sorted(want)
            for key in want:
                assert torch.equal(got[key].isnan(), want[key].isnan()), key
                assert torch.equal(got[key].nan_to_num(), want[key].nan_to_num()), key


def _zero3(cfg, seed):
    from meshtron.optim.factory import build_optimization
    from meshtron.parallel.context import build_groups

    ctx = build_groups(1, 1, 1, 1, torch.device("cpu"))
    chunks = build_chunks(cfg, ctx, seed=seed)
    cfg.parallel.data_parallel_sharding_strategy = "optim_grads_params"
    optim = build_optimization(cfg, ctx, chunks)
    optimizer = optim.optimizer
    optimizer.ensure_state()
    with torch.no_grad():  # distinct masters and moments, so that a mix-up shows
        for part in optimizer.parts:
            for pos in range(len(part.segments)):
                for k, t in part.state_of(pos).items():
                    t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + pos)) * 1e-3)
                part.load_segment(pos, "master", part.state_of(pos)["master"])
    return ctx, chunks, optimizer


def _full_state(chunks, optimizer) -> dict:
    optimizer.finish_param_gather()  # the test's reference gathers; the save does not
    return canonical_state(chunks, optimizer)


def _new_bytes_probe():
    """tests/emulation/memory_probe.py's LiveBytes, counting only new memory: the result of a view (of a
    weight shard or an optimizer state the rank already holds) allocates nothing."""
    from tests.emulation.memory_probe import LiveBytes

    class NewBytes(LiveBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(func, "is_view", False):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return NewBytes()


#: What a save holds besides chunk copies: DCP's exchange of the ranks' save plans (pickled on every rank).
PLAN_SLACK = 256 * 1024
MODEL = dict(hidden_size=64, ffn_hidden_size=512)


def _memory_worker(rank: int, world: int, root: str) -> dict:
    from meshtron.checkpoint import load_checkpoint, save_checkpoint, writer
    from meshtron.checkpoint.owned import state_shards_by_segment, weight_shards
    from meshtron.training.state import TrainingState

    writer.WRITER_THREADS = 1  # the probe counts the calling thread's tensors: write on that thread only
    cfg = tiny_config(**MODEL)
    ctx, chunks, optimizer = _zero3(cfg, seed=3)
    largest = max(c.data.numel() * 4 for c in weight_shards(optimizer) +
                  [c for s in state_shards_by_segment(optimizer) for c in s])
    whole = sum(p.numel() for p in optimizer.params) * 4 * 4  # weights, master, two moments (fp32)
    probe = _new_bytes_probe()
    with probe:
        save_checkpoint(root, TrainingState(iteration=3), chunks, optimizer, ctx, cfg, save_rng=False)
    gathered = sum(b.untyped_storage().nbytes() > 0 for b in optimizer.param_gather.full)
    ref = _full_state(chunks, optimizer)

    cfg2 = tiny_config(**MODEL)
    ctx2, chunks2, optimizer2 = _zero3(cfg2, seed=11)
    load_checkpoint(root, chunks2, optimizer2, ctx2, cfg2)
    assert_same_state(_full_state(chunks2, optimizer2), ref)
    return {"peak": probe.peak, "largest_chunk": largest, "whole": whole, "gathered_buckets": gathered,
            "ref": ref if rank == 0 else None}


def test_zero3_save_writes_own_shards_within_a_bounded_buffer_and_reloads(tmp_path):
    from meshtron.checkpoint import CheckpointError, checksums, load_checkpoint
    from meshtron.checkpoint.verify import verify_checkpoint
    from meshtron.optim.optimizer import MixedPrecisionAdamW
    from meshtron.parallel.context import ParallelContext

    root = str(tmp_path / "z3")
    results = run_ranks(_memory_worker, 4, root, timeout=200)
    for rank, r in enumerate(results):
        bound = 2 * r["largest_chunk"] + PLAN_SLACK  # one chunk copied out, one being serialised; the plans
        assert r["peak"] <= bound, f"rank {rank}: save peak {r['peak']} B over the bound {bound} B"
        assert r["whole"] > 3 * bound  # what a gather-first save held: the model and its optimizer state
        assert r["gathered_buckets"] == 0, f"rank {rank}: the save gathered full weights"
    # The checkpoint loads in one process: model and optimizer state equal the ZeRO-3 ranks' tensors.
    cfg = tiny_config(**MODEL)
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx, seed=7)
    optimizer = MixedPrecisionAdamW([p for c in chunks for p in c.parameters()], cfg.optim)
    hashed = []
    original = checksums.crc32_file
    checksums.crc32_file = lambda path: hashed.append(str(path)) or original(path)
    try:
        load_checkpoint(root, chunks, optimizer, ctx, cfg)
    finally:
        checksums.crc32_file = original
    assert_same_state(canonical_state(chunks, optimizer), results[0]["ref"])
    # No pass over the data files before the load: their chunks were verified from the bytes read.
    assert hashed and not [h for h in hashed if h.endswith(".distcp")], hashed

    # A flipped byte inside a stored tensor: refused in one line naming the file and the tensor.
    data = sorted((tmp_path / "z3" / "iter_0000003").glob("*.distcp"))[1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(root, chunks, optimizer, ctx, cfg)
    text = str(err.value)
    assert "\n" not in text and str(data) in text, text
    assert "in the bytes of tensor model." in text or "in the bytes of tensor optim." in text, text
    with pytest.raises(CheckpointError, match="does not match its checksum"):  # the standalone check too
        verify_checkpoint(tmp_path / "z3" / "iter_0000003")
