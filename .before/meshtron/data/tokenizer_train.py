"""``meshtron tokenizer train``: train a byte-level BPE tokenizer with the ``tokenizers`` library.

The result is a directory that every part of meshtron can use: ``tokenizer.json`` (load it with
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``), the same vocabulary in GPT-2's
``vocab.json`` + ``merges.txt`` format (``--tokenizer-type GPT2BPETokenizer``), and the metadata
that :func:`meshtron.data.tokenizers.load_tokenizer` reads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

from meshtron.data.errors import DataError
from meshtron.data.readers import TXT_UNITS, SkipCounts, expand_inputs, iter_texts
from meshtron.data.tokenizers import META_FILE, HuggingFaceTokenizer

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MIN_VOCAB = 256 + 2  # every byte plus end-of-document and padding


def train_bpe_from_texts(texts: Iterable[str], vocab_size: int, output_dir: str | os.PathLike,
                         min_frequency: int = 2) -> HuggingFaceTokenizer:
    """Train a byte-level BPE on ``texts`` and save it into ``output_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise DataError(f"--vocab-size must be at least {MIN_VOCAB} (256 bytes + end-of-document + padding), "
                        f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOD_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # GPT-2 format: vocab.json, merges.txt
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN}, indent=2) + "\n", encoding="utf-8")
    (out / META_FILE).write_text(json.dumps({"tokenizer_type": "HuggingFaceTokenizer", "path": "."}, indent=2) + "\n",
                                 encoding="utf-8")
    return HuggingFaceTokenizer(out)


def train_tokenizer(inputs: Sequence[str], vocab_size: int, output_dir: str | os.PathLike,
                    json_keys: Sequence[str] = ("text",), txt_unit: str = "file",
                    min_frequency: int = 2) -> HuggingFaceTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens on the documents of ``inputs`` (files, globs,
    directories; JSON lines, Parquet or text as in ``meshtron preprocess``) and save it in ``output_dir``."""
    paths = expand_inputs(inputs)
    skips = SkipCounts()
    texts = (t for t in iter_texts(paths, json_keys, txt_unit, skips) if t)
    first = next(texts, None)  # look ahead for one text, without reading the whole corpus
    if first is None:
        shown = ", ".join(str(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise DataError(f"--input {shown}: no document has text under --json-keys {' '.join(json_keys)} "
                        f"(skipped {skips.describe(json_keys)}); nothing to train on, no tokenizer written")
    return train_bpe_from_texts(itertools.chain([first], texts), vocab_size, output_dir, min_frequency)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtron tokenizer train",
                                description="Train a byte-level BPE tokenizer (Hugging Face `tokenizers`).")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="Training text: .jsonl/.json (optionally .gz/.zst), .parquet or .txt files, globs or directories.")
    p.add_argument("--vocab-size", type=int, required=True, help=f"Vocabulary size (at least {MIN_VOCAB}).")
    p.add_argument("--output", required=True, metavar="DIR", help="Directory to write the tokenizer into.")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY", help="JSON keys holding text (default: text).")
    p.add_argument("--txt-unit", choices=TXT_UNITS, default="file", help="What one document is in a .txt file.")
    p.add_argument("--min-frequency", type=int, default=2, help="Minimum pair count for a merge (default 2).")
    return p


def tokenizer_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``meshtron tokenizer train ...``; ``argv`` may start with ``train``. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        print(f"meshtron tokenizer: error: unknown command {argv[0]!r}; valid: train", file=sys.stderr)
        return 2
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        tok = train_tokenizer(args.input, args.vocab_size, args.output, args.json_keys, args.txt_unit,
                              args.min_frequency)
    except DataError as exc:
        print(f"meshtron tokenizer train: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"meshtron tokenizer train: error: {exc}", file=sys.stderr)
        return 2
    print(f"trained a byte-level BPE of {tok.vocab_size} tokens (end-of-document {tok.eod}, padding {tok.pad}); "
          f"wrote {args.output}/tokenizer.json, vocab.json, merges.txt")
    return 0
