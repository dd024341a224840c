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
    """Megatron-Core 0.18+'s NullTokenizer: --vocab-size ids, the last one the end of document by default."""
    tok = NullTokenizer(100)
    assert tok.encode("3 14 15") == [3, 14, 15]
    assert tok.decode([3, 14]) == "3 14"
    assert (tok.vocab_size, tok.eod) == (100, 99)
    assert NullTokenizer(101, eod_id=100).eod == 100  # Megatron-Core <= 0.17's vocabulary, spelt out
    with pytest.raises(DataError, match="token id 100 is outside 0..99"):
        tok.encode("3 100")
    with pytest.raises(DataError, match="--null-tokenizer-eod-id 100 is outside"):
        NullTokenizer(100, eod_id=100)
    with pytest.raises(DataError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_null_tokenizer_equals_megatron_core():
    from tests.megatron_oracle import null_tokenizer_class  # noqa: PLC0415 (skips without megatron-core)

    megatron_null = null_tokenizer_class()
    for size, eod in ((100, None), (2048, None), (101, 100), (64, 0)):
        ours, theirs = NullTokenizer(size, eod), megatron_null(size, eod_id=eod)
        assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod)
        assert ours.encode("0 7 63") == theirs.text_to_ids("0 7 63")


def test_null_tokenizer_saved_without_its_eod_id_keeps_its_old_vocabulary(tmp_path):
    """A NullTokenizer saved before the end-of-document id was recorded had vocab_size + 1 ids."""
    (tmp_path / "meshtron_tokenizer.json").write_text('{"tokenizer_type": "NullTokenizer", "vocab_size": 100}')
    old = load_tokenizer(tmp_path)
    assert (old.vocab_size, old.eod) == (101, 100)
    NullTokenizer(100, eod_id=7).save(tmp_path / "new")
    new = load_tokenizer(tmp_path / "new")
    assert (new.vocab_size, new.eod) == (100, 7)


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


def _copy_of(bpe_dir, tmp_path):
    import shutil

    out = tmp_path / "tok"
    shutil.copytree(bpe_dir, out)
    return out


@pytest.mark.parametrize("case, message", [
    ("config_not_json", r"tokenizer config .*tokenizer_config.json is not valid JSON \(.* at line 1, column 2\)"),
    ("config_not_object", r"tokenizer config .*tokenizer_config.json must hold a JSON object, not a list"),
    ("config_not_utf8", r"tokenizer config .*tokenizer_config.json is not UTF-8 text"),
    ("no_tokenizer_json", r"--tokenizer-model .*: the directory has no tokenizer.json and transformers cannot load it"),
    ("tokenizer_json_corrupt", r"cannot read tokenizer file .*tokenizer.json"),
    ("vocab_corrupt", r"cannot read GPT-2 BPE files .*vocab.json / .*merges.txt"),
    ("vocab_not_object", r"cannot read GPT-2 BPE files .*Bad vocabulary json file"),
    ("merges_corrupt", r"cannot read GPT-2 BPE files .*Merges text file invalid at line"),
    ("merges_binary", r"cannot read GPT-2 BPE files .*UTF-8"),
    ("missing_model_file", r"--tokenizer-model .*missing.model not found"),
    ("tiktoken_not_base64", r"x.tiktoken:2: not a tiktoken BPE line"),
    ("saved_meta_corrupt", r"saved tokenizer description .*meshtron_tokenizer.json is not valid JSON"),
    ("saved_meta_no_type", r"meshtron_tokenizer.json: tokenizer_type is None; valid: ByteTokenizer"),
    ("saved_meta_bad_field", r"meshtron_tokenizer.json is corrupt: file names must be strings"),
])
def test_corrupt_tokenizer_files_give_one_line_errors(bpe_dir, tmp_path, case, message):
    tok = _copy_of(bpe_dir, tmp_path)
    call = lambda: build_tokenizer("HuggingFaceTokenizer", str(tok))  # noqa: E731
    gpt2 = lambda: build_tokenizer("GPT2BPETokenizer", vocab_file=str(tok / "vocab.json"),  # noqa: E731
                                   merge_file=str(tok / "merges.txt"))
    if case == "config_not_json":
        (tok / "tokenizer_config.json").write_text("{oops")
    elif case == "config_not_object":
        (tok / "tokenizer_config.json").write_text("[1, 2]")
    elif case == "config_not_utf8":
        (tok / "tokenizer_config.json").write_bytes(b"\xff\xfe\x00{")
    elif case == "no_tokenizer_json":
        pytest.importorskip("transformers")
        (tok / "tokenizer.json").unlink()
    elif case == "tokenizer_json_corrupt":
        (tok / "tokenizer.json").write_text('{"truncated": ')
    elif case == "vocab_corrupt":
        (tok / "vocab.json").write_text("{oops")
        call = gpt2
    elif case == "vocab_not_object":
        (tok / "vocab.json").write_text("[1, 2, 3]")
        call = gpt2
    elif case == "merges_corrupt":
        (tok / "merges.txt").write_text("#version: 0.2\na b c\n")
        call = gpt2
    elif case == "merges_binary":
        (tok / "merges.txt").write_bytes(b"\xff\xfe\x00 garbage\n")
        call = gpt2
    elif case == "missing_model_file":
        call = lambda: build_tokenizer(None, str(tmp_path / "missing.model"))  # noqa: E731
    elif case == "tiktoken_not_base64":
        pytest.importorskip("tiktoken")
        (tmp_path / "x.tiktoken").write_bytes(b"YQ== 0\n\xff\xfe 1\n")
        call = lambda: build_tokenizer("TikTokenizer", str(tmp_path / "x.tiktoken"))  # noqa: E731
    elif case.startswith("saved_meta"):
        saved = ByteTokenizer().save(tmp_path / "saved")
        text = {"saved_meta_corrupt": "{oops", "saved_meta_no_type": '{"path": "."}',
                "saved_meta_bad_field": '{"tokenizer_type": "NullTokenizer", "vocab_size": "many"}'}[case]
        (saved / "meshtron_tokenizer.json").write_text(text)
        call = lambda: load_tokenizer(saved)  # noqa: E731
    with pytest.raises(DataError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_null_tokenizer_refuses_text_that_is_not_ids():
    tok = NullTokenizer(10)
    assert tok.encode(" 1 2\n9 ") == [1, 2, 9]
    with pytest.raises(DataError, match="'x' is not a token id"):
        tok.encode("1 2 x")
    with pytest.raises(DataError, match="token id 10 is outside 0..9"):
        tok.encode("1 10")
    with pytest.raises(DataError, match="token id -1 is outside"):
        tok.encode("-1 3")


def test_training_a_tokenizer_on_no_text_is_an_error(tmp_path, capsys):
    data = tmp_path / "in.jsonl"
    data.write_text('{"content": "abc"}\n{"text": ""}\n')
    assert tokenizer_main(["train", "--input", str(data), "--vocab-size", "300", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--input {data}: no document has text under --json-keys text (skipped 1 without key text)" in err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()
