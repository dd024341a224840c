"""Cases shared by the Megatron-order and LR-schedule tests and their fixtures (tests/fixtures/megatron).

Each case is computed twice: by megatron-core (``megatron_*``, through :mod:`megatron_oracle`; stored in the
fixtures by tests/fixtures/megatron/make_fixtures.py) and by meshtron (``meshtron_*``). A split is summarised
by its length, the SHA-256 of all its samples' tokens (int64, in order) and its first samples in full.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

HEAD = 6  # samples stored in full per split

# (name, number of documents, seed of their lengths); lengths 0..39 (empty documents included).
DATASETS = {"A": (2000, 7), "B": (900, 8)}
SEQ = 16
GBS = 8

DATA_CASES = {
    # flags as meshtron/Megatron-LM take them
    "single": {"data_path": ["A"], "split": "969,30,1", "train_iters": 50, "eval_interval": 10, "eval_iters": 2,
               "seed": 1234},
    "weighted": {"data_path": ["0.3", "A", "0.7", "B"], "split": "98,2,0", "train_iters": 60, "eval_interval": 20,
                 "eval_iters": 3, "seed": 5},
    "one_weighted": {"data_path": ["1", "B"], "split": "90,10,0", "train_iters": 40, "eval_interval": 40,
                     "eval_iters": 1, "seed": 11},
    "unweighted": {"data_path": ["A", "B"], "split": "969,30,1", "train_iters": 30, "eval_interval": 10,
                   "eval_iters": 1, "seed": 3},
    "per_split": {"train_data_path": ["2", "A", "1", "B"], "valid_data_path": ["B"], "test_data_path": ["A"],
                  "train_iters": 70, "eval_interval": 35, "eval_iters": 2, "seed": 99},
}


def write_datasets(directory: Path) -> dict[str, str]:
    """The cases' indexed datasets (uint16 tokens, one sequence per document) under ``directory``."""
    from meshtron.data.indexed_dataset import IndexedDatasetWriter

    prefixes = {}
    for name, (n, seed) in DATASETS.items():
        lengths = np.random.default_rng(seed).integers(0, 40, n)
        prefix = str(directory / name)
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            for i, length in enumerate(lengths):
                w.add_document((np.arange(length) * 31 + i * 17) % 997 + 1)
            w.finalize()
        prefixes[name] = prefix
    return prefixes


def _resolve(values, prefixes):
    return [prefixes.get(v, v) for v in values] if values else None


def sample_counts(case: dict) -> list[int]:
    train = case["train_iters"] * GBS
    valid = (case["train_iters"] // case["eval_interval"] + 1) * case["eval_iters"] * GBS
    return [train, valid, case["eval_iters"] * GBS]


def summarise(rows) -> dict:
    """Length, SHA-256 and first samples of a sequence of token arrays."""
    h = hashlib.sha256()
    head, n = [], 0
    for row in rows:
        row = np.asarray(row, dtype=np.int64)
        h.update(row.tobytes())
        if len(head) < HEAD:
            head.append(row.tolist())
        n += 1
    return {"len": n, "sha256": h.hexdigest(), "head": head}


# ------------------------------------------------------------------------------------------------ megatron
class _Tokenizer:
    """The little a GPTDatasetConfig reads of a tokenizer."""

    vocab_size = 1000
    eod = 0
    pad = -1
    unique_identifiers = {"class": "TestTokenizer"}


def megatron_splits(case: dict, prefixes: dict, cache: Path) -> dict:
    from megatron_oracle import dataset_modules

    gpt, builder, _ = dataset_modules()
    blend = blend_per_split = None
    if "data_path" in case:
        from megatron.core.datasets.utils import get_blend_from_list

        blend = get_blend_from_list(_resolve(case["data_path"], prefixes))
    else:
        from megatron.core.datasets.utils import get_blend_from_list

        blend_per_split = [get_blend_from_list(_resolve(case.get(f"{s}_data_path"), prefixes))
                           for s in ("train", "valid", "test")]
    config = gpt.GPTDatasetConfig(random_seed=case["seed"], sequence_length=SEQ, blend=blend,
                                  blend_per_split=blend_per_split, split=case.get("split"), path_to_cache=str(cache),
                                  tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False, mmap_bin_files=True)
    datasets = builder.BlendedMegatronDatasetBuilder(gpt.GPTDataset, sample_counts(case), lambda: True,
                                                     config).build()
    out = {}
    for split, ds in zip(("train", "valid", "test"), datasets):
        if ds is None:
            out[split] = None
            continue

        def rows(ds=ds):
            for i in range(len(ds)):
                item = ds[i]
                yield np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])

        out[split] = summarise(rows())
    return out


