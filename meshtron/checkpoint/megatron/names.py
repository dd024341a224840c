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
``...mlp.shared_experts.gate_weight`` [1, H]                  ``layers.N.mlp.shared_expert_gate.weight``
  (``--moe-shared-expert-gate``)                               (``moe_gated_shared`` layers)
multi-latent attention (``args.multi_latent_attention``):    ``layers.N.attention.``
``...self_attention.linear_q_down_proj.weight``              ``q_down.weight``
``...self_attention.linear_q_up_proj.weight`` (or            ``q_up.weight`` (``q.weight``), rotary rows
``linear_q_proj`` without --q-lora-rank)                       reordered (:func:`_mla_rows`)
``...self_attention.linear_kv_down_proj.weight``             ``kv_down.weight``, rotary rows reordered
``...self_attention.linear_kv_up_proj.weight``               ``kv_up.weight``
``...self_attention.{q,kv}_layernorm.weight`` (TE:           ``{q,kv}_latent_norm.weight``
``linear_{q,kv}_up_proj.layer_norm_weight``)
``decoder.final_layernorm.{weight,bias}``                    ``final_norm.{weight,bias}``
``output_layer.weight`` (absent or ignored when tied)        ``output.weight``
multi-token prediction depth k (``args.mtp_num_layers``):    ``mtp.layers.k.``
``mtp.layers.k.{enorm,hnorm}.{weight,bias}``                 ``{enorm,hnorm}.{weight,bias}``
``mtp.layers.k.eh_proj.weight`` [H, 2H]                      ``eh_proj.weight``
``mtp.layers.k.final_layernorm.{weight,bias}``               ``final_norm.{weight,bias}``
``mtp.layers.k.transformer_layer.*`` (torch_dist; the        ``transformer_layer.*``: the rows above,
legacy format's ``mtp_model_layer.*``)                         as for ``decoder.layers.N.*``
===========================================================  ==========================================

torch_dist stacks the decoder's layers (``decoder.layers.X`` [num_layers, ...]) but not the prediction depths:
megatron-core saves each depth under its own number, its experts stacked [experts, ...]. It saves the decoder's
layers so too when they are not all alike (dense and mixture-of-experts layers mixed, ``--moe-layer-freq`` a list
or above 1): ``decoder.layers.N.X``, read as they are.

Transformer Engine's ``_extra_state`` entries and RoPE's ``inv_freq`` carry no weights and are skipped.

With ``--rotary-interleaved`` megatron-core rotates each query/key head's dimensions in pairs (0, 1), (2, 3)...
(of its first ``--rotary-percent``); meshtron rotates halves. The rows producing them (``q``, ``k``, their biases
and head norms) are reordered on reading (:func:`rotate_half_rows`), which computes the same attention.

:func:`from_canonical` and :func:`stack_for_torch_dist` go the other way (``meshtron convert --to megatron``),
with the same tables read backwards.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from meshtron.checkpoint.errors import CheckpointError

_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: a multi-token prediction depth's tensors; its transformer layer is ``transformer_layer`` in torch_dist and
#: ``mtp_model_layer`` (the module's own name) in the legacy format's state dicts
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(?:transformer_layer|mtp_model_layer)\.(.+)$")
_MTP_SIMPLE = {
    "enorm.weight": "enorm.weight", "enorm.bias": "enorm.bias",
    "hnorm.weight": "hnorm.weight", "hnorm.bias": "hnorm.bias",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "final_norm.weight", "final_layernorm.bias": "final_norm.bias",
}
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
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",  # --moe-shared-expert-gate [1, H]
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


def _split_qkv(where: str, base: str, kind: str, t: torch.Tensor, heads: int, groups: int,
               d: int) -> list[tuple[str, torch.Tensor]]:
    """``where``: the Megatron layer (``decoder.layers.N``), ``base``: meshtron's (``layers.N``)."""
    per_group = heads // groups
    rows = groups * (per_group + 2) * d
    if t.shape[0] != rows:
        raise CheckpointError(f"Megatron-LM tensor {where}.self_attention.linear_qkv.{kind}: "
                              f"{t.shape[0]} rows, but {groups} query groups x ({per_group} query heads + 2) x "
                              f"head dim {d} = {rows} (args num_attention_heads/num_query_groups/kv_channels)")
    g = t.reshape(groups, (per_group + 2) * d, *t.shape[1:])
    q = g[:, :per_group * d].reshape(heads * d, *t.shape[1:])
    k = g[:, per_group * d:(per_group + 1) * d].reshape(groups * d, *t.shape[1:])
    v = g[:, (per_group + 1) * d:].reshape(groups * d, *t.shape[1:])
    base = f"{base}.attention"
    return [(f"{base}.q.{kind}", q), (f"{base}.k.{kind}", k), (f"{base}.v.{kind}", v)]


def _split_fc1(prefix: str, kind: str, t: torch.Tensor, swiglu: bool) -> list[tuple[str, torch.Tensor]]:
    if not swiglu:
        return [(f"{prefix}.up.{kind}", t)]
    if t.shape[0] % 2:
        raise CheckpointError(f"Megatron-LM tensor {prefix} linear_fc1.{kind}: {t.shape[0]} rows is odd, not "
                              "[gate; up] of SwiGLU")
    gate, up = t.chunk(2, dim=0)
    return [(f"{prefix}.gate.{kind}", gate), (f"{prefix}.up.{kind}", up)]


#: multi-latent attention (``shape["mla"]`` set) -> meshtron's :mod:`meshtron.layers.mla` names; its latent norms
#: are ``q_layernorm``/``kv_layernorm``, fused into the up projections by Transformer Engine
_MLA = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "attention.q_latent_norm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "attention.kv_latent_norm.weight",
    "self_attention.linear_q_down_proj.weight": "attention.q_down.weight",
    "self_attention.linear_q_up_proj.weight": "attention.q_up.weight",
    "self_attention.linear_q_proj.weight": "attention.q.weight",
    "self_attention.linear_kv_down_proj.weight": "attention.kv_down.weight",
    "self_attention.linear_kv_up_proj.weight": "attention.kv_up.weight",
    "self_attention.q_layernorm.weight": "attention.q_latent_norm.weight",
    "self_attention.kv_layernorm.weight": "attention.kv_latent_norm.weight",
}


