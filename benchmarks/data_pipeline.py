"""Measure the data pipeline on this machine: ``python benchmarks/data_pipeline.py``.

Uses only text already on the machine (the Python standard library's sources, and English prose
from the Python documentation topics and the licence texts under /usr/share), so it runs offline:

1. trains a byte-level BPE with GPT-2's vocabulary size (50257) and saves it in GPT-2's
   ``vocab.json`` + ``merges.txt`` format;
2. preprocesses each corpus (as JSON lines) with ``--tokenizer-type GPT2BPETokenizer`` and reports
   MB/s per worker;
3. reads GPT samples of ``--seq-length`` tokens through the per-rank loader and reports samples/s.

``--index-entries N`` measures instead what opening a dataset of N documents costs: it writes a
synthetic ``.idx`` of N sequences (beside a sparse ``.bin``), then times the check of every entry,
the hash of the sequence lengths that keys the index cache, and the build of one epoch's indices.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from meshtron.data.batching import BatchOptions
from meshtron.data.gpt_dataset import GPTDataset
from meshtron.data.indexed_dataset import IndexedDataset, data_path, write_index
from meshtron.data.loader import RankSampler, iterate
from meshtron.data.preprocess import TokenizerArgs, preprocess
from meshtron.data.tokenizer_train import train_bpe_from_texts


def python_source_texts(max_bytes: int = 20_000_000) -> list[str]:
    """The standard library's .py files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for p in sorted(root.rglob("*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if t:
            texts.append(t)
            total += len(t)
        if total >= max_bytes:
            break
    return texts


