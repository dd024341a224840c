"""A DeepSeek-V3-shaped tiny model through the trainer: multi-latent attention with a query rank and distinct
head dims, a first dense layer, fine-grained experts with sigmoid scores, group-limited top-k, the expert bias,
routed scaling and a shared expert, plus one multi-token prediction depth. Under expert parallelism (EP=2 with
expert data parallelism) and TP=2 x EP=2 with sequence parallelism, it logs the one-process losses, multi-token
prediction loss, router losses and expert load, iteration by iteration."""

from __future__ import annotations

import os

from meshtron.config import MeshtronConfig
from tests.moe.trainer_runs import assert_layouts_log_the_reference, set_tiny_run, train_records

KEYS = ("loss", "grad_norm", "mtp_loss", "aux_loss", "expert_load_min", "expert_load_max")


def deepseek_v3_tiny(metrics_file: str, tp: int = 1, ep: int = 1, sp: bool = False,
                     dist_opt: bool = False) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 3, 32, 4, 64, 8
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", True, "rope", True
    m.norm_epsilon, m.untie_embeddings_and_output_weights = 1e-6, True
    # Multi-latent attention: every head dim different, so that a swapped one cannot pass.
    m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank = True, 12, 16
    m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = 6, 4, 5
    # DeepSeek-V3 routing: 8 fine-grained experts in 4 groups, top-4 from the best 2 groups.
    m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_first_dense_layers = 8, 8, 4, 1
    m.moe_router_score_function, m.moe_router_num_groups, m.moe_router_group_topk = "sigmoid", 4, 2
    m.moe_router_enable_expert_bias, m.moe_router_bias_update_rate = True, 0.05
    m.moe_router_topk_scaling_factor, m.moe_shared_expert_intermediate_size = 2.5, 8
    m.moe_router_load_balancing_type, m.moe_aux_loss_coeff = "seq_aux_loss", 1e-2
    m.mtp_num_layers, m.mtp_loss_scaling_factor = 1, 0.3
    set_tiny_run(cfg, metrics_file, tp, ep, sp=sp, dist_opt=dist_opt)
    return cfg


def _train(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[list[float]]:
    from meshtron.training.trainer import run_training

    return [run_training(deepseek_v3_tiny(path, **layout)).train_losses for path, layout in runs]


LAYOUTS = {
    "ep2-edp2-distopt": dict(ep=2, dist_opt=True),  # 4 ranks: data parallel 4, experts over 2 with 2 replicas
    "tp2-ep2-sp": dict(tp=2, ep=2, sp=True),
}


def test_deepseek_v3_shaped_model_under_expert_parallelism_logs_the_one_process_values(tmp_path):
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref_path = str(tmp_path / "ref.jsonl")
    ref = run_training(deepseek_v3_tiny(ref_path))
    ref_records = train_records(ref_path)
    assert sorted(ref_records) == [1, 2, 3]
    for rec in ref_records.values():
        assert all(key in rec for key in KEYS), sorted(rec)
        assert rec["mtp_loss"] > 0 and rec["aux_loss"] > 0
    assert_layouts_log_the_reference(_train, LAYOUTS, tmp_path, ref.train_losses, ref_records, KEYS)