def _mla_rows(rest: str, t: torch.Tensor, mla: dict, inverse: bool = False) -> torch.Tensor:
    """megatron-core's MLA rotates the rotary part in interleaved pairs (``mla_rotary_interleaved``), as DeepSeek
    does: the rows producing it are reordered into meshtron's rotate-half order, as for Hugging Face's
    (``inverse``: back, for writing)."""
    from meshtron.layers.mla_hf import deinterleave_rows

    dr = mla["qk_pos_emb_head_dim"]
    if rest in ("self_attention.linear_q_up_proj.weight", "self_attention.linear_q_proj.weight"):
        return deinterleave_rows(t, mla["qk_head_dim"] + dr, dr, inverse)
    if rest == "self_attention.linear_kv_down_proj.weight":
        return deinterleave_rows(t, mla["kv_lora_rank"] + dr, dr, inverse)
    return t


#: grouped-query attention's tensors whose rows (per head of ``head_dim``) produce the rotated dimensions
_ROTATED = re.compile(r"attention\.(q|k|q_norm|k_norm)\.(weight|bias)$")


def _interleaved_rows(d: int, rotated: int, heads: int, inverse: bool) -> torch.Tensor:
    """Row indices putting each head's first ``rotated`` rows (of ``d``) from interleaved pairs (0, 1), (2, 3)...
    into rotate-half order (the even rows, then the odd ones); ``inverse``: back."""
    pairs = torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2)])
    if inverse:
        pairs = torch.argsort(pairs)
    block = torch.cat([pairs, torch.arange(rotated, d)])
    return torch.cat([block + h * d for h in range(heads)])


