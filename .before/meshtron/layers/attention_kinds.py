"""The attention variants a transformer layer can use, keyed by name, and how a config picks one.

Each class takes ``(cfg, ctx, prefix, sequence_parallel)``, is called as
``attention(x, rope, mask, cache)``, and gives as static methods the width of its rotary
tables (``rope_dim(cfg)``) and its (query/key, value) head dims (``head_dims(cfg)``, for FLOPs).
"""

from __future__ import annotations

import torch.nn as nn

from meshtron.config import ModelConfig
from meshtron.layers.attention import SelfAttention
from meshtron.layers.mla import MultiLatentAttention

ATTENTION_KINDS: dict[str, type[nn.Module]] = {"gqa": SelfAttention, "mla": MultiLatentAttention}


def attention_kind(cfg: ModelConfig) -> str:
    """``mla`` with --multi-latent-attention, else ``gqa`` (multi-head, grouped- or multi-query)."""
    return "mla" if cfg.multi_latent_attention else "gqa"


def attention_class(cfg: ModelConfig) -> type[nn.Module]:
    """The attention class of ``cfg``'s layers."""
    return ATTENTION_KINDS[attention_kind(cfg)]
