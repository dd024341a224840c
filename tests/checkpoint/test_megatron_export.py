"""Megatron-LM checkpoints written by meshtron (``meshtron convert --to megatron``): read back by meshtron, loaded by
megatron-core, and the refusals.

The meshtron checkpoints are made afresh (fixed seeds) by tests/fixtures/megatron/exported.py; megatron-core's
view of their exports (logits, the optimizer tensors it loaded, the common state it read) was recorded by
tests/fixtures/megatron/make_exported_reference.py in ``exported_reference.pt``. Where megatron-core is importable
(the ``megatron-oracle`` extra or ``MESHTRON_MEGATRON_CORE``) one test runs that load live.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from meshtron.checkpoint import load_for_inference
from meshtron.checkpoint.convert import convert_main
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.load import resolve_checkpoint
from meshtron.checkpoint.megatron import files
from meshtron.checkpoint.megatron import find_megatron_checkpoint
from meshtron.checkpoint.megatron.export import meshtron_to_megatron, read_canonical
from meshtron.checkpoint.megatron.reader import read_common_state, read_megatron
from meshtron.checkpoint.megatron.torch_dist import read_entries, read_index

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
sys.path.insert(0, str(FIXTURES))
import exported  # noqa: E402
from make_exported_reference import fingerprint  # noqa: E402

from tests.checkpoint.ckpt_helpers import mtp_losses  # noqa: E402

CASES = tuple(exported.CASES)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{case: meshtron save directory} made once for the module."""
    root = tmp_path_factory.mktemp("meshtron")
    return {case: exported.write_meshtron_checkpoint(root / case, case) for case in CASES}


@pytest.fixture(scope="module")
def reference():
    return torch.load(FIXTURES / "exported_reference.pt", weights_only=True)


def _export(src: Path, out: Path, *extra: str) -> Path:
    assert convert_main(["--to", "megatron", "--input", str(src), "--output", str(out), *extra]) == 0
    return out


