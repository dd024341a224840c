"""From a run's configuration to this rank's batches: :func:`build_data` and :class:`DataBundle`."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, TypeVar

import torch

from meshtron.data.batching import BatchOptions
from meshtron.data.blended import BlendedDataset, BlendSchedule, SampleSource
from meshtron.data.cache import dist_state, barrier
from meshtron.data.default_corpus import ensure_default_corpus
from meshtron.data.errors import DataError
from meshtron.data.gpt_dataset import SPLIT_NAMES, GPTDataset, default_cache_dir, parse_split, split_ranges
from meshtron.data.indexed_dataset import IndexedDataset
from meshtron.data.loader import RankSampler, iterate
from meshtron.data import megatron_order
from meshtron.data.mock import MockDataset
from meshtron.data.tokenizers import Tokenizer, tokenizer_from_config
from meshtron.validation import check_vocab_size, data_path_items

if TYPE_CHECKING:
    from meshtron.config import MeshtronConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class DataBundle:
    """Everything the training loop needs from the data side, for one data-parallel rank.

    ``train_batches(i)`` yields, for each iteration from ``i`` to ``--train-iters`` - 1, the list of
    this rank's micro-batches (dicts of CPU tensors: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, and ``document_ids`` with ``--reset-attention-mask``).
    """

    tokenizer: Optional[Tokenizer]
    vocab_size: int
    eod: Optional[int]
    train: Optional[SampleSource] = None
    valid: Optional[SampleSource] = None
    test: Optional[SampleSource] = None
    global_batch_size: int = 1
    micro_batch_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    train_iters: int = 0
    eval_iters: int = 0
    num_workers: int = 0
    options: BatchOptions = field(default_factory=BatchOptions)
    is_data_rank: bool = True
    description: str = ""
    order: str = "meshtron"  # --data-order
    eval_interval: int = 0

    def _sampler(self, dataset: SampleSource) -> RankSampler:
        return RankSampler(dataset, self.global_batch_size, self.micro_batch_size, self.dp_rank, self.dp_size,
                           self.options, interleaved=self.order == "megatron")

    def train_batches(self, start_iteration: int = 0) -> Iterator[list[dict[str, torch.Tensor]]]:
        """This rank's micro-batches for iterations ``start_iteration`` .. ``train_iters - 1``, prefetched."""
        if self.train is None:
            raise RuntimeError("no training data was built")
        sampler = self._sampler(self.train)
        stop = min(self.train_iters, sampler.num_iterations)
        if not self.is_data_rank:
            return self._placeholders(start_iteration, stop)
        return iterate(sampler, start_iteration, stop, self.num_workers)

    def _placeholders(self, start: int, stop: int) -> Iterator[list[dict[str, torch.Tensor]]]:
        """What ranks that read no data get: one empty dict per micro-batch, per iteration."""
        num_micro = self.global_batch_size // (self.dp_size * self.micro_batch_size)
        return ([{} for _ in range(num_micro)] for _ in range(start, stop))

    def valid_batches(self, iteration: Optional[int] = None) -> Optional[Iterator[list[dict[str, torch.Tensor]]]]:
        """``eval_iters`` iterations of validation micro-batches; None without validation data.

        meshtron's order starts every evaluation at validation sample 0 (every evaluation sees the same
        samples). Megatron's (``--data-order megatron``) continues each evaluation where the previous one
        stopped: the evaluation at training iteration ``iteration`` is the ``(iteration - 1) // eval_interval``-th
        (0-based), the in-loop ones at multiples of ``--eval-interval`` and the one after training.
        """
        first = 0
        if self.order == "megatron" and iteration and self.eval_interval > 0:
            first = (iteration - 1) // self.eval_interval * self.eval_iters
        return self._eval_batches(self.valid, first)

    def test_batches(self) -> Optional[Iterator[list[dict[str, torch.Tensor]]]]:
        """Like :meth:`valid_batches`, on the test split."""
        return self._eval_batches(self.test)

    def _eval_batches(self, dataset: Optional[SampleSource],
                      first: int = 0) -> Optional[Iterator[list[dict[str, torch.Tensor]]]]:
        if dataset is None or self.eval_iters <= 0:
            return None
        sampler = self._sampler(dataset)
        stop = min(first + self.eval_iters, sampler.num_iterations)
        if not self.is_data_rank:
            return self._placeholders(first, stop)
        return iterate(sampler, first, stop, num_workers=0)


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_weighted_paths(values: Sequence[str], flag: str) -> tuple[Optional[list[float]], list[str]]:
    """``[PREFIX ...]`` -> (None, prefixes); ``[W1 PREFIX1 W2 PREFIX2 ...]`` -> (weights, prefixes).

    Values may also hold several space-separated items (``"0.7 A 0.3 B"``, as a YAML string); otherwise an item
    is one prefix, spaces included (:func:`meshtron.validation.data_path_items`). The list
    is weighted when its first item is a number (as Megatron reads it); every weight must then be a
    finite number >= 0, with a positive sum (a dataset of weight 0 is not used).
    """
    values = data_path_items(values)
    if not values:
        raise DataError(f"{flag}: expected dataset prefixes, or 'WEIGHT PREFIX' pairs")
    if _number(values[0]) is None:
        numeric = [v for v in values[1:] if _number(v) is not None and not _dataset_named(v)]
        if numeric:
            raise DataError(f"{flag}: {numeric[0]!r} looks like a weight, but the first value {values[0]!r} is not a "
                            "number: give 'WEIGHT PREFIX' pairs (e.g. 0.7 A 0.3 B) or prefixes only")
        return None, values
    if len(values) % 2:
        raise DataError(f"{flag}: weighted prefixes come in pairs 'WEIGHT PREFIX', got {len(values)} values")
    weights, prefixes = [], []
    for w, p in zip(values[0::2], values[1::2]):
        weight = _number(w)
        if weight is None:
            raise DataError(f"{flag}: expected a weight before {p!r}, got {w!r} (weights are numbers, e.g. 0.7 A 0.3 B)")
        if not math.isfinite(weight) or weight < 0:
            raise DataError(f"{flag}: the weight of {p!r} is {w}; weights must be finite numbers >= 0")
        weights.append(weight)
        prefixes.append(p)
    if sum(weights) <= 0:
        raise DataError(f"{flag}: the weights {' '.join(values[0::2])} add up to 0; give at least one positive weight")
    return weights, prefixes


