"""Megatron-LM's ``--position-embedding-type yarn`` (grouped-query attention) in checkpoint ``args``: read as
meshtron's RoPE with YaRN frequencies, written back under Megatron-LM's flags, and checked flag by flag."""

from __future__ import annotations

import copy

import pytest

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron.args import check_model, model_settings
from meshtron.checkpoint.megatron.export import interleaved_unsupported, megatron_args, unsupported
from meshtron.cli import build_config
from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.validation import validate_config

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--vocab-size", "128", "--mock-data"]
YARN = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "8", "--yarn-original-max-position-embeddings",
        "512", "--yarn-beta-fast", "16", "--yarn-beta-slow", "2", "--no-yarn-correction-range-round-to-int",
        "--mscale", "0.9", "--mscale-all-dim", "0.1"]


def _config(argv: list[str]) -> MeshtronConfig:
    cfg = build_config(SHAPE + argv)
    validate_config(cfg, 1)
    return cfg


def _args(cfg: MeshtronConfig):
    return megatron_args(cfg, {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}, 128, 128, 1, 0, False, "local")


def _run(settings: dict) -> ModelConfig:
    return ModelConfig(**{k: v for k, v in settings.items() if k != "vocab_size"})


def test_written_under_megatrons_flags_and_read_back():
    """The export writes --position-embedding-type yarn with each YaRN flag (not the older
    --use-rotary-position-embeddings, which Megatron-LM turns into rope); reading gives the run's model."""
    cfg = _config(YARN)
    assert unsupported(cfg.model) == []
    args = _args(cfg)
    assert (args.position_embedding_type, args.use_rotary_position_embeddings, args.add_position_embedding) == \
        ("yarn", False, True)
    assert (args.rotary_scaling_factor, args.yarn_original_max_position_embeddings, args.yarn_beta_fast,
            args.yarn_beta_slow, args.yarn_correction_range_round_to_int, args.mscale, args.mscale_all_dim) == \
        (8.0, 512, 16.0, 2.0, False, 0.9, 0.1)
    settings = model_settings(args, "X")
    assert (settings["position_embedding_type"], settings["rope_type"], settings["yarn_truncate"]) == \
        ("rope", "yarn", False)
    check_model(settings, cfg.model, "X")
    plain = _args(_config(["--position-embedding-type", "rope"]))
    assert (plain.position_embedding_type, plain.use_rotary_position_embeddings) == ("rope", True)


def test_unset_flags_take_megatron_trainings_defaults():
    """A checkpoint whose args leave the --yarn-* flags unset (None) has megatron-training's defaults."""
    args = copy.copy(_args(_config(YARN)))
    for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                 "yarn_correction_range_round_to_int"):
        setattr(args, name, None)
    s = model_settings(args, "X")
    assert (s["yarn_original_max_position_embeddings"], s["yarn_beta_fast"], s["yarn_beta_slow"],
            s["yarn_truncate"], s["rotary_scaling_factor"]) == (4096, 32.0, 1.0, True, 8.0)


@pytest.mark.parametrize("change,flag", [
    ({"yarn_truncate": True}, "--yarn-truncate: checkpoint False"),
    ({"yarn_beta_fast": 32.0}, "--yarn-beta-fast: checkpoint 16.0"),
    ({"mscale": 1.0}, "--mscale: checkpoint 0.9"),
    ({"rope_type": "rope"}, "--rope-type: checkpoint 'yarn'"),
])
def test_run_flags_checked_against_the_checkpoint(change, flag):
    settings = model_settings(_args(_config(YARN)), "X")
    with pytest.raises(CheckpointError) as err:
        check_model(settings, _run(dict(settings, **change)), "Megatron-LM checkpoint X")
    assert any(line.startswith(flag) for line in err.value.differences), err.value.differences


@pytest.mark.parametrize("change,flag", [
    ({"rotary_percent": 0.5}, "--rotary-percent 0.5 with --position-embedding-type yarn"),
    ({"rotary_interleaved": True}, "--rotary-interleaved with --position-embedding-type yarn"),
    ({"multi_latent_attention": True, "qk_layernorm": True}, "--position-embedding-type yarn with multi-latent"),
])
def test_what_meshtron_would_compute_otherwise_is_refused(change, flag):
    args = copy.copy(_args(_config(YARN)))
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(CheckpointError) as err:
        model_settings(args, "Megatron-LM checkpoint X")
    assert any(flag in line for line in err.value.differences), err.value.differences


def test_export_refusals_named():
    """--rope-type yarn with --rotary-percent below 1 rotates part of each head with YaRN over that part; megatron-
    core's YaRN spans the whole head, and refuses interleaved pairs."""
    partial = _config(["--position-embedding-type", "rope", "--rope-type", "yarn", "--rotary-percent", "0.5"])
    assert any("--rotary-percent 0.5 with YaRN" in line for line in unsupported(partial.model))
    assert any("YarnRotaryEmbedding refuses" in line for line in interleaved_unsupported(_config(YARN).model))
