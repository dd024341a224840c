"""Checkpoint problems are one clear line, never a traceback: a full disk during a save (synchronous and
asynchronous), a failing writer thread, damaged RNG/config/tokenizer files, damaged Hugging Face inputs."""

from __future__ import annotations

import errno
import json
import pathlib
import re

import pytest
import torch

from ckpt_helpers import build_chunks, tiny_config
from meshtron.checkpoint import CheckpointError, finalize_async_saves, load_checkpoint, load_for_inference
from meshtron.checkpoint import save_checkpoint
from meshtron.checkpoint import layout as ckpt_layout
from meshtron.checkpoint.convert import convert_main
from meshtron.checkpoint.errors import CheckpointSaveError
from meshtron.checkpoint.layout import list_iterations, read_latest
from meshtron.data.tokenizers import ByteTokenizer
from meshtron.parallel.context import ParallelContext
from meshtron.training.state import TrainingState
from tamper import reseal


class FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written, like a real full disk."""

    def __init__(self, real, room: int, path):
        self._real, self._room, self._path = real, room, str(path)

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._room:
            raise OSError(errno.ENOSPC, "No space left on device", self._path)
        self._room -= n
        return self._real.write(data)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()


def fill_disk_for(monkeypatch, suffix: str, room: int = 1000) -> None:
    """Make files whose name ends with ``suffix`` (opened for writing through pathlib, as DCP does) hit a full
    disk after ``room`` bytes."""
    real_open = pathlib.Path.open

    def open_(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return FullDisk(f, room, self) if "w" in mode and self.name.endswith(suffix) else f

    monkeypatch.setattr(pathlib.Path, "open", open_)


def _save_fails(path, cfg, ctx, chunks, optimizer, use_async: bool) -> str:
    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(str(path), TrainingState(iteration=2), chunks, optimizer, ctx, cfg, async_save=use_async)
        if use_async:  # the background failure surfaces at the next wait
            finalize_async_saves()
    return str(info.value)


def _previous_kept(path, cfg, ctx, chunks, optimizer) -> None:
    assert read_latest(path) == 1 and list_iterations(path) == [1]
    assert not list(path.glob("*.tmp")), "the partial checkpoint directory was left behind"
    assert load_checkpoint(str(path), chunks, optimizer, ctx, cfg).iteration == 1


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", [".distcp", ".metadata.tmp", "rank_00000.pt"], ids=["data", "index", "rng"])
def test_disk_full_during_save(first_checkpoint, monkeypatch, capfd, use_async, where):
    path, cfg, ctx, chunks, optimizer = first_checkpoint
    if where == "rank_00000.pt":  # written by meshtron itself, not through DCP
        real = ckpt_layout.write_file_durable

        def write(f, data):
            if str(f).endswith(where):
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            real(f, data)

        monkeypatch.setattr(ckpt_layout, "write_file_durable", write)
    else:
        fill_disk_for(monkeypatch, where)
    capfd.readouterr()
    message = _save_fails(path, cfg, ctx, chunks, optimizer, use_async)
    assert "\n" not in message, message
    assert "no space left on device" in message and "the checkpoint needs about" in message
    assert re.search(r"needs about \d+\.\d kB in .*, [\d.]+ [kMGT]?B free there", message), message  # ~1 MB
    assert "removed the partial iter_0000002.tmp" in message and "still iteration 1" in message
    err = capfd.readouterr().err
    assert "Traceback" not in err and "unexpected pos" not in err, err
    monkeypatch.undo()
    _previous_kept(path, cfg, ctx, chunks, optimizer)


def test_failing_writer_thread_fails_the_save(first_checkpoint, monkeypatch, capfd):
    """DCP's own writer threads die with a traceback and leave their file out of the index; here the failure
    fails the save."""
    path, cfg, ctx, chunks, optimizer = first_checkpoint
    real_open = pathlib.Path.open

    def open_(self, mode="r", *args, **kwargs):
        if "w" in mode and self.name == "__0_1.distcp":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    message = _save_fails(path, cfg, ctx, chunks, optimizer, False)
    assert "__0_1.distcp: Permission denied" in message and "still iteration 1" in message
    assert "Traceback" not in capfd.readouterr().err
    monkeypatch.undo()
    _previous_kept(path, cfg, ctx, chunks, optimizer)


def _checkpoint_with_tokenizer(root):
    cfg = tiny_config(vocab_size=258, tokenizer_type="ByteTokenizer")
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx)
    save_checkpoint(str(root), TrainingState(iteration=3), chunks, None, ctx, cfg, tokenizer=ByteTokenizer())
    return root / "iter_0000003", cfg, ctx


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_rng_file_is_one_line(first_checkpoint, damage):
    path, cfg, ctx, chunks, optimizer = first_checkpoint
    rng = path / "iter_0000001" / "rng" / "rank_00000.pt"
    data = rng.read_bytes()
    rng.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x93NUMPY" * 50, "empty": b""}[damage])
    reseal(path / "iter_0000001")  # past the checksums: the reader itself must cope
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(path), chunks, optimizer, ctx, cfg)
    summary = info.value.summary + " ".join(info.value.differences)
    assert f"{rng} is corrupt or truncated" in summary and "--no-load-rng" in summary
    assert load_checkpoint(str(path), chunks, optimizer, ctx, cfg, load_rng=False).iteration == 1


@pytest.mark.parametrize("text", ["hidden_size: [unclosed\n", "- just\n- a list\n", "hidden_size: lots\n"],
                         ids=["invalid", "not-a-mapping", "wrong-type"])
def test_damaged_config_is_one_line(first_checkpoint, text):
    path = first_checkpoint[0]
    config = path / "iter_0000001" / "config.yaml"
    config.write_text(text)
    with pytest.raises(CheckpointError) as info:
        load_for_inference(path, verify=False)
    assert str(config) in str(info.value) and "\n" not in str(info.value)


def test_damaged_manifest_json_is_one_line(first_checkpoint):
    path, cfg, ctx, chunks, optimizer = first_checkpoint
    manifest = path / "iter_0000001" / "meshtron_checkpoint.json"
    manifest.write_text(manifest.read_text()[:50])
    with pytest.raises(CheckpointError, match=rf"{manifest} is not valid JSON") as info:
        load_checkpoint(str(path), chunks, optimizer, ctx, cfg)
    assert "\n" not in str(info.value)


def test_damaged_tokenizer_in_checkpoint_is_one_line(tmp_path, capsys):
    ckpt, _, _ = _checkpoint_with_tokenizer(tmp_path / "c")
    tok_meta = next((ckpt / "tokenizer").glob("*.json"))
    tok_meta.write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"is corrupt: {tok_meta} has 9 bytes"):
        load_for_inference(ckpt)
    with pytest.raises(CheckpointError, match=rf"the checkpoint's tokenizer {ckpt / 'tokenizer'} cannot be read"):
        load_for_inference(ckpt, verify=False)
    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(tmp_path / "hf"),
                         "--no-verify-checkpoint"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer" in err[0] and "cannot be read" in err[0], err


# ---------------------------------------------------------------------------------------------
# meshtron convert --from hf: damaged Hugging Face inputs.
# ---------------------------------------------------------------------------------------------

HF_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                 intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                 hidden_act="silu")


def _hf_dir(root):
    from safetensors.torch import save_file

    root.mkdir()
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g), "model.norm.weight": torch.ones(32)}
    p = "model.layers.0."
    for name, shape in (("self_attn.q_proj.weight", (32, 32)), ("self_attn.k_proj.weight", (16, 32)),
                        ("self_attn.v_proj.weight", (16, 32)), ("self_attn.o_proj.weight", (32, 32)),
                        ("mlp.gate_proj.weight", (64, 32)), ("mlp.up_proj.weight", (64, 32)),
                        ("mlp.down_proj.weight", (32, 64)), ("input_layernorm.weight", (32,)),
                        ("post_attention_layernorm.weight", (32,))):
        tensors[p + name] = torch.randn(*shape, generator=g)
    save_file(tensors, str(root / "model.safetensors"))
    return root


def _convert_error(capsys, src, out) -> str:
    assert convert_main(["--from", "hf", "--input", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_hf_conversion_works_on_the_undamaged_directory(tmp_path):
    assert convert_main(["--from", "hf", "--input", str(_hf_dir(tmp_path / "hf")), "--output",
                         str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_safetensors_is_one_line(tmp_path, capsys, damage):
    src = _hf_dir(tmp_path / "hf")
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\xff" * 4096, "empty": b""}[damage])
    line = _convert_error(capsys, src, tmp_path / "out")
    assert f"{weights} is not a readable safetensors file" in line


@pytest.mark.parametrize("text, expected", [
    ('{"model_type": "llama", ', "is not valid JSON"),
    ('["a", "list"]', "holds a JSON list"),
    (json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}), "has no 'hidden_size'"),
    (json.dumps({**HF_CONFIG, "num_attention_heads": "many"}), "holds a value of the wrong type"),
], ids=["invalid", "list", "missing-key", "wrong-type"])
def test_damaged_hf_config_is_one_line(tmp_path, capsys, text, expected):
    src = _hf_dir(tmp_path / "hf")
    (src / "config.json").write_text(text)
    line = _convert_error(capsys, src, tmp_path / "out")
    assert str(src / "config.json") in line and expected in line


def test_damaged_hf_index_is_one_line(tmp_path, capsys):
    src = _hf_dir(tmp_path / "hf")
    (src / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../../etc/passwd"}}')
    line = _convert_error(capsys, src, tmp_path / "out")
    assert "model.safetensors.index.json names '../../etc/passwd'" in line


# ---------------------------------------------------------------------------------------------
# More of the same kind.
# ---------------------------------------------------------------------------------------------

def test_load_naming_a_file_is_refused(first_checkpoint):
    path, cfg, ctx, chunks, optimizer = first_checkpoint
    not_a_dir = path / "iter_0000001" / "config.yaml"
    with pytest.raises(CheckpointError, match=rf"{not_a_dir} is a file, not a checkpoint directory"):
        load_checkpoint(str(not_a_dir), chunks, optimizer, ctx, cfg)


def test_unreadable_checkpoint_file_is_one_line(first_checkpoint, monkeypatch):
    path, cfg, ctx, chunks, optimizer = first_checkpoint
    from meshtron.checkpoint import checksums

    real = checksums.crc32_file

    def crc32_file(p):
        if str(p).endswith("__0_0.distcp"):
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real(p)

    monkeypatch.setattr(checksums, "crc32_file", crc32_file)  # a file checked whole before the load
    from meshtron.checkpoint import dcp_reader

    def open_(p, *args, **kwargs):  # a file whose items are checked as the load reads them
        if str(p).endswith("__0_0.distcp"):
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return open(p, *args, **kwargs)

    monkeypatch.setattr(dcp_reader, "open", open_, raising=False)
    with pytest.raises(CheckpointError, match=r"is corrupt: cannot read .*__0_0\.distcp: Permission denied") as info:
        load_checkpoint(str(path), chunks, optimizer, ctx, cfg)
    assert "\n" not in str(info.value)


def test_export_to_a_full_disk_removes_the_partial_export(first_checkpoint, monkeypatch, capsys):
    path = first_checkpoint[0]
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = path.parent / "exported"
    assert convert_main(["--to", "hf", "--input", str(path), "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on device" in err[0] and "needs about" in err[0], err
    assert not out.exists()