def english_prose_texts() -> list[str]:
    """English prose found on the machine: the Python docs' topics and licence/copyright texts."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics

        texts += [t for t in topics.values() if t.strip()]
    except ImportError:
        pass
    for d in (Path("/usr/share/common-licenses"), Path("/usr/share/doc")):
        if d.is_dir():
            for p in sorted(d.rglob("*")):
                if p.is_file() and (d.name == "common-licenses" or p.name == "copyright"):
                    try:
                        texts.append(p.read_text(encoding="utf-8"))
                    except (OSError, UnicodeDecodeError):
                        continue
    return texts


def _write_jsonl(path: Path, texts: Sequence[str]) -> int:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path.stat().st_size


def bench_preprocess(jsonl: Path, out_prefix: Path, tokenizer: TokenizerArgs, workers: int, engine: str) -> dict:
    """Preprocess one JSONL file with the given GPT-2 BPE engine ("tiktoken" or "tokenizers").

    Reports MB/s of wall time over the whole run (reading, tokenizing, writing) and MB per CPU-second
    of the workers (what one worker does with a core to itself, whatever else the machine runs).
    """
    previous = os.environ.get("MESHTRON_BPE_ENGINE")
    os.environ["MESHTRON_BPE_ENGINE"] = engine  # read by the (spawned) workers when they build the tokenizer
    try:
        summary = preprocess([str(jsonl)], str(out_prefix), tokenizer, workers=workers, append_eod=True,
                             progress=False)
    finally:
        if previous is None:
            os.environ.pop("MESHTRON_BPE_ENGINE", None)
        else:
            os.environ["MESHTRON_BPE_ENGINE"] = previous
    return {"workers": workers, "MB": summary.num_bytes / 1e6, "seconds": summary.seconds,
            "MB/s": summary.mb_per_s, "MB/s/worker": summary.mb_per_s / workers,
            "MB/cpu-s": summary.mb_per_cpu_s, "tokens": sum(summary.tokens.values())}


def bench_loader(prefix: str, seq_length: int, global_batch: int, micro_batch: int, iterations: int,
                 reset: bool, threaded: bool) -> dict:
    """Samples/s that one data-parallel rank's loader produces (dp=1: it reads every sample)."""
    indexed = IndexedDataset(prefix)
    with tempfile.TemporaryDirectory() as cache:
        ds = GPTDataset(indexed, (0, len(indexed)), global_batch * iterations, seq_length, seed=1234,
                        cache_dir=Path(cache))
        eod = int(indexed[0][-1])  # documents were written with an end-of-document token
        opts = BatchOptions(eod=eod, reset_position_ids=reset, reset_attention_mask=reset, eod_mask_loss=reset)
        sampler = RankSampler(ds, global_batch, micro_batch, 0, 1, opts)
        start = time.perf_counter()
        if threaded:
            for _ in iterate(sampler, 0, iterations):
                pass
        else:
            for i in range(iterations):
                sampler.iteration(i)
        seconds = time.perf_counter() - start
    return {"seq_length": seq_length, "reset_flags": reset, "thread": threaded,
            "samples/s": global_batch * iterations / seconds, "epochs": len(ds.document_index) // len(indexed)}


def bench_index(entries: int, work: Path, seq_length: int = 4096) -> dict:
    """Seconds to open (check every entry of) an index of ``entries`` one-sequence documents, to hash its
    lengths, and to build one epoch of GPT indices over it."""
    import numpy as np

    prefix = work / f"synthetic-{entries}"
    lengths = np.random.default_rng(0).integers(1, 2000, size=entries, dtype=np.int64)
    start = time.perf_counter()
    write_index(str(prefix) + ".idx", np.dtype(np.uint16), lengths, np.arange(entries + 1, dtype=np.int64))
    with open(data_path(prefix), "wb") as f:  # sparse: the tokens are never read
        f.truncate(int(lengths.sum()) * 2)
    write_seconds = time.perf_counter() - start
    del lengths
    start = time.perf_counter()
    ds = IndexedDataset(prefix)
    open_seconds = time.perf_counter() - start
    start = time.perf_counter()
    from meshtron.data.gpt_dataset import _digest

    _digest(ds.sequence_lengths)
    hash_seconds = time.perf_counter() - start
    start = time.perf_counter()
    gpt = GPTDataset(ds, (0, len(ds)), None, seq_length, seed=1)
    build_seconds = time.perf_counter() - start
    return {"entries": entries, "idx_GB": os.path.getsize(str(prefix) + ".idx") / 1e9,
            "write_s": write_seconds, "open_s": open_seconds, "hash_s": hash_seconds,
            "build_s": build_seconds, "samples": len(gpt)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/data_pipeline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--workdir", help="Keep the files here (default: a temporary directory).")
    p.add_argument("--index-entries", type=int, nargs="+",
                   help="Only measure opening synthetic datasets of this many documents (e.g. 10000000 100000000).")
    args = p.parse_args(argv)
    if args.index_entries:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            print("| documents | .idx GB | check every entry (s) | hash the lengths (s) | one epoch of indices (s) |")
            print("|---|---|---|---|---|")
            for n in args.index_entries:
                r = bench_index(n, Path(tmp), args.seq_length)
                print(f"| {n:,} | {r['idx_GB']:.2f} | {r['open_s']:.2f} | {r['hash_s']:.2f} | {r['build_s']:.1f} |",
                      flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpora = {"python-source": python_source_texts(), "english-prose": english_prose_texts()}
        start = time.perf_counter()
        train_bpe_from_texts([t for texts in corpora.values() for t in texts], args.vocab_size, work / "gpt2")
        print(f"trained a byte-level BPE ({args.vocab_size}) in {time.perf_counter() - start:.1f} s; GPT-2 files in "
              f"{work / 'gpt2'}")
        tok = TokenizerArgs("GPT2BPETokenizer", vocab_file=str(work / "gpt2" / "vocab.json"),
                            merge_file=str(work / "gpt2" / "merges.txt"))
        print("| corpus | MB | engine | workers | seconds | MB/s | MB/s per worker | MB per worker CPU-s | tokens |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, texts in corpora.items():
            jsonl = work / f"{name}.jsonl"
            _write_jsonl(jsonl, texts)
            for engine in ("tiktoken", "tokenizers"):
                for w in args.workers:
                    r = bench_preprocess(jsonl, work / f"{name}-{engine}-w{w}", tok, w, engine)
                    print(f"| {name} | {r['MB']:.1f} | {engine} | {w} | {r['seconds']:.2f} | {r['MB/s']:.2f} | "
                          f"{r['MB/s/worker']:.2f} | {r['MB/cpu-s']:.2f} | {r['tokens']:,} |", flush=True)
        prefix = str(work / f"python-source-tiktoken-w{args.workers[0]}_text_document")
        print(f"\nloader, seq {args.seq_length}, global batch {args.global_batch}, micro batch {args.micro_batch}, "
              f"{args.iterations} iterations, one rank reading every sample")
        print("| reset flags | through | samples/s | epochs of data |")
        print("|---|---|---|---|")
        for reset in (False, True):
            for threaded in (False, True):
                r = bench_loader(prefix, args.seq_length, args.global_batch, args.micro_batch, args.iterations,
                                 reset, threaded)
                print(f"| {'on' if reset else 'off'} | {'prefetch thread' if threaded else 'direct call'} | "
                      f"{r['samples/s']:,.0f} | {r['epochs']} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
