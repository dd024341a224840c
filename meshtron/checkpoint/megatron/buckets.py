"""The distributed optimizer's buckets: Megatron's flat per-rank optimizer state mapped back to its tensors.

megatron-core's ``DistributedOptimizer`` keeps each model-parallel rank's fp32 master weights and Adam moments
as flat buffers laid out like its gradient buffer (``_compute_per_buffer_param_layout``):

* the rank's parameters in *reverse* ``named_parameters()`` order (backward order), each starting on a
  64-element boundary (zeros in between); with multi-token prediction the last stage's order is its layers, the
  final layernorm, each prediction depth (``enorm``, ``hnorm``, ``eh_proj``, its transformer layer,
  ``final_layernorm``), then the output layer, and, with more than one stage, the copy of the word embedding the
  depths read comes first;
* cut into buckets: a bucket closes after the parameter that brings it to ``bucket_size`` elements
  (only with ``--overlap-grad-reduce``, ``--ddp-bucket-size`` or max(4e7, 1e6 x DP), and only on the first
  pipeline stage); a tied embedding or output layer off a one-stage pipeline gets a bucket of its own, as do
  both copies of the word embedding that prediction depths on another stage read;
* the prediction depths are on the last chunk of the last stage, or where a layout string's ``m`` places them
  (megatron-core's "standalone" depths, a chunk before the loss's, with their own copy of the word embedding);
  in a model with depths the final layernorm is beside the last transformer layer (megatron-core's
  ``has_final_layernorm_in_this_stage``), which may be an earlier chunk than the output layer's;
* a bucket's saved length is its *unpadded* size (up to the end of its last parameter);
* with virtual pipeline stages each model chunk is a DistributedDataParallel of its own, so one buffer per chunk
  (the optimizer's ``gbuf_idx``, chunks in order, one parameter dtype), laid out as above; chunk ``v`` of stage
  ``p`` holds the layers from ``v x L/VP + p x L/(PP x VP)`` on (:func:`chunk_layers`), the embedding is the first
  chunk of the first stage's, the final norm and output layer the last chunk of the last stage's, and only the
  first chunk of the first stage is bucketed (Megatron-LM's ``disable_bucketing`` for the others);
* with ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` those stages hold their
  own counts and the middle stages the rest evenly; other splits (``--pipeline-model-parallel-layout``, the
  embedding/loss accounting) as meshtron's own partition places them (:func:`stage_split`, equal to
  megatron-core's ``get_transformer_layer_offset``).

A layer's order (:data:`_LOCAL_ORDER`, :data:`_TE_ORDER`, :data:`_MLA_ORDER`) is its modules' registration order:
the input norm, ``linear_proj`` (built by ``Attention`` before its subclass's projections), then grouped-query
attention's ``linear_qkv`` or multi-latent attention's ``linear_q_proj`` / ``linear_q_down_proj``,
``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj`` and its latent norms, the pre-MLP norm and the
MLP; a mixture-of-experts MLP's router and shared expert (its gate, a parameter of its own module, before its
linears) stay in this buffer, the router's expert bias is a buffer (no optimizer state).

A mixture-of-experts model's experts (``allreduce=False`` in megatron-core) are in a buffer of their own, laid out
the same way over the expert-data-parallel group and kept by a second, chained optimizer: per expert rank
(expert tensor-parallel rank + ETP x (expert-parallel rank + EP x pipeline rank)) its share of each of the stage's
layers' experts, SequentialMLP's ``local_experts.i.linear_fc1``, ``linear_fc2`` per expert (TEGroupedMLP: every
``linear_fc1`` first) (:func:`expert_rank_params`). At expert-parallel 1 with expert tensor parallelism equal to
tensor parallelism the experts' linears are ``allreduce=True``: megatron-core then keeps them in the dense buffer,
each layer's (all of them, in the same order) after its router and before its shared expert, and builds a single
optimizer (:func:`experts_apart`).

The ``torch_dist`` format ``dp_reshardable`` (Megatron-LM's default for the distributed optimizer) saves each
bucket as one tensor ``optimizer.distributed.dp_group_idx_M.gbuf_idx_K.dtype_(...).bucket_idx_B.{param,exp_avg,
exp_avg_sq}`` whose index ``M`` is the model-parallel rank (tensor-parallel rank + TP x pipeline rank), ``K`` the
model chunk; with
experts in a buffer of their own the two chained optimizers' keys begin ``chained_0.`` (dense, ``M`` as above) and
``chained_1.`` (experts, ``M`` the expert rank). The legacy ``distrib_optim.pt`` saves, per buffer, the buckets'
unpadded contents one after another (:func:`split_coalesced` cuts them), a mixture-of-experts model's experts'
buffer as the second of the chained optimizers' states (:mod:`.legacy_optim`).

Nothing in the checkpoint names the parameters inside a bucket, so the layout is derived here from the model's
tensors (their per-rank shards) and Megatron's module order, and then *proven*: every master-weight slice must
equal the model weight it belongs to, or the layout is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

from meshtron.checkpoint.megatron.names import expert_name
from meshtron.errors import ConfigError
from meshtron.pipeline.partition import PipelineLayout, partition_layers

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
#: a layer's attention parameters in megatron-core's ``named_parameters()`` order (TransformerLayer builds
#: input_layernorm, self_attention, pre_mlp_layernorm, mlp; Attention builds linear_proj before its subclass's
#: projections). Local spec: the input norm a module of its own, first.
_LOCAL_ATTENTION = ("input_layernorm.weight", "input_layernorm.bias",
                    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")
#: Transformer Engine fuses the input norm into linear_qkv, after linear_proj
_TE_ATTENTION = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                 "input_layernorm.weight", "input_layernorm.bias",
                 "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                 "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")
#: multi-latent attention (either spec: its input norm is a module of its own): linear_proj, then MLASelfAttention's
#: query projection(s), the key/value down and up projections, the latent norms (Transformer Engine fuses them
#: into the up projections, ahead of their weights)
_MLA_ATTENTION = ("input_layernorm.weight", "input_layernorm.bias",
                  "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                  "self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
                  "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
                  "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
                  "self_attention.linear_kv_up_proj.weight", "self_attention.q_layernorm.weight",
                  "self_attention.kv_layernorm.weight")
#: the MLP: dense, or a MoE layer's router, experts (MoELayer registers router, experts, shared_experts in that
#: order; the experts are here only at expert-parallel 1 with expert tensor parallelism equal to tensor parallelism,
#: else in a buffer of their own, :func:`expert_rank_params`) and shared expert, whose gate (a parameter of
#: SharedExpertMLP itself) comes before its linears' (named_parameters() yields a module's own parameters before its
#: children's); the router's expert bias is a buffer
_EXPERTS_SLOT = "mlp.experts"
_MLP = ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
        "mlp.router.weight", _EXPERTS_SLOT, "mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.linear_fc2.weight")
_LOCAL_ORDER = _LOCAL_ATTENTION + _MLP
_TE_ORDER = _TE_ATTENTION + _MLP
_MLA_ORDER = _MLA_ATTENTION + _MLP
_BEFORE_LAYERS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_AFTER_LAYERS = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
#: a prediction depth's own parameters around its transformer layer (``None``), in ``named_parameters()`` order
_MTP_ORDER = ("enorm.weight", "enorm.bias", "hnorm.weight", "hnorm.bias", "eh_proj.weight", None,
              "final_layernorm.weight", "final_layernorm.bias")
#: the fused spellings (Transformer Engine, and every torch_dist checkpoint) of the layer norms
_FUSED = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
          "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
          "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_COLUMN = re.compile(r"(linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias)|word_embeddings\.weight|"
                     r"linear_q_proj\.weight|linear_q_up_proj\.weight|linear_kv_up_proj\.weight|"
                     r"^output_layer\.weight|^mtp\.layers\.\d+\.eh_proj\.weight)$")
_ROW = re.compile(r"(linear_proj\.weight|linear_fc2\.weight)$")
_ALIGN = 64  # every parameter starts on a 64-element boundary
#: the last stage's copy of the word embedding that prediction depths read (its state is the first stage's)
EMBEDDING_COPY = "mtp:embedding.word_embeddings.weight"


class LayoutMismatch(Exception):
    """The derived layout does not fit the checkpoint's buckets (the message says where)."""


