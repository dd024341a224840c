"""Rotary position embeddings (RoPE), with Llama-3.1 frequency scaling.

Uses the rotate-half convention (the first and second halves of each head
dimension form the rotated pairs), as Megatron-Core and Hugging Face Llama do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from meshtron.config import ModelConfig


def inverse_frequencies(dim: int, base: float, device: torch.device, cfg: Optional[ModelConfig] = None) -> torch.Tensor:
    """1 / base^(2i/dim), optionally rescaled as Llama 3.1 does for long contexts."""
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


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq, batch, 1, dim] (or [seq, 1, 1, dim] for shared positions [seq])."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [..., dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    if emb.dim() == 2:  # [seq, dim]
        emb = emb[:, None, None, :]
    else:  # [batch, seq, dim] -> [seq, batch, 1, dim]
        emb = emb.transpose(0, 1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [seq, batch, heads, dim] by the tables."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
