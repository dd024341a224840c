"""Megatron-LM model variants carried over both ways: multi-latent attention with YaRN, the gated shared expert
(``--moe-shared-expert-gate``), partial and interleaved RoPE (``--rotary-percent``, ``--rotary-interleaved``).

The fixtures were written by megatron-core 0.19.2 itself (tests/fixtures/megatron/make_checkpoints.py), each with
fully reshardable optimizer state:

* ``mla_yarn``: multi-latent attention (8 rotary dimensions) with ``--rope-type`` unset (megatron-core's MLA then
  takes YaRN), ``--rotary-scaling-factor 4 --mscale 1 --mscale-all-dim 0.7``, the original context and betas
  MLATransformerConfig's (4096, 32, 1: Megatron-LM has no flags for them);
* ``moe_gate_ep2``: 4 experts top 2 and a shared expert whose output a sigmoid gate scales, expert-parallel 2;
* ``rope_partial_interleaved_tp2``: grouped-query attention (head size 8, query/key head norms) rotating the first
  half of each head in interleaved pairs (``--rotary-percent 0.5 --rotary-interleaved``), TP=2;
* ``gqa_yarn_tp2``: grouped-query attention (head size 8) with ``--position-embedding-type yarn`` and every YaRN
  flag of Megatron-LM set (factor 4, original context 64, betas 4 / 0.5, the ramp's ends fractional, mscales
  0.9 / 0.2), TP=2.

``reference.pt`` holds megatron-core's logits of each, loaded into a TP=1 model. The other direction (meshtron's
``convert --to megatron`` of these models, loaded by megatron-core) is in test_megatron_export.py; here the
export of the fixtures themselves is compared with megatron-core's own save.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint import load_for_inference
from meshtron.checkpoint.convert import convert_main
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron import find_megatron_checkpoint
from meshtron.checkpoint.megatron.args import check_model, model_settings
from meshtron.checkpoint.megatron.names import rotate_half_rows
from meshtron.checkpoint.megatron.reader import read_common_state, read_megatron
from meshtron.checkpoint.megatron.torch_dist import read_entries, read_index
from meshtron.checkpoint.metadata import read_config
from meshtron.config import ModelConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
YARN, GATE, ROPE, GQA_YARN = "mla_yarn", "moe_gate_ep2", "rope_partial_interleaved_tp2", "gqa_yarn_tp2"
CASES = (YARN, GATE, ROPE, GQA_YARN)


@pytest.fixture(scope="module")
def reference():
    return torch.load(FIXTURES / "reference.pt", weights_only=True)


def _args(name: str):
    return read_common_state(find_megatron_checkpoint(FIXTURES / name))["args"]


def _convert(name: str, out: Path) -> Path:
    assert convert_main(["--from", "megatron", "--input", str(FIXTURES / name), "--output", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", CASES)
def test_converted_logits_equal_megatron_cores(name, tmp_path, reference):
    """Converted (weights and optimizer state), the model computes megatron-core's logits (fp32)."""
    out = _convert(name, tmp_path / "c")
    model, _ = load_for_inference(out, "cpu", torch.float32)
    with torch.no_grad():
        logits = model(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][name], rtol=0, atol=2e-5)


def test_yarn_flags_carry_over(tmp_path):
    """megatron-core's multi-latent attention with --rope-type unset is YaRN: the converted model takes
    Megatron-LM's --rotary-scaling-factor, --mscale, --mscale-all-dim and MLATransformerConfig's original
    context, betas and rounded ramp ends; a checkpoint whose args hold those config fields gives them instead."""
    m = read_config(next(_convert(YARN, tmp_path / "c").glob("iter_*"))).model
    assert _args(YARN).rope_type is None
    assert (m.rope_type, m.rotary_scaling_factor, m.mscale, m.mscale_all_dim) == ("yarn", 4.0, 1.0, 0.7)
    assert (m.yarn_original_max_position_embeddings, m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_truncate) == \
        (4096, 32.0, 1.0, True)
    args = copy.copy(_args(YARN))
    args.original_max_position_embeddings, args.beta_fast, args.beta_slow = 8192, 16.0, 2.0
    s = model_settings(args, "X")
    assert (s["yarn_original_max_position_embeddings"], s["yarn_beta_fast"], s["yarn_beta_slow"]) == (8192, 16.0, 2.0)


