"""Tokenizers: text <-> token ids, with end-of-document and padding ids.

Kinds (``--tokenizer-type``, Megatron's names):

* ``ByteTokenizer``: the 256 byte values, then end-of-document (256) and padding (257). No file.
* ``HuggingFaceTokenizer``: a local ``tokenizer.json`` or a local pretrained directory
  (``--tokenizer-model PATH``). ``meshtron tokenizer train`` writes one.
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file vocab.json --merge-file merges.txt``.
* ``SentencePieceTokenizer``: a SentencePiece ``.model`` (``--tokenizer-model``; needs ``sentencepiece``).
* ``TikTokenizer``: a tiktoken BPE file, one ``base64(token) rank`` per line (``--tokenizer-model``;
  needs ``tiktoken``), e.g. Llama 3's ``tokenizer.model``.
* ``NullTokenizer``: text is already space-separated ids below ``--vocab-size``; end-of-document is
  ``vocab_size`` (as in Megatron).

Every tokenizer can :meth:`~Tokenizer.save` itself into a directory (which checkpoints carry) and
:func:`load_tokenizer` restores it from there.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Optional, Sequence

from meshtron.data.bpe_engine import FastByteLevelBPE
from meshtron.data.errors import DataError

META_FILE = "meshtron_tokenizer.json"

# Names under which tokenizers commonly keep their end-of-document / padding tokens, most likely first.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")

TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "TikTokenizer", "NullTokenizer")


class Tokenizer(ABC):
    """Common interface of every tokenizer kind."""

    #: Megatron's ``--tokenizer-type`` name of this kind.
    kind: str = ""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (before any padding of the embedding table)."""

    @property
    @abstractmethod
    def eod(self) -> Optional[int]:
        """End-of-document id (None if the tokenizer defines none)."""

    @property
    def pad(self) -> Optional[int]:
        """Padding id (the end-of-document id when the tokenizer has no dedicated one)."""
        return self.eod

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts (kinds with a faster batched path override this)."""
        return [self.encode(t) for t in texts]

    def save(self, directory: str | os.PathLike) -> Path:
        """Write what :func:`load_tokenizer` needs into ``directory``. Returns the directory."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"tokenizer_type": self.kind, **self._save_files(out)}
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return out

    @abstractmethod
    def _save_files(self, out: Path) -> dict[str, Any]:
        """Copy this tokenizer's files into ``out``; return the metadata that names them."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, end-of-document 256, padding 257."""

    kind = "ByteTokenizer"

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return 256

    @property
    def pad(self) -> int:
        return 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def _save_files(self, out: Path) -> dict[str, Any]:
        return {}


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


