"""Nothing in a checkpoint runs code: each reader meets a file crafted to execute code and refuses it.

Each crafted file would create a marker file if unpickled the usual way (checked first, so the
payload is live); every reader must leave the marker absent and say, in one line, which file it
refused. The manifest is re-sealed after each change, as an attacker would: the checksums then
match, and the readers themselves are what is tested.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ckpt_helpers import build_chunks, make_optimizer, tiny_config
from meshtron.checkpoint import CheckpointError, load_checkpoint, load_for_inference, save_checkpoint
from meshtron.checkpoint.convert import convert_main, meshtron_to_hf
from meshtron.checkpoint.dcp_reader import TensorOnlyLoadPlanner, read_dcp_metadata, unpickle_index
from meshtron.cli import main as meshtron_main
from meshtron.data.tokenizers import ByteTokenizer
from meshtron.parallel.context import ParallelContext
from meshtron.training.state import TrainingState
from tamper import CodeRunner, code_running_pickle, reseal, saved_checkpoint

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["--mock-data", "--vocab-size", "256", "--model", "tiny", "--num-layers", "2", "--hidden-size", "64",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--device", "cpu", "--log-interval", "1", "--no-generate-sample", "--eval-interval", "0"]


def test_payload_is_live(tmp_path):
    """The crafted pickle does run code under plain pickle: the tests below would catch a reader that used it."""
    marker = tmp_path / "marker"
    pickle.loads(code_running_pickle(marker))
    assert marker.exists()


def _poison_index(ckpt_dir: Path, marker: Path) -> Path:
    index = ckpt_dir / ".metadata"
    index.write_bytes(code_running_pickle(marker))
    reseal(ckpt_dir)
    return index


def test_restricted_unpickler_refuses_code(tmp_path):
    ckpt, _ = saved_checkpoint(tmp_path / "c")
    md = read_dcp_metadata(ckpt)  # a real index passes
    assert md.state_dict_metadata
    marker = tmp_path / "marker"
    index = _poison_index(ckpt, marker)
    with pytest.raises(CheckpointError) as info:
        read_dcp_metadata(ckpt)
    assert not marker.exists()
    message = str(info.value)
    assert "\n" not in message and str(index) in message and "builtins.exec" in message


def test_index_with_a_bytes_entry_is_refused(tmp_path):
    """A non-tensor entry would reach DCP's planner, which unpickles it with torch.load(weights_only=False)."""
    ckpt, _ = saved_checkpoint(tmp_path / "c")
    md = read_dcp_metadata(ckpt)
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key] = BytesStorageMetadata()
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"\.metadata is not a checkpoint tensor index: it names "
                                              r"torch\.distributed\.checkpoint\.metadata\.BytesStorageMetadata"):
        read_dcp_metadata(ckpt)
    with pytest.raises(CheckpointError, match="stored as bytes"):  # the planner refuses it too
        TensorOnlyLoadPlanner().load_bytes(type("Item", (), {"dest_index": MetadataIndex(key)})(), None)


def test_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    ckpt, _ = saved_checkpoint(tmp_path / "c")
    md = read_dcp_metadata(ckpt)
    index, info = next(iter(md.storage_data.items()))
    info.relative_path = "../../elsewhere.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"names '\.\./\.\./elsewhere\.distcp', not a file inside"):
        read_dcp_metadata(ckpt)


def test_truncated_index_is_one_line(tmp_path):
    ckpt, _ = saved_checkpoint(tmp_path / "c")
    index = ckpt / ".metadata"
    index.write_bytes(index.read_bytes()[:100])
    with pytest.raises(CheckpointError) as info:
        read_dcp_metadata(ckpt)
    assert "\n" not in str(info.value) and str(index) in str(info.value) and "damaged" in str(info.value)
    assert unpickle_index(pickle.dumps(torch.Size([2, 3]))) == torch.Size([2, 3])


def _fresh_model(cfg):
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx, seed=3)
    optimizer, _ = make_optimizer(cfg, chunks)
    return ctx, chunks, optimizer


def test_every_loader_refuses_a_code_running_index(tmp_path):
    ckpt, cfg = saved_checkpoint(tmp_path / "c")
    marker = tmp_path / "marker"
    index = _poison_index(ckpt, marker)
    ctx, chunks, optimizer = _fresh_model(cfg)
    loaders = {
        "load_checkpoint": lambda: load_checkpoint(str(ckpt), chunks, optimizer, ctx, cfg),
        "load_for_inference": lambda: load_for_inference(ckpt),
        "meshtron_to_hf": lambda: meshtron_to_hf(ckpt, tmp_path / "hf"),
    }
    for name, load in loaders.items():
        with pytest.raises(CheckpointError, match=rf"{index}.*builtins\.exec"):
            load()
        assert not marker.exists(), f"{name} ran code from {index}"


