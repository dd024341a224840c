"""YaRN rotary frequencies from plain numbers (gpt-oss's ``rope_type: yarn``).

:mod:`meshtron.layers.rotary` has YaRN as configured for multi-latent attention (DeepSeek: the ramp's
ends rounded to whole frequency indices, the table scale ``mscale / mscale_all_dim``). gpt-oss sets
``truncate: false`` (the ramp's ends stay fractional) and no ``mscale``, so its cos/sin tables are
multiplied by ``0.1 ln(factor) + 1``. Both come from here::

    inv, scale = yarn_inverse_frequencies(...), yarn_attention_factor(factor)
    cos, sin = rope_tables(positions, inv, dtype, scale)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from meshtron.layers.rotary import _yarn_correction_dim, yarn_mscale


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
    return (1.0 / (factor * powers)) * ramp + (1.0 / powers) * (1 - ramp)


def yarn_attention_factor(factor: float, mscale: Optional[float] = None, mscale_all_dim: Optional[float] = None,
                          attention_factor: Optional[float] = None) -> float:
    """The factor on the cos/sin tables: ``attention_factor`` when given, else ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set, else ``0.1 ln(factor) + 1`` (1 for factor <= 1)."""
    if attention_factor is not None:
        return attention_factor
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor, 1.0)