class NullTokenizer(Tokenizer):
    """Pre-tokenized text: space-separated integer ids ``0 .. vocab_size - 1``.

    As Megatron-Core 0.18 and later: the vocabulary is ``--vocab-size`` ids and the end-of-document id is the last
    of them unless ``--null-tokenizer-eod-id`` names another. (Megatron-Core 0.17 and earlier added one id for
    the end of document: ``--vocab-size N+1 --null-tokenizer-eod-id N`` gives that vocabulary.)
    """

    kind = "NullTokenizer"

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None) -> None:
        if vocab_size is None or vocab_size <= 0:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size N (ids are 0..N-1, end-of-document "
                            "N-1 unless --null-tokenizer-eod-id says otherwise)")
        self._n = int(vocab_size)
        self._eod = self._n - 1 if eod_id is None else int(eod_id)
        if not 0 <= self._eod < self._n:
            raise DataError(f"--null-tokenizer-eod-id {self._eod} is outside the vocabulary 0..{self._n - 1} "
                            f"(--vocab-size {self._n})")

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            bad = next((t for t in text.split() if not _is_int(t)), text)
            raise DataError(f"NullTokenizer: {bad[:40]!r} is not a token id (its text must be space-separated "
                            f"integers below --vocab-size {self._n})") from None
        if ids and (min(ids) < 0 or max(ids) >= self._n):
            bad_id = min(ids) if min(ids) < 0 else max(ids)
            raise DataError(f"NullTokenizer: token id {bad_id} is outside 0..{self._n - 1} (--vocab-size {self._n})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def _save_files(self, out: Path) -> dict[str, Any]:
        return {"vocab_size": self._n, "eod_id": self._eod}


def _hf_encode_batch(tok: Any, texts: Sequence[str]) -> list[list[int]]:
    """Batch encoding with the ``tokenizers`` library, skipping offset tracking where the library can."""
    fast = getattr(tok, "encode_batch_fast", None)  # tokenizers >= 0.21: about 1.5x faster, no offsets
    encodings = (fast or tok.encode_batch)(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings]


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path``; :class:`DataError` naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DataError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise DataError(f"{what} {path} is not UTF-8 text (a corrupt or binary file)") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise DataError(f"{what} {path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _special_from_config(value: Any) -> Optional[str]:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer from a local ``tokenizer.json`` (or a directory holding one).

    A pretrained directory without ``tokenizer.json`` is loaded through ``transformers`` when it is
    installed. End-of-document and padding come from ``tokenizer_config.json`` when present, else
    from well-known token names.
    """

    kind = "HuggingFaceTokenizer"

    def __init__(self, path: str | os.PathLike) -> None:
        p = Path(path).expanduser()
        self.path = p
        self._hf = None  # transformers tokenizer, when loaded that way
        self._tok = None  # tokenizers.Tokenizer
        config: dict = {}
        if p.is_dir():
            if (p / "tokenizer_config.json").is_file():
                config = read_json_object(p / "tokenizer_config.json", "tokenizer config")
            if (p / "tokenizer.json").is_file():
                self._load_json(p / "tokenizer.json")
            else:
                self._load_transformers(p)
        elif p.is_file():
            self._load_json(p)
        else:
            raise DataError(f"--tokenizer-model {p} not found (give a tokenizer.json file or a local "
                            "pretrained tokenizer directory)")
        if self._hf is not None:
            self._eod = self._hf.eos_token_id
            self._pad = self._hf.pad_token_id
        else:
            self._eod = self._find(_special_from_config(config.get("eos_token")), EOD_CANDIDATES)
            self._pad = self._find(_special_from_config(config.get("pad_token")), PAD_CANDIDATES)

    def _load_json(self, file: Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception on parse errors
            raise DataError(f"cannot read tokenizer file {file}: {exc}") from None
        self._json_file = file

    def _load_transformers(self, directory: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(f"{directory} has no tokenizer.json; loading other pretrained tokenizer formats needs "
                            "`pip install transformers`") from None
        try:
            self._hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError... depending on what is missing
            reason = " ".join(str(exc).split())[:200]
            raise DataError(f"--tokenizer-model {directory}: the directory has no tokenizer.json and transformers "
                            f"cannot load it as a pretrained tokenizer ({type(exc).__name__}: {reason}); give a "
                            "tokenizer.json file or a directory holding one") from None

    def _find(self, configured: Optional[str], candidates: Sequence[str]) -> Optional[int]:
        names = ([configured] if configured else []) + list(candidates)
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> Optional[int]:
        return self._eod

    @property
    def pad(self) -> Optional[int]:
        return self._pad if self._pad is not None else self._eod

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._hf is not None:
            return [list(ids) for ids in self._hf(list(texts), add_special_tokens=False)["input_ids"]]
        return _hf_encode_batch(self._tok, texts)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    def _save_files(self, out: Path) -> dict[str, Any]:
        if self._hf is not None:
            self._hf.save_pretrained(str(out / "hf"))
            return {"path": "hf"}
        self._tok.save(str(out / "tokenizer.json"))
        meta: dict[str, Any] = {"path": "tokenizer.json"}
        if self.path.is_dir() and (self.path / "tokenizer_config.json").is_file():
            shutil.copyfile(self.path / "tokenizer_config.json", out / "tokenizer_config.json")
            meta["path"] = "."
        return meta


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt``; end-of-document ``<|endoftext|>``."""

    kind = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> None:
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        for flag, f in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if f is None or not Path(f).is_file():
                raise DataError(f"--tokenizer-type GPT2BPETokenizer needs {flag}: {f} is not a file")
        self.vocab_file, self.merge_file = Path(vocab_file), Path(merge_file)
        try:
            model = models.BPE.from_file(str(vocab_file), str(merge_file))
        except Exception as exc:
            raise DataError(f"cannot read GPT-2 BPE files {vocab_file} / {merge_file}: {exc}") from None
        tok = _HFTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self._eod = tok.token_to_id("<|endoftext|>")
        if self._eod is None:
            raise DataError(f"--vocab-file {vocab_file} has no <|endoftext|> token (GPT-2's end-of-document)")
        # Same ids, about four times faster, when tiktoken is installed (see meshtron.data.bpe_engine).
        self._fast = FastByteLevelBPE.try_build(vocab_file, merge_file)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @property
    def eod(self) -> int:
        return int(self._eod)

    @property
    def engine(self) -> str:
        """Which library encodes: "tiktoken" (fast path) or "tokenizers" (reference)."""
        return "tiktoken" if self._fast is not None else "tokenizers"

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return self._fast.encode_batch(texts)
        return _hf_encode_batch(self._tok, texts)

    def reference_encode(self, text: str) -> list[int]:
        """Encoding by the ``tokenizers`` library, whatever the engine."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def _save_files(self, out: Path) -> dict[str, Any]:
        shutil.copyfile(self.vocab_file, out / "vocab.json")
        shutil.copyfile(self.merge_file, out / "merges.txt")
        return {"vocab_file": "vocab.json", "merge_file": "merges.txt"}


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; end-of-document is its ``</s>`` (or one extra id when it has none)."""

    kind = "SentencePieceTokenizer"

    def __init__(self, model_file: str | os.PathLike) -> None:
        try:
            import sentencepiece as spm
        except ImportError:
            raise DataError("--tokenizer-type SentencePieceTokenizer needs `pip install sentencepiece` "
                            "(or meshtron[sentencepiece])") from None
        if model_file is None or not Path(model_file).is_file():
            raise DataError(f"--tokenizer-type SentencePieceTokenizer needs --tokenizer-model: {model_file} is not a file")
        self.model_file = Path(model_file)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        except Exception as exc:
            raise DataError(f"cannot read SentencePiece model {model_file}: {exc}") from None
        self._n = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        self._extra_eod = eos < 0
        self._eod = self._n if self._extra_eod else eos
        pad = int(self._sp.pad_id())
        self._pad = pad if pad >= 0 else self._eod

    @property
    def vocab_size(self) -> int:
        return self._n + (1 if self._extra_eod else 0)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(x) for x in self._sp.encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) < self._n])

    def _save_files(self, out: Path) -> dict[str, Any]:
        shutil.copyfile(self.model_file, out / "tokenizer.model")
        return {"tokenizer_model": "tokenizer.model"}


