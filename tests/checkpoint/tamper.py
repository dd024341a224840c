"""Damaging and forging checkpoints for the tests: code-running pickles, flipped bytes, re-sealed manifests."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from ckpt_helpers import build_chunks, make_optimizer, tiny_config
from meshtron.checkpoint import save_checkpoint
from meshtron.checkpoint.checksums import FILES_KEY, entries_for_tree, seal_manifest
from meshtron.checkpoint.metadata import META_FILE
from meshtron.parallel.context import ParallelContext
from meshtron.training.state import TrainingState


class CodeRunner:
    """Unpickling this creates ``marker``: proof that a reader executed code from a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def code_running_pickle(marker: Path) -> bytes:
    return pickle.dumps(CodeRunner(marker))


def saved_checkpoint(root: Path, iteration: int = 1, **config) -> tuple[Path, object]:
    """A small one-process training checkpoint (model, optimizer, RNG) under ``root``; returns (iter dir, cfg)."""
    cfg = tiny_config(**config)
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx)
    optimizer, _ = make_optimizer(cfg, chunks)
    save_checkpoint(str(root), TrainingState(iteration=iteration), chunks, optimizer, ctx, cfg)
    return root / f"iter_{iteration:07d}", cfg


def reseal(ckpt_dir: Path) -> None:
    """Rewrite the manifest's checksums to match the files as they are now (what a forger would do)."""
    f = ckpt_dir / META_FILE
    meta = json.loads(f.read_text())
    files = {name: entry for name, entry in entries_for_tree(ckpt_dir, ckpt_dir).items() if name != META_FILE}
    meta[FILES_KEY] = files
    f.write_text(json.dumps(seal_manifest(meta), indent=2))


def flip_tensor_byte(data_file: Path, stored: tuple[torch.Tensor, int, int]) -> None:
    """Change one byte inside a stored tensor's bytes (``stored``: tensor, offset and length of its record in
    ``data_file``); the zip records around it stay intact."""
    tensor, offset, length = stored
    raw = tensor.detach().contiguous().numpy().tobytes()
    data = bytearray(data_file.read_bytes())
    pos = data.find(raw, offset, offset + length)
    assert pos >= 0, "tensor bytes not found in the data file"
    data[pos + len(raw) // 2] ^= 0x40
    data_file.write_bytes(bytes(data))


def stored_tensor_and_file(ckpt_dir: Path, key: str) -> tuple[Path, tuple[torch.Tensor, int, int]]:
    """(data file holding ``key``'s first chunk, (that chunk's saved values, its record's offset and length))."""
    import io

    from meshtron.checkpoint.dcp_reader import read_dcp_metadata

    md = read_dcp_metadata(ckpt_dir)
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == key)
    f = ckpt_dir / info.relative_path
    with open(f, "rb") as fh:
        fh.seek(info.offset)
        tensor = torch.load(io.BytesIO(fh.read(info.length)), weights_only=True)
    return f, (tensor, info.offset, info.length)
