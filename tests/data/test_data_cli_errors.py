"""Bad data given to `meshtron train` ends with one line naming the file or flag, and exit code 2."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from meshtron.cli import main
from meshtron.data.indexed_dataset import IndexedDatasetWriter

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu",
        "--train-iters", "2", "--eval-iters", "0"]


@pytest.fixture()
def dataset(tmp_path) -> str:
    """40 documents of token ids below 50 (uint16)."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        for _ in range(40):
            w.add_document(rng.integers(0, 50, rng.integers(5, 30)))
        w.finalize()
    return str(tmp_path / "d")


def _corrupt_pointer(prefix: str, entry: int, value: int) -> None:
    raw = bytearray(open(prefix + ".idx", "rb").read())
    n = struct.unpack_from("<Q", raw, 18)[0]
    struct.pack_into("<q", raw, 34 + 4 * n + 8 * entry, value)
    open(prefix + ".idx", "wb").write(bytes(raw))


@pytest.mark.parametrize("case, expected", [
    ("impossible_request", "--train-iters 1000000000000 x --global-batch-size 4 = 4,000,000,000,000 train samples"),
    ("pointer_past_end", "d.idx is corrupt: sequence 17 starts at byte 99999999, past the end of"),
    ("short_bin", "past the end of {d}.bin"),
    ("bad_magic", "is not a Megatron indexed-dataset index: magic"),
    # The configuration's own check may answer first; either way the line names --data-path.
    ("negative_weight", "--data-path: "),
    ("weight_not_a_number", "--data-path: "),
    ("tokenizer_config", "tokenizer config {tmp}/tok/tokenizer_config.json is not valid JSON"),
])
def test_bad_data_exits_2_with_one_line(tmp_path, capsys, monkeypatch, dataset, case, expected):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path / "cache"))
    data = ["--data-path", dataset, "--tokenizer-type", "NullTokenizer", "--vocab-size", "51"]
    flags = []
    if case == "impossible_request":
        flags = ["--train-iters", "1000000000000"]
    elif case == "pointer_past_end":
        _corrupt_pointer(dataset, 17, 99_999_999)
    elif case == "short_bin":
        with open(dataset + ".bin", "r+b") as f:
            f.truncate(f.seek(0, 2) - 4)
    elif case == "bad_magic":
        raw = open(dataset + ".idx", "rb").read()
        open(dataset + ".idx", "wb").write(b"NOTMAGIC\x00" + raw[9:])
    elif case == "negative_weight":
        data = ["--data-path", "1", dataset, "-1", dataset, "--tokenizer-type", "NullTokenizer", "--vocab-size", "51"]
    elif case == "weight_not_a_number":
        data = ["--data-path", "1", dataset, "x", dataset, "--tokenizer-type", "NullTokenizer", "--vocab-size", "51"]
    elif case == "tokenizer_config":
        tok = tmp_path / "tok"
        tok.mkdir()
        (tok / "tokenizer.json").write_text("{}")
        (tok / "tokenizer_config.json").write_text("{oops")
        data = ["--data-path", dataset, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok)]
    assert main(["train", *TINY, *data, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtron train: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert expected.format(d=dataset, tmp=tmp_path) in err