@dataclass
class Rank:
    """One model-parallel rank's parameters, in ``named_parameters()`` order: (Megatron name, local shard)."""

    tp: int
    pp: int
    params: list[tuple[str, torch.Tensor]]
    first_stage: bool  #: the first pipeline stage's first model chunk (the only one megatron-core buckets)
    shared_embedding: set[str]  #: names given a bucket of their own (tied embedding/output, PP > 1)


def _layer_key(rest: str) -> str:
    return _FUSED.get(rest, rest)


def local_shard(name: str, whole: torch.Tensor, tp: int, tp_size: int, swiglu: bool) -> torch.Tensor:
    """Tensor-parallel rank ``tp``'s shard of Megatron's whole tensor ``name``: column-parallel layers by rows
    (SwiGLU's ``linear_fc1`` as ``[gate_tp; up_tp]``), row-parallel weights by columns, the rest replicated."""
    if tp_size == 1:
        return whole
    short = _LAYER.sub(r"\2", name)
    if _ROW.search(short):
        return whole.chunk(tp_size, dim=1)[tp]
    if _COLUMN.search(short):
        if swiglu and "linear_fc1" in short:
            gate, up = whole.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp_size)[tp], up.chunk(tp_size)[tp]])
        return whole.chunk(tp_size, dim=0)[tp]
    return whole


