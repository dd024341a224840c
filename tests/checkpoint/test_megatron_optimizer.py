"""The distributed optimizer's state of Megatron-LM checkpoints in megatron-core's bucket layout, read by meshtron.

``dense_tp2pp2_dp2_dp_reshardable`` was written by megatron-core 0.19.2's own ``DistributedOptimizer``
(tests/fixtures/megatron/make_checkpoints.py ``--optimizer``): TP=2 x PP=2 x DP=2, ``--overlap-grad-reduce`` with
buckets of 1500 elements, its state saved in the ``dp_reshardable`` format (Megatron-LM's default). The same
optimizer saved in the ``fully_reshardable`` format (megatron-core mapping its buckets to the model's tensors
itself) is ``reference_optimizer.pt``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.megatron import buckets, find_megatron_checkpoint, reader
from meshtron.checkpoint.megatron.reader import read_megatron

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
CASE = "dense_tp2pp2_dp2_dp_reshardable"


@pytest.fixture(scope="module")
def state():
    return read_megatron(find_megatron_checkpoint(FIXTURES / CASE))


@pytest.fixture(scope="module")
def reference(state):
    """megatron-core's own per-tensor optimizer state, in meshtron's names."""
    saved = torch.load(FIXTURES / "reference_optimizer.pt", weights_only=True)[CASE]["optimizer"]
    shape = reader._shape_info(state.settings)
    out = {}
    for megatron_state, ours in reader.OPTIM_STATES.items():
        prefix = f"optimizer.state.{megatron_state}."
        tensors = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        if tensors:
            out[ours] = reader._canonical(tensors, state.settings["num_layers"], shape)
    return out


def test_buckets_give_megatron_cores_tensors(state, reference):
    assert state.notices == [] and state.step == 7
    assert set(state.optim) == set(reference) == {"master", "exp_avg", "exp_avg_sq"}
    for name in reference:
        assert set(state.optim[name]) == set(reference[name]) == set(state.model), name
        for k, t in reference[name].items():
            assert torch.equal(state.optim[name][k], t), (name, k)


def test_the_model_is_the_same_as_without_buckets(state):
    """Same seeds, same layout as dense_tp2pp2: the weights read equal, and so do the master weights."""
    plain = read_megatron(find_megatron_checkpoint(FIXTURES / "dense_tp2pp2"), optimizer=False)
    for k, t in plain.model.items():
        assert torch.equal(state.model[k], t), k
        assert torch.equal(state.optim["master"][k], t), k


def test_a_layout_that_does_not_fit_is_a_notice(monkeypatch):
    """Bucket lengths or master weights that do not fit the derived layout: nothing read, said in one line."""
    monkeypatch.setattr(reader, "_bucket_size", lambda args: None)  # one bucket per rank: lengths differ
    got = read_megatron(find_megatron_checkpoint(FIXTURES / CASE))
    assert got.optim == {} and got.step is None and len(got.notices) == 1
    note = got.notices[0]
    assert "\n" not in note and "Megatron-LM checkpoint" in note and "dp_reshardable" in note
    assert "model-parallel rank 0 (TP 0, PP 0)" in note and "Adam moments start from zero" in note


def test_tied_embedding_gets_a_bucket_of_its_own():
    """A tied embedding off a one-stage pipeline closes the bucket before it and gets its own (megatron-core's
    ``shared_embedding``); parameters start on 64-element boundaries; buckets close at ``bucket_size``."""
    model = {"embedding.word_embeddings.weight": torch.zeros(8, 4), "decoder.layers.0.input_layernorm.weight":
             torch.zeros(4), "decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(4, 25),
             "decoder.final_layernorm.weight": torch.zeros(4)}
    first = buckets.rank_params(model, 0, 0, 1, 2, 2, "local", False, tied=True)
    places, lengths = buckets.layout(first, bucket_size=200)
    assert [(p.name, p.bucket, p.start) for p in places] == [
        ("decoder.layers.0.mlp.linear_fc2.weight", 0, 0), ("decoder.layers.0.input_layernorm.weight", 0, 128),
        ("embedding.word_embeddings.weight", 1, 0)]
    assert lengths == [192, 32]  # the bucket closed where the embedding would have started
    _, lengths = buckets.layout(first, bucket_size=90)
    assert lengths == [100, 64, 32]
    last = buckets.rank_params(model, 0, 1, 1, 2, 2, "local", False, tied=True)
    assert [n for n, _ in last.params] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    places, lengths = buckets.layout(last, bucket_size=200)  # a later stage is not bucketed, the copy still is
    assert [(p.name, p.bucket, p.start) for p in places] == [("output_layer.weight", 0, 0),
                                                             ("decoder.final_layernorm.weight", 1, 0)]
    assert lengths == [32, 4]
