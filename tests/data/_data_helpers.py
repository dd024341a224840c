"""Shared helpers of the data tests."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from meshtron.config import MeshtronConfig

MULTIBYTE_TEXT = ("héllo wörld — naïve café, 日本語のテキスト, emoji 🎉🚀, Ελληνικά, русский текст\n"
                  "\ttabs  and   spaces, math ∑∫√, end.")


def stdlib_texts(max_bytes: int = 300_000) -> list[str]:
    """Some real text to train small tokenizers on: Python standard library sources, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for p in sorted(root.glob("*.py")):
        t = p.read_text(encoding="utf-8", errors="replace")
        texts.append(t)
        total += len(t)
        if total >= max_bytes:
            break
    return texts


def small_config(**overrides) -> MeshtronConfig:
    """A config for data tests: tiny sequences and batches, no worker processes."""
    cfg = MeshtronConfig()
    cfg.model.seq_length = 16
    cfg.train.global_batch_size = 8
    cfg.train.micro_batch_size = 2
    cfg.train.train_iters = 20
    cfg.train.eval_iters = 2
    cfg.data.num_workers = 0
    for key, value in overrides.items():
        cfg.set(key, value)
    return cfg


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts, or raw strings written as they are) one per line."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path