def _dataset_named(value: str) -> bool:
    """Whether ``value`` is the prefix of an existing dataset (a prefix may look like a number)."""
    from meshtron.data.indexed_dataset import dataset_exists

    return dataset_exists(value)


def _used(prefixes: list[str], weights: Optional[list[float]]) -> list[tuple[str, Optional[float]]]:
    """(prefix, weight) of the datasets a blend uses: those of weight 0 are left out."""
    if weights is None:
        return [(p, None) for p in prefixes]
    return [(p, w) for p, w in zip(prefixes, weights) if w > 0]


@dataclass
class _Component:
    """One dataset prefix's share of a split."""

    indexed: IndexedDataset
    begin: int
    end: int
    weight: Optional[float]


def _rank_zero_first(build: Callable[[], T]) -> T:
    """Run ``build`` on global rank 0 first (it writes the caches), then on the other ranks (which read them)."""
    initialised, rank = dist_state()
    if not initialised:
        return build()
    result, failure = None, None
    if rank == 0:
        try:
            result = build()
        except BaseException as exc:  # reach the barrier so that the other ranks do not hang
            failure = exc
    barrier()
    if failure is not None:
        raise failure
    if rank != 0:
        result = build()
    return result


class _FileDatasets:
    """Train/valid/test sample sources over indexed datasets, per the data flags."""

    def __init__(self, cfg: "MeshtronConfig", default_prefix: Optional[str], samples: dict[str, int],
                 global_batch: int) -> None:
        self.cfg = cfg
        self.default_prefix = default_prefix
        self.samples = samples
        self.global_batch = global_batch
        self._opened: dict[str, IndexedDataset] = {}

    def _open(self, prefix: str) -> IndexedDataset:
        if prefix not in self._opened:
            self._opened[prefix] = IndexedDataset(prefix)
        return self._opened[prefix]

    def plan(self) -> dict[str, list[_Component]]:
        d = self.cfg.data
        separate = {"train": d.train_data_path, "valid": d.valid_data_path, "test": d.test_data_path}
        if d.data_path and any(separate.values()):
            raise DataError("give either --data-path (split by --split) or --train-data-path/--valid-data-path/"
                            "--test-data-path, not both")
        plan: dict[str, list[_Component]] = {}
        if any(separate.values()):
            for split, values in separate.items():
                if values:
                    weights, prefixes = parse_weighted_paths(values, f"--{split}-data-path")
                    plan[split] = [_Component(self._open(p), 0, len(self._open(p)), w)
                                   for p, w in _used(prefixes, weights)]
            if "train" not in plan:
                raise DataError("--valid-data-path/--test-data-path need --train-data-path as well")
            return plan
        values = d.data_path or [self.default_prefix]
        weights, prefixes = parse_weighted_paths(values, "--data-path")
        fractions = parse_split(d.split)
        for i, split in enumerate(SPLIT_NAMES):
            parts = []
            for p, w in _used(prefixes, weights):
                ds = self._open(p)
                begin, end = split_ranges(len(ds), fractions)[i]
                if end > begin:
                    parts.append(_Component(ds, begin, end, w))
            if parts:
                plan[split] = parts
        if "train" not in plan:
            raise DataError(f"--split {d.split}: the training split is empty (give it a positive share)")
        return plan

    def build(self) -> dict[str, Optional[SampleSource]]:
        cfg = self.cfg
        out: dict[str, Optional[SampleSource]] = {s: None for s in SPLIT_NAMES}
        for split, parts in self.plan().items():
            n = self.samples.get(split, 0)
            if n > 0:
                out[split] = self._split_source(split, parts, n, cfg.model.seq_length, cfg.train.seed)
        return out

    def build_megatron(self) -> dict[str, Optional[SampleSource]]:
        """The splits in Megatron-Core's order (``--data-order megatron``; :mod:`meshtron.data.megatron_order`)."""
        d = self.cfg.data
        out: dict[str, Optional[SampleSource]] = {s: None for s in SPLIT_NAMES}
        separate = {"train": d.train_data_path, "valid": d.valid_data_path, "test": d.test_data_path}
        if any(separate.values()):
            if d.data_path:
                raise DataError("give either --data-path (split by --split) or --train-data-path/--valid-data-path/"
                                "--test-data-path, not both")
            if not separate["train"]:
                raise DataError("--valid-data-path/--test-data-path need --train-data-path as well")
            for split, values in separate.items():
                n = self.samples.get(split, 0)
                if values and n > 0:
                    weights, prefixes = parse_weighted_paths(values, f"--{split}-data-path")
                    ranges = {p: (0, len(self._open(p))) for p in prefixes}
                    out[split] = self._megatron_split(split, prefixes, weights, ranges, n)
            return out
        weights, prefixes = parse_weighted_paths(d.data_path or [self.default_prefix], "--data-path")
        for i, split in enumerate(SPLIT_NAMES):
            n = self.samples.get(split, 0)
            ranges = {p: megatron_order.split_document_ranges(len(self._open(p)), d.split)[i] for p in prefixes}
            if split == "train" and ranges[prefixes[0]] is None:
                raise DataError(f"--split {d.split}: the training split is empty (give it a positive share)")
            if n > 0 and ranges[prefixes[0]] is not None:
                out[split] = self._megatron_split(split, prefixes, weights, ranges, n)
        return out

    def _megatron_split(self, split: str, prefixes: list[str], weights: Optional[list[float]],
                        ranges: dict, n: int) -> SampleSource:
        """One split as Megatron-Core's builder makes it: a GPTDataset for one unweighted prefix, else a blend."""
        request = self._request(split)
        seq, seed = self.cfg.model.seq_length, self.cfg.train.seed

        def gpt(prefix: str, num: Optional[int]) -> megatron_order.MegatronGPTDataset:
            return megatron_order.MegatronGPTDataset(self._open(prefix), ranges[prefix], num, seq, seed, split,
                                                     self._cache_dir(prefix), request=request)

        if weights is None:
            if len(prefixes) == 1:
                return gpt(prefixes[0], n)
            # Unweighted prefixes: one epoch of each, blended in proportion to their samples.
            parts = [gpt(p, None) for p in prefixes]
            lengths = [len(x) for x in parts]
            return megatron_order.MegatronBlendedDataset(parts, lengths, min(n, sum(lengths)), split)
        used = _used(prefixes, weights)  # a weight of 0 leaves its dataset out
        w = megatron_order.normalize([wt for _, wt in used])
        targets = megatron_order.sizes_per_dataset(w, n)
        buffers = megatron_order.sizes_per_dataset(w, n, megatron_order.MID_LEVEL_SURPLUS)
        parts = [gpt(p, b) for (p, _), b in zip(used, buffers)]
        return megatron_order.MegatronBlendedDataset(parts, w, sum(targets), split)

    def _cache_dir(self, prefix: str) -> Path:
        return Path(self.cfg.data.data_cache_path) if self.cfg.data.data_cache_path else default_cache_dir(prefix)

    def _request(self, split: str) -> str:
        """How the run asks for the samples of ``split``, for a message refusing too large a request."""
        t = self.cfg.train
        iters = f"--train-iters {t.train_iters}" if split == "train" else f"--eval-iters {t.eval_iters}"
        return f"{iters} x --global-batch-size {self.global_batch}"

    def _split_source(self, split: str, parts: list[_Component], n: int, seq: int, seed: int) -> SampleSource:
        request = self._request(split)

        def gpt(c: _Component, num: int) -> GPTDataset:
            return GPTDataset(c.indexed, (c.begin, c.end), num, seq, seed, split, self._cache_dir(c.indexed.prefix),
                              request=request)

        if len(parts) == 1:
            return gpt(parts[0], n)
        if parts[0].weight is None:
            # Unweighted prefixes blend in proportion to their tokens, like one concatenated dataset.
            weights = [float(c.indexed.sequence_lengths[c.begin:c.end].sum(dtype="int64")) for c in parts]
        else:
            weights = [c.weight for c in parts]
        counts = BlendSchedule(weights).counts(n)
        return BlendedDataset([gpt(c, max(int(k), 1)) for c, k in zip(parts, counts)], weights, n)


