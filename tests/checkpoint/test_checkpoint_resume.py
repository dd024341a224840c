"""Save and load in one process: exact resume, asynchronous saves, retention, contents, inference loading."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from ckpt_helpers import VOCAB, assert_same_state, batch, build_chunks, canonical_state, make_optimizer, tiny_config
from meshtron.checkpoint import (
    finalize_async_saves, last_save_timings, load_checkpoint, load_for_inference, resolve_checkpoint, save_checkpoint,
)
from meshtron.checkpoint.layout import LATEST_FILE, MEGATRON_LATEST_FILE, list_iterations
from meshtron.data.tokenizers import ByteTokenizer
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import capture_rng_state, restore_rng_state
from meshtron.training.state import TrainingState


def train_steps(model, optimizer, buffer, first: int, count: int) -> list[float]:
    """Real forward/backward/AdamW steps on fixed batches (dropout on: the RNG state matters)."""
    model.train()
    losses = []
    for i in range(first, first + count):
        tokens, labels, weight = batch(i)
        buffer.zero()
        total, _ = model(tokens, labels=labels, loss_weight=weight)
        total.backward()
        optimizer.step(1e-2)
        losses.append(float(total.detach()))
    return losses


def fresh(cfg, seed=1):
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx, seed=seed)
    optimizer, buffer = make_optimizer(cfg, chunks)
    return ctx, chunks, optimizer, buffer


def test_same_layout_resume_is_exact(tmp_path):
    cfg = tiny_config(hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    ctx, chunks, optimizer, buffer = fresh(cfg)
    train_steps(chunks[0], optimizer, buffer, 0, 3)
    state = TrainingState(iteration=3, consumed_samples=6, skipped_iterations=1, extra={"note": "x"})
    state.rng = capture_rng_state()
    save_checkpoint(str(tmp_path), state, chunks, optimizer, ctx, cfg)
    reference = train_steps(chunks[0], optimizer, buffer, 3, 3)
    final = canonical_state(chunks, optimizer)

    torch.manual_seed(1234)  # a different RNG state: only the checkpoint's may reproduce the run
    ctx, chunks2, optimizer2, buffer2 = fresh(cfg, seed=2)
    loaded = load_checkpoint(str(tmp_path), chunks2, optimizer2, ctx, cfg)
    assert (loaded.iteration, loaded.consumed_samples, loaded.skipped_iterations) == (3, 6, 1)
    assert loaded.extra == {"note": "x"}
    assert optimizer2.step_count == 3
    restore_rng_state(loaded.rng)
    resumed = train_steps(chunks2[0], optimizer2, buffer2, 3, 3)
    assert resumed == reference  # bit for bit
    assert_same_state(canonical_state(chunks2, optimizer2), final)


def test_async_save_writes_the_state_at_call_time(tmp_path):
    cfg = tiny_config()
    ctx, chunks, optimizer, buffer = fresh(cfg)
    train_steps(chunks[0], optimizer, buffer, 0, 2)
    at_save = canonical_state(chunks, optimizer)
    save_checkpoint(str(tmp_path), TrainingState(iteration=2), chunks, optimizer, ctx, cfg, async_save=True)
    train_steps(chunks[0], optimizer, buffer, 2, 2)  # training goes on while the copy is written
    save_checkpoint(str(tmp_path), TrainingState(iteration=4), chunks, optimizer, ctx, cfg, async_save=True)
    at_second = canonical_state(chunks, optimizer)
    train_steps(chunks[0], optimizer, buffer, 4, 1)
    finalize_async_saves()
    assert (tmp_path / LATEST_FILE).read_text().strip() == "4"
    timings = last_save_timings()
    assert timings["blocking_s"] >= 0 and timings["total_s"] >= timings["tensors_s"] > 0

    for iteration, expected in ((2, at_save), (4, at_second)):
        ctx, chunks2, optimizer2, _ = fresh(cfg, seed=3)
        state = load_checkpoint(str(tmp_path / f"iter_{iteration:07d}"), chunks2, optimizer2, ctx, cfg)
        assert state.iteration == iteration
        assert_same_state(canonical_state(chunks2, optimizer2), expected)


def test_latest_pointer_and_retention(tmp_path):
    cfg = tiny_config()
    ctx, chunks, optimizer, _ = fresh(cfg)
    assert load_checkpoint(str(tmp_path), chunks, optimizer, ctx, cfg) is None  # nothing saved yet
    assert load_checkpoint(str(tmp_path / "absent"), chunks, optimizer, ctx, cfg) is None
    for it in (1, 2, 3, 4):
        save_checkpoint(str(tmp_path), TrainingState(iteration=it), chunks, optimizer, ctx, cfg, retain=2,
                        async_save=(it % 2 == 0))
    finalize_async_saves()
    assert list_iterations(tmp_path) == [3, 4]
    assert (tmp_path / LATEST_FILE).read_text() == "4\n"
    assert (tmp_path / MEGATRON_LATEST_FILE).read_text() == "4\n"
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*tmp*"))
    assert resolve_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    assert load_checkpoint(str(tmp_path), chunks, optimizer, ctx, cfg).iteration == 4
    # Saving the same iteration again (a resumed run) replaces that checkpoint.
    save_checkpoint(str(tmp_path), TrainingState(iteration=4, consumed_samples=9), chunks, optimizer, ctx, cfg)
    assert load_checkpoint(str(tmp_path), chunks, optimizer, ctx, cfg).consumed_samples == 9
    # Killed between the two renames of such a replacement: the parked previous copy still loads.
    (tmp_path / "iter_0000004").rename(tmp_path / "iter_0000004.old")
    assert resolve_checkpoint(tmp_path) == tmp_path / "iter_0000004.old"
    assert load_checkpoint(str(tmp_path), chunks, optimizer, ctx, cfg).consumed_samples == 9


def test_contents_config_tokenizer_and_inference_loading(tmp_path):
    cfg = tiny_config(vocab_size=258, tokenizer_type="ByteTokenizer")
    ctx = ParallelContext()
    from meshtron.model import GPTModel
    from meshtron.parallel.sharding import initialize_parameters

    model = GPTModel(cfg.model, ctx, 258)
    initialize_parameters(model, 3, torch.device("cpu"), torch.float32)
    save_checkpoint(str(tmp_path), TrainingState(iteration=7), [model], None, ctx, cfg, tokenizer=ByteTokenizer())
    ckpt = tmp_path / "iter_0000007"
    saved_cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert saved_cfg["hidden_size"] == 32 and saved_cfg["tokenizer_type"] == "ByteTokenizer"
    meta = json.loads((ckpt / "meshtron_checkpoint.json").read_text())
    assert meta["iteration"] == 7 and meta["model"]["vocab_size"] == 258 and not meta["optimizer"]["present"]

    loaded, tokenizer = load_for_inference(str(tmp_path), "cpu")
    assert tokenizer is not None and tokenizer.decode(tokenizer.encode("hi")) == "hi"
    assert not loaded.training
    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def test_masters_follow_loaded_weights_without_optimizer_state(tmp_path):
    """bf16 weights with fp32 masters: loading weights only must also reset the masters."""
    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx, seed=1)
    save_checkpoint(str(tmp_path), TrainingState(iteration=1), chunks, None, ctx, cfg)
    target = canonical_state(chunks)

    chunks2 = build_chunks(cfg, ctx, seed=2)
    for p in chunks2[0].parameters():
        p.data = p.data.to(torch.bfloat16)
    optimizer, _ = make_optimizer(cfg, chunks2)
    load_checkpoint(str(tmp_path), chunks2, optimizer, ctx, cfg)
    for i, p in enumerate(optimizer.params):
        master = optimizer.state_tensors(i)["master"]
        assert master.dtype == torch.float32
        assert torch.equal(master, p.detach().float())
    got = canonical_state(chunks2)
    for name, ref in target.items():
        torch.testing.assert_close(got[name], ref.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("load_optim", [True, False])
def test_load_optim_flag(tmp_path, load_optim):
    cfg = tiny_config()
    ctx, chunks, optimizer, buffer = fresh(cfg)
    train_steps(chunks[0], optimizer, buffer, 0, 2)
    save_checkpoint(str(tmp_path), TrainingState(iteration=2), chunks, optimizer, ctx, cfg)
    ctx, chunks2, optimizer2, _ = fresh(cfg, seed=5)
    load_checkpoint(str(tmp_path), chunks2, optimizer2, ctx, cfg, load_optim=load_optim, load_rng=False)
    moments = optimizer2.state_tensors(0)["exp_avg"]
    assert bool(moments.abs().sum() > 0) == load_optim
    assert optimizer2.step_count == (2 if load_optim else 0)
    assert_same_state(canonical_state(chunks2), canonical_state(chunks))
    assert VOCAB == chunks2[0].vocab_size
