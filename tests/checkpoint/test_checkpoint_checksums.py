"""Corrupt checkpoints are refused with the file named: flipped bytes, truncated, deleted, an edited manifest.

Also: the checksums the writer streams equal the files' own, ``--no-verify-checkpoint`` loads a damaged
checkpoint (which shows the damage was real), old checkpoints without checksums load with a warning, and
several ranks share the checking.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ckpt_helpers import build_chunks, canonical_state, make_optimizer, run_ranks, tiny_config
from meshtron.checkpoint import CheckpointError, load_checkpoint, load_for_inference, save_checkpoint
from meshtron.checkpoint.checksums import FILES_KEY, SEAL_KEY, crc32_file, share_of
from meshtron.checkpoint.convert import convert_main
from meshtron.checkpoint.metadata import META_FILE
from meshtron.parallel.context import ParallelContext
from meshtron.training.state import TrainingState
from tamper import flip_tensor_byte, saved_checkpoint, stored_tensor_and_file

KEY = "model.layers.0.attention.q.weight"


def _load(ckpt, cfg, **kwargs):
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx, seed=9)
    optimizer, _ = make_optimizer(cfg, chunks)
    state = load_checkpoint(str(ckpt), chunks, optimizer, ctx, cfg, **kwargs)
    return state, canonical_state(chunks, optimizer)


def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    ckpt, _ = saved_checkpoint(tmp_path)
    meta = json.loads((ckpt / META_FILE).read_text())
    files = meta[FILES_KEY]
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {META_FILE}
    assert set(files) == on_disk and meta["version"] == 2 and SEAL_KEY in meta
    for name, entry in files.items():  # streamed while writing = read back from disk
        assert crc32_file(ckpt / name) == (entry["bytes"], entry["crc32"]), name


def test_flipped_tensor_byte_is_refused_and_loads_without_verification(tmp_path):
    ckpt, cfg = saved_checkpoint(tmp_path)
    clean = dict(load_for_inference(ckpt)[0].named_parameters())
    data_file, saved = stored_tensor_and_file(ckpt, KEY)
    flip_tensor_byte(data_file, saved)
    with pytest.raises(CheckpointError) as info:
        _load(ckpt, cfg)
    message = str(info.value)
    assert "\n" not in message and f"{data_file} does not match its checksum" in message
    assert "--no-verify-checkpoint" in message
    # The zip structure is intact: without verification it loads, with a changed weight.
    damaged = dict(load_for_inference(ckpt, verify=False)[0].named_parameters())
    changed = [n for n in clean if not torch.equal(clean[n], damaged[n])]
    assert len(changed) == 1 and "layers.0" in changed[0], changed
    cfg.checkpoint.no_verify_checkpoint = True  # --no-verify-checkpoint reaches load_checkpoint through cfg
    assert _load(ckpt, cfg)[0].iteration == 1


@pytest.mark.parametrize("damage", ["truncate", "delete", "extend"])
def test_truncated_deleted_or_grown_shard_is_refused(tmp_path, damage):
    ckpt, cfg = saved_checkpoint(tmp_path)
    shard = sorted(ckpt.glob("*.distcp"))[-1]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        expected = f"{shard} has {shard.stat().st_size} bytes, the checkpoint recorded"
    elif damage == "delete":
        shard.unlink()
        expected = f"{shard} is missing"
    else:
        shard.write_bytes(shard.read_bytes() + b"\0")
        expected = f"{shard} has {shard.stat().st_size} bytes"
    with pytest.raises(CheckpointError, match=expected):
        _load(ckpt, cfg)


@pytest.mark.parametrize("edit", ["progress", "checksum", "seal"])
def test_edited_manifest_is_refused(tmp_path, edit):
    ckpt, cfg = saved_checkpoint(tmp_path)
    f = ckpt / META_FILE
    meta = json.loads(f.read_text())
    if edit == "progress":
        meta["training_state"]["consumed_samples"] = 12345
    elif edit == "checksum":
        meta[FILES_KEY]["__0_0.distcp"]["crc32"] = "00000000"
    else:
        del meta[SEAL_KEY]
    f.write_text(json.dumps(meta, indent=2))
    with pytest.raises(CheckpointError, match=rf"{f} does not match its own checksum"):
        _load(ckpt, cfg)
    assert _load(ckpt, cfg, verify=False)[0].iteration == 1


def test_damaged_rng_and_config_are_caught_by_their_checksums(tmp_path):
    ckpt, cfg = saved_checkpoint(tmp_path)
    rng = ckpt / "rng" / "rank_00000.pt"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 1
    rng.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{rng} does not match its checksum"):
        _load(ckpt, cfg)
    config = ckpt / "config.yaml"
    config.write_text(config.read_text().replace("hidden_size: 32", "hidden_size: 48"))
    with pytest.raises(CheckpointError, match=r"does not match its checksum"):
        load_for_inference(ckpt)


def test_checkpoint_without_checksums_loads_with_a_warning(tmp_path, caplog):
    ckpt, cfg = saved_checkpoint(tmp_path)
    f = ckpt / META_FILE
    meta = json.loads(f.read_text())
    for key in (FILES_KEY, SEAL_KEY, "checksum_algorithm"):
        meta.pop(key)
    meta["version"] = 1  # as written before checksums were recorded
    f.write_text(json.dumps(meta, indent=2))
    with caplog.at_level(logging.WARNING, logger="meshtron.checkpoint.verify"):
        assert _load(ckpt, cfg)[0].iteration == 1
    warnings = [r.getMessage() for r in caplog.records if "records no checksums" in r.getMessage()]
    assert len(warnings) == 1 and str(ckpt) in warnings[0] and "\n" not in warnings[0]


def test_convert_refuses_a_corrupt_checkpoint(tmp_path, capsys):
    ckpt, _ = saved_checkpoint(tmp_path / "c")
    data_file, saved = stored_tensor_and_file(ckpt, KEY)
    flip_tensor_byte(data_file, saved)
    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{data_file} does not match its checksum" in err and len(err.strip().splitlines()) == 1
    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(tmp_path / "hf2"),
                         "--no-verify-checkpoint"]) == 0


def test_share_of_covers_every_file_once():
    files = {f"f{i}": {"bytes": size, "crc32": "0"} for i, size in enumerate([9, 1, 5, 5, 3, 0, 7])}
    shares = [share_of(files, r, 3) for r in range(3)]
    assert sorted(n for s in shares for n in s) == sorted(files)
    loads = [sum(files[n]["bytes"] for n in s) for s in shares]
    assert max(loads) - min(loads) <= 9


def _two_rank_worker(rank: int, world: int, root: str) -> str:
    import torch.distributed as dist

    from meshtron.parallel.context import build_groups

    cfg = tiny_config(num_layers=2)
    ctx = build_groups(1, 1, 1, 1, torch.device("cpu"))
    chunks = build_chunks(cfg, ctx)
    optimizer, _ = make_optimizer(cfg, chunks)
    save_checkpoint(root, TrainingState(iteration=1), chunks, optimizer, ctx, cfg)
    dist.barrier()
    ckpt = f"{root}/iter_0000001"
    if rank == 0:  # damage the file that rank 1 checks: the error must reach rank 0 too
        meta = json.loads(open(f"{ckpt}/{META_FILE}").read())
        victim = share_of(meta[FILES_KEY], 1, world)[0]
        with open(f"{ckpt}/{victim}", "r+b") as f:
            f.seek(10)
            byte = f.read(1)
            f.seek(10)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        load_checkpoint(root, chunks, optimizer, ctx, cfg)
    except CheckpointError as err:
        return str(err)
    return "loaded"


@pytest.mark.timeout(120)
def test_ranks_share_the_check_and_agree(tmp_path):
    results = run_ranks(_two_rank_worker, 2, str(tmp_path / "ckpt"), timeout=100)
    assert results[0] == results[1] and "does not match its checksum" in results[0], results
