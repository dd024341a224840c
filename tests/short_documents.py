"""An indexed dataset of 300 short documents (3-30 tokens, NullTokenizer, EOD appended): packed-document runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_short_documents(directory: Path) -> str:
    """Write the dataset under ``directory``; returns its ``--data-path`` prefix."""
    from meshtron.data.preprocess import TokenizerArgs, preprocess

    rng = np.random.default_rng(0)
    docs = [" ".join(str(x) for x in rng.integers(0, 50, rng.integers(3, 30))) for _ in range(300)]
    src = directory / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    preprocess([str(src)], str(directory / "d"), TokenizerArgs("NullTokenizer", vocab_size=51), append_eod=True,
               progress=False)
    return str(directory / "d_text_document")