def rotate_half_rows(name: str, t: torch.Tensor, shape: dict, inverse: bool = False) -> torch.Tensor:
    """``--rotary-interleaved`` (``shape["rope_interleaved"]``: the rotated dimensions of each head): megatron-core
    rotates pairs (0, 1), (2, 3)... of each query/key head; meshtron rotates halves. Reordering the rows that
    produce a query/key head (and its head norm's weight and bias) alike makes meshtron's rotation compute
    megatron-core's, and leaves every attention score as it was. Other tensors pass unchanged."""
    rotated = shape.get("rope_interleaved")
    if not rotated or not _ROTATED.search(name):
        return t
    d = shape["head_dim"]
    return t[_interleaved_rows(d, rotated, t.shape[0] // d, inverse)]


def _layer_to_canonical(where: str, base: str, rest: str, t: torch.Tensor,
                        shape: dict) -> Optional[list[tuple[str, torch.Tensor]]]:
    """One transformer layer's tensor ``rest`` (Megatron's name after the layer's prefix ``where``) as meshtron's
    under ``base`` (``layers.N`` or a prediction depth's ``mtp.layers.k.transformer_layer``); None: unknown."""
    out = _layer_tensors(where, base, rest, t, shape)
    if out is None or not shape.get("rope_interleaved"):
        return out
    return [(n, rotate_half_rows(n, x, shape)) for n, x in out]


def _layer_tensors(where: str, base: str, rest: str, t: torch.Tensor,
                   shape: dict) -> Optional[list[tuple[str, torch.Tensor]]]:
    rest = _NORM_ALIASES.get(rest, rest)
    if shape.get("mla") and rest in _MLA:
        return [(f"{base}.{_MLA[rest]}", _mla_rows(rest, t, shape["mla"]))]
    if rest in _LAYER_SIMPLE:
        return [(f"{base}.{_LAYER_SIMPLE[rest]}", t)]
    if rest.startswith("self_attention.linear_qkv."):
        return _split_qkv(where, base, rest.rsplit(".", 1)[1], t, shape["heads"], shape["groups"], shape["head_dim"])
    if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        return _split_fc1(f"{base}.mlp", rest.rsplit(".", 1)[1], t, shape["swiglu"])
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return _split_fc1(f"{base}.mlp.shared_experts", "weight", t, shape["swiglu"])
    experts = expert_name(rest, t)
    if experts is None:
        return None
    out = []
    for ename, et in experts:
        e, part = ename.split(".")[2], ename.split(".", 3)[3]
        prefix = f"{base}.mlp.experts.{e}"
        if part.startswith("linear_fc1."):
            out += _split_fc1(prefix, part.rsplit(".", 1)[1], et, shape["swiglu"])
        else:
            out.append((f"{prefix}.down.{part.rsplit('.', 1)[1]}", et))
    return out


def to_canonical(name: str, t: torch.Tensor, shape: dict) -> list[tuple[str, torch.Tensor]]:
    """meshtron (canonical name, tensor) pairs of one per-layer Megatron tensor; ``shape`` holds ``heads``,
    ``groups``, ``head_dim``, ``swiglu`` and ``tied`` (from the checkpoint's args). Unknown names raise."""
    if is_skipped(name):
        return []
    if name in _GLOBAL:
        if name == "output_layer.weight" and shape["tied"]:
            return []  # the tied output layer is the embedding
        return [(_GLOBAL[name], t)]
    out = None
    m = _PER_LAYER.match(name)
    if m:
        out = _layer_to_canonical(f"decoder.layers.{m.group(1)}", f"layers.{m.group(1)}", m.group(2), t, shape)
    m = _MTP.match(name)
    if m:
        depth, rest = m.group(1), m.group(2)
        inner = _MTP_LAYER.match(rest)
        if rest in _MTP_SIMPLE:
            out = [(f"mtp.layers.{depth}.{_MTP_SIMPLE[rest]}", t)]
        elif inner:
            out = _layer_to_canonical(f"mtp.layers.{depth}.transformer_layer",
                                      f"mtp.layers.{depth}.transformer_layer", inner.group(1), t, shape)
    if out is not None:
        return out
    raise CheckpointError(f"Megatron-LM tensor {name} has no meshtron equivalent (supported: dense GPT/Llama, "
                          "mixture-of-experts and multi-latent attention layers, multi-token prediction depths)")


def fit_vocab(t: torch.Tensor, vocab: int, name: str) -> torch.Tensor:
    """An embedding/output tensor of Megatron's padded vocabulary cut to ``vocab`` rows."""
    if t.shape[0] < vocab:
        raise CheckpointError(f"Megatron-LM tensor {name} has {t.shape[0]} rows (the checkpoint's padded "
                              f"vocabulary), fewer than this run's vocabulary of {vocab}")
    return t[:vocab]


# ---------------------------------------------------------------------------------------------
# The other direction: meshtron's canonical tensors -> Megatron-LM's torch_dist tensors.
# ---------------------------------------------------------------------------------------------

#: Megatron's layer specs: ``transformer_engine`` (Megatron-LM's default ``--transformer-impl``) and ``local``.
#: Their torch_dist names differ only in the pre-MLP norm of a mixture-of-experts layer: TE keeps it a module
#: of its own (``pre_mlp_layernorm``), the local spec saves it under the fused name, as for a dense layer.
SPECS = ("transformer_engine", "local")
_FROM_LAYER = {v: k for k, v in _LAYER_SIMPLE.items()}
_FROM_GLOBAL = {v: k for k, v in _GLOBAL.items()}
_FUSED_NORMS = {v: k for k, v in _NORM_ALIASES.items()}  # input_layernorm.weight -> linear_qkv.layer_norm_weight
#: The modules whose Transformer Engine state (``_extra_state``, empty in these files) megatron-core saves, by
#: part of a layer: its attention (grouped-query or multi-latent), its MLP (dense, or a mixture of experts' shared
#: expert; the experts apart, one entry per expert).
GQA_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")
MLA_LINEARS = ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
               "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj", "self_attention.linear_proj")
DENSE_MLP_LINEARS = ("mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
#: canonical MLA name -> Megatron's, by spec: Transformer Engine fuses the latent norms into the up projections
_FUSED_MLA_NORMS = {k for k in _MLA if k.endswith(".layer_norm_weight")}
_PLAIN_MLA_NORMS = {"self_attention.q_layernorm.weight", "self_attention.kv_layernorm.weight"}
_FROM_MLA = {spec: {v: k for k, v in _MLA.items()
                    if k not in (_PLAIN_MLA_NORMS if spec == "transformer_engine" else _FUSED_MLA_NORMS)}
             for spec in SPECS}


def _megatron_layer_name(rest: str, moe: bool, spec: str, mla: bool = False) -> str:
    """Megatron's per-layer name (after ``decoder.layers.N.``) of a simple canonical name (after ``layers.N.``)."""
    name = _FROM_LAYER[rest]
    if name.startswith("pre_mlp_layernorm.") and moe and spec == "transformer_engine":
        return name  # TE's MoE layer: a separate norm module
    if mla and (name.startswith("input_layernorm.") or spec == "local"):
        return name  # MLA's layer: the input norm a module of its own (no fused QKV), no fused names in local
    return _FUSED_NORMS.get(name, name)


def _cat(parts: list[Optional[torch.Tensor]], what: str) -> torch.Tensor:
    if any(p is None for p in parts):
        raise CheckpointError(f"meshtron checkpoint: {what} is incomplete (a query/key/value or gate/up part is "
                              "missing)")
    return torch.cat(parts, dim=0)


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, d: int) -> torch.Tensor:
    """Megatron's fused QKV rows: per query group g, [its q heads; k_g; v_g] (the inverse of :func:`_split_qkv`)."""
    per_group = heads // groups
    tail = tuple(q.shape[1:])
    blocks = torch.cat([q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail),
                        v.reshape(groups, d, *tail)], dim=1)
    return blocks.reshape(groups * (per_group + 2) * d, *tail)


