"""Every tokenizer kind: round trip on multi-byte text, special ids, save/load, training."""

from __future__ import annotations

import base64
import io
import json

import pytest

from _data_helpers import MULTIBYTE_TEXT, stdlib_texts
from meshtron.data.bpe_engine import byte_to_unicode
from meshtron.data.errors import DataError
from meshtron.data.tokenizer_train import tokenizer_main, train_tokenizer
from meshtron.data.tokenizers import (ByteTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer,
                                      SentencePieceTokenizer, TikTokenizer, Tokenizer, build_tokenizer, load_tokenizer)


@pytest.fixture(scope="module")
def tiktoken_file(bpe_dir, tmp_path_factory):
    """A tiktoken BPE file holding the same merges as the session BPE (ranks = merge order)."""
    char_to_byte = {c: b for b, c in byte_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for line in (bpe_dir / "merges.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("#version") or not line.strip():
            continue
        a, b = line.split(" ")
        token = bytes(char_to_byte[c] for c in a + b)
        ranks.setdefault(token, len(ranks))
    path = tmp_path_factory.mktemp("tiktoken") / "bpe.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    lines = [ln for t in stdlib_texts(100_000) for ln in t.splitlines() if ln.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
                                   minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "sp.model"
    path.write_bytes(buf.getvalue())
    return path


def _kinds(bpe_dir, tiktoken_file, sentencepiece_model) -> dict[str, Tokenizer]:
    return {
        "byte": ByteTokenizer(),
        "hf-dir": HuggingFaceTokenizer(bpe_dir),
        "hf-file": build_tokenizer("HuggingFaceTokenizer", str(bpe_dir / "tokenizer.json")),
        "gpt2": build_tokenizer("GPT2BPETokenizer", vocab_file=str(bpe_dir / "vocab.json"),
                                merge_file=str(bpe_dir / "merges.txt")),
        "sentencepiece": build_tokenizer("SentencePieceTokenizer", str(sentencepiece_model)),
        "tiktoken": build_tokenizer("TikTokenizer", str(tiktoken_file)),
    }


KINDS = ["byte", "hf-dir", "hf-file", "gpt2", "sentencepiece", "tiktoken"]


@pytest.fixture(scope="module")
def tokenizers(bpe_dir, tiktoken_file, sentencepiece_model):
    pytest.importorskip("tiktoken")
    return _kinds(bpe_dir, tiktoken_file, sentencepiece_model)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_multibyte_text(tokenizers, kind):
    tok = tokenizers[kind]
    ids = tok.encode(MULTIBYTE_TEXT)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == MULTIBYTE_TEXT
    assert tok.encode_batch([MULTIBYTE_TEXT, "abc"]) == [ids, tok.encode("abc")]


@pytest.mark.parametrize("kind", KINDS)
def test_special_ids_are_defined_and_in_range(tokenizers, kind):
    tok = tokenizers[kind]
    assert tok.eod is not None and 0 <= tok.eod < tok.vocab_size
    assert tok.pad is not None and 0 <= tok.pad < tok.vocab_size
    assert tok.eod not in tok.encode(MULTIBYTE_TEXT)


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_restore_the_same_tokenizer(tokenizers, kind, tmp_path):
    tok = tokenizers[kind]
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert type(again) is type(tok)
    assert (again.vocab_size, again.eod, again.pad) == (tok.vocab_size, tok.eod, tok.pad)
    assert again.encode(MULTIBYTE_TEXT) == tok.encode(MULTIBYTE_TEXT)


def test_expected_special_ids(tokenizers):
    assert (tokenizers["byte"].vocab_size, tokenizers["byte"].eod, tokenizers["byte"].pad) == (258, 256, 257)
    hf = tokenizers["hf-dir"]
    assert hf.decode([hf.eod]) == "<|endoftext|>" and hf.decode([hf.pad]) == "<|pad|>"
    assert tokenizers["gpt2"].eod == hf.eod  # same vocabulary in GPT-2 format
    assert tokenizers["gpt2"].encode(MULTIBYTE_TEXT) == hf.encode(MULTIBYTE_TEXT)
    sp = tokenizers["sentencepiece"]
    assert (sp.eod, sp.pad, sp.vocab_size) == (2, 3, 400)
    tk = tokenizers["tiktoken"]
    assert tk.eod == tk.vocab_size - 2 and tk.pad == tk.vocab_size - 1


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.encode("3 14 15") == [3, 14, 15]
    assert tok.decode([3, 14]) == "3 14"
    assert (tok.vocab_size, tok.eod) == (101, 100)
    with pytest.raises(DataError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_kind_is_inferred_from_files(bpe_dir, tiktoken_file, sentencepiece_model):
    pytest.importorskip("tiktoken")
    assert isinstance(build_tokenizer(tokenizer_model=str(bpe_dir)), HuggingFaceTokenizer)
    assert isinstance(build_tokenizer(vocab_file=str(bpe_dir / "vocab.json"), merge_file=str(bpe_dir / "merges.txt")),
                      GPT2BPETokenizer)
    assert isinstance(build_tokenizer(tokenizer_model=str(sentencepiece_model)), SentencePieceTokenizer)
    assert isinstance(build_tokenizer(tokenizer_model=str(tiktoken_file)), TikTokenizer)
    # Llama 3 ships its tiktoken file as tokenizer.model: recognised by content.
    renamed = tiktoken_file.parent / "tokenizer.model"
    renamed.write_bytes(tiktoken_file.read_bytes())
    assert isinstance(build_tokenizer(tokenizer_model=str(renamed)), TikTokenizer)


@pytest.mark.parametrize("args, message", [
    ({}, "--tokenizer-type"),
    ({"tokenizer_type": "HuggingFaceTokenizer"}, "--tokenizer-model"),
    ({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "/nonexistent/tok.json"}, "not found"),
    ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/nonexistent/vocab.json"}, "--vocab-file"),
    ({"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/nonexistent.model"}, "--tokenizer-model"),
    ({"tokenizer_type": "Nope"}, "unknown --tokenizer-type"),
])
def test_bad_tokenizer_flags(args, message):
    with pytest.raises(DataError, match=message):
        build_tokenizer(**args)


def test_train_tokenizer_from_jsonl_is_deterministic(tmp_path):
    texts = stdlib_texts(120_000)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    a = train_tokenizer([str(data)], 400, tmp_path / "a")
    train_tokenizer([str(data)], 400, tmp_path / "b")
    assert a.vocab_size == 400
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a.decode(a.encode(MULTIBYTE_TEXT)) == MULTIBYTE_TEXT
    assert len(a.encode(texts[0])) < 0.8 * len(texts[0].encode())  # it learned merges


def test_tokenizer_cli(tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text("\n".join(stdlib_texts(50_000)), encoding="utf-8")
    assert tokenizer_main(["train", "--input", str(data), "--vocab-size", "300", "--output", str(tmp_path / "o")]) == 0
    assert "300 tokens" in capsys.readouterr().out
    assert load_tokenizer(tmp_path / "o").vocab_size == 300
    assert tokenizer_main(["train", "--input", str(data), "--vocab-size", "10", "--output", str(tmp_path / "p")]) == 2
    assert "--vocab-size must be at least 258" in capsys.readouterr().err
    assert tokenizer_main(["train", "--input", str(tmp_path / "missing.txt"), "--vocab-size", "300",
                           "--output", str(tmp_path / "q")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert tokenizer_main(["fit"]) == 2
    assert tokenizer_main(["train", "--vocab-size", "300"]) == 2  # argparse: --input and --output required


def test_gpt2_fast_engine_matches_the_reference(tokenizers, bpe_dir, monkeypatch):
    gpt2 = tokenizers["gpt2"]
    assert gpt2.engine == "tiktoken"
    texts = [MULTIBYTE_TEXT, "<|endoftext|> is plain text here", "  lots   of\n\n\n spaces\t\t", ""]
    texts += stdlib_texts(200_000)
    assert gpt2.encode_batch(texts) == [gpt2.reference_encode(t) for t in texts]
    monkeypatch.setenv("MESHTRON_BPE_ENGINE", "tokenizers")
    reference = GPT2BPETokenizer(bpe_dir / "vocab.json", bpe_dir / "merges.txt")
    assert reference.engine == "tokenizers"
    assert reference.encode_batch(texts[:5]) == gpt2.encode_batch(texts[:5])


def test_gpt2_table_not_made_by_plain_bpe_uses_the_reference(tmp_path, bpe_dir):
    pytest.importorskip("tiktoken")
    merges = (bpe_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    # Repeat a merge: a token made twice has no single rank, so the fast path is not safe.
    (tmp_path / "merges.txt").write_text("\n".join(merges + [merges[1]]) + "\n", encoding="utf-8")
    tok = GPT2BPETokenizer(bpe_dir / "vocab.json", tmp_path / "merges.txt")
    assert tok.engine == "tokenizers"
    assert tok.decode(tok.encode(MULTIBYTE_TEXT)) == MULTIBYTE_TEXT
