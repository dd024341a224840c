"""Rotary position embeddings (RoPE), with Llama-3.1 frequency scaling and YaRN.

Uses the rotate-half convention (the first and second halves of each head
dimension form the rotated pairs), as Megatron-Core and Hugging Face Llama do.
Checkpoints whose rotary pairs are interleaved (DeepSeek's ``rope_interleave``)
map onto it by permuting the rows that produce the rotary part
(:func:`meshtron.layers.mla_hf.deinterleave_rows`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from meshtron.config import ModelConfig


def rope_kind(cfg: ModelConfig) -> str:
    """``rope`` or ``yarn``: --rope-type, else yarn for multi-latent attention (Megatron's default;
    at --rotary-scaling-factor 1 it equals plain RoPE), else rope."""
    if cfg.rope_type:
        return cfg.rope_type
    return "yarn" if cfg.multi_latent_attention else "rope"


def inverse_frequencies(dim: int, base: float, device: torch.device, cfg: Optional[ModelConfig] = None) -> torch.Tensor:
    """1 / base^(2i/dim), optionally rescaled as Llama 3.1 does for long contexts, or by YaRN."""
    if cfg is not None and rope_kind(cfg) == "yarn":
        return _yarn(dim, base, device, cfg)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    if cfg is not None and cfg.use_rope_scaling:
        factor, low_factor, high_factor = cfg.rope_scaling_factor, 1.0, 4.0
        old_len = cfg.rope_original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / low_factor, old_len / high_factor
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def _yarn_correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The (fractional) frequency index whose wavelength fits ``rotations`` times into ``context``."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn(dim: int, base: float, device: torch.device, cfg: ModelConfig) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) with the model's --rotary-scaling-factor and --yarn-* flags; fp32 throughout, the
    operations in megatron-core's YarnRotaryEmbedding's order, so that the tables are its own."""
    return yarn_inverse_frequencies(dim, base, cfg.rotary_scaling_factor, cfg.yarn_original_max_position_embeddings,
                                    cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_truncate, device)


def yarn_inverse_frequencies(dim: int, base: float, factor: float, original_max_position_embeddings: int,
                             beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
                             device: Optional[torch.device] = None) -> torch.Tensor:
    """fp32 [dim / 2]: frequencies that turn more than ``beta_fast`` times within the original context are
    kept, those turning fewer than ``beta_slow`` times are divided by ``factor``, and a linear ramp over
    the frequency index mixes the two in between (``truncate``: round the ramp's ends outwards)."""
    powers = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    low = _yarn_correction_dim(beta_fast, dim, base, original_max_position_embeddings)
    high = _yarn_correction_dim(beta_slow, dim, base, original_max_position_embeddings)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-step ramp
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # megatron-core and transformers weight the original frequency by 1 - ramp and the interpolated one by
    # 1 - (1 - ramp), not exactly ramp in fp32: the same operations give their tables bit for bit
    kept = 1 - ramp
    return (1.0 / (factor * powers)) * (1 - kept) + (1.0 / powers) * kept


def yarn_mscale(factor: float, coefficient: float) -> float:
    """YaRN's attention temperature 0.1 * coefficient * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def rope_table_scale(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies the cos/sin tables by (--mscale over --mscale-all-dim); 1 otherwise."""
    if rope_kind(cfg) != "yarn":
        return 1.0
    factor = cfg.rotary_scaling_factor
    return yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq, batch, 1, dim] (or [seq, 1, 1, dim] for shared positions [seq]),
    multiplied by ``scale`` (see :func:`rope_table_scale`)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [..., dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    if emb.dim() == 2:  # [seq, dim]
        emb = emb[:, None, None, :]
    else:  # [batch, seq, dim] -> [seq, batch, 1, dim]
        emb = emb.transpose(0, 1)[:, :, None, :]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [seq, batch, heads, dim] by the tables."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of ``x`` [s, b, heads, d] (--rotary-percent below 1);
    the rest pass unchanged."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