_FROM_MTP = {v: k for k, v in _MTP_SIMPLE.items()}


def _layer_from_canonical(base: str, rest: str, t: torch.Tensor, moe: bool, spec: str, shape: dict,
                          out: dict[str, torch.Tensor], fused: dict[str, dict[str, torch.Tensor]]) -> bool:
    """One transformer layer's canonical tensor ``rest`` (after ``layers.N.``) into ``out`` under Megatron's layer
    prefix ``base`` (or into ``fused``, the parts of a fused tensor); False: no Megatron name."""
    if shape.get("mla") and rest in _FROM_MLA[spec]:
        mname = _FROM_MLA[spec][rest]
        out[f"{base}.{mname}"] = _mla_rows(mname, t, shape["mla"], inverse=True)
        return True
    t = rotate_half_rows(rest, t, shape, inverse=True)  # --rotary-interleaved: the query/key rows back in pairs
    if rest in _FROM_LAYER:
        out[f"{base}.{_megatron_layer_name(rest, moe, spec, bool(shape.get('mla')))}"] = t
        return True
    parts = re.match(r"^attention\.([qkv])\.(weight|bias)$", rest)
    if parts:
        fused.setdefault(f"{base}.self_attention.linear_qkv.{parts.group(2)}", {})[parts.group(1)] = t
        return True
    parts = re.match(r"^mlp\.(?:(shared_experts|experts\.\d+)\.)?(gate|up|down)\.(weight|bias)$", rest)
    if parts:
        owner = parts.group(1)
        prefix = f"{base}.mlp" + (f".{owner}" if owner else "")
        if parts.group(2) == "down":
            out[f"{prefix}.linear_fc2.{parts.group(3)}"] = t
        else:
            fused.setdefault(f"{prefix}.linear_fc1.{parts.group(3)}", {})[parts.group(2)] = t
        return True
    return False