def test_code_running_tensor_file_is_refused(tmp_path):
    """An index made of allowed classes that points a tensor at a crafted data file: DCP reads data files with
    torch.load(weights_only=True), which refuses the pickle."""
    ckpt, cfg = saved_checkpoint(tmp_path / "c")
    marker = tmp_path / "marker"
    evil = ckpt / "__9_0.distcp"
    blob = io.BytesIO()
    torch.save(CodeRunner(marker), blob)
    evil.write_bytes(blob.getvalue())
    md = read_dcp_metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path, info.offset, info.length = evil.name, 0, len(blob.getvalue())
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    reseal(ckpt)
    ctx, chunks, optimizer = _fresh_model(cfg)
    with pytest.raises(CheckpointError, match=r"reading tensors from .* failed") as info:
        load_checkpoint(str(ckpt), chunks, optimizer, ctx, cfg)
    assert "weights_only" in str(info.value) or "Unsupported global" in str(info.value)
    assert not marker.exists()


def test_code_running_rng_file_is_refused(tmp_path):
    ckpt, cfg = saved_checkpoint(tmp_path / "c")
    marker = tmp_path / "marker"
    rng = ckpt / "rng" / "rank_00000.pt"
    torch.save({"python": CodeRunner(marker), "numpy": 0, "torch": 0}, rng)
    reseal(ckpt)
    ctx, chunks, optimizer = _fresh_model(cfg)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(ckpt), chunks, optimizer, ctx, cfg)
    assert not marker.exists()
    assert f"{rng} is corrupt or truncated" in str(info.value) and "--no-load-rng" in str(info.value)


def test_code_running_config_is_refused(tmp_path):
    ckpt, cfg = saved_checkpoint(tmp_path / "c")
    marker = tmp_path / "marker"
    config = ckpt / "config.yaml"
    config.write_text(f"hidden_size: !!python/object/apply:os.system ['touch {marker}']\n")
    reseal(ckpt)
    with pytest.raises(CheckpointError, match=rf"{config} is not valid YAML"):
        load_for_inference(ckpt)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Through the command line: train --load, generate --load, convert --to hf.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    """A checkpoint written by ``meshtron train`` (two iterations of a small model)."""
    root = tmp_path_factory.mktemp("cli") / "ckpt"
    assert meshtron_main(["train", *TRAIN, "--train-iters", "2", "--save", str(root)]) == 0
    return root


def _poisoned_copy(cli_checkpoint: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    save = tmp_path / "ckpt"
    shutil.copytree(cli_checkpoint, save)
    marker = tmp_path / "marker"
    return save, _poison_index(save / "iter_0000002", marker), marker


def _one_error_line(stderr: str, named: Path) -> str:
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(named) in errors[0], stderr
    assert "Traceback" not in stderr, stderr
    return errors[0]


@pytest.mark.timeout(120)
def test_cli_train_load_refuses_code(cli_checkpoint, tmp_path):
    save, index, marker = _poisoned_copy(cli_checkpoint, tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", *TRAIN, "--train-iters", "3", "--load",
                           str(save)], capture_output=True, text=True, cwd=REPO, env=env, timeout=110)
    assert proc.returncode == 2, proc.stderr
    assert "builtins.exec" in _one_error_line(proc.stderr, index)
    assert not marker.exists()


def test_cli_generate_and_convert_refuse_code(cli_checkpoint, tmp_path, capsys):
    save, index, marker = _poisoned_copy(cli_checkpoint, tmp_path)
    assert meshtron_main(["generate", "--load", str(save), "--prompt", "hi", "--device", "cpu"]) == 2
    _one_error_line(capsys.readouterr().err, index)
    assert convert_main(["--to", "hf", "--input", str(save), "--output", str(tmp_path / "hf")]) == 2
    _one_error_line(capsys.readouterr().err, index)
    assert not marker.exists()


def test_checkpoint_tokenizer_may_not_name_files_outside_it(tmp_path):
    cfg = tiny_config(vocab_size=258, tokenizer_type="ByteTokenizer")
    ctx = ParallelContext()
    save_checkpoint(str(tmp_path), TrainingState(iteration=1), build_chunks(cfg, ctx), None, ctx, cfg,
                    tokenizer=ByteTokenizer())
    ckpt = tmp_path / "iter_0000001"
    described = ckpt / "tokenizer" / "meshtron_tokenizer.json"
    described.write_text('{"tokenizer_type": "HuggingFaceTokenizer", "path": "/etc/passwd"}')
    reseal(ckpt)
    with pytest.raises(CheckpointError, match=r"path '/etc/passwd' is not a file inside"):
        load_for_inference(ckpt)
