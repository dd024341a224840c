"""Tiny Qwen3.5 models through the trainer (gated DeltaNet and gated attention layers, zero-centred norms, partial
RoPE; the MoE's sigmoid-gated shared expert): tensor parallelism with sequence parallelism, pipeline parallelism
(stages of DeltaNet and attention layers), data parallelism with the distributed optimizer and, for the MoE,
expert parallelism each log the one-process losses and gradient norms (and router losses and expert load),
iteration by iteration; context parallelism runs (and logs the one-process values) with gdn and gated attention
layers, and with gated attention layers alone (the model under CP, to 1e-5: tests/context_parallel/
test_cp_gated_deltanet.py)."""

from __future__ import annotations

import os

import pytest

from meshtron.config import MeshtronConfig
from meshtron.validation import validate_config
from tests.moe.trainer_runs import assert_layouts_log_the_reference, set_tiny_run, train_records

KEYS = ("loss", "grad_norm")
MOE_KEYS = KEYS + ("aux_loss", "expert_load_min", "expert_load_max")


def qwen3_5_tiny(metrics_file: str, moe: bool = False, tp: int = 1, ep: int = 1, pp: int = 1, sp: bool = False,
                 dist_opt: bool = False) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 32, 4, 16
    m.group_query_attention, m.num_query_groups, m.kv_channels, m.ffn_hidden_size = True, 2, 16, 48
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", True, "rope", True
    m.untie_embeddings_and_output_weights, m.zero_centred_norm, m.rotary_percent = True, True, 0.25
    m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim = 2, 4, 8, 6
    mlp = "moe_gated_shared" if moe else "dense"
    m.layer_pattern = f"gdn+{mlp},gated_attn+{mlp},gdn+{mlp},gated_attn+{mlp}"
    if moe:
        m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk = 4, 12, 2
        m.moe_shared_expert_intermediate_size, m.moe_aux_loss_coeff = 16, 1e-2
    set_tiny_run(cfg, metrics_file, tp, ep, pp, sp, dist_opt)
    return cfg


def _train(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[list[float]]:
    from meshtron.training.trainer import run_training

    return [run_training(qwen3_5_tiny(path, **layout)).train_losses for path, layout in runs]


def _reference(tmp_path, moe: bool):
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref_path = str(tmp_path / "ref.jsonl")
    ref = run_training(qwen3_5_tiny(ref_path, moe=moe))
    records = train_records(ref_path)
    assert sorted(records) == [1, 2, 3]
    return ref.train_losses, records


def test_qwen3_5_under_tensor_and_sequence_parallelism_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path, moe=False)
    assert_layouts_log_the_reference(_train, {"tp2-sp": dict(tp=2, sp=True)}, tmp_path, losses, records, KEYS,
                                     world=2)


@pytest.mark.slow
def test_qwen3_5_under_pipeline_and_data_parallelism_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path, moe=False)
    layouts = {"pp2-dp2": dict(pp=2), "dp4-distopt": dict(dist_opt=True)}
    assert_layouts_log_the_reference(_train, layouts, tmp_path, losses, records, KEYS)


@pytest.mark.slow
def test_qwen3_5_moe_under_every_layout_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path, moe=True)
    layouts = {
        "tp2-ep2-sp": dict(moe=True, tp=2, ep=2, sp=True),
        "pp2-dp2": dict(moe=True, pp=2),
        "ep2-edp2-distopt": dict(moe=True, ep=2, dist_opt=True),
    }
    assert_layouts_log_the_reference(_train, layouts, tmp_path, losses, records, MOE_KEYS)


def _train_cp(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[list[float]]:
    from meshtron.training.trainer import run_training

    out = []
    for path, layout in runs:
        cfg = qwen3_5_tiny(path)
        cfg.parallel.context_parallel_size = layout["cp"]
        out.append(run_training(cfg).train_losses)
    return out


def test_context_parallelism_passes_validation_with_gdn_layers(tmp_path):
    cfg = qwen3_5_tiny(str(tmp_path / "m.jsonl"))
    cfg.parallel.context_parallel_size = 2
    validate_config(cfg, 2)
    # All-to-all CP with gated DeltaNet layers only: no heads to split, whatever the attention head count says.
    cfg = qwen3_5_tiny(str(tmp_path / "m.jsonl"))
    cfg.model.layer_pattern = "gdn+dense*4"
    cfg.model.num_attention_heads, cfg.model.num_query_groups = 3, 1
    cfg.parallel.context_parallel_size, cfg.parallel.cp_comm_type = 2, "a2a"
    validate_config(cfg, 2)


@pytest.mark.slow
def test_qwen3_5_under_context_parallelism_logs_the_one_process_values(tmp_path):
    losses, records = _reference(tmp_path, moe=False)
    assert_layouts_log_the_reference(_train_cp, {"cp2": dict(cp=2)}, tmp_path, losses, records, KEYS, world=2)


def _train_gated_only(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[list[float]]:
    from meshtron.training.trainer import run_training

    out = []
    for path, layout in runs:
        cfg = qwen3_5_tiny(path)
        cfg.model.layer_pattern = "gated_attn+dense*4"
        cfg.parallel.context_parallel_size = layout["cp"]
        out.append(run_training(cfg).train_losses)
    return out


@pytest.mark.slow
def test_gated_attention_alone_runs_under_context_parallelism(tmp_path):
    """gated_attn layers keep gqa's context-parallel attention (with their partial RoPE and output gate)."""
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    cfg = qwen3_5_tiny(str(tmp_path / "ref.jsonl"))
    cfg.model.layer_pattern = "gated_attn+dense*4"
    ref = run_training(cfg)
    records = train_records(str(tmp_path / "ref.jsonl"))
    assert_layouts_log_the_reference(_train_gated_only, {"cp2": dict(cp=2)}, tmp_path, ref.train_losses, records,
                                     KEYS, world=2)