def from_canonical(tensors: dict[str, torch.Tensor], shape: dict, moe_layers: set[int],
                   spec: str = "transformer_engine", mtp_moe: bool = False) -> dict[str, torch.Tensor]:
    """Megatron's per-layer tensors (``decoder.layers.N.*``, ``mtp.layers.k.*``, global names) of meshtron's
    canonical ones; ``shape`` as for :func:`to_canonical`, ``moe_layers`` the layers with experts, ``mtp_moe``
    whether the prediction depths' layers have experts. Experts come out as
    ``decoder.layers.N.mlp.experts.E.linear_fcK.weight`` (stacked over E by :func:`stack_for_torch_dist`)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}  # Megatron name -> parts by canonical role (q/k/v, gate/up)
    for name, t in tensors.items():
        if name in _FROM_GLOBAL:
            if name == OUTPUT and shape["tied"]:
                continue  # the tied output layer is the embedding
            out[_FROM_GLOBAL[name]] = t
            continue
        done = False
        m = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if m:
            layer = int(m.group(1))
            done = _layer_from_canonical(f"decoder.layers.{layer}", m.group(2), t, layer in moe_layers, spec, shape,
                                         out, fused)
        m = _MTP.match(name)
        if m:
            depth, rest = m.group(1), m.group(2)
            if rest in _FROM_MTP:
                out[f"mtp.layers.{depth}.{_FROM_MTP[rest]}"] = t
                done = True
            elif rest.startswith("transformer_layer."):
                done = _layer_from_canonical(f"mtp.layers.{depth}.transformer_layer", rest[len("transformer_layer."):],
                                             t, mtp_moe, spec, shape, out, fused)
        if not done:
            raise CheckpointError(f"meshtron tensor {name} has no Megatron-LM equivalent (supported: dense "
                                  "GPT/Llama, mixture-of-experts and multi-latent attention layers, multi-token "
                                  "prediction depths)")
    for mname, roles in fused.items():
        if mname.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            qkv = [roles.get(r) for r in "qkv"]
            _cat(qkv, mname)  # every part present
            out[mname] = _join_qkv(*qkv, shape["heads"], shape["groups"], shape["head_dim"])
        elif shape["swiglu"]:
            out[mname] = _cat([roles.get("gate"), roles.get("up")], mname)
        else:
            out[mname] = _cat([roles.get("up")], mname)
    return out


#: an expert's tensor in a layer saved under its own number (a prediction depth's, or a decoder layer's when the
#: layers are not stacked): stacked over the experts alone
_OWN_EXPERTS = re.compile(r"^((?:mtp\.layers\.\d+\.transformer_layer|decoder\.layers\.\d+)\.mlp\.experts)"
                          r"\.(\d+)\.(.+)$")


def _stack_own_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each layer's ``mlp.experts.E.Y`` stacked as ``mlp.experts.experts.Y`` [experts, ...]
    (layers under their own numbers); other names as they are."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        e = _OWN_EXPERTS.match(name)
        if e:
            experts.setdefault(f"{e.group(1)}.experts.{e.group(3)}", {})[int(e.group(2))] = t
        else:
            out[name] = t
    for name, by_expert in experts.items():
        out[name] = torch.stack([by_expert[i] for i in range(len(by_expert))])
    return out


def stack_for_torch_dist(per_layer: dict[str, torch.Tensor], num_layers: int,
                         stacked: bool = True) -> dict[str, torch.Tensor]:
    """megatron-core's torch_dist tensors: ``decoder.layers.N.X`` stacked as ``decoder.layers.X``
    [num_layers, ...], experts ``mlp.experts.E.Y`` as ``mlp.experts.experts.Y`` [num_layers, experts, ...]
    (the layout of its sequential and grouped experts alike); every layer must then hold the same tensors.
    ``stacked`` False (megatron-core's "non-homogeneous" layers: dense and mixture-of-experts layers mixed): each
    decoder layer under its own number (``decoder.layers.N.X``), its experts stacked [experts, ...]. A prediction
    depth's tensors stay its own (``mtp.layers.k.*``), its experts stacked [experts, ...]."""
    if not stacked:
        return _stack_own_experts(per_layer)
    by_rest: dict[str, dict[int, torch.Tensor]] = {}
    others: dict[str, torch.Tensor] = {}
    for name, t in per_layer.items():
        m = _PER_LAYER.match(name)
        if m:
            by_rest.setdefault(m.group(2), {})[int(m.group(1))] = t
        else:
            others[name] = t
    out = _stack_own_experts(others)
    experts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    for rest, layers in by_rest.items():
        if sorted(layers) != list(range(num_layers)):
            raise CheckpointError(f"Megatron-LM export: decoder.layers.N.{rest} exists for layers "
                                  f"{sorted(layers)[:8]} only; torch_dist stacks a tensor over all {num_layers} "
                                  "layers (layers of different kinds are written unstacked)")
        e = re.match(r"^mlp\.experts\.(\d+)\.(.+)$", rest)
        if e:
            experts.setdefault(e.group(2), {})[int(e.group(1))] = layers
            continue
        out[f"decoder.layers.{rest}"] = torch.stack([layers[i] for i in range(num_layers)])
    for rest, by_expert in experts.items():
        count = len(by_expert)
        out[f"decoder.layers.mlp.experts.experts.{rest}"] = torch.stack(
            [torch.stack([by_expert[e][i] for e in range(count)]) for i in range(num_layers)])
    return out
