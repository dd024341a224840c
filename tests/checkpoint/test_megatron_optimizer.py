"""Optimizer state of Megatron-LM checkpoints that does not name its tensors, read by meshtron.

Written by megatron-core 0.19.2's own optimizers (tests/fixtures/megatron/make_checkpoints.py ``--optimizer``):

* ``dense_tp2pp2_dp2_dp_reshardable``: its ``DistributedOptimizer`` at TP=2 x PP=2 x DP=2 (2 layers),
  ``--overlap-grad-reduce`` with buckets of 1000 elements, saved in torch_dist's ``dp_reshardable`` format
  (Megatron-LM's default);
* ``legacy_tp2pp2_dp2_distrib_optim``: the same optimizer in the legacy format (``distrib_optim.pt`` by
  ``DistributedOptimizer.save_parameter_state``, ``optimizer.state_dict()`` in ``model_optim_rng.pt``);
* ``legacy_tp2_bf16_optim``: a bf16 model (2 layers, TP=2) with Megatron's non-distributed optimizer
  (``Float16OptimizerWithFloat16Params``: fp32 masters), legacy format;
* ``mtp_tp2pp2_dp_reshardable`` and ``legacy_mtp_tp2pp2_distrib_optim``: a model with a multi-token prediction
  depth, its ``DistributedOptimizer`` at TP=2 x PP=2 in both formats (the depth's parameters in the last stage's
  buffer, the word embedding and the last stage's copy of it in buckets of their own);
* ``rope_partial_interleaved_tp2_dp_reshardable``: grouped-query attention with ``--rotary-percent 0.5
  --rotary-interleaved`` and query/key head norms, its ``DistributedOptimizer`` at TP=2 in ``dp_reshardable``
  buckets of 600 elements (the bucket layout is the dense model's; the query/key rows are reordered afterwards,
  as the weights are);
* ``moe_ep2_dp4_dp_reshardable``: a mixture-of-experts model (2 layers, 4 experts top 2, a gated shared expert,
  a router with expert bias, tied embedding) at EP=2 over 4 processes, ``dp_reshardable``: megatron-core chains two
  optimizers, the dense parameters' buffer over data-parallel 4 (keys ``chained_0.``) and the experts' own buffer
  over expert-data-parallel 2 (``chained_1.``, one ``dp_group_idx`` per expert-parallel rank);
* ``legacy_moe_ep2_dp4_distrib_optim``: the same model and optimizer in the legacy format: ``mp_rank_00_000/`` and
  ``mp_rank_00_001/`` (one stage: the second field is the expert-parallel rank), each ``distrib_optim.pt`` the
  chained optimizers' list [dense buffer or None, the expert rank's buffer];
* ``legacy_moe_ep2_dp4_bf16_optim``: that model in bf16 with Megatron's non-distributed optimizer
  (``Float16OptimizerWithFloat16Params``, chained: dense, experts), legacy format: each ``model_optim_rng.pt``'s
  ``optimizer`` the list of both optimizers' ``state_dict()`` (the experts' one group: matrices only);
* ``mla_dp2_dp_reshardable``: multi-latent attention (q and kv down/up projections, their latent norms), its
  ``DistributedOptimizer`` at DP=2 in buckets of 1000 elements, ``dp_reshardable``;
* ``moe_ep1_dp2_dp_reshardable``, ``legacy_moe_ep1_dp2_distrib_optim``: ``moe_ep2_dp4_dp_reshardable``'s model at
  expert-parallel 1 over 2 processes in both formats: one optimizer, the experts in the dense buffer among their
  layer's parameters (after the router, before the shared expert);
* ``legacy_moe_ep1_dp2_bf16_optim``: that model in bf16 with the non-distributed optimizer, legacy format (one
  optimizer, the experts in its parameter groups);
* ``dense_pp2vp2_dp2_dp_reshardable``, ``legacy_pp2vp2_dp2_distrib_optim``: a dense model of 4 layers at PP=2 x
  virtual pipeline 2 x DP=2 in both formats: one buffer per model chunk (``gbuf_idx`` the chunk), one layer per
  chunk (chunk-major: stage 0 holds layers 0 and 2), buckets of 1000 elements on the first chunk of the first
  stage only.

``reference_optimizer.pt`` holds megatron-core's own per-tensor state of each, as it was in memory: per
model-parallel rank and parameter name, the masters and moments (the distributed optimizer's pieces put together
with its own parameter ranges); the second is the first's (``same_as``).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron import buckets, find_megatron_checkpoint, reader
from meshtron.checkpoint.megatron.reader import read_megatron

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
CASE = "dense_tp2pp2_dp2_dp_reshardable"
LEGACY = "legacy_tp2pp2_dp2_distrib_optim"
BF16 = "legacy_tp2_bf16_optim"
MTP = "mtp_tp2pp2_dp_reshardable"
MTP_LEGACY = "legacy_mtp_tp2pp2_distrib_optim"
ROPE = "rope_partial_interleaved_tp2_dp_reshardable"
MOE = "moe_ep2_dp4_dp_reshardable"
MLA = "mla_dp2_dp_reshardable"
MOE_LEGACY = "legacy_moe_ep2_dp4_distrib_optim"
MOE_BF16 = "legacy_moe_ep2_dp4_bf16_optim"
MOE_EP1 = "moe_ep1_dp2_dp_reshardable"
MOE_EP1_LEGACY = "legacy_moe_ep1_dp2_distrib_optim"
MOE_EP1_BF16 = "legacy_moe_ep1_dp2_bf16_optim"
VP = "dense_pp2vp2_dp2_dp_reshardable"
VP_LEGACY = "legacy_pp2vp2_dp2_distrib_optim"
VP_BF16 = "legacy_pp2vp2_bf16_optim"
UNEVEN = "dense_pp3_uneven_dp_reshardable"
UNEVEN_LEGACY = "legacy_pp3_uneven_distrib_optim"
LAYOUT = "dense_pp2vp2_layout_dp_reshardable"  # --pipeline-model-parallel-layout "Ett|t|t|ttL"
LAYOUT_LEGACY = "legacy_pp2vp2_layout_distrib_optim"
LOSS_SLOT = "dense_pp2_loss_slot_dp_reshardable"  # --account-for-loss-in-pipeline-split
LOSS_SLOT_LEGACY = "legacy_pp2_loss_slot_distrib_optim"
MOE_PP = "moe_pp2_ep2_dp_reshardable"  # tied: the last stage's output layer a copy of the embedding
MOE_PP_LEGACY = "legacy_moe_pp2_ep2_distrib_optim"
#: --pipeline-model-parallel-layout "Et|t|mm|L": megatron-core's standalone depths on stage 2 of 4
STANDALONE = "mtp_pp4_standalone_dp_reshardable"
STANDALONE_LEGACY = "legacy_mtp_pp4_standalone_distrib_optim"


def _read(name: str):
    return read_megatron(find_megatron_checkpoint(FIXTURES / name))


@pytest.fixture(scope="module")
def references():
    return torch.load(FIXTURES / "reference_optimizer.pt", weights_only=True)


def _reference(references: dict, name: str, settings: dict, args=None) -> dict[str, dict[str, torch.Tensor]]:
    """megatron-core's own per-tensor optimizer state of ``name``, in meshtron's names (the per-rank shards of
    the non-distributed optimizer joined as Megatron's tensor parallelism splits them)."""
    entry = references[name]
    entry = references[entry["same_as"]] if "same_as" in entry else entry
    shape = reader._shape_info(settings, args)
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for (tp, pp), by_name in entry["per_rank"].items():
        for pname, tensors in by_name.items():
            if pname == "embedding.word_embeddings.weight" and pp > 0:
                continue  # the prediction depths' copy on the last stage: the first stage's state is the one kept
            for key, t in tensors.items():
                parts.setdefault((key, pname), {})[tp] = t
    saved = {f"optimizer.state.{key}.{pname}": buckets.merge_shards(pname, [p[t] for t in sorted(p)], shape["swiglu"])
             for (key, pname), p in parts.items()}
    out = {}
    for megatron_state, ours in reader.OPTIM_STATES.items():
        prefix = f"optimizer.state.{megatron_state}."
        tensors = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        if tensors:
            out[ours] = reader._canonical(tensors, settings["num_layers"], shape)
    return out


@pytest.mark.parametrize("name", [CASE, LEGACY, BF16, MTP, MTP_LEGACY, ROPE, MOE, MLA, MOE_LEGACY, MOE_BF16,
                                  MOE_EP1, MOE_EP1_LEGACY, MOE_EP1_BF16, VP, VP_LEGACY, VP_BF16, UNEVEN,
                                  UNEVEN_LEGACY, LAYOUT, LAYOUT_LEGACY, LOSS_SLOT, LOSS_SLOT_LEGACY, MOE_PP,
                                  MOE_PP_LEGACY, STANDALONE, STANDALONE_LEGACY])
def test_optimizer_state_is_megatron_cores(name, references):
    state = _read(name)
    assert state.notices == [] and state.step == 7
    assert set(state.optim) == {"master", "exp_avg", "exp_avg_sq"}
    reference = _reference(references, name, state.settings, state.args)
    assert set(reference) == {"master", "exp_avg", "exp_avg_sq"}
    params = {k: t for k, t in state.model.items() if not k.endswith("expert_bias")}  # a buffer: no state
    for which in reference:
        assert set(state.optim[which]) == set(reference[which]) == set(params), which
        for k, t in reference[which].items():
            assert torch.equal(state.optim[which][k], t), (which, k)
    for k, t in params.items():  # the masters are the weights, rounded to the model's dtype
        assert torch.equal(state.optim["master"][k].to(t.dtype), t), k


@pytest.mark.parametrize("pair", [(CASE, LEGACY), (MTP, MTP_LEGACY), (MOE, MOE_LEGACY), (MOE_EP1, MOE_EP1_LEGACY),
                                  (VP, VP_LEGACY), (UNEVEN, UNEVEN_LEGACY), (LAYOUT, LAYOUT_LEGACY),
                                  (LOSS_SLOT, LOSS_SLOT_LEGACY), (MOE_PP, MOE_PP_LEGACY),
                                  (STANDALONE, STANDALONE_LEGACY)])
def test_the_same_optimizer_in_both_formats(pair):
    """The same model and optimizer saved as torch_dist dp_reshardable and as legacy distrib_optim.pt read the
    same: weights, masters (an fp32 model's: its weights) and moments (a mixture-of-experts model's experts
    included)."""
    a, b = _read(pair[0]), _read(pair[1])
    assert set(a.model) == set(b.model)
    for k, t in a.model.items():
        assert torch.equal(b.model[k], t), k
        if k.endswith("expert_bias"):
            continue  # a buffer: no optimizer state
        assert torch.equal(a.optim["master"][k], t) and torch.equal(b.optim["master"][k], t), k
    for which in ("exp_avg", "exp_avg_sq"):
        for k, t in a.optim[which].items():
            assert torch.equal(b.optim[which][k], t), (which, k)


def test_a_layout_that_does_not_fit_is_a_notice(monkeypatch):
    """Bucket lengths or master weights that do not fit the derived layout: nothing read, said in one line."""
    monkeypatch.setattr(reader, "_bucket_size", lambda args: None)  # one bucket per rank: lengths differ
    got = read_megatron(find_megatron_checkpoint(FIXTURES / CASE))
    assert got.optim == {} and got.step is None and len(got.notices) == 1
    note = got.notices[0]
    assert "\n" not in note and "Megatron-LM checkpoint" in note and "dp_reshardable" in note
    assert "model-parallel rank 0 (TP 0, PP 0)" in note and "Adam moments start from zero" in note


_EXPERT_RANK_0 = "expert model-parallel rank 0 (expert TP 0, EP 0, PP 0)"


@pytest.mark.parametrize("name, where", [
    (MOE, _EXPERT_RANK_0), (MOE_LEGACY, _EXPERT_RANK_0),
    (MOE_BF16, "mp_rank_00_000_000 (experts): the optimizer's param of parameter 1 is not shaped like")])
def test_experts_in_the_wrong_order_are_a_notice(monkeypatch, name, where):
    """The experts' buffer (or parameter group) laid out as TEGroupedMLP's (every expert's linear_fc1 before every
    linear_fc2) where megatron-core's SequentialMLP wrote it: the proof refuses it, nothing read, said in one
    line."""
    monkeypatch.setattr(reader, "_expert_args", lambda args: (2, None, True))
    got = _read(name)
    assert got.optim == {} and got.step is None and len(got.notices) == 1
    note = got.notices[0]
    assert "\n" not in note and where in note
    assert "Adam moments start from zero" in note


def test_experts_follow_their_layer_in_the_expert_buffer():
    """An expert rank's parameters: its share of each layer's experts, SequentialMLP's fc1, fc2 per expert (or
    every fc1 first, grouped); the dense rank leaves the experts and the router's bias (a buffer) out, and puts a
    shared expert's gate before its linears."""
    model = {"decoder.layers.0.mlp.router.weight": torch.zeros(4, 2),
             "decoder.layers.0.mlp.router.expert_bias": torch.zeros(4),
             "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": torch.zeros(4, 2),
             "decoder.layers.0.mlp.shared_experts.gate_weight": torch.zeros(1, 2),
             "decoder.layers.0.mlp.experts.experts.linear_fc1.weight": torch.arange(4.).reshape(4, 1, 1),
             "decoder.layers.0.mlp.experts.experts.linear_fc2.weight": torch.zeros(4, 1, 1)}
    dense = buckets.rank_params(model, 0, 0, 1, 1, 1, "local", False, tied=True)
    assert [n for n, _ in dense.params] == ["decoder.layers.0.mlp.router.weight",
                                            "decoder.layers.0.mlp.shared_experts.gate_weight",
                                            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    second = buckets.expert_rank_params(buckets.experts_by_layer(model), 0, 1, 0, 1, 2, 1, 1, False, grouped=False)
    prefix = "decoder.layers.0.mlp.experts.local_experts."
    assert [n[len(prefix):] for n, _ in second.params] == ["2.linear_fc1.weight", "2.linear_fc2.weight",
                                                           "3.linear_fc1.weight", "3.linear_fc2.weight"]
    assert second.params[0][1].item() == 2.0
    grouped = buckets.expert_rank_params(buckets.experts_by_layer(model), 0, 1, 0, 1, 2, 1, 1, False, grouped=True)
    assert [n[len(prefix):] for n, _ in grouped.params] == ["2.linear_fc1.weight", "3.linear_fc1.weight",
                                                            "2.linear_fc2.weight", "3.linear_fc2.weight"]



_DENSE_RANK_0 = "model-parallel rank 0 (TP 0, PP 0)"


@pytest.mark.parametrize("name, expert_args, where", [
    (MOE_EP1, (1, None, True), _DENSE_RANK_0), (MOE_EP1_LEGACY, (1, None, True), _DENSE_RANK_0),
    (MOE_EP1_BF16, (1, None, True), "mp_rank_00_000: the optimizer's param of parameter 5 is not shaped like"),
    (MOE_EP1, (2, None, False), "optimizers [0] (chained_K. prefixes), expected 0 (dense parameters) and 1"),
    (MOE_EP1_LEGACY, (2, None, False), "holds 1 optimizers, expected 2 (chained: dense parameters, experts)")])
def test_experts_at_ep1_in_another_layout_are_a_notice(monkeypatch, name, expert_args, where):
    """Experts that megatron-core kept in the dense buffer at expert-parallel 1 (SequentialMLP's order) read as
    TEGroupedMLP's order, or as if expert-parallel 2 had given them a buffer of their own: refused, nothing read,
    said in one line."""
    monkeypatch.setattr(reader, "_expert_args", lambda args: expert_args)
    got = _read(name)
    assert got.optim == {} and got.step is None and len(got.notices) == 1
    note = got.notices[0]
    assert "\n" not in note and where in note, note
    assert "Adam moments start from zero" in note


def test_experts_follow_the_router_in_the_dense_buffer_at_ep1():
    """At expert-parallel 1 the dense rank holds every expert of its layers, after the router and before the
    shared expert's gate (MoELayer's registration order), SequentialMLP's fc1, fc2 per expert (grouped: every fc1
    first), sharded over tensor parallelism as dense MLPs are."""
    model = {"decoder.layers.0.pre_mlp_layernorm.weight": torch.zeros(2),
             "decoder.layers.0.mlp.router.weight": torch.zeros(2, 2),
             "decoder.layers.0.mlp.router.expert_bias": torch.zeros(2),
             "decoder.layers.0.mlp.shared_experts.gate_weight": torch.zeros(1, 2),
             "decoder.layers.0.mlp.experts.experts.linear_fc1.weight": torch.arange(8.).reshape(2, 4, 1),
             "decoder.layers.0.mlp.experts.experts.linear_fc2.weight": torch.zeros(2, 1, 2)}
    prefix = "decoder.layers.0.mlp.experts.local_experts."
    sequential = buckets.rank_params(model, 1, 0, 2, 1, 1, "local", True, tied=True, inline_experts=True)
    assert [n.replace(prefix, "") for n, _ in sequential.params] == [
        "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.router.weight",
        "0.linear_fc1.weight", "0.linear_fc2.weight", "1.linear_fc1.weight", "1.linear_fc2.weight",
        "decoder.layers.0.mlp.shared_experts.gate_weight"]
    assert sequential.params[2][1].flatten().tolist() == [1.0, 3.0]  # TP rank 1's rows of [gate; up]
    assert tuple(sequential.params[3][1].shape) == (1, 1)
    grouped = buckets.rank_params(model, 0, 0, 1, 1, 1, "local", True, tied=True, inline_experts=True, grouped=True)
    assert [n.replace(prefix, "") for n, _ in grouped.params][2:6] == [
        "0.linear_fc1.weight", "1.linear_fc1.weight", "0.linear_fc2.weight", "1.linear_fc2.weight"]
    assert not buckets.experts_apart(2, 1, None) and buckets.experts_apart(2, 1, 1) and buckets.experts_apart(1, 2, 1)


@pytest.mark.parametrize("name", [VP, VP_LEGACY])
def test_virtual_stages_in_another_order_are_a_notice(monkeypatch, name):
    """Model chunks whose layers are taken as consecutive per stage (stage 0: layers 0, 1) where megatron-core
    assigns them chunk-major (stage 0: layers 0, 2): the proof refuses them, nothing read, said in one line."""
    def consecutive(num_layers, pp, pp_size, chunk=0, vp_size=1, uneven=buckets.EVEN):
        per_chunk = num_layers // (pp_size * vp_size)
        start = (pp * vp_size + chunk) * per_chunk
        return range(start, start + per_chunk)

    monkeypatch.setattr(buckets, "chunk_layers", consecutive)
    got = _read(name)
    assert got.optim == {} and got.step is None and len(got.notices) == 1
    note = got.notices[0]
    assert "\n" not in note and "Adam moments start from zero" in note
    assert "model-parallel rank 0 (TP 0, PP 0, virtual stage 1): the master weights at" in note, note


@pytest.mark.parametrize("name, where", [
    (VP, "parameter buffers [0, 1] per optimizer where 1 model chunk(s) have one each"),
    (VP_LEGACY, "holds buffers [0, 1], expected one per model chunk (1)")])
def test_virtual_stages_unknown_to_args_are_a_notice(monkeypatch, name, where):
    """A checkpoint with two model chunks per stage read as if its args named none: refused by name."""
    monkeypatch.setattr(reader, "_vp_size", lambda args: 1)
    got = _read(name)
    assert got.optim == {} and len(got.notices) == 1 and where in got.notices[0], got.notices[0]


def test_virtual_stages_split_the_layers_chunk_major():
    """Chunk v of stage p holds layers v x L/VP + p x L/(PP x VP) on; the embedding is the first chunk of the first
    stage's (alone bucketed), the final norm and output layer the last chunk of the last stage's."""
    assert [list(buckets.chunk_layers(8, p, 2, v, 2)) for p in range(2) for v in range(2)] == [
        [0, 1], [4, 5], [2, 3], [6, 7]]
    model = {"embedding.word_embeddings.weight": torch.zeros(8, 4), "output_layer.weight": torch.zeros(8, 4),
             "decoder.final_layernorm.weight": torch.zeros(4)}
    model.update({f"decoder.layers.{n}.mlp.linear_fc2.weight": torch.full((4, 16), float(n)) for n in range(4)})
    ranks = buckets.dense_ranks(model, 1, 2, 4, "local", False, tied=False, vp_size=2)
    assert {k: [n for n, _ in r.params] for k, (_, r) in ranks.items()} == {
        (0, 0): ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc2.weight"],
        (0, 1): ["decoder.layers.2.mlp.linear_fc2.weight"],
        (1, 0): ["decoder.layers.1.mlp.linear_fc2.weight"],
        (1, 1): ["decoder.layers.3.mlp.linear_fc2.weight", "decoder.final_layernorm.weight", "output_layer.weight"]}
    assert [r.first_stage for _, r in ranks.values()] == [True, False, False, False]
    assert buckets.layout(ranks[(0, 1)][1], bucket_size=10)[1] == [64]  # a later chunk is never bucketed
    assert buckets.layout(ranks[(0, 0)][1], bucket_size=10)[1] == [64, 32]


def test_chunks_joined_in_another_order_are_a_notice(monkeypatch):
    """The non-distributed optimizer's groups take chunk 0's parameters before chunk 1's: read the other way round,
    the masters prove the mismatch, nothing is read, and the weights still load."""
    from meshtron.checkpoint.megatron import legacy_optim

    joined = legacy_optim._chunks_joined
    monkeypatch.setattr(legacy_optim, "_chunks_joined", lambda ranks: joined(list(reversed(ranks))))
    got = _read(VP_BF16)
    assert got.optim == {} and len(got.notices) == 1 and "Adam moments start from zero" in got.notices[0]
    assert set(got.model) == set(_read(VP).model)


def test_uneven_stages_split_as_megatron_core():
    """--decoder-first/last-pipeline-num-layers: those stages hold their own counts (split over their model chunks),
    the middle stages the rest evenly, chunk-major (the expectations are megatron-core 0.19.2's
    get_transformer_layer_offset and get_num_layers_to_build, which agree on 1,103 such placements)."""
    assert [list(buckets.chunk_layers(4, p, 3, uneven=(1, 1))) for p in range(3)] == [[0], [1, 2], [3]]
    assert [list(buckets.chunk_layers(5, p, 3, uneven=(1, None))) for p in range(3)] == [[0], [1, 2], [3, 4]]
    assert [list(buckets.chunk_layers(5, p, 3, uneven=(None, 1))) for p in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(buckets.chunk_layers(8, p, 3, v, 2, (2, 2))) for p in range(3) for v in range(2)] == [
        [0], [4], [1, 2], [5, 6], [3], [7]]
    assert list(buckets.chunk_layers(4, 0, 1, uneven=(1, 1))) == [0, 1, 2, 3]  # one stage: the counts do not apply
    for split in [(5, 3, 1, (2, None)), (4, 2, 1, (1, 1)), (8, 3, 2, (1, 2)), (3, 3, 1, (2, 2))]:
        with pytest.raises(buckets.LayoutMismatch, match="do not split over"):
            buckets.check_split(*split)


def test_uneven_stages_unknown_to_args_are_a_notice(monkeypatch):
    """The uneven fixture read as if its first stage held two layers: the layout proof fails, nothing is read."""
    monkeypatch.setattr(reader, "_uneven", lambda args, num_layers: (2, None))
    got = read_megatron(find_megatron_checkpoint(FIXTURES / UNEVEN))
    assert got.optim == {} and len(got.notices) == 1 and "Adam moments start from zero" in got.notices[0]
    assert set(_read(UNEVEN).model) == set(got.model)  # the weights load as before


def _legacy_moe_copy(tmp_path: Path) -> tuple[Path, list]:
    """A copy of the legacy MoE fixture and its two distrib_optim.pt files' chained lists (by expert rank)."""
    from meshtron.checkpoint.megatron.unpickler import load_pickled

    dst = tmp_path / "legacy_moe"
    shutil.copytree(FIXTURES / MOE_LEGACY, dst)
    files = [dst / "iter_0000007" / f"mp_rank_00_{ep:03d}" / "distrib_optim.pt" for ep in range(2)]
    return dst, [(f, load_pickled(f, str(f))) for f in files]


def test_legacy_expert_buffers_swapped_are_a_notice(tmp_path):
    """The two expert ranks' buffers exchanged between their directories (the same lengths): the proof refuses
    them, nothing read, said in one line."""
    dst, ((f0, c0), (f1, c1)) = _legacy_moe_copy(tmp_path)
    c0[1], c1[1] = c1[1], c0[1]
    torch.save(c0, f0)
    torch.save(c1, f1)
    got = _read_dir(dst)
    assert got.optim == {} and got.step is None and len(got.notices) == 1
    note = got.notices[0]
    assert "\n" not in note and "distrib_optim.pt" in note and "Adam moments start from zero" in note
    assert "expert model-parallel rank 0 (expert TP 0, EP 0, PP 0): the master weights at" in note


@pytest.mark.parametrize("tamper", ["no_experts", "one_optimizer", "dense_twice"])
def test_legacy_chain_unlike_megatron_cores_is_a_notice(tmp_path, tamper):
    """A distrib_optim.pt whose chained list is not megatron-core's (an expert rank's buffer missing, a single
    optimizer's state, the dense buffer in both directories) is refused by name, never guessed."""
    dst, ((f0, c0), (f1, c1)) = _legacy_moe_copy(tmp_path)
    if tamper == "no_experts":
        c1[1] = None
        expected = f"{f1} holds no experts' buffer"
    elif tamper == "one_optimizer":
        c1 = c1[1]
        expected = f"{f1} holds 1 optimizers, expected 2 (chained: dense parameters, experts)"
    else:
        c1[0] = c0[0]
        expected = f"{f1}: a second dense buffer of model-parallel rank 0"
    torch.save(c1, f1)
    got = _read_dir(dst)
    assert got.optim == {} and len(got.notices) == 1 and expected in got.notices[0]



@pytest.mark.parametrize("tamper", ["swapped", "one_optimizer", "groups"])
def test_legacy_moe_local_optimizer_unlike_megatron_cores_is_a_notice(tmp_path, tamper):
    """The non-distributed optimizer of a mixture-of-experts model: the expert ranks' optimizers exchanged between
    their directories, a single optimizer's state where two are chained, or the experts' group split by another
    rule: refused by name, never guessed."""
    from meshtron.checkpoint.megatron.unpickler import load_pickled

    dst = tmp_path / "moe_bf16"
    shutil.copytree(FIXTURES / MOE_BF16, dst)
    files = [dst / "iter_0000007" / f"mp_rank_00_{ep:03d}" / "model_optim_rng.pt" for ep in range(2)]
    states = [load_pickled(f, str(f)) for f in files]
    for state in states:
        state["args"].attention_backend = "auto"  # the stand-in of Megatron's enum does not pickle back
    if tamper == "swapped":
        states[0]["optimizer"][1], states[1]["optimizer"][1] = states[1]["optimizer"][1], states[0]["optimizer"][1]
        expected = "mp_rank_00_000_000 (experts): the master weight of parameter"
    elif tamper == "one_optimizer":
        states[1]["optimizer"] = states[1]["optimizer"][0]
        expected = "mp_rank_00_000_001: its 'optimizer' entry holds 1 optimizers, expected 2"
    else:
        group = states[1]["optimizer"][1]["optimizer"]["param_groups"][0]
        moved = dict(group, params=group["params"][-1:], wd_mult=0.0)
        group["params"] = group["params"][:-1]
        states[1]["optimizer"][1]["optimizer"]["param_groups"].append(moved)
        expected = "mp_rank_00_000_001 (experts): parameter groups of [7, 1] parameters, Megatron-LM's standard " \
                   "groups here would hold [8, 0]"
    for f, state in zip(files, states):
        torch.save(state, f)
    got = _read_dir(dst)
    assert got.optim == {} and len(got.notices) == 1
    assert "\n" not in got.notices[0] and expected in got.notices[0], got.notices[0]

def test_one_stage_expert_directories_are_expert_ranks(tmp_path):
    """Megatron-LM names a one-stage expert-parallel checkpoint's directories mp_rank_TT_EEE: read with its args,
    the second field is the expert rank; without, a pipeline rank (mp_rank_TT_PPP)."""
    from meshtron.checkpoint.megatron import legacy

    directory = FIXTURES / MOE_LEGACY / "iter_0000007"
    assert sorted(legacy.rank_files(directory, expert_only=True)) == [(0, 0, 0), (0, 0, 1)]
    assert sorted(legacy.rank_files(directory)) == [(0, 0, 0), (0, 1, 0)]

def test_legacy_missing_or_foreign_optimizer_file(tmp_path):
    """A missing distrib_optim.pt is a notice (the weights load); a foreign pickle in one is refused in one line
    naming the file."""
    dst = tmp_path / "legacy"
    shutil.copytree(FIXTURES / LEGACY, dst)
    f = dst / "iter_0000007" / "mp_rank_01_001" / "distrib_optim.pt"
    f.unlink()
    got = _read_dir(dst)
    assert got.optim == {} and len(got.notices) == 1 and str(f) in got.notices[0] and "\n" not in got.notices[0]
    f.write_bytes(pickle.dumps({"buckets_coalesced": True, 0: _Payload()}, protocol=2))
    with pytest.raises(CheckpointError) as err:
        _read_dir(dst)
    text = str(err.value)
    assert "\n" not in text and str(f) in text and f"{os.system.__module__}.system" in text


def test_bf16_groups_that_do_not_fit_are_a_notice(tmp_path):
    """Parameter groups unlike Megatron-LM's standard two: nothing taken from them, said in one line."""
    from meshtron.checkpoint.megatron.unpickler import load_pickled

    dst = tmp_path / "bf16"
    shutil.copytree(FIXTURES / BF16, dst)
    f = dst / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = load_pickled(f, str(f))
    state["args"].attention_backend = "auto"  # the stand-in of Megatron's enum does not pickle back
    groups = state["optimizer"]["optimizer"]["param_groups"]
    groups[0]["params"], groups[1]["params"] = groups[0]["params"][:-1], groups[1]["params"] + groups[0]["params"][-1:]
    torch.save(state, f)
    got = _read_dir(dst)
    assert got.optim == {} and len(got.notices) == 1
    assert "mp_rank_00_000: parameter groups of [9, 6] parameters" in got.notices[0]


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def _read_dir(path: Path):
    return read_megatron(find_megatron_checkpoint(path))


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


def test_prediction_depths_follow_the_final_norm_on_the_last_stage():
    """Multi-token prediction on the last of two stages: megatron-core's order there is its copy of the word
    embedding, the stage's layers, the final norm, each depth (enorm, hnorm, eh_proj, its transformer layer,
    final_layernorm), the output layer; both copies of the embedding get buckets of their own."""
    model = {"embedding.word_embeddings.weight": torch.zeros(8, 4),
             "decoder.layers.0.input_layernorm.weight": torch.zeros(4),
             "decoder.layers.1.input_layernorm.weight": torch.zeros(4),
             "decoder.final_layernorm.weight": torch.zeros(4),
             "mtp.layers.0.final_layernorm.weight": torch.zeros(4),
             "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight": torch.zeros(4, 6),
             "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight": torch.zeros(4),
             "mtp.layers.0.eh_proj.weight": torch.zeros(4, 8),
             "mtp.layers.0.hnorm.weight": torch.zeros(4),
             "mtp.layers.0.enorm.weight": torch.zeros(4),
             "output_layer.weight": torch.zeros(8, 4)}
    last = buckets.rank_params(model, 0, 1, 1, 2, 2, "local", False, tied=False)
    assert [n for n, _ in last.params] == [
        buckets.EMBEDDING_COPY, "decoder.layers.1.input_layernorm.weight", "decoder.final_layernorm.weight",
        "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight",
        "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight", "mtp.layers.0.final_layernorm.weight",
        "output_layer.weight"]
    places, lengths = buckets.layout(last, bucket_size=None)
    assert (places[-1].name, places[-1].bucket, places[-1].start) == (buckets.EMBEDDING_COPY, 1, 0)
    assert lengths[1] == 32
    first = buckets.rank_params(model, 0, 0, 1, 2, 2, "local", False, tied=False)
    assert first.shared_embedding == {"embedding.word_embeddings.weight"}
    assert not any(n.startswith("mtp.") for n, _ in first.params)


@pytest.mark.slow
@pytest.mark.parametrize("name", [CASE, LEGACY, BF16, MTP, MOE, MLA, MOE_LEGACY, MOE_BF16, MOE_EP1, MOE_EP1_LEGACY,
                                  VP, VP_LEGACY, VP_BF16, UNEVEN, LAYOUT, LOSS_SLOT_LEGACY, MOE_PP, STANDALONE])
def test_train_continues_with_the_optimizer_state(name):
    """meshtron train --load on each: resumes at iteration 7 with the optimizer state (no notice that the Adam
    moments start from zero) and trains on."""
    from ckpt_helpers import train_on_from_megatron

    train_on_from_megatron(FIXTURES / name)
