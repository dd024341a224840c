"""A tiny gpt-oss through the trainer (sliding-window and full sink attention layers, biases, clamped SwiGLU
experts with a biased router, YaRN): tensor parallelism with sequence parallelism, pipeline parallelism
(stages of sliding and full layers), data parallelism with the distributed optimizer and expert parallelism
each log the one-process losses, gradient norms, router losses and expert load, iteration by iteration; and
context parallelism is refused in one line."""

from __future__ import annotations

import os

import pytest

from meshtron.config import ConfigError, MeshtronConfig
from meshtron.validation import validate_config
from tests.moe.trainer_runs import assert_layouts_log_the_reference, set_tiny_run, train_records

KEYS = ("loss", "grad_norm", "aux_loss", "expert_load_min", "expert_load_max")


def gpt_oss_tiny(metrics_file: str, tp: int = 1, ep: int = 1, pp: int = 1, sp: bool = False,
                 dist_opt: bool = False) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 32, 4, 16
    m.group_query_attention, m.num_query_groups, m.kv_channels = True, 2, 8
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", True, "rope", False
    m.untie_embeddings_and_output_weights = True
    m.layer_pattern, m.sliding_window_size = "sink_window+oss_moe,sink+oss_moe,sink_window+oss_moe,sink+oss_moe", 5
    m.rope_type, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings = "yarn", 4.0, 8
    m.mscale, m.mscale_all_dim, m.yarn_truncate = 1.0, 0.0, False
    m.num_experts, m.moe_ffn_hidden_size, m.ffn_hidden_size, m.moe_router_topk = 4, 16, 16, 2
    m.moe_aux_loss_coeff, m.swiglu_clamp_limit = 1e-2, 1.5  # a low limit: the clamps act at this scale
    set_tiny_run(cfg, metrics_file, tp, ep, pp, sp, dist_opt)
    return cfg


def _train(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[list[float]]:
    from meshtron.training.trainer import run_training

    return [run_training(gpt_oss_tiny(path, **layout)).train_losses for path, layout in runs]


def _reference(tmp_path):
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref_path = str(tmp_path / "ref.jsonl")
    ref = run_training(gpt_oss_tiny(ref_path))
    records = train_records(ref_path)
    assert sorted(records) == [1, 2, 3] and all(r["aux_loss"] > 0 for r in records.values())
    return ref.train_losses, records


def test_gpt_oss_under_tensor_and_sequence_parallelism_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path)
    assert_layouts_log_the_reference(_train, {"tp2-sp": dict(tp=2, sp=True)}, tmp_path, losses, records, KEYS,
                                     world=2)


@pytest.mark.slow
def test_gpt_oss_under_pipeline_data_and_expert_parallelism_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path)
    layouts = {
        "pp2-dp2": dict(pp=2),  # stages of a sliding and a full layer each
        "ep2-edp2-distopt": dict(ep=2, dist_opt=True),  # data parallel 4, experts over 2 with 2 replicas
        "tp2-ep2-sp": dict(tp=2, ep=2, sp=True),
    }
    assert_layouts_log_the_reference(_train, layouts, tmp_path, losses, records, KEYS)


def test_context_parallelism_is_refused_in_one_line(tmp_path):
    cfg = gpt_oss_tiny(str(tmp_path / "m.jsonl"))
    cfg.parallel.context_parallel_size = 2
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 2)
    text = str(err.value)
    assert "\n" not in text and "--context-parallel-size 2" in text and "sink_window" in text