def merge_shards(name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """The inverse of :func:`local_shard` over every tensor-parallel rank."""
    if len(shards) == 1:
        return shards[0]
    short = _LAYER.sub(r"\2", name)
    if _ROW.search(short):
        return torch.cat(shards, dim=1)
    if _COLUMN.search(short):
        if swiglu and "linear_fc1" in short:
            halves = [s.chunk(2) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(shards)
    return shards[0]


def _mtp_sort_key(rest: str, order: dict[str, int]) -> tuple[int, int]:
    """Where a prediction depth's tensor (after ``mtp.layers.k.``) comes in its ``named_parameters()``."""
    inner = rest.split(".", 1)[1] if rest.startswith(("transformer_layer.", "mtp_model_layer.")) else None
    if inner is not None:
        key = _layer_key(inner)
        if key not in order:
            raise LayoutMismatch(f"mtp layer tensor {rest} has no known place in megatron-core's layer")
        return _MTP_ORDER.index(None), order[key]
    if rest not in _MTP_ORDER:
        raise LayoutMismatch(f"mtp layer tensor {rest} has no known place in megatron-core's prediction layer")
    return _MTP_ORDER.index(rest), 0


def experts_apart(tp_size: int, ep_size: int, etp_size: Optional[int]) -> bool:
    """Whether megatron-core keeps a mixture-of-experts model's experts in a buffer (and optimizer) of their own:
    with expert parallelism, or expert tensor parallelism unlike tensor parallelism (its linears' ``allreduce``
    False); else they are in the dense buffer, among their layer's parameters."""
    return ep_size > 1 or (etp_size or tp_size) != tp_size


#: How the layers split over the pipeline stages: Megatron-LM's ``--decoder-first-pipeline-num-layers`` and
#: ``--decoder-last-pipeline-num-layers`` (None where not given: that stage is one of the middle ones), or every
#: chunk's layers where Megatron-LM placed them otherwise (``--pipeline-model-parallel-layout``,
#: ``--account-for-embedding/loss-in-pipeline-split``: meshtron's own partition of those flags)
Uneven = Union[tuple[Optional[int], Optional[int]], PipelineLayout]
EVEN: Uneven = (None, None)


def stage_split(num_layers: int, pp_size: int, vp_size: int = 1, uneven: Uneven = EVEN) -> PipelineLayout:
    """Every model chunk's layers as megatron-core places them (``get_transformer_layer_offset``,
    ``get_num_layers_to_build``): meshtron's own partition (:func:`~meshtron.pipeline.partition.partition_layers`,
    the one it trains with) of ``num_layers`` over ``pp_size`` stages of ``vp_size`` chunks, evenly or with
    ``uneven``'s first and/or last stage's own count (ignored at one stage, as megatron-core ignores it), or
    ``uneven`` itself when it is a whole layout. A split megatron-core could not have made is a
    :class:`LayoutMismatch`."""
    chunks = f" x {vp_size} virtual stages" if vp_size > 1 else ""
    if isinstance(uneven, PipelineLayout):
        if (uneven.num_layers, uneven.stages, uneven.virtual_stages) != (num_layers, pp_size, vp_size):
            raise LayoutMismatch(f"the pipeline layout of {uneven.num_layers} layers over {uneven.stages} stages x "
                                 f"{uneven.virtual_stages} virtual stages is not one of {num_layers} layers over "
                                 f"{pp_size} stages{chunks}")
        return uneven
    first, last = uneven if pp_size > 1 else EVEN
    try:
        return partition_layers(num_layers, pp_size, first=first, last=last,
                                virtual_size=vp_size if vp_size > 1 else None)
    except ConfigError as err:
        raise LayoutMismatch(f"{num_layers} layers do not split over {pp_size} pipeline stages{chunks}: {err}") \
            from None


def chunk_layers(num_layers: int, pp: int, pp_size: int, chunk: int = 0, vp_size: int = 1,
                 uneven: Uneven = EVEN) -> range:
    """The layers of pipeline rank ``pp``'s model chunk ``chunk`` (of ``vp_size`` virtual stages), chunk-major
    (chunk ``v`` of every stage before chunk ``v + 1``), as megatron-core places them (:func:`stage_split`)."""
    layers = stage_split(num_layers, pp_size, vp_size, uneven).layers(pp, chunk)
    return range(layers[0], layers[-1] + 1) if layers else range(0)


def rank_params(model: dict[str, torch.Tensor], tp: int, pp: int, tp_size: int, pp_size: int, num_layers: int,
                spec: str, swiglu: bool, tied: bool, inline_experts: bool = False, grouped: bool = False,
                chunk: int = 0, vp_size: int = 1, uneven: Uneven = EVEN) -> Rank:
    """Rank (tp, pp)'s parameters of its model chunk ``chunk`` (of ``vp_size``, :func:`chunk_layers`) from
    Megatron's whole per-layer tensors ``model`` (the embedding on the first chunk of the first stage, the final
    norm, prediction depths and output layer on the last chunk of the last; the fused norm spellings accepted).
    ``inline_experts``: a mixture-of-experts layer's experts (all of them, ``grouped``: TEGroupedMLP's order) follow
    its router, as megatron-core keeps them at expert-parallel 1 (:func:`experts_apart`)."""
    split = stage_split(num_layers, pp_size, vp_size, uneven)
    mine = chunk_layers(num_layers, pp, pp_size, chunk, vp_size, split)
    order = {k: i for i, k in enumerate(_layer_order(model, spec))}
    # megatron-core's pre_process / post_process of this chunk
    first, last = pp == 0 and chunk == 0, pp == pp_size - 1 and chunk == vp_size - 1
    # its mtp_process (the last chunk's, or a layout string's chunk of its own); with prediction depths
    # megatron-core keeps the final norm beside the last transformer layer, else beside the output layer
    with_depths = any(_MTP.match(n) for n in model)
    depths_here = with_depths and split.has_mtp(pp, chunk)
    final_norm_here = (num_layers - 1 in mine) if with_depths else last
    layers: dict[int, list[tuple[tuple[int, int], str]]] = {}
    whole = dict(model)  # plus the experts under their per-expert names, when they are in this buffer
    if inline_experts:
        for layer, experts in experts_by_layer(model).items():
            if layer in mine:
                for i, (name, t) in enumerate(_layer_experts(layer, experts, 0, 1, grouped)):
                    whole[name] = t
                    layers.setdefault(layer, []).append(((order[_EXPERTS_SLOT], i), name))
    depths: dict[int, list[tuple[tuple[int, int], str]]] = {}
    for name in model:
        m = _LAYER.match(name)
        if m and (expert_name(m.group(2), model[name]) is not None or m.group(2) == "mlp.router.expert_bias"):
            continue  # experts: added above when in this buffer, else in their own; the router's bias: a buffer
        if m:
            n, rest = int(m.group(1)), _layer_key(m.group(2))
            if rest not in order:
                raise LayoutMismatch(f"{name} has no known place in megatron-core's layer")
            if n in mine:
                layers.setdefault(n, []).append(((order[rest], 0), name))
        m = _MTP.match(name)
        if m and depths_here:
            depths.setdefault(int(m.group(1)), []).append((_mtp_sort_key(m.group(2), order), name))
    mtp_copy = bool(depths) and not first  # the depths' chunk's copy of the embedding they read
    names = [n for n in _BEFORE_LAYERS if first and n in model]
    shared = set()
    if mtp_copy:
        names.insert(0, EMBEDDING_COPY)
        shared.add(EMBEDDING_COPY)
    for n in sorted(layers):
        names += [name for _, name in sorted(layers[n])]
    names += [n for n in _AFTER_LAYERS[:2] if final_norm_here and n in model]
    for k in sorted(depths):
        names += [name for _, name in sorted(depths[k])]
    if last and (not tied and "output_layer.weight" in model):
        names.append("output_layer.weight")
    elif last and tied and not first and not mtp_copy:  # the last stage's copy of the tied embedding
        names.append("output_layer.weight")
        shared.add("output_layer.weight")
    if (tied or with_depths) and first and not last:
        shared.add("embedding.word_embeddings.weight")
    params = []
    for name in names:
        copy = name == EMBEDDING_COPY or (tied and name == "output_layer.weight")
        source = "embedding.word_embeddings.weight" if copy else name
        params.append((name, local_shard(source, whole[source], tp, tp_size, swiglu)))
    return Rank(tp, pp, params, first, shared)


def _layer_order(model: dict[str, torch.Tensor], spec: str) -> tuple:
    """One layer's parameter names in ``named_parameters()`` order: multi-latent attention's when the model has
    its projections, else the layer spec's."""
    if any(n.endswith("self_attention.linear_kv_down_proj.weight") for n in model):
        return _MLA_ORDER
    return _TE_ORDER if spec == "transformer_engine" else _LOCAL_ORDER


def expert_local(layer: int, expert: int, rest: str) -> str:
    """The name under which an expert's weight is kept here (the legacy per-expert spelling, ``expert`` counted over
    the whole model), which :func:`meshtron.checkpoint.megatron.names.expert_name` reads."""
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{rest}"


def experts_by_layer(model: dict[str, torch.Tensor]) -> dict[int, dict[int, dict[str, torch.Tensor]]]:
    """{layer: {expert: {"linear_fc1.weight"...: whole tensor}}} from every spelling of the experts in ``model``."""
    out: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in model.items():
        m = _LAYER.match(name)
        found = expert_name(m.group(2), t) if m else None
        for ename, et in found or []:
            _, _, e, rest = ename.split(".", 3)  # mlp.experts.E.linear_fcK.weight
            out.setdefault(int(m.group(1)), {}).setdefault(int(e), {})[rest] = et
    return out


def expert_rank_params(experts_of: dict[int, dict[int, dict[str, torch.Tensor]]], etp: int, ep: int, pp: int,
                       etp_size: int, ep_size: int, pp_size: int, num_layers: int, swiglu: bool, grouped: bool,
                       chunk: int = 0, vp_size: int = 1, uneven: Uneven = EVEN) -> Rank:
    """The expert buffer's parameters of expert rank (etp, ep, pp) from ``experts_of`` (:func:`experts_by_layer`),
    in ``named_parameters()`` order: the stage's
    layers in turn, each with its local experts (``ep``'s share of them, in order): SequentialMLP's
    ``local_experts.i.linear_fc1``, ``linear_fc2`` per expert, or, ``grouped`` (TEGroupedMLP), every expert's
    ``linear_fc1`` before every ``linear_fc2``. Expert tensor parallelism shards them as dense MLPs are."""
    mine = chunk_layers(num_layers, pp, pp_size, chunk, vp_size, uneven)
    params: list[tuple[str, torch.Tensor]] = []
    for layer, experts in sorted(experts_of.items()):
        if layer in mine:
            params += [(name, local_shard(name, t, etp, etp_size, swiglu))
                       for name, t in _layer_experts(layer, experts, ep, ep_size, grouped)]
    return Rank(etp, pp, params, pp == 0 and chunk == 0, set())


def _layer_experts(layer: int, experts: dict[int, dict[str, torch.Tensor]], ep: int, ep_size: int, grouped: bool
                   ) -> list[tuple[str, torch.Tensor]]:
    """Expert-parallel rank ``ep``'s share of one layer's experts ({expert: {"linear_fc1.weight"...: whole
    tensor}}) in ``named_parameters()`` order, under their per-expert names (:func:`expert_local`): SequentialMLP's
    ``linear_fc1``, ``linear_fc2`` per expert, or, ``grouped`` (TEGroupedMLP), every ``linear_fc1`` first."""
    if len(experts) % ep_size:
        raise LayoutMismatch(f"layer {layer}: {len(experts)} experts do not split evenly over {ep_size} "
                             "expert-parallel ranks")
    local = len(experts) // ep_size
    mine = range(ep * local, (ep + 1) * local)
    kinds = sorted({k for e in mine for k in experts[e]}, key=lambda k: (k.split(".")[0], k.endswith(".bias")))
    out = []
    for rest, e in ([(k, e) for k in kinds for e in mine] if grouped else [(k, e) for e in mine for k in kinds]):
        if rest not in experts[e]:
            raise LayoutMismatch(f"layer {layer}, expert {e}: no {rest}")
        out.append((expert_local(layer, e, rest), experts[e][rest]))
    return out


@dataclass
class Placement:
    name: str
    bucket: int
    start: int  #: offset in the bucket's saved tensor
    shape: tuple


def layout(rank: Rank, bucket_size: Optional[int]) -> tuple[list[Placement], list[int]]:
    """(where each parameter of ``rank`` lies, each bucket's unpadded length), as megatron-core lays them out.
    A bucket's end padding (to a multiple of 128 x DP) is never saved, and the next bucket starts after it, so
    offsets are counted from each bucket's start."""
    size = bucket_size if rank.first_stage else None  # later pipeline stages are never bucketed
    placements: list[Placement] = []
    lengths: list[int] = []
    pos, bucket, count, end = 0, 0, 0, 0
    for name, t in reversed(rank.params):
        shared = name in rank.shared_embedding
        pos = -(-pos // _ALIGN) * _ALIGN
        if shared and count:  # a tied embedding/output closes the bucket before it
            lengths.append(pos)
            pos, bucket, count = 0, bucket + 1, 0
        end = pos + t.numel()
        placements.append(Placement(name, bucket, pos, tuple(t.shape)))
        count += 1
        if (size is not None and end >= size) or shared:
            lengths.append(end)
            pos, bucket, count = 0, bucket + 1, 0
        else:
            pos = end
    if count:
        lengths.append(end)
    return placements, lengths


#: {(rank index, model chunk): (label for messages, its parameters)}: each rank's buffer of each model chunk
#: (virtual pipeline stage; one without), as the optimizer's ``gbuf_idx`` numbers them for one parameter dtype
RankMap = dict[tuple[int, int], tuple[str, Rank]]
#: {(rank index, model chunk): {bucket: {state: flat tensor}}}
Buckets = dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]]


def _chunk_label(chunk: int, vp_size: int) -> str:
    return f", virtual stage {chunk}" if vp_size > 1 else ""


def dense_ranks(model: dict[str, torch.Tensor], tp_size: int, pp_size: int, num_layers: int, spec: str,
                swiglu: bool, tied: bool, inline_experts: bool = False, grouped: bool = False,
                vp_size: int = 1, uneven: Uneven = EVEN) -> RankMap:
    """The dense buffers, indexed by (model-parallel rank ``tp + TP x pp``, model chunk) (``inline_experts``: with
    the experts among their layer's parameters, :func:`rank_params`)."""
    return {(tp + tp_size * pp, v): (f"model-parallel rank {tp + tp_size * pp} (TP {tp}, PP {pp}"
                                     f"{_chunk_label(v, vp_size)})",
                                     rank_params(model, tp, pp, tp_size, pp_size, num_layers, spec, swiglu, tied,
                                                 inline_experts, grouped, v, vp_size, uneven))
            for pp in range(pp_size) for tp in range(tp_size) for v in range(vp_size)}


def expert_ranks(experts_of: dict[int, dict[int, dict[str, torch.Tensor]]], etp_size: int, ep_size: int,
                 pp_size: int, num_layers: int, swiglu: bool, grouped: bool, vp_size: int = 1,
                 uneven: Uneven = EVEN) -> RankMap:
    """The experts' buffers (:func:`expert_rank_params`), indexed (``etp + ETP x (ep + EP x pp)`` as in
    megatron-core's tensor-expert-pipeline group, model chunk)."""
    out = {}
    for pp in range(pp_size):
        for ep in range(ep_size):
            for etp in range(etp_size):
                index = etp + etp_size * (ep + ep_size * pp)
                for v in range(vp_size):
                    out[(index, v)] = (f"expert model-parallel rank {index} (expert TP {etp}, EP {ep}, PP {pp}"
                                       f"{_chunk_label(v, vp_size)})",
                                       expert_rank_params(experts_of, etp, ep, pp, etp_size, ep_size, pp_size,
                                                          num_layers, swiglu, grouped, v, vp_size, uneven))
    return out


def _expected_keys(found: list, ranks: RankMap) -> str:
    """The (rank, model chunk) buffers found against those expected, for a message."""
    return f"buffers (rank, model chunk) {found}, expected {sorted(ranks)}"


def split_coalesced(ranks: RankMap, world: dict[tuple[int, int], dict[str, torch.Tensor]],
                    bucket_size: Optional[int]) -> Buckets:
    """One kind of buffer (dense or expert) of the legacy ``distrib_optim.pt`` ({(rank index, model chunk): {state:
    the buckets' unpadded contents one after another}}) cut into buckets as :func:`unflatten` takes them, by
    :func:`layout` of ``ranks`` (:func:`dense_ranks`, :func:`expert_ranks`)."""
    if sorted(world) != sorted(ranks):
        raise LayoutMismatch(f"optimizer state for {_expected_keys(sorted(world), ranks)}")
    out: Buckets = {}
    for index, states in world.items():
        label, rank = ranks[index]
        _, lengths = layout(rank, bucket_size)
        for state, flat in states.items():
            if flat.numel() != sum(lengths):
                raise LayoutMismatch(f"{label}: a buffer of {flat.numel()} elements, the model's parameters lay "
                                     f"out as {sum(lengths)}")
            for b, piece in enumerate(flat.split(lengths)):
                out.setdefault(index, {}).setdefault(b, {})[state] = piece
    return out


def unflatten(model: dict[str, torch.Tensor], buckets: Buckets, tp_size: int, pp_size: int, num_layers: int,
              spec: str, swiglu: bool, tied: bool, bucket_size: Optional[int], expert_buckets: Optional[Buckets] = None,
              ep_size: int = 1, etp_size: Optional[int] = None, grouped: bool = False, vp_size: int = 1,
              uneven: Uneven = EVEN) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {Megatron name: whole tensor}} from ``buckets`` ({(model-parallel rank, model chunk): {bucket:
    {state: flat tensor}}}, ``state`` among ``param``, ``exp_avg``, ``exp_avg_sq``; ``vp_size`` model chunks per
    rank, virtual pipeline stages), checked against ``model`` (Megatron's whole per-layer tensors): LayoutMismatch
    if a bucket's length or a master weight differs.

    A mixture-of-experts model's experts are in ``expert_buckets`` ({expert model-parallel rank: ...}, that rank
    numbered ``etp + ETP x (ep + EP x pp)`` as in megatron-core's tensor-expert-pipeline group; expert tensor
    parallelism ``etp_size``, default ``tp_size``), or, at expert-parallel 1 with expert tensor parallelism equal
    to tensor parallelism (:func:`experts_apart`), in ``buckets`` among their layer's parameters (``expert_buckets``
    None); they come back as ``decoder.layers.N.mlp.experts.local_experts.E.linear_fcK.weight`` (``E`` over the
    whole model). ``uneven``: the first and last stages' own layer counts (:func:`chunk_layers`)."""
    check_split(num_layers, pp_size, vp_size, uneven)
    experts_of = experts_by_layer(model)
    apart = bool(experts_of) and experts_apart(tp_size, ep_size, etp_size)
    ranks = dense_ranks(model, tp_size, pp_size, num_layers, spec, swiglu, tied, bool(experts_of) and not apart,
                        grouped, vp_size, uneven)
    vp = f" x VP {vp_size}" if vp_size > 1 else ""
    shards = _unflatten_buffer(ranks, buckets, bucket_size, f"TP {tp_size} x PP {pp_size}{vp}")
    if apart != (expert_buckets is not None):
        raise LayoutMismatch("experts in a buffer of their own (expert parallelism) but no expert buffer" if apart
                             else "an expert buffer for a model whose experts (if any) are in the dense buffer")
    if apart:
        etp_size = etp_size or tp_size
        eranks = expert_ranks(experts_of, etp_size, ep_size, pp_size, num_layers, swiglu, grouped, vp_size, uneven)
        for state, by_name in _unflatten_buffer(eranks, expert_buckets, bucket_size,
                                                f"expert TP {etp_size} x EP {ep_size} x PP {pp_size}{vp}").items():
            shards.setdefault(state, {}).update(by_name)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for state, by_name in shards.items():
        for name, parts in by_name.items():
            if (tied and name == "output_layer.weight") or name == EMBEDDING_COPY:
                continue  # a copy of the embedding: the first stage's own state is the one kept
            out.setdefault(state, {})[name] = merge_shards(name, [parts[t] for t in sorted(parts)], swiglu).clone()
    return out


