"""The attention kernel call: PyTorch's SDPA (or flex attention for packed documents) on [batch, heads, seq, dim].

It sits below both the attention layers and context-parallel attention, which calls it for the all-to-all exchange
of heads, so that neither needs the other.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshtron.layers.documents import DocumentMask, document_attention

# On CUDA, cuDNN attention measured fastest on H200 (fwd+bwd, causal, GQA: 380 vs 242 TFLOP/s for
# flash at head dim 64; 462 vs 263 at 128; docs/benchmarks.md), then flash; the math fallback, which
# materialises the attention matrix, comes last.
CUDA_SDPA_PRIORITY = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH)


def _sdpa(q, k, v, mask, dropout_p, gqa, scale):
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa,
                                              scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa,
                                          scale=scale)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float,
                   scale: Optional[float] = None) -> torch.Tensor:
    """SDPA on [batch, heads, seq, dim] tensors; causal unless an explicit mask is given.

    ``mask``: None (causal), a boolean tensor, or a :class:`~meshtron.layers.documents.DocumentMask`
    (packed documents: flex attention with its block mask on CUDA, :mod:`meshtron.layers.documents`).

    ``scale`` multiplies the scores (default 1/sqrt(query head dim)). Values may have another head
    dim than queries and keys (multi-latent attention): on CUDA, SDPA then takes the first kernel of
    the priority list that accepts the shapes (flash needs equal head dims).
    """
    if isinstance(mask, DocumentMask):
        return document_attention(q, k, v, mask, dropout_p, scale, _sdpa_any)
    return _sdpa_any(q, k, v, mask, dropout_p, k.shape[1] != q.shape[1], scale)


def _sdpa_any(q, k, v, mask, dropout_p, gqa, scale):
    if q.is_cuda:
        with sdpa_kernel(list(CUDA_SDPA_PRIORITY), set_priority=True):
            return _sdpa(q, k, v, mask, dropout_p, gqa, scale)
    return _sdpa(q, k, v, mask, dropout_p, gqa, scale)
