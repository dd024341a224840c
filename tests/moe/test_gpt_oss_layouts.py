"""A tiny gpt-oss through the trainer (sliding-window and full sink attention layers, biases, clamped SwiGLU
experts with a biased router, YaRN): tensor parallelism with sequence parallelism, pipeline parallelism
(stages of sliding and full layers), data parallelism with the distributed optimizer, expert parallelism and
context parallelism (the 5-key window crossing the split's chunks of 4 tokens) each log the one-process losses,
gradient norms, router losses and expert load, iteration by iteration."""

from __future__ import annotations

import os

import pytest

from meshtron.config import MeshtronConfig
from tests.moe.trainer_runs import assert_layouts_log_the_reference, set_tiny_run, train_records

KEYS = ("loss", "grad_norm", "aux_loss", "expert_load_min", "expert_load_max")


def gpt_oss_tiny(metrics_file: str, tp: int = 1, ep: int = 1, pp: int = 1, sp: bool = False,
                 dist_opt: bool = False, cp: int = 1, cp_comm_type: str = "p2p") -> MeshtronConfig:
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
    cfg.parallel.context_parallel_size, cfg.parallel.cp_comm_type = cp, cp_comm_type
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


def test_gpt_oss_under_tensor_sequence_and_context_parallelism_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path)
    layouts = {"tp2-sp": dict(tp=2, sp=True), "cp2-allgather": dict(cp=2, cp_comm_type="allgather")}
    assert_layouts_log_the_reference(_train, layouts, tmp_path, losses, records, KEYS, world=2)


@pytest.mark.slow
def test_gpt_oss_under_pipeline_data_and_expert_parallelism_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path)
    layouts = {
        "pp2-dp2": dict(pp=2),  # stages of a sliding and a full layer each
        "ep2-edp2-distopt": dict(ep=2, dist_opt=True),  # data parallel 4, experts over 2 with 2 replicas
        "tp2-ep2-sp": dict(tp=2, ep=2, sp=True),
        "tp2-cp2-a2a": dict(tp=2, cp=2, cp_comm_type="a2a"),
        "cp2-p2p-ep2": dict(cp=2, ep=2),
    }
    assert_layouts_log_the_reference(_train, layouts, tmp_path, losses, records, KEYS)