def test_yarn_differences_would_show(tmp_path, reference):
    """Each YaRN detail moves megatron-core's logits by far more than the tolerance: plain RoPE, fractional ramp
    ends (gpt-oss's), the softmax's mscale^2 and the tables' concentration factor."""
    out = _convert(YARN, tmp_path / "c")
    _assert_each_change_moves_the_logits(out, reference, YARN, ({"rope_type": "rope"}, {"yarn_truncate": False},
                                                                 {"mscale_all_dim": 0.0}, {"mscale": 0.7}))


def _assert_each_change_moves_the_logits(out, reference, case: str, changes) -> None:
    """Each change of the converted checkpoint's model settings moves its logits away from megatron-core's
    recorded ones by more than 1e-4."""
    import yaml

    config = next(out.rglob("config.yaml"))
    values = yaml.safe_load(config.read_text())
    for change in changes:
        config.write_text(yaml.safe_dump(dict(values, **change), sort_keys=False))
        model, _ = load_for_inference(out, "cpu", torch.float32, verify=False)
        with torch.no_grad():
            diff = (model(reference["tokens"]) - reference["logits"][case]).abs().max()
        assert diff > 1e-4, change


def test_gqa_yarn_flags_carry_over(tmp_path, reference):
    """--position-embedding-type yarn: the converted model is meshtron's RoPE with --rope-type yarn and the
    checkpoint's flags; each YaRN detail moves megatron-core's logits by far more than the tolerance."""
    out = _convert(GQA_YARN, tmp_path / "c")
    m = read_config(next(out.glob("iter_*"))).model
    assert (m.position_embedding_type, m.rope_type, m.rotary_scaling_factor, m.mscale, m.mscale_all_dim) == \
        ("rope", "yarn", 4.0, 0.9, 0.2)
    assert (m.yarn_original_max_position_embeddings, m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_truncate) == \
        (64, 4.0, 0.5, False)
    _assert_each_change_moves_the_logits(out, reference, GQA_YARN, ({"rope_type": "rope"}, {"yarn_truncate": True},
                                                                     {"mscale": 1.0}, {"yarn_beta_slow": 1.0}))


def test_gated_shared_expert_is_a_layer_kind(tmp_path):
    """--moe-shared-expert-gate: the MoE layers become moe_gated_shared, the gate [1, H] its shared_expert_gate."""
    state = read_megatron(find_megatron_checkpoint(FIXTURES / GATE))
    assert state.settings["layer_pattern"] == "gqa+moe_gated_shared*2"
    raw = {"decoder.layers.mlp.shared_experts.gate_weight": torch.empty(2, 1, 16)}
    raw, _ = read_entries(FIXTURES / GATE / "iter_0000007", read_index(FIXTURES / GATE / "iter_0000007"), list(raw))
    for layer in range(2):
        assert torch.equal(state.model[f"layers.{layer}.mlp.shared_expert_gate.weight"],
                           raw["decoder.layers.mlp.shared_experts.gate_weight"][layer])
    args = copy.copy(_args(GATE))
    args.moe_layer_freq = [0, 1]
    assert model_settings(args, "X")["layer_pattern"] == "gqa+dense,gqa+moe_gated_shared"


def test_interleaved_rows_reordered_per_head():
    """Each head's first rotated rows go from pairs (0, 1), (2, 3) to halves (0, 2), (1, 3); the rest of the head,
    values and other tensors stay; writing reorders them back."""
    shape = {"rope_interleaved": 4, "head_dim": 8}
    t = torch.arange(16.0)
    out = rotate_half_rows("layers.0.attention.q.weight", t, shape)
    assert out.tolist() == [0, 2, 1, 3, 4, 5, 6, 7, 8, 10, 9, 11, 12, 13, 14, 15]
    assert torch.equal(rotate_half_rows("attention.q.weight", out, shape, inverse=True), t)
    assert torch.equal(rotate_half_rows("layers.0.attention.k_norm.weight", t[:8], shape), out[:8])
    assert torch.equal(rotate_half_rows("layers.0.attention.v.weight", t, shape), t)