def megatron_index_cases() -> list[dict]:
    """Document, sample and shuffle indices of random small splits (extra token on and off, final epochs)."""
    gpt, _, helpers = _dataset_functions()
    rng = np.random.default_rng(2024)
    cases = []
    while len(cases) < 40:
        n = int(rng.integers(1, 30))
        sizes = rng.integers(0, 50, n + 4).astype(np.int32)
        begin = int(rng.integers(0, 3))
        docs = np.arange(begin, begin + n, dtype=np.int32)
        tokens = int(sizes[docs].sum())
        if tokens < 2:
            continue
        seq, num, seed = int(rng.integers(2, 40)), int(rng.integers(0, 150)), int(rng.integers(0, 10**6))
        extra = bool(len(cases) % 4)
        try:
            d, s, sh = megatron_indices(gpt, helpers, sizes, docs, num, seq, seed, extra)
        except AssertionError:  # combinations megatron-core itself refuses
            continue
        cases.append({"sizes": sizes.tolist(), "documents": [begin, begin + n], "num_samples": num, "seq_length": seq,
                      "seed": seed, "extra_token": extra,
                      "document_index": d.tolist(), "sample_index": s.tolist(), "shuffle_index": sh.tolist(),
                      "dtypes": [str(d.dtype), str(s.dtype), str(sh.dtype)]})
    return cases


def _dataset_functions():
    from megatron_oracle import dataset_modules

    gpt, _, helpers = dataset_modules()
    return gpt, None, helpers


def megatron_indices(gpt, helpers, sizes, docs, num, seq, seed, extra):
    """megatron-core's three arrays, by the steps of GPTDataset._build_document_sample_shuffle_indices."""
    tokens = int(sizes[docs].sum())
    epochs, total_tokens = 1, tokens
    while total_tokens < num * seq + int(extra):
        epochs += 1
        total_tokens += tokens
    separate = False
    if epochs > 1:
        before = ((epochs - 1) * tokens - int(extra)) // seq
        per_epoch = (tokens - int(extra)) // seq
        separate = num - before < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)
    d = gpt._build_document_index(docs, epochs, rs, separate)
    s = helpers.build_sample_idx(sizes, d, seq, epochs, tokens, True, extra)
    total = s.shape[0] - 1
    sh = gpt._build_shuffle_index(before if separate else total, total, rs)
    return d, s, sh


LR_CASES = {
    "linear_warmup": {"lr": 1.0, "min_lr": 0.1, "lr_decay_style": "linear", "lr_warmup_iters": 4,
                      "train_iters": 20, "gbs": 8},
    "cosine_fraction": {"lr": 3e-4, "min_lr": 3e-5, "lr_decay_style": "cosine", "lr_warmup_fraction": 0.13,
                        "train_iters": 25, "gbs": 3, "lr_warmup_init": 1e-5},
    "cosine_decay_iters": {"lr": 2.0, "min_lr": 0.5, "lr_decay_style": "cosine", "lr_warmup_iters": 2,
                           "lr_decay_iters": 15, "train_iters": 24, "gbs": 4},
    "constant": {"lr": 1.0, "min_lr": 0.0, "lr_decay_style": "constant", "lr_warmup_iters": 3, "train_iters": 10,
                 "gbs": 2},
    "isr": {"lr": 1.0, "min_lr": 0.05, "lr_decay_style": "inverse-square-root", "lr_warmup_iters": 3,
            "train_iters": 30, "lr_decay_iters": 20, "gbs": 2},
    "wsd_exponential": {"lr": 1.0, "min_lr": 0.1, "lr_decay_style": "WSD", "lr_wsd_decay_style": "exponential",
                        "lr_wsd_decay_iters": 6, "lr_warmup_iters": 2, "train_iters": 20, "gbs": 5},
    "wsd_minus_sqrt": {"lr": 1.0, "min_lr": 0.0, "lr_decay_style": "WSD", "lr_wsd_decay_style": "minus_sqrt",
                       "lr_wsd_decay_iters": 5, "train_iters": 16, "gbs": 1},
    "wsd_cosine": {"lr": 1.0, "min_lr": 0.2, "lr_decay_style": "WSD", "lr_wsd_decay_style": "cosine",
                   "lr_wsd_decay_iters": 7, "lr_warmup_iters": 1, "train_iters": 18, "gbs": 2},
    "samples": {"lr": 1.0, "min_lr": 0.1, "lr_decay_style": "linear", "train_samples": 203, "lr_decay_samples": 150,
                "lr_warmup_samples": 21, "gbs": 8},
    "samples_wsd": {"lr": 1.0, "min_lr": 0.0, "lr_decay_style": "WSD", "lr_wsd_decay_style": "linear",
                    "train_samples": 100, "lr_wsd_decay_samples": 33, "gbs": 4},
}