def _logits(save_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model, _ = load_for_inference(save_dir, "cpu", torch.float32)
    with torch.no_grad():
        return model(tokens)


# Every case under the local spec; under Transformer Engine's names the dense and MoE cases (the others slow).
@pytest.mark.parametrize("case,spec", [
    pytest.param(c, spec, id=f"{c}-{spec}",
                 marks=pytest.mark.slow if spec == "transformer_engine" and c not in ("dense", "moe") else ())
    for c in CASES for spec in ("transformer_engine", "local")])
def test_round_trip_through_meshtrons_reader(case, spec, sources, tmp_path, capsys):
    """Weights, fp32 masters, Adam moments, step, iteration and consumed samples read back unchanged; converted
    back to meshtron, the model computes the same logits."""
    src = sources[case]
    out = _export(src, tmp_path / "mg", "--megatron-spec", spec)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(exported.ITERATION)
    state = read_megatron(find_megatron_checkpoint(out), vocab_size=exported.VOCAB)
    ckpt = resolve_checkpoint(src)
    weights, optim = read_canonical(ckpt, "model."), read_canonical(ckpt, "optim.")
    assert set(weights) == set(state.model)
    for name, t in weights.items():
        assert torch.equal(t, state.model[name]), name
    assert {f"{s}.{n}" for s, ts in state.optim.items() for n in ts} == set(optim)
    for key, t in optim.items():
        s, name = key.split(".", 1)
        assert torch.equal(t, state.optim[s][name]), key
    assert (state.step, state.iteration, state.consumed_samples) == (exported.ITERATION, exported.ITERATION,
                                                                     exported.CONSUMED)
    assert convert_main(["--from", "megatron", "--input", str(out), "--output", str(tmp_path / "back")]) == 0
    tokens = exported.tokens()
    torch.testing.assert_close(_logits(tmp_path / "back", tokens)[..., :exported.VOCAB], _logits(src, tokens),
                               rtol=0, atol=0)


def test_layout_as_megatron_core_saves_it(sources, tmp_path):
    """torch_dist files, metadata.json, stacked layers, experts [layers, experts, ...], QKV per query group,
    the padded vocabulary, the common state entry and the TE names of a mixture-of-experts layer."""
    out = _export(sources["moe"], tmp_path / "mg")
    d = out / "iter_0000003"
    assert sorted(p.name for p in d.iterdir()) == [".metadata", "__0_0.distcp", "metadata.json"]
    assert (d / "metadata.json").read_text() == '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    shapes = {k: tuple(v.size) for k, v in read_index(d).state_dict_metadata.items() if hasattr(v, "size")}
    assert shapes["embedding.word_embeddings.weight"] == (96, 16)
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (4, 32, 16)
    assert shapes["decoder.layers.pre_mlp_layernorm.weight"] == (4, 16)  # TE: a norm of its own in an MoE layer
    assert shapes["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == (4, 16)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 24, 16)
    assert shapes["decoder.layers.mlp.router.expert_bias"] == (4, 4)
    assert "output_layer.weight" not in shapes  # tied
    assert "optimizer.state.exp_avg.decoder.layers.mlp.router.expert_bias" not in shapes  # a buffer
    assert "optimizer.state.param.decoder.layers.mlp.shared_experts.linear_fc1.weight" in shapes
    common = read_common_state(find_megatron_checkpoint(out))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 3
    assert common["args"].padded_vocab_size == 96 and common["args"].no_save_rng
    groups = common["optimizer"]["optimizer"]["param_groups"]  # expert-parallel 1: one optimizer
    assert [(g["wd_mult"], g["step"], g["is_expert_parallel"]) for g in groups] == [(1.0, 3, False), (0.0, 3, False)]
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    _, raw = read_entries(d, read_index(d), (), ["decoder.layers.mlp.experts.experts.linear_fc2._extra_state/"
                                                 "shard_3.1_4.4"])
    assert len(raw) == 1


def test_experts_optimizer_chained_above_expert_parallel_1(sources, tmp_path):
    """Megatron keeps experts in an optimizer of their own only with --expert-model-parallel-size above 1."""
    out = _export(sources["moe"], tmp_path / "mg", "--megatron-expert-parallel-size", "2")
    common = read_common_state(find_megatron_checkpoint(out))
    assert common["args"].expert_model_parallel_size == 2
    assert sorted(common["optimizer"]) == [0, 1]
    assert [g["is_expert_parallel"] for g in common["optimizer"][1]["optimizer"]["param_groups"]] == [True, True]


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_megatron_cores(case, sources, reference):
    """megatron-core's GPTModel loaded the export of this very checkpoint (make_exported_reference.py): its logits
    are meshtron's; the padding rows it computes are 0."""
    ref = reference["cases"][case]
    tokens = reference["tokens"]
    assert torch.equal(tokens, exported.tokens())
    mine = _logits(sources[case], tokens)
    torch.testing.assert_close(ref["logits"][..., :exported.VOCAB], mine, rtol=0, atol=2e-5)
    assert torch.count_nonzero(ref["logits"][..., exported.VOCAB:]) == 0
    # moe: the default --megatron-spec transformer_engine too, loaded under its names; dense and mtp: loaded at
    # TP=2 x PP=2, saved again by megatron-core and loaded at TP=1
    # rope_partial: also written with --megatron-rotary-interleaved, loaded into a model with --rotary-interleaved
    other = {"moe": "te_names_logits", "dense": "tp2pp2_resaved_logits", "mtp": "tp2pp2_resaved_logits",
             "rope_partial": "interleaved_logits"}.get(case)
    if other:
        torch.testing.assert_close(ref[other][..., :exported.VOCAB], mine, rtol=0, atol=2e-5)


@pytest.mark.parametrize("case", CASES)
def test_megatron_core_read_the_optimizer_state_and_common_state(case, sources, reference, tmp_path):
    """Every optimizer tensor megatron-core loaded (fully reshardable keys) is what meshtron wrote; the common state
    it read holds the iteration, step, schedule and model flags."""
    ref = reference["cases"][case]
    out = _export(sources[case], tmp_path / "mg", "--megatron-spec", "local")
    d = out / "iter_0000003"
    md = read_index(d)
    keys = [k for k in md.state_dict_metadata if k.startswith("optimizer.state.")]
    assert sorted(keys) == sorted(ref["optimizer"])
    tensors, _ = read_entries(d, md, keys)
    for key in keys:
        torch.testing.assert_close(fingerprint(tensors[key]), ref["optimizer"][key], rtol=1e-9, atol=1e-7)
    assert (ref["iteration"], ref["checkpoint_version"], ref["step"]) == (3, 3.0, 3)
    assert ref["sharding_type"] == "fully_reshardable"
    assert ref["opt_param_scheduler"]["num_steps"] == 3 * 8 and ref["opt_param_scheduler"]["max_lr"] == 1e-2
    expected = {"num_layers": 4, "hidden_size": 16, "ffn_hidden_size": 32,
                "num_query_groups": 4 if case == "mla_yarn" else 2, "padded_vocab_size": 96,
                "consumed_train_samples": exported.CONSUMED}
    expected.update({"mla_yarn": {"multi_latent_attention": True, "rope_type": "yarn", "rotary_scaling_factor": 4.0,
                                  "mscale": 1.0, "mscale_all_dim": 0.7},
                     "moe_gate": {"moe_shared_expert_gate": True},
                     "rope_partial": {"rotary_percent": 0.5, "rotary_interleaved": False, "kv_channels": 8,
                                      "qk_layernorm": True},
                     "moe_mixed": {"moe_layer_freq": [0, 1, 1, 1]},
                     "moe_freq2_mtp": {"moe_layer_freq": 2}}.get(case, {}))
    assert {k: ref["args"][k] for k in expected} == expected


@pytest.mark.parametrize("case", ["mtp", "moe_mtp", "moe_freq2_mtp"])
def test_mtp_losses_equal_megatron_cores(case, sources, reference, tmp_path):
    """Prediction depths written under megatron-core's names (two dense depths; one mixture-of-experts depth, its
    experts stacked [experts, ...]; one dense depth after mixed dense and mixture-of-experts layers): its model (TP=1, and for ``mtp`` at TP=2 x PP=2 with the depths on the last
    stage, saved again and reloaded) computes the main loss and each depth's loss that meshtron computes from the
    export read back (the same weights, test_round_trip_through_meshtrons_reader; both with Megatron's padded
    vocabulary, whose zero rows take some probability)."""
    ref = reference["cases"][case]
    out = _export(sources[case], tmp_path / "mg")
    assert convert_main(["--from", "megatron", "--input", str(out), "--output", str(tmp_path / "back")]) == 0
    model, _ = load_for_inference(tmp_path / "back", "cpu", torch.float32)
    main, depths = mtp_losses(model, ref["mtp_batch"])
    for got in (ref["mtp_losses"], ref.get("tp2pp2_resaved_mtp_losses", ref["mtp_losses"])):
        torch.testing.assert_close(got["loss"], main, rtol=0, atol=2e-5)
        torch.testing.assert_close(got["depths"], depths, rtol=0, atol=2e-5)
    assert depths.shape == (exported.CASES[case]["mtp_num_layers"],)


def test_mtp_layout_as_megatron_core_saves_it(sources, tmp_path):
    """Each depth under its own number (not stacked over depths, as megatron-core saves them), the transformer layer
    as ``transformer_layer``, eh_proj [H, 2H], Transformer Engine's entries of its linears, and the flags in args."""
    out = _export(sources["mtp"], tmp_path / "mg")
    d = out / "iter_0000003"
    md = read_index(d)
    shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    for k in (0, 1):
        base = f"mtp.layers.{k}"
        assert shapes[f"{base}.eh_proj.weight"] == (16, 32)
        for n in ("enorm.weight", "hnorm.weight", "final_layernorm.weight",
                  "transformer_layer.self_attention.linear_qkv.layer_norm_weight",
                  "transformer_layer.mlp.linear_fc1.layer_norm_weight"):
            assert shapes[f"{base}.{n}"] == (16,), n
        assert shapes[f"{base}.transformer_layer.self_attention.linear_qkv.weight"] == (32, 16)
        assert shapes[f"{base}.transformer_layer.mlp.linear_fc1.weight"] == (64, 16)
        assert f"optimizer.state.exp_avg.{base}.eh_proj.weight" in shapes
        assert f"{base}.eh_proj._extra_state/shard_0_1" in md.state_dict_metadata
        assert f"{base}.transformer_layer.mlp.linear_fc2._extra_state/shard_0_1" in md.state_dict_metadata
    assert not any(k.startswith("mtp.layers.transformer_layer") for k in shapes)
    args = read_common_state(find_megatron_checkpoint(out))["args"]
    assert (args.mtp_num_layers, args.mtp_loss_scaling_factor) == (2, 0.3)


def test_mixture_of_experts_depth_as_megatron_core_saves_it(sources, tmp_path):
    """A depth whose layer has experts: stacked [experts, ...] without a layer axis, one Transformer Engine entry
    per expert, the router and its expert bias, the shared expert; the pre-MLP norm under Transformer Engine's own
    module name, as in the decoder's mixture-of-experts layers."""
    out = _export(sources["moe_mtp"], tmp_path / "mg")
    md = read_index(out / "iter_0000003")
    shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    base = "mtp.layers.0.transformer_layer"
    assert shapes[f"{base}.mlp.experts.experts.linear_fc1.weight"] == (4, 24, 16)
    assert shapes[f"{base}.mlp.experts.experts.linear_fc2.weight"] == (4, 16, 12)
    assert shapes[f"{base}.mlp.router.expert_bias"] == (4,) and shapes[f"{base}.mlp.router.weight"] == (4, 16)
    assert shapes[f"{base}.mlp.shared_experts.linear_fc1.weight"] == (16, 16)
    assert shapes[f"{base}.pre_mlp_layernorm.weight"] == (16,)
    assert f"{base}.mlp.experts.experts.linear_fc1._extra_state/shard_3_4" in md.state_dict_metadata
    assert "output_layer.weight" not in shapes  # tied


def test_mtp_without_normed_hidden_states_is_written_with_a_notice(sources, tmp_path, capsys):
    """A model whose depths read the hidden states before the final norms (meshtron's default): its weights are
    written all the same, with a notice that megatron-core's depths compute from the normed ones."""
    ckpt = resolve_checkpoint(sources["mtp"])
    copy = tmp_path / "src"
    shutil.copytree(ckpt.parent, copy)
    config = next(copy.rglob("config.yaml"))
    values = yaml.safe_load(config.read_text())
    values["mtp_normed_hidden_states"] = False
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    notices: list[str] = []
    meshtron_to_megatron(copy, tmp_path / "mg", notices=notices, verify=False)
    assert any("--mtp-normed-hidden-states" in n and "loss differs" in n for n in notices), notices
    state = read_megatron(find_megatron_checkpoint(tmp_path / "mg"), vocab_size=exported.VOCAB, optimizer=False)
    assert all(torch.equal(t, state.model[k]) for k, t in read_canonical(ckpt, "model.").items())


@pytest.mark.parametrize("kind,expected", [("HuggingFaceTokenizer", "HuggingFaceTokenizer"),
                                           ("GPT2BPETokenizer", "GPT2BPETokenizer"),
                                           ("SentencePieceTokenizer", "SentencePieceTokenizer"),
                                           ("TikTokenizer", "TikTokenizer"), ("NullTokenizer", "NullTokenizer"),
                                           ("ByteTokenizer", None), (None, None)])
def test_args_name_the_tokenizer(kind, expected, sources, tmp_path):
    """args.tokenizer_type: Megatron-LM's name of the run's tokenizer (the same names), with the tokenizer's file;
    left out for meshtron's byte tokenizer (no Megatron-LM counterpart; a notice says so) and without a tokenizer."""
    ckpt = resolve_checkpoint(sources["dense"])
    copy = tmp_path / "src"
    shutil.copytree(ckpt.parent, copy)
    config = next(copy.rglob("config.yaml"))
    values = yaml.safe_load(config.read_text())
    values.update(tokenizer_type=kind, tokenizer_model="/data/tok" if kind else None)
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    notices: list[str] = []
    meshtron_to_megatron(copy, tmp_path / "mg", notices=notices, verify=False)
    args = read_common_state(find_megatron_checkpoint(tmp_path / "mg"))["args"]
    assert getattr(args, "tokenizer_type", None) == expected
    assert getattr(args, "tokenizer_model", None) == ("/data/tok" if expected else None)
    assert any("ByteTokenizer has no Megatron-LM counterpart" in n for n in notices) == (kind == "ByteTokenizer")


def test_tokenizer_kind_from_the_saved_tokenizer(tmp_path):
    """Without --tokenizer-type, the kind of the tokenizer saved in the checkpoint (GPT-2 BPE from its files)."""
    from meshtron.checkpoint.megatron.export import tokenizer_kind
    from meshtron.config import MeshtronConfig

    cfg = MeshtronConfig()
    assert tokenizer_kind(cfg, tmp_path) is None
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "meshtron_tokenizer.json").write_text('{"tokenizer_type": "TikTokenizer"}')
    assert tokenizer_kind(cfg, tmp_path) == "TikTokenizer"
    cfg.data.vocab_file, cfg.data.merge_file = "vocab.json", "merges.txt"
    assert tokenizer_kind(cfg, tmp_path) == "GPT2BPETokenizer"


def test_interleaved_export_as_megatron_core_loaded_it(sources, reference, tmp_path):
    """--megatron-rotary-interleaved: args.rotary_interleaved, and the optimizer tensors megatron-core loaded into
    its model with --rotary-interleaved are what meshtron wrote (the query/key rows reordered as the weights)."""
    ref = reference["cases"]["rope_partial"]
    assert ref["interleaved_args"]["rotary_interleaved"] and ref["interleaved_args"]["rotary_percent"] == 0.5
    out = _export(sources["rope_partial"], tmp_path / "mg", "--megatron-spec", "local", "--megatron-rotary-interleaved")
    assert read_common_state(find_megatron_checkpoint(out))["args"].rotary_interleaved
    d = out / "iter_0000003"
    md = read_index(d)
    keys = [k for k in md.state_dict_metadata if k.startswith("optimizer.state.")]
    assert sorted(keys) == sorted(ref["interleaved_optimizer"])
    tensors, _ = read_entries(d, md, keys)
    for key in keys:
        torch.testing.assert_close(fingerprint(tensors[key]), ref["interleaved_optimizer"][key], rtol=1e-9, atol=1e-7)
    qkv = "optimizer.state.param.decoder.layers.self_attention.linear_qkv.weight"
    assert not torch.equal(ref["interleaved_optimizer"][qkv], ref["optimizer"][qkv])  # the rows did move


@pytest.mark.parametrize("which", ["dense", "moe", "moe_ep2", "mtp", "moe_mtp", "mla_yarn", "moe_gate",
                                   "rope_partial", "moe_mixed", "moe_freq2_mtp"])
def test_megatron_cores_distributed_optimizer_took_the_state(which, sources, reference, tmp_path):
    """megatron-core's DistributedOptimizer (Megatron-LM's parameter groups; experts chained at expert-parallel 2)
    loaded the export with ``optimizer.load_state_dict`` and saved it again: what it saved is what meshtron wrote,
    and every group took the step count."""
    case, extra = (which, ()) if which != "moe_ep2" else ("moe", ("--megatron-expert-parallel-size", "2"))
    ref = reference["cases"][case]["distributed_optimizer" + ("_ep2" if extra else "")]
    assert ref["steps"] == [exported.ITERATION] * (3 if extra else 2)
    out = _export(sources[case], tmp_path / "mg", "--megatron-spec", "local", *extra)
    d = out / "iter_0000003"
    md = read_index(d)
    keys = [k for k in md.state_dict_metadata if k.startswith("optimizer.state.")]
    assert sorted(keys) == sorted(ref["optimizer"])
    tensors, _ = read_entries(d, md, keys)
    for key in keys:
        torch.testing.assert_close(fingerprint(tensors[key]), ref["optimizer"][key], rtol=1e-9, atol=1e-7)


def test_mixed_layers_export_is_megatron_cores_own_save(tmp_path):
    """Dense and mixture-of-experts layers mixed (``--moe-layer-freq [0,1,1]``): megatron-core's own checkpoint (the
    ``moe_mixed_ep2`` fixture of make_checkpoints.py, each layer under its own number, experts [experts, ...],
    fully reshardable optimizer state) read and written again at expert-parallel 2 with ``--megatron-spec local``
    gives megatron-core's keys, shapes and bit for bit its tensors (weights, masters, moments), its Transformer Engine
    entries and args.moe_layer_freq; what is read back computes megatron-core's logits."""
    src = FIXTURES / "moe_mixed_ep2" / "iter_0000007"
    assert convert_main(["--from", "megatron", "--input", str(src.parent), "--output", str(tmp_path / "c")]) == 0
    out = tmp_path / "mg"
    assert convert_main(["--to", "megatron", "--input", str(tmp_path / "c"), "--output", str(out),
                         "--megatron-spec", "local", "--megatron-expert-parallel-size", "2"]) == 0
    written = next(out.glob("iter_*"))
    ma, mb = read_index(src), read_index(written)
    assert set(ma.state_dict_metadata) == set(mb.state_dict_metadata)
    keys = [k for k, v in ma.state_dict_metadata.items() if hasattr(v, "chunks")]
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in keys
    assert "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight" in keys
    a, _ = read_entries(src, ma, keys)
    b, _ = read_entries(written, mb, keys)
    for k in keys:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    common = read_common_state(find_megatron_checkpoint(out))
    assert common["args"].moe_layer_freq == read_common_state(find_megatron_checkpoint(src.parent))[
        "args"].moe_layer_freq == [0, 1, 1]
    assert sorted(common["optimizer"]) == [0, 1]  # the experts' optimizer chained at expert-parallel 2
    ref = torch.load(FIXTURES / "reference.pt", weights_only=True)
    assert convert_main(["--from", "megatron", "--input", str(out), "--output", str(tmp_path / "back")]) == 0
    model, _ = load_for_inference(tmp_path / "back", "cpu", torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ref["tokens"]), ref["logits"]["moe_mixed_ep2"], rtol=0, atol=2e-5)


