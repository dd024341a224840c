"""YaRN rotary frequencies from plain numbers (gpt-oss's ``rope_type: yarn``).

:mod:`meshtron.layers.rotary` computes YaRN's frequencies (re-exported here) for every model with
``--rope-type yarn`` / ``--position-embedding-type yarn``, its table scale ``mscale / mscale_all_dim``
(DeepSeek's, and Megatron's for grouped-query attention). gpt-oss sets ``truncate: false`` (the ramp's ends
stay fractional) and no ``mscale``, so its cos/sin tables are multiplied by ``0.1 ln(factor) + 1``. Both
come from here::

    inv, scale = yarn_inverse_frequencies(...), yarn_attention_factor(factor)
    cos, sin = rope_tables(positions, inv, dtype, scale)
"""

from __future__ import annotations

from typing import Optional

from meshtron.layers.rotary import yarn_inverse_frequencies, yarn_mscale

__all__ = ["yarn_inverse_frequencies", "yarn_attention_factor"]


def yarn_attention_factor(factor: float, mscale: Optional[float] = None, mscale_all_dim: Optional[float] = None,
                          attention_factor: Optional[float] = None) -> float:
    """The factor on the cos/sin tables: ``attention_factor`` when given, else ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set, else ``0.1 ln(factor) + 1`` (1 for factor <= 1)."""
    if attention_factor is not None:
        return attention_factor
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor, 1.0)
