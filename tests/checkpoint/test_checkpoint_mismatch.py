"""Loading a checkpoint of another model fails before touching any weight, listing every difference."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_helpers import build_chunks, canonical_state, make_optimizer, tiny_config
from meshtron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from meshtron.training.state import TrainingState


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx)
    optimizer, _ = make_optimizer(cfg, chunks)
    save_checkpoint(str(path), TrainingState(iteration=5), chunks, optimizer, ctx, cfg)
    return path


def _load_error(path, vocab=100, **overrides) -> tuple[CheckpointError, dict, dict]:
    cfg = tiny_config(**overrides)
    ctx = ParallelContext()
    model = GPTModel(cfg.model, ctx, vocab)
    initialize_parameters(model, 9, torch.device("cpu"), torch.float32)
    optimizer, _ = make_optimizer(cfg, [model])
    before = canonical_state([model])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(path), [model], optimizer, ctx, cfg)
    return info.value, before, canonical_state([model])


def test_shape_fields_are_listed_and_weights_untouched(saved):
    err, before, after = _load_error(saved, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128)
    lines = err.differences
    assert "hidden_size (--hidden-size): checkpoint 32, this run 64" in lines
    assert "num_attention_heads (--num-attention-heads): checkpoint 4, this run 8" in lines
    assert "ffn_hidden_size (--ffn-hidden-size): checkpoint 64, this run 128" in lines
    # The tensors that follow, one line per kind of tensor (layers grouped).
    assert "tensor layers.*.attention.q.weight: checkpoint shape (32, 32), this model (64, 64) (layers 0-3)" in lines
    assert len(lines) == 3 + 12
    assert "does not match this model" in str(err)
    for name in before:
        assert torch.equal(before[name], after[name])


def test_vocab_normalization_and_untied_output(saved):
    err, _, _ = _load_error(saved, vocab=99, normalization="LayerNorm", untie_embeddings_and_output_weights=False)
    text = "\n".join(err.differences)
    assert "vocab_size (--vocab-size): checkpoint 100, this run 99" in text
    assert "normalization (--normalization): checkpoint 'RMSNorm', this run 'LayerNorm'" in text
    assert "untie_embeddings_and_output_weights" in text
    assert "tensor output.weight (100, 32) is in the checkpoint but not in this model" in text
    assert "tensor layers.*.input_norm.bias (32,) is missing from the checkpoint (layers 0-3)" in text
    assert "tensor final_norm.bias (32,) is missing from the checkpoint" in text


def test_missing_tensors_without_field_differences(tmp_path):
    """A checkpoint of the first pipeline stage alone lacks the final norm and output layer."""
    cfg = tiny_config()
    ctx = ParallelContext()
    stage = GPTModel(cfg.model, ctx, 100, layer_ids=[0, 1, 2, 3], post_process=False)
    initialize_parameters(stage, 1, torch.device("cpu"), torch.float32)
    save_checkpoint(str(tmp_path), TrainingState(iteration=1), [stage], None, ctx, cfg)
    err, _, _ = _load_error(tmp_path)
    assert err.differences == ["tensor final_norm.weight (32,) is missing from the checkpoint",
                               "tensor output.weight (100, 32) is missing from the checkpoint"]


def test_broken_checkpoints_give_clear_errors(saved, tmp_path):
    cfg = tiny_config()
    ctx = ParallelContext()
    chunks = build_chunks(cfg, ctx)
    (tmp_path / "latest").write_text("12\n")
    with pytest.raises(CheckpointError, match="names iteration 12, but .*iter_0000012 is missing"):
        load_checkpoint(str(tmp_path), chunks, None, ctx, cfg)
    (tmp_path / "latest").write_text("twelve\n")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        load_checkpoint(str(tmp_path), chunks, None, ctx, cfg)

    meta_file = saved / "iter_0000005" / "meshtron_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    try:
        meta_file.write_text(json.dumps({**meta, "version": 99}))
        with pytest.raises(CheckpointError, match="unsupported checkpoint format"):
            load_checkpoint(str(saved), chunks, None, ctx, cfg)
    finally:
        meta_file.write_text(json.dumps(meta))
    assert load_checkpoint(str(saved), chunks, None, ctx, cfg).iteration == 5