def test_mixed_layers_layout(sources, tmp_path):
    """meshtron's --moe-first-dense-layers 1 (4 layers): each layer under its own number (megatron-core's
    "non-homogeneous" layers; nothing stacked over the layers), the dense layer's MLP, the others' experts
    [experts, ...] with one Transformer Engine entry per expert without a layer axis, Megatron-LM's
    --moe-layer-freq as the list, and Transformer Engine's own pre-MLP norm name in the mixture-of-experts layers."""
    out = _export(sources["moe_mixed"], tmp_path / "mg")
    md = read_index(out / "iter_0000003")
    shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    assert not any(k.startswith("decoder.layers.") and not k.split(".")[2].isdigit() for k in md.state_dict_metadata)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (64, 16)
    assert shapes["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == (16,)
    assert not any(k.startswith("decoder.layers.0.mlp.experts") for k in shapes)
    for layer in (1, 2, 3):
        base = f"decoder.layers.{layer}"
        assert shapes[f"{base}.mlp.experts.experts.linear_fc1.weight"] == (4, 24, 16)
        assert shapes[f"{base}.pre_mlp_layernorm.weight"] == (16,)
        assert shapes[f"{base}.mlp.router.expert_bias"] == (4,)
        assert f"{base}.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in md.state_dict_metadata
        assert f"{base}.mlp.linear_fc1.weight" not in shapes
    assert "decoder.layers.0.mlp.linear_fc2._extra_state/shard_0_1" in md.state_dict_metadata
    assert "optimizer.state.param.decoder.layers.2.mlp.shared_experts.linear_fc1.weight" in shapes
    assert read_common_state(find_megatron_checkpoint(out))["args"].moe_layer_freq == [0, 1, 1, 1]


@pytest.mark.parametrize("settings,freq", [
    (dict(moe_layer_freq=2), 2), (dict(moe_layer_freq=3), 3), (dict(moe_first_dense_layers=3), [0, 0, 0, 1, 1, 1]),
    (dict(moe_layer_freq=2, moe_first_dense_layers=1), [0, 0, 1, 0, 1, 0]), ({}, 1),
    (dict(layer_pattern="gqa+moe,gqa+dense*2,gqa+moe*3"), [1, 0, 0, 1, 1, 1])])
def test_moe_layer_freq_as_megatron_lm_writes_it(settings, freq):
    """args.moe_layer_freq: Megatron-LM's integer N where the experts are in every N-th layer from layer 0 (its
    i % N == 0), else the list of 0/1 per layer (first dense layers, a --layer-pattern); 1 when all are alike.
    Only 1 keeps the layers stacked, as megatron-core decides; meshtron's reader reads both forms back as the same
    layers."""
    import argparse

    from meshtron.checkpoint.megatron.args import apply_settings, model_settings
    from meshtron.checkpoint.megatron.export import moe_layer_freq, stacked_layers
    from meshtron.config import ModelConfig
    from meshtron.layer_kinds.pattern import is_moe_layer

    m = ModelConfig()
    m.num_layers, m.num_experts = 6, 4
    for k, v in settings.items():
        setattr(m, k, v)
    assert moe_layer_freq(m) == freq
    assert stacked_layers(m) == (freq == 1)
    args = argparse.Namespace(num_layers=6, hidden_size=16, num_attention_heads=4, num_experts=4, moe_layer_freq=freq)
    back = apply_settings(ModelConfig(), model_settings(args, "args"))
    assert [is_moe_layer(back, i) for i in range(6)] == [is_moe_layer(m, i) for i in range(6)]


@pytest.mark.slow
def test_megatron_core_loads_the_export_live(tmp_path):
    """megatron-core itself (where importable) loads fresh exports: the reference is made again and compared."""
    sys.path.insert(0, str(FIXTURES.parents[1]))
    from tests.megatron_oracle import _core_package

    _core_package()  # skips without megatron-core
    out = tmp_path / "ref.pt"
    env = dict(os.environ, PYTHONPATH=str(FIXTURES.parents[2]))
    run = subprocess.run([sys.executable, str(FIXTURES / "make_exported_reference.py"), "--output", str(out),
                          "--tp1-only"], capture_output=True, text=True, timeout=900, env=env,
                         cwd=FIXTURES.parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    fresh = torch.load(out, weights_only=True)
    recorded = torch.load(FIXTURES / "exported_reference.pt", weights_only=True)
    for case in CASES:
        source = exported.write_meshtron_checkpoint(tmp_path / case, case)
        mine = _logits(source, fresh["tokens"])
        got = fresh["cases"][case]
        torch.testing.assert_close(got["logits"][..., :exported.VOCAB], mine, rtol=0, atol=2e-5)
        if "mtp_losses" in got:  # the export read back: Megatron's padded vocabulary, as megatron-core's model
            back = tmp_path / f"{case}_back"
            megatron = meshtron_to_megatron(source, tmp_path / f"{case}_mg", spec="local").parent
            assert convert_main(["--from", "megatron", "--input", str(megatron), "--output", str(back)]) == 0
            model, _ = load_for_inference(back, "cpu", torch.float32)
            main, depths = mtp_losses(model, got["mtp_batch"])
            torch.testing.assert_close(got["mtp_losses"]["loss"], main, rtol=0, atol=2e-5)
            torch.testing.assert_close(got["mtp_losses"]["depths"], depths, rtol=0, atol=2e-5)
        assert got["distributed_optimizer"]["steps"] == [exported.ITERATION] * 2
        for key, value in recorded["cases"][case]["distributed_optimizer"]["optimizer"].items():
            torch.testing.assert_close(got["distributed_optimizer"]["optimizer"][key], value, rtol=1e-9, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Refusals.
# ---------------------------------------------------------------------------------------------

def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_model_megatron_cannot_express_is_refused_in_one_line(sources, tmp_path, capsys):
    ckpt = resolve_checkpoint(sources["dense"])
    copy = tmp_path / "src"
    shutil.copytree(ckpt.parent, copy)
    config = next(copy.rglob("config.yaml"))
    values = yaml.safe_load(config.read_text())  # flat: one key per flag
    # megatron-core adds the shifted position's embedding to a prediction depth's input: not meshtron's model
    values.update(mtp_num_layers=1, position_embedding_type="learned_absolute")
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    code = convert_main(["--to", "megatron", "--input", str(copy), "--output", str(tmp_path / "mg"),
                         "--no-verify-checkpoint"])
    assert code == 2
    line = _one_line_error(capsys)
    assert "--mtp-num-layers with learned absolute position embeddings" in line
    assert "cannot be written as a Megatron-LM checkpoint" in line
    assert not (tmp_path / "mg").exists()


def test_non_empty_output_refused_unless_added_to(sources, tmp_path, capsys):
    out = tmp_path / "mg"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert convert_main(["--to", "megatron", "--input", str(sources["dense"]), "--output", str(out)]) == 2
    assert "--add-to-existing" in _one_line_error(capsys)
    _export(sources["dense"], out, "--add-to-existing")
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3" and (out / "notes.txt").exists()
    assert convert_main(["--to", "megatron", "--input", str(sources["dense"]), "--output", str(out),
                         "--add-to-existing"]) == 2
    assert "already holds iter_0000003" in _one_line_error(capsys)


def test_failed_write_leaves_no_checkpoint_marked_latest(sources, tmp_path, monkeypatch, capsys):
    """A save directory with iteration 1 marked latest: a write of iteration 3 that fails part-way leaves it as it
    was (no iter_0000003, the tracker still naming 1)."""
    out = tmp_path / "mg"
    out.mkdir()
    (out / "iter_0000001").mkdir()
    (out / "latest_checkpointed_iteration.txt").write_text("1")
    real = files.write_iteration

    def fail_half_way(directory, *args):
        real(directory, *args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_iteration", fail_half_way)
    with pytest.raises(CheckpointError, match="no space left|No space left"):
        meshtron_to_megatron(sources["dense"], out, add_to_existing=True)
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "1"
    with pytest.raises(CheckpointError):
        meshtron_to_megatron(sources["dense"], tmp_path / "fresh" / "mg")
    assert not (tmp_path / "fresh").exists()


def test_train_exports_its_last_checkpoint(tmp_path):
    """meshtron train --export-megatron: the checkpoint saved at the end, also as a Megatron-LM checkpoint."""
    cmd = [sys.executable, "-m", "meshtron", "train", "--mock-data", "--device", "cpu", "--num-layers", "2",
           "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "8", "--vocab-size", "64",
           "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--train-iters", "2",
           "--global-batch-size", "2", "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "1",
           "--save", str(tmp_path / "run"), "--export-megatron", str(tmp_path / "mg")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    state = read_megatron(find_megatron_checkpoint(tmp_path / "mg"), vocab_size=64)
    assert (state.iteration, state.step, state.consumed_samples) == (2, 2, 4)
    weights = read_canonical(resolve_checkpoint(tmp_path / "run"), "model.")
    assert all(torch.equal(t, state.model[name]) for name, t in weights.items())
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # finished: resumes, nothing to do
    assert again.returncode == 0 and "exists already; not written again" in again.stdout + again.stderr, \
        again.stderr[-2000:]


def test_export_megatron_needs_save(tmp_path):
    from meshtron.config import MeshtronConfig
    from meshtron.errors import ConfigError
    from meshtron.validation import validate_config

    cfg = MeshtronConfig()
    for key, value in dict(mock_data=True, device="cpu", export_megatron=str(tmp_path / "mg")).items():
        cfg.set(key, value)
    with pytest.raises(ConfigError, match="--export-megatron .*give --save too"):
        validate_config(cfg, 1)


def test_mla_export_is_megatron_cores_own_save(tmp_path):
    """Multi-latent attention: megatron-core's own checkpoint (the ``mla`` fixture of make_checkpoints.py) read and
    written again with ``--megatron-spec local`` gives megatron-core's keys, bit for bit its tensors (the rotary
    rows back in interleaved pairs) and its Transformer Engine entries; what is read back computes megatron-core's
    logits. With Transformer Engine's spec the latent norms and the pre-MLP norm take its fused names."""
    src = FIXTURES / "mla" / "iter_0000007"
    assert convert_main(["--from", "megatron", "--input", str(src.parent), "--output", str(tmp_path / "c")]) == 0
    for spec in ("local", "transformer_engine"):
        out = tmp_path / spec
        assert convert_main(["--to", "megatron", "--input", str(tmp_path / "c"), "--output", str(out),
                             "--megatron-spec", spec]) == 0
        written = next(out.glob("iter_*"))
        ma, mb = read_index(src), read_index(written)
        theirs, ours = set(ma.state_dict_metadata), set(mb.state_dict_metadata)
        if spec == "local":
            assert theirs == ours
        else:
            renamed = {"decoder.layers.pre_mlp_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                       "decoder.layers.self_attention.q_layernorm.weight":
                           "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
                       "decoder.layers.self_attention.kv_layernorm.weight":
                           "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight"}
            assert {renamed.get(k, k) for k in theirs} == ours
        keys = [k for k, v in ma.state_dict_metadata.items() if hasattr(v, "chunks") and k in ours]
        a, _ = read_entries(src, ma, keys)
        b, _ = read_entries(written, mb, keys)
        for k in keys:
            assert torch.equal(a[k], b[k]), (spec, k)
    ref = torch.load(FIXTURES / "reference.pt", weights_only=True)
    assert convert_main(["--from", "megatron", "--input", str(tmp_path / "local"), "--output",
                         str(tmp_path / "back")]) == 0
    model, _ = load_for_inference(tmp_path / "back", "cpu", torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ref["tokens"]), ref["logits"]["mla"], rtol=0, atol=2e-5)


def test_train_exports_for_the_transformer_impl_given(tmp_path):
    """--transformer-impl local (Megatron-LM's flag): --export-megatron writes a mixture-of-experts layer's pre-MLP
    norm under the local spec's name, which Megatron-LM's local layers load (the Transformer Engine spec's
    ``pre_mlp_layernorm`` is what they refuse)."""
    from meshtron.checkpoint.megatron import torch_dist

    cmd = [sys.executable, "-m", "meshtron", "train", "--mock-data", "--device", "cpu", "--num-layers", "1",
           "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "8", "--vocab-size", "64",
           "--swiglu", "--normalization", "RMSNorm", "--num-experts", "2", "--moe-ffn-hidden-size", "8",
           "--train-iters", "1", "--global-batch-size", "2", "--micro-batch-size", "2", "--eval-iters", "0",
           "--transformer-impl", "local", "--save", str(tmp_path / "run"), "--export-megatron", str(tmp_path / "mg")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    keys = set(torch_dist.read_index(tmp_path / "mg" / "iter_0000001").state_dict_metadata)
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys, sorted(keys)
    assert not any("pre_mlp_layernorm" in k for k in keys)
