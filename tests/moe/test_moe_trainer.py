"""Through the trainer: MoE models under expert parallelism (with the distributed optimizer, TP x SP,
pipeline stages, context parallelism) log the one-process losses, router losses and expert load, iteration by iteration."""

from __future__ import annotations

import os

from meshtron.config import MeshtronConfig
from tests.moe.trainer_runs import assert_layouts_log_the_reference, train_records

MOE_KEYS = ("aux_loss", "z_loss", "expert_load_min", "expert_load_max")


def _config(metrics_file: str, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, sp: bool = False,
            dist_opt: bool = False) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 4, 32, 4, 64, 8
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", True, "rope", True
    m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_first_dense_layers = 4, 16, 2, 1
    m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_shared_expert_intermediate_size = 0.05, 1e-3, 16
    m.moe_router_enable_expert_bias, m.moe_router_bias_update_rate = True, 0.05
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size = tp, pp, ep
    p.context_parallel_size, p.sequence_parallel, p.use_distributed_optimizer = cp, sp, dist_opt
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 4, 3, 5, "cpu"
    t.eval_interval, t.compile, t.generate_sample = 0, False, False
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.adam_eps = 1e-2, 0, 1e-5
    log = cfg.log
    log.log_interval, log.quiet, log.progress_bar, log.metrics_file = 1, True, False, metrics_file
    return cfg


def _train(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[dict]:
    from meshtron.training.trainer import run_training

    return [run_training(_config(path, **layout)).train_losses for path, layout in runs]


LAYOUTS = {
    "ep2-dp4-distopt": dict(ep=2, dist_opt=True),
    "ep2-tp2-sp-distopt": dict(tp=2, ep=2, sp=True, dist_opt=True),
    "ep2-pp2": dict(pp=2, ep=2),
    "ep2-cp2": dict(cp=2, ep=2),
}


def test_trainer_moe_layouts_log_the_single_process_values(tmp_path):
    from meshtron.training.trainer import run_training

    os.environ.pop("WORLD_SIZE", None)
    ref_path = str(tmp_path / "ref.jsonl")
    ref = run_training(_config(ref_path))
    ref_records = train_records(ref_path)
    assert sorted(ref_records) == [1, 2, 3]
    for rec in ref_records.values():
        assert all(key in rec for key in MOE_KEYS)
        assert rec["aux_loss"] > 0 and rec["z_loss"] > 0
        assert 0 <= rec["expert_load_min"] <= 1 <= rec["expert_load_max"] <= 4 / 2
    assert_layouts_log_the_reference(_train, LAYOUTS, tmp_path, ref.train_losses, ref_records,
                                     ("loss", "grad_norm") + MOE_KEYS)