def build_data(cfg: "MeshtronConfig", dp_rank: int, dp_size: int, *, is_data_rank: bool = True) -> DataBundle:
    """The tokenizer and this data-parallel rank's batch iterators for a run.

    Call it on every rank: with torch.distributed initialised it synchronises so that global rank 0
    builds any missing cache (default corpus, dataset index arrays) before the others read them.
    Ranks with ``is_data_rank=False`` (middle pipeline stages) know the datasets' sizes but never read
    a sample: their iterators yield one empty dict per micro-batch.
    """
    d, m, t = cfg.data, cfg.model, cfg.train
    G = t.global_batch_size or t.micro_batch_size * dp_size
    samples = {"train": t.train_iters * G, "valid": max(t.eval_iters, 0) * G, "test": max(t.eval_iters, 0) * G}
    tokenizer: Optional[Tokenizer] = None
    has_tokenizer_flags = bool(d.tokenizer_type or d.tokenizer_model or d.vocab_file)
    if d.mock_data:
        if has_tokenizer_flags:
            tokenizer = tokenizer_from_config(d, m.vocab_size)
        vocab = m.vocab_size or (tokenizer.vocab_size if tokenizer else None)
        if not vocab:
            raise DataError("--mock-data needs --vocab-size (or a tokenizer) to know which token ids to draw")
        # A split given no share by --split has no mock set either (as Megatron's mock data): no test
        # evaluation with --split 99,1,0. The training set is always there.
        shares = dict(zip(SPLIT_NAMES, parse_split(d.split)))
        datasets = {s: (MockDataset(vocab, m.seq_length, t.seed, s, n) if n > 0 and (s == "train" or shares[s] > 0)
                        else None) for s, n in samples.items()}
        description = f"mock data: random tokens below {vocab}"
    else:
        default_prefix = None
        if d.data_path or d.train_data_path:
            tokenizer = tokenizer_from_config(d, m.vocab_size)
            source = "data " + " ".join(str(x) for x in (d.data_path or d.train_data_path))
        else:
            corpus = ensure_default_corpus()
            tokenizer = corpus.tokenizer()
            default_prefix = corpus.prefix
            info = corpus.manifest()
            source = (f"default corpus: Python {info['python']} standard library, {info['files']} files, "
                      f"{info['bytes'] / 1e6:.1f} MB, {info['tokens']:,} tokens, BPE vocabulary {info['vocab_size']}")
            if has_tokenizer_flags:
                logger.warning("the default corpus uses its own tokenizer; tokenizer flags apply to --data-path only")
        vocab = tokenizer.vocab_size
        check_vocab_size(m, vocab, tokenizer.kind)  # the model takes the tokenizer's size
        if d.data_order == "megatron":
            train_n, valid_n, test_n = megatron_order.split_sample_counts(
                t.train_iters, G, t.eval_iters, t.eval_interval, t.train_samples, t.skip_train)
            samples = {"train": train_n, "valid": valid_n, "test": test_n}
        files = _FileDatasets(cfg, default_prefix, samples, G)
        datasets = _rank_zero_first(files.build_megatron if d.data_order == "megatron" else files.build)
        description = source
    eod = tokenizer.eod if tokenizer is not None else None
    pad = tokenizer.pad if tokenizer is not None else None
    options = BatchOptions(eod=eod, pad=pad, vocab_size=vocab if tokenizer is not None else None,
                           reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
                           eod_mask_loss=d.eod_mask_loss, pin_memory=torch.cuda.is_available())
    options.check()
    sizes = ", ".join(f"{s} {len(ds):,} samples" for s, ds in datasets.items() if ds is not None)
    return DataBundle(
        tokenizer=tokenizer, vocab_size=int(vocab), eod=eod,
        train=datasets["train"], valid=datasets["valid"], test=datasets["test"],
        global_batch_size=G, micro_batch_size=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
        train_iters=t.train_iters, eval_iters=t.eval_iters,
        # Worker processes only pay off beside a GPU; on a CPU they would take cores from training.
        num_workers=d.num_workers if torch.cuda.is_available() else 0,
        options=options, is_data_rank=is_data_rank,
        description=f"{description}; {sizes}" if sizes else description,
        order=d.data_order if not d.mock_data else "meshtron",
        eval_interval=0 if t.skip_train else (t.eval_interval or 0),
    )
