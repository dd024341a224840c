"""Megatron-LM's tensor names and layouts -> meshtron's canonical tensors.

Megatron (per layer, after :func:`per_layer` has unstacked the ``torch_dist`` stacks)  ->  meshtron:

===========================================================  ==========================================
``embedding.word_embeddings.weight`` [padded vocab, H]       ``embedding.word_embeddings.weight`` (rows
                                                             trimmed to the run's vocabulary, :func:`fit_vocab`)
``embedding.position_embeddings.weight``                     ``embedding.position_embeddings.weight``
``decoder.layers.N.input_layernorm.{weight,bias}``, or TE's  ``layers.N.input_norm.{weight,bias}``
``...self_attention.linear_qkv.layer_norm_{weight,bias}``
``...self_attention.linear_qkv.{weight,bias}``               ``layers.N.attention.{q,k,v}.{weight,bias}``:
  [ng * (q_per_group + 2) * d, H], per query group            rows of group g are [q heads of g; k; v]
``...self_attention.linear_proj.{weight,bias}``              ``layers.N.attention.o.{weight,bias}``
``...self_attention.{q,k}_layernorm.weight``                 ``layers.N.attention.{q,k}_norm.weight``
``...pre_mlp_layernorm.*`` or ``mlp.linear_fc1.layer_norm_*``  ``layers.N.post_attention_norm.*``
``...mlp.linear_fc1.{weight,bias}`` (SwiGLU: [gate; up])     ``layers.N.mlp.{gate,up}.*`` (``mlp.up`` without)
``...mlp.linear_fc2.{weight,bias}``                          ``layers.N.mlp.down.*``
``...mlp.router.weight``, ``mlp.router.expert_bias``         ``layers.N.mlp.router.{weight,expert_bias}``
``...mlp.experts.E.linear_fc{1,2}.weight`` (every spelling   ``layers.N.mlp.experts.E.{gate,up,down}.weight``
  of experts: :func:`expert_name`)
``...mlp.shared_experts.linear_fc{1,2}.weight``              ``layers.N.mlp.shared_experts.{gate,up,down}.weight``
``decoder.final_layernorm.{weight,bias}``                    ``final_norm.{weight,bias}``
``output_layer.weight`` (absent or ignored when tied)        ``output.weight``
===========================================================  ==========================================

Transformer Engine's ``_extra_state`` entries and RoPE's ``inv_freq`` carry no weights and are skipped.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from meshtron.checkpoint.errors import CheckpointError

_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
# Expert weights: legacy per expert, TE grouped (legacy weightN), torch_dist sequential and grouped stacks.
_EXPERT_LOCAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_EXPERT_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_EXPERT_STACK = re.compile(r"^mlp\.experts\.(?:experts\.)?(linear_fc[12]\.(?:weight|bias))$")
_SKIPPED = re.compile(r"(\._extra_state(/.*)?$|\.inv_freq$|local_tokens_per_expert$)")
_NORM_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_norm.weight",
    "input_layernorm.bias": "input_norm.bias",
    "pre_mlp_layernorm.weight": "post_attention_norm.weight",
    "pre_mlp_layernorm.bias": "post_attention_norm.bias",
    "self_attention.linear_proj.weight": "attention.o.weight",
    "self_attention.linear_proj.bias": "attention.o.bias",
    "self_attention.q_layernorm.weight": "attention.q_norm.weight",
    "self_attention.k_layernorm.weight": "attention.k_norm.weight",
    "self_attention.q_layernorm.bias": "attention.q_norm.bias",
    "self_attention.k_layernorm.bias": "attention.k_norm.bias",
    "mlp.linear_fc2.weight": "mlp.down.weight",
    "mlp.linear_fc2.bias": "mlp.down.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output.weight",
}
WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output.weight"


def is_skipped(name: str) -> bool:
    return bool(_SKIPPED.search(name))


def per_layer(name: str, tensor: torch.Tensor, num_layers: int) -> list[tuple[str, torch.Tensor]]:
    """A torch_dist tensor as per-layer Megatron tensors: ``decoder.layers.X`` stacked [num_layers, ...] becomes
    ``decoder.layers.N.X``; per-layer and global names stay as they are."""
    m = _STACKED.match(name)
    if not m:
        return [(name, tensor)]
    if tensor.dim() == 0 or tensor.shape[0] != num_layers:
        raise CheckpointError(f"Megatron-LM tensor {name}: expected {num_layers} stacked layers (args.num_layers), "
                              f"got shape {tuple(tensor.shape)}")
    return [(f"decoder.layers.{i}.{m.group(1)}", tensor[i]) for i in range(num_layers)]


def expert_name(rest: str, tensor: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
    """Every spelling of expert weights as ``mlp.experts.E.linear_fcK.weight`` (None: not an expert tensor)."""
    m = _EXPERT_LOCAL.match(rest)
    if m:
        return [(f"mlp.experts.{m.group(1)}.{m.group(2)}", tensor)]
    m = _EXPERT_GROUPED.match(rest)
    if m:
        return [(f"mlp.experts.{m.group(3)}.{m.group(1)}.{m.group(2)}", tensor)]
    m = _EXPERT_STACK.match(rest)
    if m:  # torch_dist: [experts, ...] after the layer axis
        return [(f"mlp.experts.{e}.{m.group(1)}", tensor[e]) for e in range(tensor.shape[0])]
    return None


def _split_qkv(layer: str, kind: str, t: torch.Tensor, heads: int, groups: int, d: int) -> list[tuple[str, torch.Tensor]]:
    per_group = heads // groups
    rows = groups * (per_group + 2) * d
    if t.shape[0] != rows:
        raise CheckpointError(f"Megatron-LM tensor decoder.layers.{layer}.self_attention.linear_qkv.{kind}: "
                              f"{t.shape[0]} rows, but {groups} query groups x ({per_group} query heads + 2) x "
                              f"head dim {d} = {rows} (args num_attention_heads/num_query_groups/kv_channels)")
    g = t.reshape(groups, (per_group + 2) * d, *t.shape[1:])
    q = g[:, :per_group * d].reshape(heads * d, *t.shape[1:])
    k = g[:, per_group * d:(per_group + 1) * d].reshape(groups * d, *t.shape[1:])
    v = g[:, (per_group + 1) * d:].reshape(groups * d, *t.shape[1:])
    base = f"layers.{layer}.attention"
    return [(f"{base}.q.{kind}", q), (f"{base}.k.{kind}", k), (f"{base}.v.{kind}", v)]


def _split_fc1(prefix: str, kind: str, t: torch.Tensor, swiglu: bool) -> list[tuple[str, torch.Tensor]]:
    if not swiglu:
        return [(f"{prefix}.up.{kind}", t)]
    if t.shape[0] % 2:
        raise CheckpointError(f"Megatron-LM tensor {prefix} linear_fc1.{kind}: {t.shape[0]} rows is odd, not "
                              "[gate; up] of SwiGLU")
    gate, up = t.chunk(2, dim=0)
    return [(f"{prefix}.gate.{kind}", gate), (f"{prefix}.up.{kind}", up)]


def to_canonical(name: str, t: torch.Tensor, shape: dict) -> list[tuple[str, torch.Tensor]]:
    """meshtron (canonical name, tensor) pairs of one per-layer Megatron tensor; ``shape`` holds ``heads``,
    ``groups``, ``head_dim``, ``swiglu`` and ``tied`` (from the checkpoint's args). Unknown names raise."""
    if is_skipped(name):
        return []
    if name in _GLOBAL:
        if name == "output_layer.weight" and shape["tied"]:
            return []  # the tied output layer is the embedding
        return [(_GLOBAL[name], t)]
    m = _PER_LAYER.match(name)
    if m:
        layer, rest = m.group(1), _NORM_ALIASES.get(m.group(2), m.group(2))
        if rest in _LAYER_SIMPLE:
            return [(f"layers.{layer}.{_LAYER_SIMPLE[rest]}", t)]
        if rest.startswith("self_attention.linear_qkv."):
            return _split_qkv(layer, rest.rsplit(".", 1)[1], t, shape["heads"], shape["groups"], shape["head_dim"])
        if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            return _split_fc1(f"layers.{layer}.mlp", rest.rsplit(".", 1)[1], t, shape["swiglu"])
        if rest == "mlp.shared_experts.linear_fc1.weight":
            return _split_fc1(f"layers.{layer}.mlp.shared_experts", "weight", t, shape["swiglu"])
        experts = expert_name(rest, t)
        if experts is not None:
            out = []
            for ename, et in experts:
                e, part = ename.split(".")[2], ename.split(".", 3)[3]
                prefix = f"layers.{layer}.mlp.experts.{e}"
                if part.startswith("linear_fc1."):
                    out += _split_fc1(prefix, part.rsplit(".", 1)[1], et, shape["swiglu"])
                else:
                    out.append((f"{prefix}.down.{part.rsplit('.', 1)[1]}", et))
            return out
    raise CheckpointError(f"Megatron-LM tensor {name} has no meshtron equivalent (supported: dense GPT/Llama and "
                          "mixture-of-experts layers; multi-latent attention and multi-token prediction are not "
                          "read yet)")


def fit_vocab(t: torch.Tensor, vocab: int, name: str) -> torch.Tensor:
    """An embedding/output tensor of Megatron's padded vocabulary cut to ``vocab`` rows."""
    if t.shape[0] < vocab:
        raise CheckpointError(f"Megatron-LM tensor {name} has {t.shape[0]} rows (the checkpoint's padded "
                              f"vocabulary), fewer than this run's vocabulary of {vocab}")
    return t[:vocab]