@pytest.mark.parametrize("name", CASES)
def test_optimizer_state_maps_like_the_weights(name):
    """The fully reshardable optimizer state goes through the weights' mapping (the fixtures' masters are the
    weights): YaRN's rotary rows, the gate and the reordered query/key rows alike."""
    state = read_megatron(find_megatron_checkpoint(FIXTURES / name))
    assert set(state.optim) == {"master", "exp_avg", "exp_avg_sq"} and state.step == 7
    assert set(state.optim["master"]) == {k for k in state.model if not k.endswith("expert_bias")}
    for k, t in state.optim["master"].items():
        assert torch.equal(t, state.model[k].float()), k


def test_refusals_named():
    """What megatron-core computes otherwise than meshtron: refused, the flag named."""
    cases = [(YARN, {"rope_type": "rope", "rotary_scaling_factor": 4.0}, "--mscale-all-dim 0.7"),
             (YARN, {"rope_type": "rope", "rotary_scaling_factor": 1.0, "rotary_percent": 0.5}, "--rotary-percent"),
             (YARN, {"qk_layernorm": False}, "without --qk-layernorm"),
             (ROPE, {"rotary_percent": 0.2}, "--rotary-percent 0.2 (rotates 1 of each head's 8"),
             (ROPE, {"position_embedding_type": "yarn"}, "--position-embedding-type yarn")]
    for name, change, flag in cases:
        args = copy.copy(_args(name))
        for k, v in change.items():
            setattr(args, k, v)
        with pytest.raises(CheckpointError) as err:
            model_settings(args, "Megatron-LM checkpoint X")
        assert any(flag in line for line in err.value.differences), (flag, err.value.differences)
    args = copy.copy(_args(YARN))
    args.rotary_percent = 0.5  # megatron-core's YaRN rotates the whole rotary part whatever --rotary-percent says
    assert "rotary_percent" not in model_settings(args, "X")


def test_run_flags_checked_against_the_checkpoint():
    """A run whose RoPE, YaRN or shared expert differs from the checkpoint's is refused, flag by flag."""
    for name, change, flag in ((YARN, {"mscale_all_dim": 1.0}, "--mscale-all-dim: checkpoint 0.7"),
                               (YARN, {"rope_type": "rope"}, "--rope-type: checkpoint 'yarn'"),
                               (ROPE, {"rotary_percent": 1.0}, "--rotary-percent: checkpoint 0.5"),
                               (GATE, {"layer_pattern": None}, "--layer-pattern: checkpoint 'gqa+moe_gated_shared*2'")):
        settings = model_settings(_args(name), "X")
        run = ModelConfig()
        for k, v in dict(settings, **change).items():
            if k != "vocab_size":
                setattr(run, k, v)
        check_model(settings, ModelConfig(**{k: v for k, v in settings.items() if k != "vocab_size"}), "X")
        with pytest.raises(CheckpointError) as err:
            check_model(settings, run, "Megatron-LM checkpoint X")
        assert any(line.startswith(flag) for line in err.value.differences), (flag, err.value.differences)
    # YaRN at --rotary-scaling-factor 1 is plain RoPE: a run with meshtron's MLA default (YaRN, factor 1) loads
    # the --rope-type rope checkpoint
    settings = model_settings(_args("mla"), "X")
    run = ModelConfig(**{k: v for k, v in settings.items() if k != "vocab_size"})
    run.rope_type, run.mscale_all_dim = None, 1.0
    check_model(settings, run, "X")


