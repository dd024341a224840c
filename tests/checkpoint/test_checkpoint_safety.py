"""A checkpoint is never corrupted: killed saves, failed writes and failed verification leave the previous one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_helpers import assert_same_state, build_chunks, canonical_state, make_optimizer, tiny_config
from meshtron.checkpoint import CheckpointError, install_signal_handler, load_checkpoint, save_checkpoint
from meshtron.checkpoint import writer
from meshtron.checkpoint.layout import list_iterations, read_latest
from meshtron.parallel.context import ParallelContext
from meshtron.training.state import TrainingState

HERE = Path(__file__).resolve().parent

# Saves iteration 1, then starts saving iteration 2 and stops inside the write (data files written,
# DCP's metadata not yet) until its parent kills it.
CHILD = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    from ckpt_helpers import build_chunks, canonical_state, elementwise_steps, make_optimizer, tiny_config
    from meshtron.checkpoint import finalize_async_saves, save_checkpoint
    from meshtron.parallel.context import ParallelContext
    from meshtron.training.state import TrainingState

    save_dir, ref_path, use_async = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx)
    optimizer, buffer = make_optimizer(cfg, chunks)
    elementwise_steps(optimizer, buffer, 1)
    save_checkpoint(save_dir, TrainingState(iteration=1), chunks, optimizer, ctx, cfg)
    torch.save(canonical_state(chunks, optimizer), ref_path)
    elementwise_steps(optimizer, buffer, 1)
    finish = dcp.FileSystemWriter.finish
    def stalled_finish(self, *args, **kwargs):
        print("WRITING", flush=True)
        sys.stdin.readline()  # never answered: the parent kills this process here
        return finish(self, *args, **kwargs)
    dcp.FileSystemWriter.finish = stalled_finish
    save_checkpoint(save_dir, TrainingState(iteration=2), chunks, optimizer, ctx, cfg, async_save=use_async)
    finalize_async_saves()
    print("DONE", flush=True)
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_killed_during_save_leaves_previous_checkpoint(tmp_path, use_async):
    save_dir, ref_path = tmp_path / "ckpt", tmp_path / "ref.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(save_dir), str(ref_path), "1" if use_async else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", f"child did not reach the write (exit code {proc.poll()})"
        partial = save_dir / "iter_0000002.tmp"
        assert list(partial.glob("*.distcp")) and not (partial / ".metadata").exists()
    finally:
        proc.kill()  # SIGKILL: no cleanup of any kind runs
        proc.wait()
    assert read_latest(save_dir) == 1 and list_iterations(save_dir) == [1]

    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx, seed=7)
    optimizer, _ = make_optimizer(cfg, chunks)
    state = load_checkpoint(str(save_dir), chunks, optimizer, ctx, cfg)
    assert state.iteration == 1
    assert_same_state(canonical_state(chunks, optimizer), torch.load(ref_path))

    # The next save succeeds and clears what the killed one left behind.
    save_checkpoint(str(save_dir), TrainingState(iteration=2), chunks, optimizer, ctx, cfg)
    assert read_latest(save_dir) == 2 and not list(save_dir.glob("*.tmp"))


def test_failed_verification_keeps_latest(first_checkpoint, monkeypatch):
    path, cfg, ctx, chunks, optimizer = first_checkpoint
    monkeypatch.setattr(writer, "verify_tensor_files", lambda d: [f"data file {d}/__0_0.distcp is missing"])
    with pytest.raises(CheckpointError, match="verification failed: data file .* is missing"):
        save_checkpoint(str(path), TrainingState(iteration=2), chunks, optimizer, ctx, cfg)
    assert read_latest(path) == 1 and list_iterations(path) == [1]
    assert load_checkpoint(str(path), chunks, optimizer, ctx, cfg).iteration == 1


def test_failed_tensor_write_keeps_latest(first_checkpoint, monkeypatch):
    path, cfg, ctx, chunks, optimizer = first_checkpoint

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
    for use_async in (False, True):
        with pytest.raises(CheckpointError, match="no space left on device"):
            save_checkpoint(str(path), TrainingState(iteration=2), chunks, optimizer, ctx, cfg, async_save=use_async)
            if use_async:  # the background failure surfaces at the next wait
                from meshtron.checkpoint import finalize_async_saves
                finalize_async_saves()
    assert read_latest(path) == 1


def test_unusable_save_directory(tmp_path):
    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(CheckpointError, match=r"saving checkpoint iteration 3 to .*file failed"):
        save_checkpoint(str(not_a_dir), TrainingState(iteration=3), chunks, None, ctx, cfg)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save_checkpoint(str(tmp_path / "c"), TrainingState(iteration=3, extra={"x": object()}), chunks, None, ctx,
                        cfg)
    assert not (tmp_path / "c").exists()


def test_signal_handler_records_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    handler = install_signal_handler()
    try:
        assert not handler.triggered
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.triggered and handler.received == signal.SIGTERM
    finally:
        handler.restore()
    assert signal.getsignal(signal.SIGTERM) is previous
