"""A checkpoint written in one parallel layout loads into another: model, optimizer state and step count.

Four gloo processes save in one layout and load in another (TP, PP, interleaved
virtual stages, DP, GQA key/value replicas, vocabulary padding, tied embeddings,
sequence parallelism). The loaded canonical tensors must equal the saved ones
exactly, one more optimizer step must give the same weights as in the saving
layout, and the loss of a fixed batch must match. The parent process then loads
one of those checkpoints in a single process (no process group).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_helpers import (
    assert_same_state, build_chunks, canonical_state, elementwise_steps, forward_loss, make_optimizer, run_ranks,
    tiny_config,
)
from meshtron.checkpoint import load as checkpoint_load
from meshtron.checkpoint import finalize_async_saves, load_checkpoint, save_checkpoint
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.training.state import TrainingState

GPT = dict(normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
           disable_bias_linear=False, group_query_attention=False, num_query_groups=None,
           untie_embeddings_and_output_weights=False)

# name, save layout, load layout, config overrides; a layout is
# (TP, PP, virtual stages, sequence parallel, distributed optimizer), DP = world / (TP x PP)
SCENARIOS = [
    ("tp2pp2_to_dp4", (2, 2, 1, False, False), (1, 1, 1, False, False), {}),
    ("dp4_to_tp2pp2_tied", (1, 1, 1, False, False), (2, 2, 1, False, False),
     {"untie_embeddings_and_output_weights": False}),
    ("tp4_kv_replicated_padding_to_tp2dp2", (4, 1, 1, False, False), (2, 1, 1, False, False),
     {"make_vocab_size_divisible_by": 64}),
    ("pp2_virtual2_to_pp4", (1, 2, 2, False, False), (1, 4, 1, False, False), {}),
    ("gpt_tp2_sp_to_tp4", (2, 1, 1, True, False), (4, 1, 1, False, False), GPT),
    ("tp2dp2_distopt_async_to_dp4_distopt", (2, 1, 1, False, True), (1, 1, 1, False, True), {}),
    ("pp2dp2_distopt_to_tp2pp2", (1, 2, 1, False, True), (2, 2, 1, False, False), {}),
]
# Eight processes: TP=2 x PP=2 x DP=2 with the distributed optimizer <-> TP=1 x PP=1 x DP=8, and virtual stages.
SCENARIOS_8 = [
    ("tp2pp2dp2_distopt_to_dp8_distopt", (2, 2, 1, False, True), (1, 1, 1, False, True), {}),
    ("dp8_async_to_tp2pp2dp2_distopt", (1, 1, 1, False, False), (2, 2, 1, False, True), {}),
    ("pp2_virtual2_dp4_to_pp4_dp2", (1, 2, 2, False, True), (1, 4, 1, False, False), {}),
]


def _build(cfg, layout, seed):
    tp, pp, virtual, sp, distributed = layout
    ctx = build_groups(tp, 1, pp, 1, torch.device("cpu"))
    chunks = build_chunks(cfg, ctx, seed=seed, virtual=virtual, sequence_parallel=sp)
    optimizer, buffer = make_optimizer(cfg, chunks, ctx, distributed)
    return ctx, chunks, optimizer, buffer


def _reshard_worker(rank: int, world: int, root: str, scenarios: list) -> dict:
    # Load the distributed optimizer's state a few parameters at a time: pipeline stages then make
    # different numbers of reads, which must still pair up across ranks.
    checkpoint_load.LOAD_BATCH_BYTES = 64 * 1024
    out = {}
    for name, save_layout, load_layout, overrides in scenarios:
        cfg = tiny_config(**overrides)
        path = os.path.join(root, name)
        ctx, chunks, optimizer, buffer = _build(cfg, save_layout, seed=1)
        elementwise_steps(optimizer, buffer, 2)
        loss_saved = forward_loss(chunks[0]) if save_layout[1] == 1 else None
        ref = canonical_state(chunks, optimizer)
        use_async = "async" in name
        save_checkpoint(path, TrainingState(iteration=2, consumed_samples=16), chunks, optimizer, ctx, cfg,
                        async_save=use_async)
        elementwise_steps(optimizer, buffer, 1)  # with an async save: while it is being written
        ref_next = canonical_state(chunks, optimizer)
        finalize_async_saves()

        ctx2, chunks2, optimizer2, buffer2 = _build(cfg, load_layout, seed=99)
        state = load_checkpoint(path, chunks2, optimizer2, ctx2, cfg)
        assert state.iteration == 2 and state.consumed_samples == 16
        assert state.rng is not None  # same world size: every rank gets its own RNG state back
        assert optimizer2.step_count == 2
        assert_same_state(canonical_state(chunks2, optimizer2), ref)
        loss_loaded = forward_loss(chunks2[0]) if load_layout[1] == 1 else None
        elementwise_steps(optimizer2, buffer2, 1)
        assert_same_state(canonical_state(chunks2, optimizer2), ref_next, atol=1e-7)
        out[name] = {"loss_saved": loss_saved, "loss_loaded": loss_loaded,
                     "ref": {k: v for k, v in ref.items() if k.startswith("model.")} if rank == 0 else None}
    return out


def test_resharding_between_layouts(tmp_path):
    results = run_ranks(_reshard_worker, 4, str(tmp_path), SCENARIOS, timeout=300)
    for name, *_ in SCENARIOS:
        r = results[0][name]
        if r["loss_saved"] is not None and r["loss_loaded"] is not None:
            assert abs(r["loss_saved"] - r["loss_loaded"]) < 1e-5, name
        for other in results[1:]:  # every rank agrees on the loss
            assert other[name]["loss_loaded"] == r["loss_loaded"]

    # Replicated chunks are stored once: TP-replicated norms, replicated key/value heads (TP=4 > 2 groups),
    # data-parallel replicas; ranks holding only vocabulary padding store nothing of the embedding.
    md = dcp.FileSystemReader(str(tmp_path / SCENARIOS[2][0] / "iter_0000002")).read_metadata()
    chunks_of = {k: len(v.chunks) for k, v in md.state_dict_metadata.items()}
    assert chunks_of["model.layers.0.input_norm.weight"] == 1
    assert chunks_of["model.layers.0.attention.k.weight"] == 2
    assert chunks_of["model.layers.0.attention.q.weight"] == 4
    assert chunks_of["model.embedding.word_embeddings.weight"] == 2  # rows 0-63, 64-99; ranks 2-3 are padding
    assert chunks_of["optim.exp_avg.layers.0.attention.k.weight"] == 2
    md = dcp.FileSystemReader(str(tmp_path / SCENARIOS[1][0] / "iter_0000002")).read_metadata()
    assert all(len(v.chunks) == 1 for v in md.state_dict_metadata.values())  # DP=4 replicas: written once

    # One process, no process group: the TP=2 x PP=2 checkpoint loads into a whole model.
    name = "tp2pp2_to_dp4"
    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx, seed=5)
    optimizer, _ = make_optimizer(cfg, chunks)
    state = load_checkpoint(str(tmp_path / name), chunks, optimizer, ctx, cfg)
    assert state.iteration == 2
    assert state.rng is None  # written by 4 processes: RNG states are not restored in 1
    got = {k: v for k, v in canonical_state(chunks).items()}
    assert_same_state(got, results[0][name]["ref"])
    assert abs(forward_loss(chunks[0]) - results[0][name]["loss_loaded"]) < 1e-5


@pytest.mark.slow  # eight processes; test_resharding_between_layouts (four) is the fast representative
def test_resharding_eight_processes(tmp_path):
    results = run_ranks(_reshard_worker, 8, str(tmp_path), SCENARIOS_8, timeout=400)
    r = results[0]["dp8_async_to_tp2pp2dp2_distopt"]
    assert abs(r["loss_saved"] - results[0]["tp2pp2dp2_distopt_to_dp8_distopt"]["loss_loaded"]) < 1e-5