def megatron_lengths(c: dict) -> dict:
    """The scheduler's arguments, as Megatron-LM's get_optimizer_param_scheduler derives them."""
    gbs = c["gbs"]
    if c.get("train_samples") is None:
        decay = c.get("lr_decay_iters", c["train_iters"]) * gbs
        wsd = c["lr_wsd_decay_iters"] * gbs if c.get("lr_wsd_decay_iters") is not None else None
        warm = (c["lr_warmup_fraction"] * decay if c.get("lr_warmup_fraction") is not None
                else c.get("lr_warmup_iters", 0) * gbs)
        iters = c["train_iters"]
    else:
        decay = c.get("lr_decay_samples", c["train_samples"])
        wsd = c.get("lr_wsd_decay_samples")
        warm = (c["lr_warmup_fraction"] * decay if c.get("lr_warmup_fraction") is not None
                else c.get("lr_warmup_samples", 0))
        iters = c["train_samples"] // gbs
    return {"warmup": warm, "decay": decay, "wsd": wsd, "iters": iters}


def megatron_lr_cases() -> dict:
    """Per case, the learning rate of iterations 1 .. train iterations + 3 (read before each step)."""
    from megatron_oracle import scheduler_module

    sched = scheduler_module()
    out = {}
    for name, c in LR_CASES.items():
        n = megatron_lengths(c)

        class _Optimizer:
            param_groups = [{}]

        s = sched.OptimizerParamScheduler(
            _Optimizer(), init_lr=c.get("lr_warmup_init", 0.0), max_lr=c["lr"], min_lr=c["min_lr"],
            lr_warmup_steps=n["warmup"], lr_decay_steps=n["decay"], lr_decay_style=c["lr_decay_style"],
            start_wd=0.01, end_wd=0.01, wd_incr_steps=n["iters"] * c["gbs"], wd_incr_style="constant",
            wsd_decay_steps=n["wsd"], lr_wsd_decay_style=c.get("lr_wsd_decay_style"))
        lrs = []
        for _ in range(n["iters"] + 3):
            lrs.append(s.optimizer.param_groups[0]["lr"])
            s.step(increment=c["gbs"])
        out[name] = lrs
    return out


# ------------------------------------------------------------------------------------------------ meshtron
def meshtron_config(case: dict, prefixes: dict, cache: Path):
    from meshtron.config import MeshtronConfig

    cfg = MeshtronConfig()
    cfg.model.seq_length = SEQ
    cfg.train.global_batch_size = GBS
    cfg.train.micro_batch_size = GBS
    cfg.train.train_iters = case["train_iters"]
    cfg.train.eval_interval = case["eval_interval"]
    cfg.train.eval_iters = case["eval_iters"]
    cfg.train.seed = case["seed"]
    cfg.data.num_workers = 0
    cfg.data.data_order = "megatron"
    cfg.data.data_cache_path = str(cache)
    cfg.data.tokenizer_type = "NullTokenizer"
    cfg.model.vocab_size = 1000
    for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if key in case:
            setattr(cfg.data, key, _resolve(case[key], prefixes))
    if "split" in case:
        cfg.data.split = case["split"]
    return cfg


def meshtron_splits(case: dict, prefixes: dict, cache: Path) -> dict:
    from meshtron.data.build import build_data

    bundle = build_data(meshtron_config(case, prefixes, cache), 0, 1)
    out = {}
    for split in ("train", "valid", "test"):
        ds = getattr(bundle, split)
        out[split] = None if ds is None else summarise(ds.samples(i, 1)[0] for i in range(len(ds)))
    return out


def meshtron_lrs(c: dict) -> list[float]:
    from meshtron.config import OptimConfig
    from meshtron.optim.lr_schedule import learning_rate

    keys = ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_init",
            "lr_decay_iters", "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_style", "lr_wsd_decay_iters",
            "lr_wsd_decay_samples")
    o = OptimConfig(**{k: c[k] for k in keys if k in c})
    n = megatron_lengths(c)
    if o.lr_decay_iters is None and o.lr_decay_samples is None:
        o.lr_decay_iters = n["iters"]  # as meshtron's configuration check fills it
    return [learning_rate(o, i, n["iters"], c["gbs"], train_samples=c.get("train_samples"))
            for i in range(1, n["iters"] + 4)]