# The split pattern of cl100k / Llama 3.
TIKTOKEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_RANKS = 128000


def _llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens, in id order after its 128000 BPE ranks."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(named))]


def read_tiktoken_file(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one ``base64(token) rank`` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:  # the caller checked that it is a file
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:  # also binascii.Error: not base64
                raise DataError(f"{path}:{lineno}: not a tiktoken BPE line (expected 'base64-token rank')") from None
    return ranks


class TikTokenizer(Tokenizer):
    """A tiktoken BPE file with the cl100k/Llama-3 split pattern.

    Special tokens follow the BPE ranks: Llama 3's 256 when the file has exactly Llama 3's 128000
    ranks (end-of-document ``<|end_of_text|>``), otherwise ``<|endoftext|>`` and ``<|pad|>``.
    """

    kind = "TikTokenizer"

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            import tiktoken
        except ImportError:
            raise DataError("--tokenizer-type TikTokenizer needs `pip install tiktoken` (or meshtron[tiktoken])") from None
        if path is None or not Path(path).is_file():
            raise DataError(f"--tokenizer-type TikTokenizer needs --tokenizer-model: {path} is not a file")
        self.path = Path(path)
        ranks = read_tiktoken_file(path)
        n = len(ranks)
        if n == LLAMA3_NUM_RANKS:
            names, eod_name, pad_name = _llama3_special_tokens(), "<|end_of_text|>", "<|finetune_right_pad_id|>"
        else:
            names, eod_name, pad_name = ["<|endoftext|>", "<|pad|>"], "<|endoftext|>", "<|pad|>"
        specials = {name: n + i for i, name in enumerate(names)}
        self._enc = tiktoken.Encoding(name=f"meshtron-{self.path.name}", pat_str=TIKTOKEN_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self._eod, self._pad = specials[eod_name], specials[pad_name]

    @property
    def vocab_size(self) -> int:
        return int(self._enc.n_vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def _save_files(self, out: Path) -> dict[str, Any]:
        shutil.copyfile(self.path, out / "tokenizer.tiktoken")
        return {"tokenizer_model": "tokenizer.tiktoken"}


def _infer_type(tokenizer_model: Optional[str], vocab_file: Optional[str], merge_file: Optional[str]) -> Optional[str]:
    """Guess the tokenizer kind from the files given, when --tokenizer-type is not."""
    if vocab_file and merge_file:
        return "GPT2BPETokenizer"
    if tokenizer_model:
        p = Path(tokenizer_model)
        if p.is_dir() or p.suffix == ".json":
            return "HuggingFaceTokenizer"
        if p.suffix == ".tiktoken":
            return "TikTokenizer"
        if p.suffix == ".model":
            if not p.is_file():
                raise DataError(f"--tokenizer-model {p} not found (a SentencePiece or tiktoken .model file)")
            # Llama 3 ships a tiktoken file named tokenizer.model; SentencePiece models are binary protobufs.
            with open(p, "rb") as f:
                head = f.read(64)
            try:
                token, rank = head.split(b"\n", 1)[0].split()
                base64.b64decode(token, validate=True)
                int(rank)
                return "TikTokenizer"
            except ValueError:
                return "SentencePieceTokenizer"
    return None


def build_tokenizer(tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    vocab_size: Optional[int] = None, null_eod_id: Optional[int] = None) -> Tokenizer:
    """A tokenizer from Megatron-style flags; the kind is inferred from the files when not given.

    ``vocab_size`` and ``null_eod_id`` (``--null-tokenizer-eod-id``) size NullTokenizer only."""
    kind = tokenizer_type or _infer_type(tokenizer_model, vocab_file, merge_file)
    if kind is None:
        raise DataError("no tokenizer: give --tokenizer-type (one of " + ", ".join(TOKENIZER_TYPES) + ") with "
                        "--tokenizer-model, or --vocab-file and --merge-file")
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size, null_eod_id)
    if kind == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise DataError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or a "
                            "local pretrained directory)")
        return HuggingFaceTokenizer(tokenizer_model)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if kind == "TikTokenizer":
        return TikTokenizer(tokenizer_model)
    raise DataError(f"unknown --tokenizer-type {kind!r}; valid: {', '.join(TOKENIZER_TYPES)}")


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Restore a tokenizer written by :meth:`Tokenizer.save`."""
    d = Path(directory)
    meta_file = d / META_FILE
    if not meta_file.is_file():
        raise DataError(f"{d} holds no saved tokenizer ({META_FILE} is missing)")
    meta = read_json_object(meta_file, "saved tokenizer description")
    kind = meta.get("tokenizer_type")
    if kind not in TOKENIZER_TYPES:
        raise DataError(f"{meta_file}: tokenizer_type is {kind!r}; valid: {', '.join(TOKENIZER_TYPES)}")
    files = {k: meta.get(k) for k in ("tokenizer_model", "path", "vocab_file", "merge_file")}
    vocab_size, eod_id = meta.get("vocab_size"), meta.get("eod_id")
    if any(v is not None and not isinstance(v, str) for v in files.values()) or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (vocab_size, eod_id)):
        raise DataError(f"{meta_file} is corrupt: file names must be strings, vocab_size and eod_id integers")
    if kind == "NullTokenizer" and eod_id is None and vocab_size is not None:
        # Saved before the end-of-document id was recorded: then the vocabulary was vocab_size ids plus it.
        vocab_size, eod_id = vocab_size + 1, vocab_size

    def rel(key: str) -> Optional[str]:
        return str(d / files[key]) if files[key] is not None else None

    return build_tokenizer(kind, tokenizer_model=rel("tokenizer_model") or rel("path"),
                           vocab_file=rel("vocab_file"), merge_file=rel("merge_file"), vocab_size=vocab_size,
                           null_eod_id=eod_id)


def tokenizer_from_config(data_cfg: Any, vocab_size: Optional[int] = None) -> Tokenizer:
    """A tokenizer from a :class:`meshtron.config.DataConfig` (``vocab_size`` for NullTokenizer)."""
    return build_tokenizer(data_cfg.tokenizer_type, data_cfg.tokenizer_model, data_cfg.vocab_file,
                           data_cfg.merge_file, vocab_size, data_cfg.null_tokenizer_eod_id)
