"""Parameter arithmetic from the configuration alone (today: one multi-latent attention layer).

Plain arithmetic, no torch and no layer code: ``meshtron presets``, the configuration check and the memory
estimate use it without importing the layers.
:class:`meshtron.layers.mla.MultiLatentAttention` builds exactly these tensors (tests/layers/test_mla.py checks it).
"""

from __future__ import annotations

from meshtron.config import ModelConfig


def mla_parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, all parameters) of one MLA layer, as :class:`MultiLatentAttention` builds them."""
    H, n = cfg.hidden_size, cfg.num_attention_heads
    dq, dr, dv = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    norm = 1 if cfg.normalization == "RMSNorm" else 2  # parameters per normalised feature
    bias = not cfg.disable_bias_linear
    q = rq * H + n * dq * rq if rq else n * dq * H
    matmul = q + (rkv + dr) * H + n * (cfg.qk_head_dim + dv) * rkv + H * n * dv
    others = norm * (rkv + (rq or 0))
    if bias:
        others += (rq or 0) + rkv + dr + H  # down projections and output
    return matmul, matmul + others


def mla_rank_parameters(cfg: ModelConfig, tp: int) -> float:
    """Parameters of one MLA layer held by one tensor-parallel rank (down projections and norms replicated)."""
    matmul, total = mla_parameter_counts(cfg)
    n, H, rq = cfg.num_attention_heads, cfg.hidden_size, cfg.q_lora_rank
    dq, dkv, dv = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.qk_head_dim + cfg.v_head_dim, cfg.v_head_dim
    per_head = n * (dq * rq if rq else dq * H) + n * dkv * cfg.kv_lora_rank + H * n * dv  # split over TP
    return total - per_head + per_head / tp