# ---------------------------------------------------------------------------------------------
# Written back: megatron-core's own save.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_export_is_megatron_cores_own_save(name, tmp_path, reference):
    """Read and written again with ``--megatron-spec local`` (the interleaved one with
    ``--megatron-rotary-interleaved``), each fixture gives megatron-core's keys and, bit for bit, its tensors and
    optimizer state, and args with its flags; what is read back computes megatron-core's logits. Without
    ``--megatron-rotary-interleaved`` the query/key rows are written in meshtron's rotate-half order, the same
    attention (args.rotary_interleaved False)."""
    src = FIXTURES / name / "iter_0000007"
    _convert(name, tmp_path / "c")
    flags = [["--megatron-rotary-interleaved"], []] if name == ROPE else [[]]
    for extra in flags:
        out = tmp_path / f"mg{len(extra)}"
        assert convert_main(["--to", "megatron", "--input", str(tmp_path / "c"), "--output", str(out),
                             "--megatron-spec", "local", *extra]) == 0
        written = next(out.glob("iter_*"))
        ma, mb = read_index(src), read_index(written)
        assert set(ma.state_dict_metadata) == set(mb.state_dict_metadata)
        keys = [k for k, v in ma.state_dict_metadata.items() if hasattr(v, "chunks")]
        a, _ = read_entries(src, ma, keys)
        b, _ = read_entries(written, mb, keys)
        differ = {k for k in keys if not torch.equal(a[k], b[k])}
        if extra or name != ROPE:
            assert not differ
        else:
            assert differ and all("linear_qkv" in k or "q_layernorm" in k or "k_layernorm" in k for k in differ)
        theirs, ours = _args(name), read_common_state(find_megatron_checkpoint(out))["args"]
        for flag in ("rotary_percent", "moe_shared_expert_gate", "multi_latent_attention", "rotary_scaling_factor",
                     "mscale", "mscale_all_dim", "kv_channels", "qk_layernorm"):
            assert getattr(ours, flag, None) == getattr(theirs, flag, None), flag
        assert ours.rotary_interleaved == bool(extra)
        assert getattr(ours, "rope_type", None) == ("yarn" if name == YARN else None)  # theirs: unset, the same
        for flag in ("position_embedding_type", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                     "yarn_beta_slow", "yarn_correction_range_round_to_int"):
            assert getattr(ours, flag, None) == getattr(theirs, flag, None), flag
        back = tmp_path / f"back{len(extra)}"
        assert convert_main(["--from", "megatron", "--input", str(out), "--output", str(back), "--no-optimizer"]) == 0
        model, _ = load_for_inference(back, "cpu", torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(model(reference["tokens"]), reference["logits"][name], rtol=0, atol=2e-5)


def test_what_megatron_cannot_be_given_is_refused(tmp_path, capsys):
    """YaRN values Megatron-LM has no flag for with multi-latent attention, gated and plain shared experts mixed,
    and --megatron-rotary-interleaved for multi-latent attention: refused in one line naming the flag."""
    import yaml

    _convert(YARN, tmp_path / "c")
    config = next((tmp_path / "c").rglob("config.yaml"))
    values = yaml.safe_load(config.read_text())
    for change, extra, flag in (({"yarn_original_max_position_embeddings": 8192}, [],
                                 "--yarn-original-max-position-embeddings 8192"),
                                ({"yarn_truncate": False}, [], "--no-yarn-truncate"),
                                ({}, ["--megatron-rotary-interleaved"], "--megatron-rotary-interleaved")):
        config.write_text(yaml.safe_dump(dict(values, **change), sort_keys=False))
        out = tmp_path / "mg"
        assert convert_main(["--to", "megatron", "--input", str(tmp_path / "c"), "--output", str(out),
                             "--no-verify-checkpoint", *extra]) == 2
        err = capsys.readouterr().err
        assert flag in err and "cannot be written as a Megatron-LM checkpoint" in err, err
        assert not out.exists()
    from meshtron.checkpoint.megatron.export import unsupported

    m = ModelConfig(num_layers=2, num_experts=4, moe_shared_expert_intermediate_size=8,
                    layer_pattern="gqa+moe,gqa+moe_gated_shared")
    assert any("--layer-pattern gqa+moe,gqa+moe_gated_shared" in p for p in unsupported(m))


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES + ("rope_partial_interleaved_tp2_dp_reshardable",))
def test_train_continues_from_each(name):
    """meshtron train --load --use-checkpoint-args on each: the model flags taken from args (YaRN, the gated shared
    expert's layer pattern, --rotary-percent), resumed at iteration 7 with the optimizer state, trained on."""
    from ckpt_helpers import train_on_from_megatron

    train_on_from_megatron(FIXTURES / name)
