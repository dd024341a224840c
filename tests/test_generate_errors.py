"""`meshtron generate` refuses bad input in one line naming the flag and its valid range (exit 2), and says
when the context ends before --max-new-tokens. The checkpoint load is replaced by a tiny model and a
byte tokenizer (the load itself is tested in tests/checkpoint)."""

from __future__ import annotations

import pytest
import torch

from meshtron.cli import main

CONTEXT = 16


class ByteTokenizer:
    """One token per byte (ids 1-255); 0 is the end of a document."""

    eod = 0

    def encode(self, text: str) -> list[int]:
        return [b or 1 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 or 32 for i in ids).decode(errors="replace")


@pytest.fixture
def loaded(monkeypatch):
    """meshtron.checkpoint.load_for_inference returns a tiny model with a context of CONTEXT positions."""
    import meshtron.checkpoint
    from meshtron.config import ModelConfig
    from meshtron.model import GPTModel
    from meshtron.parallel.context import ParallelContext
    from meshtron.parallel.sharding import initialize_parameters
    from meshtron.presets import apply_preset

    m = ModelConfig()
    apply_preset(m, "tiny")
    m.num_layers, m.seq_length, m.max_position_embeddings = 1, CONTEXT, CONTEXT
    model = GPTModel(m, ParallelContext(), 300)
    initialize_parameters(model, 5, torch.device("cpu"), torch.float32)
    calls = []

    def load(path, device, verify=True):
        calls.append(path)
        return model, ByteTokenizer()

    monkeypatch.setattr(meshtron.checkpoint, "load_for_inference", load)
    return calls


def _generate(capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["generate", "--load", "ckpt", "--device", "cpu", *flags])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flags, names", [
    (["--prompt", ""], ["--prompt", "empty"]),
    (["--prompt", "hi", "--temperature", "nan"], ["--temperature nan", ">= 0"]),
    (["--prompt", "hi", "--temperature", "-1"], ["--temperature -1", ">= 0"]),
    (["--prompt", "hi", "--temperature", "inf"], ["--temperature inf", "finite"]),
    (["--prompt", "hi", "--max-new-tokens", "-1"], ["--max-new-tokens -1", "at least 1"]),
    (["--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens 0", "at least 1"]),
    (["--prompt", "hi", "--top-p", "0"], ["--top-p 0", "(0, 1]"]),
    (["--prompt", "hi", "--top-p", "1.5"], ["--top-p 1.5", "(0, 1]"]),
    (["--prompt", "hi", "--top-p", "nan"], ["--top-p nan", "(0, 1]"]),
    (["--prompt", "hi", "--top-k", "-3"], ["--top-k -3", ">= 0"]),
    (["--prompt", "x" * CONTEXT], ["--prompt is 16 tokens", "context holds 16", f"at most {CONTEXT - 1} tokens"]),
])
def test_bad_input_is_one_line_naming_the_flag(loaded, capsys, flags, names):
    code, out, err = _generate(capsys, *flags)
    lines = err.strip().splitlines()
    assert code == 2 and out == "", (code, out, err)
    assert len(lines) == 1 and all(n in lines[0] for n in names), lines


def test_sampling_flags_are_checked_before_the_checkpoint_is_loaded(loaded, capsys):
    assert _generate(capsys, "--prompt", "hi", "--top-p", "0")[0] == 2
    assert loaded == []


def test_the_context_ending_first_is_noted_and_generation_stops_there(loaded, capsys):
    prompt = "x" * (CONTEXT - 3)
    code, out, err = _generate(capsys, "--prompt", prompt, "--max-new-tokens", "10", "--temperature", "0")
    assert code == 0 and out.startswith(prompt)
    assert "room for 3 new tokens" in err and "--max-new-tokens 10" in err, err
    assert len(out.rstrip("\n")) - len(prompt) <= 3


def test_valid_input_generates_without_a_note(loaded, capsys):
    code, out, err = _generate(capsys, "--prompt", "hi", "--max-new-tokens", "4", "--top-p", "0.9")
    assert code == 0 and out.startswith("hi") and err == "", err