def check_split(num_layers: int, pp_size: int, vp_size: int = 1, uneven: Uneven = EVEN) -> None:
    """LayoutMismatch unless the layers split over the pipeline stages and their model chunks as megatron-core
    splits them (:func:`stage_split`)."""
    stage_split(num_layers, pp_size, vp_size, uneven)


def _unflatten_buffer(ranks: RankMap, buckets: Buckets, bucket_size: Optional[int], grid: str
                      ) -> dict[str, dict[str, dict[int, torch.Tensor]]]:
    """{state: {name: {tensor-parallel rank: local piece}}} of one kind of buffer (dense or expert), each rank's
    buckets ({(index, chunk): {bucket: {state: flat}}}) cut by :func:`layout` of ``ranks`` ({(index, chunk):
    (label, Rank)}) and proven: every bucket's length and every master-weight slice must be the model's."""
    if sorted(buckets) != sorted(ranks):
        raise LayoutMismatch(f"optimizer state for {_expected_keys(sorted(buckets), ranks)} ({grid})")
    shards: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for index, (label, rank) in sorted(ranks.items()):
        placements, lengths = layout(rank, bucket_size)
        saved = buckets[index]
        found = [next(iter(saved[b].values())).numel() for b in sorted(saved)]
        if found != lengths:
            raise LayoutMismatch(f"{label}: buckets of {found} elements, the model's parameters lay out as {lengths}")
        local = dict(rank.params)
        for p in placements:
            n = local[p.name].numel()
            for state, flat in saved[p.bucket].items():
                piece = flat[p.start:p.start + n].reshape(p.shape)
                if state == "param" and not torch.equal(piece.to(local[p.name].dtype), local[p.name]):
                    raise LayoutMismatch(f"{label}: the master weights at {p.start}..{p.start + n} of bucket "
                                         f"{p.bucket} are not {p.name}")
                shards.setdefault(state, {}).setdefault(p.name, {})[rank.tp] = piece
    return shards
