"""The layer kinds' descriptions against the model as built, and the per-layer pattern.

Each kind's torch-free description (:mod:`meshtron.layer_kinds`) must count what its module builds: the
whole model (``build.built_parameter_count``) for every preset and a few mixed patterns, and each layer's
mixer and MLP on one rank of a TP/EP split (built on the meta device with that rank's context).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from meshtron.build import built_parameter_count
from meshtron.config import ConfigError, MeshtronConfig, ModelConfig
from meshtron.layer_kinds import MIXERS, MLPS
from meshtron.layer_kinds.pattern import layer_kinds, parse_pattern, resolved_pattern
from meshtron.memory import layer_parameters
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.presets import PRESETS, apply_preset, count_parameters
from meshtron.cli import build_config
from meshtron.validation import validate_config

VOCAB = 1000  # for presets that leave the vocabulary to the tokenizer
ROOT = Path(__file__).resolve().parents[2]


def _small(**kw) -> ModelConfig:
    base = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       group_query_attention=True, ffn_hidden_size=64, seq_length=32, normalization="RMSNorm",
                       swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                       untie_embeddings_and_output_weights=True)
    return dataclasses.replace(base, **kw)


_MOE = dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)
_MLA = dict(multi_latent_attention=True, group_query_attention=False, num_query_groups=None, q_lora_rank=12,
            kv_lora_rank=16, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=8)
_GDN = dict(zero_centred_norm=True, rotary_percent=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6)
MIXED = {
    "dense-moe-alternating": _small(**_MOE, layer_pattern="gqa+dense,gqa+moe,gqa+dense,gqa+moe"),
    "moe-then-dense": _small(**_MOE, moe_shared_expert_intermediate_size=16, layer_pattern="gqa+moe*3,gqa+dense"),
    "mla-moe": _small(**_MOE, **_MLA, layer_pattern="mla+dense,mla+moe*3"),
    "mla-moe-biases": _small(**_MOE, **_MLA, disable_bias_linear=False, normalization="LayerNorm",
                             layer_pattern="mla+moe,mla+dense,mla+moe*2"),
    "gpt-oss": _small(**_MOE, disable_bias_linear=False, sliding_window_size=4,
                      layer_pattern="sink_window+oss_moe,sink+oss_moe,sink_window+oss_moe,sink+oss_moe"),
    "sinks-with-others": _small(**_MOE, sliding_window_size=4,
                                layer_pattern="sink_window+dense,gqa+oss_moe,sink+moe,gqa+dense"),
    "qwen3.5": _small(**_GDN, layer_pattern="gdn+dense*3,gated_attn+dense"),
    "qwen3.5-moe": _small(**_MOE, **_GDN, moe_shared_expert_intermediate_size=16,
                          layer_pattern="gdn+moe_gated_shared,gated_attn+moe_gated_shared,gdn+moe,gated_attn+dense"),
}


def _preset(name: str) -> ModelConfig:
    cfg = MeshtronConfig()
    apply_preset(cfg.model, name)
    return cfg.model


def _built(m: ModelConfig, vocab: int) -> int:
    cfg = MeshtronConfig()
    cfg.model = m
    return built_parameter_count(cfg, vocab)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_counted_by_its_kinds(name):
    m = _preset(name)
    vocab = m.vocab_size or VOCAB
    assert count_parameters(m, vocab)["total"] == _built(m, vocab)


@pytest.mark.parametrize("name", sorted(MIXED))
def test_mixed_patterns_are_counted_by_their_kinds(name):
    m = MIXED[name]
    assert count_parameters(m, 96)["total"] == _built(m, 96)


def _one_layer(m: ModelConfig, layer: int, tp: int) -> GPTModel:
    """Layer ``layer`` alone, as rank 0 of a TP split builds it (meta device: shapes only). Expert parallelism
    needs its group to build; its rank holds 1/EP of the experts, which the test multiplies back."""
    ctx = ParallelContext(tp=tp)
    return GPTModel(m, ctx, 96, layer_ids=[layer], pre_process=False, post_process=False).layers[str(layer)]


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _split_cases():
    cases = []
    for name in ("llama3-8b", "qwen3-0.6b", "gpt2-small", "mixtral-8x7b", "deepseek-v2-lite", "gpt-oss-20b",
                 "qwen3.5-35b-a3b"):
        m = _preset(name)
        entries = parse_pattern(m.layer_pattern) if m.layer_pattern else []
        first_two = [f"{mixer}+{mlp}" for mixer, mlp in entries[:2]] or None
        m = dataclasses.replace(m, num_layers=min(m.num_layers, 2), layer_pattern=first_two and ",".join(first_two),
                                moe_first_dense_layers=min(m.moe_first_dense_layers, 1))
        cases.append((name, m))
    cases += [(name, m) for name, m in MIXED.items()]
    return [pytest.param(m, tp, ep, id=f"{name}-tp{tp}-ep{ep}") for name, m in cases for tp, ep in ((1, 1), (2, 1), (2, 2))
            if not (ep > 1 and not m.num_experts)]


@pytest.mark.parametrize("m, tp, ep", _split_cases())
def test_each_layer_on_one_rank_is_counted_by_its_kinds(m, tp, ep):
    for i, kinds in enumerate(layer_kinds(m)):
        layer = _one_layer(m, i, tp)
        assert kinds.mixer.rank_parameters(m, tp) == _numel(layer.attention), (i, kinds.entry)
        mlp = kinds.mlp.rank_parameters(m, tp, ep, tp)
        assert mlp.dense + mlp.expert * ep == _numel(layer.mlp), (i, kinds.entry)
        dense, expert = layer_parameters(m, i, tp, ep, tp)
        assert dense + expert * ep == _numel(layer)
        assert (expert > 0) == kinds.mlp.has_experts


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "mixtral-8x7b", "llama3-8b"])
def test_matmul_and_active_counts_add_up_over_kinds(name):
    m = _preset(name)
    counts = count_parameters(m, VOCAB)
    kinds = layer_kinds(m)
    matmul = sum(k.mixer.parameters(m).matmul + k.mlp.parameters(m).matmul for k in kinds)
    assert counts["matmul"] == matmul + (m.mtp_num_layers or 0) * 0 + VOCAB * m.hidden_size + (
        (m.mtp_num_layers or 0) * (kinds[-1].mixer.parameters(m).matmul + kinds[-1].mlp.parameters(m).matmul
                                   + 2 * m.hidden_size ** 2 + VOCAB * m.hidden_size))
    assert counts["active"] <= counts["total"]


# ------------------------------------------------------------------ the pattern
def test_the_derived_pattern_follows_the_moe_flags():
    m = _small(**_MOE, num_layers=6, moe_first_dense_layers=1, moe_layer_freq=2)
    assert resolved_pattern(m) == "gqa+dense*2,gqa+moe,gqa+dense,gqa+moe,gqa+dense"
    assert resolved_pattern(_small(**_MLA)) == "mla+dense*4"


@pytest.mark.parametrize("pattern, message", [
    ("gqa+dense*3", "gives 3 layers but --num-layers is 4"),
    ("gqa+dense,gqa,gqa+dense*2", "bad entry 'gqa'"),
    ("gqa+dense*x,gqa+dense", "bad entry 'gqa+dense*x'"),
    ("gqa+dense*0,gqa+dense*4", "a repeat must be at least 1"),
    ("xyz+dense*4", "bad entry 'xyz+dense*4'"),
    ("gqa+moe*4", "moe layers need --num-experts"),
    ("mla+dense*4", "mla layers need --multi-latent-attention"),
])
def test_a_bad_pattern_is_refused_in_one_line(pattern, message):
    with pytest.raises(ConfigError) as err:
        validate_config(build_config(["--mock-data", "--device", "cpu", "--num-layers", "4", "--hidden-size", "64",
                                      "--num-attention-heads", "4", "--layer-pattern", pattern]), 1)
    text = str(err.value)
    assert "\n" not in text and text.startswith("--layer-pattern") and message in text


def test_the_model_builds_each_layer_from_its_entry():
    m = MIXED["mla-moe"]
    model = GPTModel(m, ParallelContext(), 96)
    built = [(type(layer.attention).__name__, type(layer.mlp).__name__) for layer in model.layers.values()]
    assert built == [("MultiLatentAttention", "MLP")] + [("MultiLatentAttention", "MoELayer")] * 3


def test_the_kinds_are_registered_by_name():
    assert set(MIXERS) >= {"gqa", "mla"} and set(MLPS) >= {"dense", "moe"}
    for kind in list(MIXERS.values()) + list(MLPS.values()):
        assert kind.module_class().__name__  # the module class is found through the registry


# ------------------------------------------------------------------ no kind branches outside the kinds
#: Modules that must ask a layer's kinds instead of testing the flags that choose them.
KIND_FREE = ["meshtron/memory.py", "meshtron/planning/step_time.py", "meshtron/planning/layer_costs.py",
             "meshtron/presets.py", "meshtron/training/metrics.py", "meshtron/pipeline/balance.py",
             "meshtron/model.py"]
#: Reading the flags that pick a layer's mixer or MLP kind (or the shapes only one kind has), or the helpers
#: that answered "is this an MLA / MoE layer" before the kinds did. (A preset's data may name them.)
KIND_TEST = re.compile(r"\.(?:multi_latent_attention|num_experts|moe_layer_freq|moe_first_dense_layers|"
                       r"moe_ffn_hidden_size|moe_shared_expert_intermediate_size|moe_router_topk|kv_lora_rank|"
                       r"q_lora_rank|qk_pos_emb_head_dim)\b|\bis_moe_layer\b|\bmla_\w*parameters\b|"
                       r"\battention_class\b")


@pytest.mark.parametrize("path", KIND_FREE)
def test_no_module_outside_the_kinds_branches_on_a_layer_kind(path):
    code = "\n".join(line for line in (ROOT / path).read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    code = re.sub(r'"""(.|\n)*?"""', "", code)  # docstrings may name the flags
    assert [hit.group(0) for hit in KIND_TEST.finditer(code)] == [], path


# ------------------------------------------------------------------ training with an explicit pattern
def _training_config(pattern=None) -> MeshtronConfig:
    """A few CPU steps of a small MoE model with its first layer dense (experts on layers 1-3)."""
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 4, 32, 4, 64, 16
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    m.disable_bias_linear, m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk = True, 4, 16, 2
    m.moe_first_dense_layers, m.moe_aux_loss_coeff, m.layer_pattern = 1, 0.05, pattern
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 2, 3, 5, "cpu"
    t.eval_interval, t.eval_iters, t.compile, t.generate_sample = 1000, 0, False, False
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    cfg.optim.lr, cfg.optim.lr_warmup_iters = 1e-2, 0
    cfg.log.log_interval, cfg.log.quiet, cfg.log.progress_bar = 1, True, False
    return cfg


def test_an_explicit_pattern_equal_to_the_derived_one_trains_identically():
    from meshtron.training.trainer import run_training

    derived = run_training(_training_config())
    explicit = run_training(_training_config("gqa+dense,gqa+moe*3"))
    assert derived.train_losses and explicit.train_losses == derived.train_losses
    other = run_training(_training_config("gqa+moe*3,gqa+dense"))  # the same flags, another pattern
    assert other.train_losses != derived.train_losses


# ------------------------------------------------------------------ the models of the model, per layer
def _run_config(m: ModelConfig, pp: int = 1) -> MeshtronConfig:
    cfg = MeshtronConfig()
    cfg.model = m
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 8
    return cfg


def test_an_explicit_pattern_equal_to_the_derived_one_changes_no_estimate():
    from meshtron.memory import stage_estimates
    from meshtron.planning.profiles import H200
    from meshtron.planning.step_time import predict_step
    from meshtron.training.metrics import flops_per_token

    derived = _preset("deepseek-v2-lite")
    explicit = dataclasses.replace(derived, layer_pattern=resolved_pattern(derived))
    assert explicit.layer_pattern == "mla+dense,mla+moe*26"
    for m in (derived, explicit):
        assert [k.entry for k in layer_kinds(m)] == ["mla+dense"] + ["mla+moe"] * 26
    a, b = _run_config(derived, pp=3), _run_config(explicit, pp=3)
    assert stage_estimates(a, 102400, world_size=6) == stage_estimates(b, 102400, world_size=6)
    assert predict_step(a, 6, H200, 102400) == predict_step(b, 6, H200, 102400)
    assert flops_per_token(derived, 102400) == flops_per_token(explicit, 102400)


def test_moving_the_experts_moves_the_estimates_with_them():
    from meshtron.memory import stage_estimates

    first = _small(**_MOE, num_layers=4, layer_pattern="gqa+moe*2,gqa+dense*2", ffn_hidden_size=512)
    last = dataclasses.replace(first, layer_pattern="gqa+dense*2,gqa+moe*2")
    a, b = (stage_estimates(_run_config(m, pp=2), 96) for m in (first, last))
    assert a[0].weights < a[1].weights and b[0].weights > b[1].weights  # the dense layers are the heavy ones
    assert count_parameters(first, 96) == count_parameters(last, 96)


def test_the_balance_hint_weighs_each_layer_by_its_kinds():
    from meshtron.pipeline.balance import layer_costs

    assert set(layer_costs(_preset("llama3-8b"))) == {1.0}
    costs = layer_costs(_small(**_MOE, ffn_hidden_size=512, layer_pattern="gqa+dense,gqa+moe*3"))
    assert costs[0] > costs[1] == costs[2] == costs[3] and sum(costs) == pytest.approx(4.0)


# ------------------------------------------------------------------ checkpoints
def test_a_checkpoint_records_a_pattern_other_than_the_derived_one():
    from meshtron.checkpoint.metadata import compare_signatures, model_signature

    derived = _small(**_MOE, moe_first_dense_layers=1)
    same = dataclasses.replace(derived, layer_pattern="gqa+dense,gqa+moe*3")
    moved = dataclasses.replace(derived, layer_pattern="gqa+moe*3,gqa+dense")
    assert model_signature(same, 96) == model_signature(derived, 96)  # older checkpoints keep their signature
    assert model_signature(moved, 96)["layer_pattern"] == "gqa+moe*3,gqa+dense"
    assert any(line.startswith("layer_pattern (--layer-pattern)")
               for line in compare_signatures(model_signature(moved, 96), model_signature(derived, 96)))


def test_a_pattern_hugging_face_cannot_express_is_not_exported():
    from meshtron.checkpoint.errors import CheckpointError
    from meshtron.checkpoint.hf import check_exportable

    m = _small(**_MOE, num_query_groups=4, group_query_attention=False)
    check_exportable(dataclasses.replace(m, layer_pattern="gqa+moe*4"), "mixtral")  # the derived pattern: fine
    with pytest.raises(CheckpointError) as err:
        check_exportable(dataclasses.replace(m, layer_pattern="gqa+moe*3,gqa+dense"), "mixtral")
    assert "--layer-pattern gqa+moe*3,gqa+dense" in str(err.value) + str(getattr(err.value, "args", ""))


def test_megatrons_list_of_moe_layers_is_read_as_a_pattern_and_checked():
    from types import SimpleNamespace

    from meshtron.checkpoint.errors import CheckpointError
    from meshtron.checkpoint.megatron.args import apply_settings, check_model, model_settings

    args = SimpleNamespace(num_layers=4, hidden_size=32, num_attention_heads=4, num_experts=4, moe_router_topk=2,
                           moe_layer_freq=[0, 1, 1, 0], add_bias_linear=False)
    settings = model_settings(args, "checkpoint X")
    assert settings["layer_pattern"] == "gqa+dense,gqa+moe*2,gqa+dense"
    run = apply_settings(ModelConfig(), {k: v for k, v in settings.items() if k != "vocab_size"})
    check_model(settings, run, "checkpoint X")  # the same layers: no difference
    with pytest.raises(CheckpointError) as err:
        check_model(settings, dataclasses.replace(run, layer_pattern=None), "checkpoint X")
    assert any(line.startswith("--layer-pattern: checkpoint 'gqa+dense,gqa+moe*2,gqa+dense'")
               for line in err.value.differences)
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        model_settings(SimpleNamespace(**{**vars(args), "moe_layer_freq": [0, 2, 1, 0]}), "checkpoint X")
