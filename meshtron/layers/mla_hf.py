"""Hugging Face DeepSeek-V2/V3 attention tensors <-> meshtron's multi-latent attention tensors.

Names (relative to a layer's ``self_attn.`` and ``attention.``) map one to one. The one change of
values: DeepSeek checkpoints lay each rotary part out in interleaved pairs ``(x0, x1), (x2, x3), ...``
(``rope_interleave`` in the Hugging Face config, true for DeepSeek-V2/V3), while meshtron rotates
halves ``(x_i, x_{i + d/2})``. Reordering the rows that produce a rotary part, even rows first and
then odd ones, makes the rotate-half rotation compute the interleaved one; attention scores are
unchanged because queries and keys are reordered alike.
"""

from __future__ import annotations

import torch

from meshtron.config import ModelConfig
from meshtron.layer_kinds.mla import MLA

#: Hugging Face ``self_attn.<name>`` -> meshtron ``attention.<name>``: the MLA kind's names.
HF_TO_MESHTRON = MLA.hf_names
MESHTRON_TO_HF = {v: k for k, v in HF_TO_MESHTRON.items()}


def _rope_row_order(group: int, rope_dim: int, groups: int, inverse: bool) -> torch.Tensor:
    """Row indices that reorder the last ``rope_dim`` rows of each of ``groups`` blocks of ``group`` rows."""
    pairs = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    if inverse:
        pairs = torch.argsort(pairs)
    block = torch.cat([torch.arange(group - rope_dim), group - rope_dim + pairs])
    return torch.cat([block + g * group for g in range(groups)])


def deinterleave_rows(t: torch.Tensor, group: int, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """Reorder the rotary rows of ``t`` (dim 0 in blocks of ``group`` rows, the last ``rope_dim`` of each
    rotary) from interleaved pairs to rotate-half order (``inverse``: back)."""
    return t[_rope_row_order(group, rope_dim, t.shape[0] // group, inverse)]


def _rope_blocks(meshtron_name: str, cfg: ModelConfig) -> int | None:
    """Rows per block of the tensors that produce a rotary part, None for the others."""
    if meshtron_name in ("q_up.weight", "q.weight"):
        return cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    if meshtron_name in ("kv_down.weight", "kv_down.bias"):
        return cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    return None


def attention_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                      rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """One layer's Hugging Face ``self_attn`` tensors (names without the prefix) as meshtron's."""
    out = {}
    for name, t in tensors.items():
        ours = HF_TO_MESHTRON[name]
        group = _rope_blocks(ours, cfg)
        out[ours] = deinterleave_rows(t, group, cfg.qk_pos_emb_head_dim) if rope_interleave and group else t
    return out


def attention_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                    rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """Inverse of :func:`attention_from_hf`."""
    out = {}
    for name, t in tensors.items():
        group = _rope_blocks(name, cfg)
        out[MESHTRON_TO_HF[name]] = (deinterleave_rows(t, group, cfg.qk_pos_emb_head_dim, inverse=True)
                                     if rope_interleave and group else t)
    return out
