"""An estimate of the GPU memory one rank needs to train a configuration.

Used beside measured peaks in ``meshtron bench`` and by anything that plans a layout. It is
an estimate of live tensors (comparable to ``torch.cuda.max_memory_allocated``): it leaves out
the CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation, communication buffers and
transient copies (e.g. the few-times-larger peak inside the loss's backward).

The accounting follows Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198) and Megatron-LM's theoretical memory report, adapted to
this model family (RMSNorm, RoPE, grouped-query attention, SwiGLU) and to flash attention.

Weights, gradients, optimizer state (bytes per parameter)
----------------------------------------------------------
- bf16 training (``--bf16``, ``--fp8-format``, or the GPU default): bf16 weights 2, fp32 main
  gradients 4 (2 with ``--grad-reduce-in-bf16``), fp32 master weights + Adam m + v 12.
- fp32 training (``--fp32`` or ``--device cpu``): weights 4, gradients 4, Adam m + v 8.
- Each rank holds its tensor-parallel shard of its pipeline stage's layers (norms and
  row-parallel biases are replicated), the vocab-parallel embedding on the first stage and
  the output layer on the last (a tied embedding has a copy there when PP > 1). Experts are
  split over EP and the expert tensor-parallel size.
- ``--release-grad-buffer`` (the default with a full gradient buffer: ``no_shard``, ``optim``) frees the
  gradients as each iteration starts and allocates each bucket when backward reaches it: with one micro-batch
  per step a rank's peak (the end of its forward) holds no gradient (with full recomputation: the output
  layer's, untied, and one layer's, for a peak in the first recomputed layer's backward), unless the
  optimizer step's (every gradient, no activation) is higher.
- ``--use-distributed-optimizer`` divides the optimizer state over DP x CP (expert weights:
  over the expert data-parallel group, DP x CP x TP / (EP x ETP)); gradients stay whole.
  ``--optimizer-cpu-offload`` moves ``--optimizer-offload-fraction`` of it off the GPU.

Activations of one layer for one micro-batch
--------------------------------------------
Per token (``b*s`` tokens, ``s`` the sequence per context-parallel rank), with ``e`` bytes per
activation element (2 in bf16, 4 in fp32), hidden ``h``, ``a`` query heads and ``g`` key/value
groups of head dim ``d`` (``q = a*d``, ``k = g*d``), MLP width ``f``, the tensors the compiled
layer keeps for the backward. They were counted on an H200 (torch 2.11, saved-tensor hooks on the
compiled layers of llama3-3b, deepseek-moe-16b with MLA, mixtral-8x7b and a Qwen3-MoE shape), and
agree with the counts below within 0.5% per layer:

====================================  =================  ===============
tensor                                bytes per token    split over TP
====================================  =================  ===============
layer input and second residual       2*e*h              only with SP
stream (the norms' inputs; the
output projection's output stands
in for the second)
norm statistics (fp32 rstd / mean)    2*4 (RMS) 2*8 (LN) only with SP
outputs of the norms (= inputs of     2*e*h              only with SP
QKV and of the MLP's first matmul)
v (a copy out of the fused QKV       e*k                always
output, which then goes)
q and k after RoPE (new tensors)      e*(q + k)          always
attention output                      e*q                always
flash-attention log-sum-exp (fp32)    4*a                always
SwiGLU input (gate and up)            2*e*f              always
SwiGLU output (= down-proj input)     0 (recomputed)     always
two hidden-dropout masks (if p > 0)   2*h                only with SP
====================================  =================  ===============

(Without RoPE and head norms, q and k are views of the QKV output, which then stays whole: ``e*(q + 2k)``.
SwiGLU's down projection recomputes the product from gate and up in its backward
(``linear._SwiGLUMatmul``), FP8 tensorwise with its casts (compiled, or without biases: ``fp8.swiglu``);
zero-bubble weight-gradient deferral, the sequence-parallel FP8 path and eager FP8 with biases keep it (``e*f``, one byte per element in FP8). A GeLU MLP keeps ``e*f`` for the GeLU input and ``e*f`` for its output. ``--qk-layernorm``
adds the heads' statistics.) So without recomputation a layer keeps::

    b*s * [ e*(4h + 2q + 2k + 2f) + 4a + stats + dropout ]          (SwiGLU, RoPE)

For GPT-style layers (learned positions, GeLU, ``f = 4h``, ``q = k = h``, dropout on) this is
``b*s*(e*16h + 2h) = 34*b*s*h`` bytes in bf16: Korthikanti's ``sbh*34``; the ``5as/h`` term of
their formula is absent because flash attention (SDPA's flash/cuDNN kernels, meshtron's GPU
default) never stores the ``s x s`` attention matrix; ``flash_attention=False`` adds it back
(softmax output ``e``, plus mask and dropout output ``1+e`` with attention dropout, per head
per key position). Packed documents (``--reset-attention-mask``) change nothing here: on CUDA they run
flex attention with a block mask (:mod:`meshtron.layers.documents`), which saves the output and the
fp32 log-sum-exp like flash and builds no ``s x s`` mask (its block table is ``(s/128)^2`` int32s per
sample, built once per micro-batch and freed with it); only the dense reference path
(``MESHTRON_DOCUMENT_ATTENTION=dense``, or attention dropout with documents) holds a boolean
``b*s*s`` mask, which this model does not count. For Llama-3-8B (``h=4096, q=4096, k=1024, f=14336``) the bf16 figure is
``110,592 + 136`` bytes per token per layer, about ``27*h``.

Without sequence parallelism the "only with SP" rows are replicated on each TP rank
(Korthikanti's ``10sbh + 24sbh/t``); with SP everything is divided by TP, except that a compiled
layer keeps the all-gathered inputs of its two column-parallel linears (QKV, fc1) whole: the backward's
all-gather of the saved shard is merged with the forward's by the compiler, and a collective is not
recomputed (``2*e*h*(1 - 1/TP)`` per token more, in FP8 ``2*h*(1 - 1/TP)`` for the one-byte copies; not
with selective recomputation). A compiled TP=2 + SP layer's saved bytes equal this count exactly on the
CPU (tests/parallel/test_saved_activations_tp.py, also with selective recomputation and FP8), and the
two-GPU TP=2 + SP rows of revision 0 of :data:`LAYER_SAVES` peak where it puts them. On the GPU today (revision
7) the compiled layer keeps only the shard, as written: the emulated H100 rows (torch 2.11) of TP 2, 4 and 8
peak within 1% of the model without that term, 1.6-13 GiB below the model with it (docs/planning.md, "The
planner against emulation").

Multi-latent attention (``--multi-latent-attention``; ``n`` heads of dims ``dn``/``dr``/``dv``,
ranks ``rq``/``rkv``): the attention rows become the down projection's output and the normed
latents (``2*e*(rq + rkv + dr)``: the first replicated like the down projection, the second
gathered over the sequence), the concatenated queries and keys (``2*e*n*(dn + dr)``), the
key/value projection's output (``e*n*(dn + dv)``, the values a view of it), the attention output
and its ``[s, b, n*dv]`` copy that the output projection keeps (``2*e*n*dv``).

Mixture of experts (balanced routing, no dropped tokens): a MoE layer keeps no second norm output
(the router reads an fp32 copy, ``4*h``, of the whole sequence on every TP rank, and the experts'
rows are gathered from it), plus the router's logits and probabilities (``8*E``) and its int64
indices (``38*topk``), and, per routing choice, the row of the grouped GEMM's aligned buffer and the
expert's output row that the weighted sum's batched matmul keeps (``2*e*h`` where every expert is local and
nothing is dropped: tokens go straight into and out of the buffer; through the dispatcher, with expert
parallelism or a capacity, one more row, ``3*e*h``), fc1's output
(``2*e*fe``), SiLU's output and the SwiGLU product (``2*e*fe``: the experts run eagerly, so SiLU's
output is kept), the experts' part split over the expert TP size; a shared expert keeps its input
and its MLP's ``3*e*fs``.

FP8 (``--fp8-format``, tensorwise recipe, ``meshtron.layers.fp8``): the layer's tensor-parallel
linears keep one-byte transposed FP8 copies of their inputs instead of the bf16 ones: the two norm
outputs (``h`` each) cost one byte per element, not ``e``; the output projection keeps a one-byte copy
of the attention output (``q``) beside the bf16 one that attention's backward needs; SwiGLU's fc2
recomputes its input's casts in backward (on the sequence-parallel FP8 path it keeps the product's
one-byte copy, ``f``). No linear keeps an FP8 copy of its weight: backward casts the weight again with
the forward's scale (before revision 2 of :data:`LAYER_SAVES` each linear but fc2 kept one per
micro-batch in flight, :func:`fp8_weight_copy_bytes`).
The router, the routed experts and the output layer stay in bf16. The rowwise recipe keeps bf16
inputs and reads the weights themselves, so it is counted as bf16.

Recomputation
-------------
- ``selective`` (cheap, memory-heavy ops recomputed, matmul and attention outputs kept; the
  modules are ``core_attn``, ``norm``, ``act`` by default): ``core_attn`` drops RoPE's queries and
  keys (and the attention matrix without flash; the log-sum-exp is an output of the attention
  kernel and stays), ``norm`` drops the norm outputs (2*e*h) and statistics, ``act`` drops the
  SwiGLU/GeLU output (e*f). Under SP the output projection's matmul output is kept for the whole
  sequence (its reduce-scatter is recomputed): ``e*h*(1 - 1/TP)`` more than its shard.
- ``full`` keeps only each checkpointed chunk's input (``e*h`` per token, split over TP with
  SP); ``uniform`` checkpoints chunks of ``--recompute-num-layers`` layers and, during the
  backward, holds that many layers' full activations (less the chunk's input, already kept); ``block``
  recomputes the first ``--recompute-num-layers`` layers of each stage and keeps the rest. A checkpointed
  layer keeps no FP8 weight copy.

The backward of a layer
-----------------------
On top of what is saved, a layer's backward holds the gradient it receives (``e*h`` per token) and, at its
peak in the MLP, SwiGLU's recomputed product and the gradient of gate and up (``3*e*f``, split over TP;
``2*e*f`` for GeLU): :func:`backward_working_bytes`. The last stage has two moments that never meet: the
loss (its chunk, its fp32 weight gradient, the final norm's and output layer's inputs) and a layer's
backward (the working set above; the head's inputs are freed and the weight gradient rounded to the
weights' dtype, which a tied embedding keeps until its own part arrives). The peak is the larger: the loss
for short sequences, the first recomputed layer's backward for long ones with full recomputation (on one
H100, llama3-1b at 1 x 131072: the recomputed layer's 55,432 bytes per token and 49,408 above the received
gradient, against 55,432 and ``3*e*f = 49,152`` modelled; 38.2 GiB measured and modelled, where the loss's
moment alone gave 33.6).

Pipeline, embedding and loss
----------------------------
- 1F1B: rank r holds ``min(PP - r, M)`` micro-batches' activations of its layers (M
  micro-batches per iteration). Interleaved with V virtual stages: rank r holds
  ``min(M*V, 2(PP-r-1) + (V-1)*PP + 1)`` chunk-forwards of ``L/(PP*V)`` layers; for rank 0
  this is ``L * (1 + (PP-1)/(PP*V))`` layers, Korthikanti's interleaving factor.
- First stage: token ids (int64, 8 bytes per token) and the embedding dropout mask.
- Last stage, for one micro-batch: the final norm's input and the output layer's input (or,
  with the fused loss, the gradient of the hidden states it keeps instead): ``2*e*h``; and
  the loss (reported as ``logits``). meshtron's loss (``meshtron.layers.cross_entropy``) is
  fused with the output layer and chunked over tokens: it keeps the fp32 gradient of the
  output weight (``4*h*V/TP`` bytes) and, while it runs, one chunk's logits and their gradient
  (``4`` bytes per element in bf16, where compiled kernels keep no fp32 copy: measured 4.0 GB for
  8192 tokens of llama3-3b; ``20`` in fp32, eager), of a chunk of about 2^30 / (V/TP) tokens, and
  with more than one chunk the previous chunk's gradient too (``e`` more per element: measured
  1.96 GiB for llama3-3b at 4 x 4096, two chunks); V is the padded vocabulary.
  ``fused_loss=False`` models an unfused loss instead: fp32 logits kept for the backward,
  ``4*V/TP`` bytes per token (Korthikanti's and Megatron's accounting).
- Context parallelism divides the sequence: ``s = seq_length / CP``. All-to-all CP (``--cp-comm-type a2a``,
  ``a2a+p2p``) keeps the exchanged q, k, v instead (the same bytes per token), with each key/value head
  repeated ``lcm(groups, A) / groups`` times when the groups of a TP rank do not split over its A ranks.
- Multi-token prediction: each depth adds its layer, its inputs, and its own pass through the fused
  loss, which keeps another fp32 gradient of the output weight.

Activation offloading (``--offload-activations``, :mod:`meshtron.layers.activation_offload`)
--------------------------------------------------------------------------------------------
In each model chunk the first ``--offload-activations-num-layers`` layers (default: all but the
chunk's last) copy what they save to pinned host memory on a side stream; tensors under 1 MiB
stay (of the counted ones: the norms' fp32 statistics at short sequences). A tensor is freed by
the forward as usual, but the caching allocator hands its block out again only when its copy has
run, so the device holds what the copies have not reached yet (reserved memory; no longer counted
by ``max_memory_allocated``, the figure this model describes): the copies run at ``pcie_gbps`` of the
device profile (``profile``, the built-in H200 one by default; ``meshtron plan --calibrate``
measures it) behind each layer's forward, whose time comes from the step-time model's per-layer costs
(:mod:`meshtron.planning.layer_costs`). In the backward the same stream first drains that backlog,
then fetches each layer's tensors when the backward reaches the layer after it, so a layer's and
its predecessor's tensors are on the device together. :func:`offload_timeline` replays this
queue; the peak is the largest of (kept activations of the layers not yet back-propagated + the
two fetched layers) over the backward's layers, the backlog is reported beside it
(``MemoryEstimate.pending_copies``), and the time the backward waits for a fetch is what the
step-time model adds. Measured on llama3-3b at 1 x 32768 with selective recomputation (h67):
63.7 GiB allocated, as modelled; the copies ran at 55 GB/s each way.

The reported figure is for the pipeline rank with the largest total (first or last stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from meshtron.config import MeshtronConfig, ModelConfig, num_kv_heads, padded_vocab_size
from meshtron.layers.cross_entropy import chunk_size  # the fused loss's chunk rule
from meshtron.layer_kinds import MLPS
from meshtron.layer_kinds.base import SavedBytes, norm_parameters
from meshtron.layer_kinds.pattern import LayerKinds, layer_at, layer_kinds
from meshtron.optim.accounting import releases_gradients
from meshtron.parallel.layout import sequence_parallel_in_effect
# LAYER_SAVES and fc2_recomputes_product are the layers' (the step-time model needs them as well).
from meshtron.planning.layer_costs import LAYER_SAVES, _layers_compiled, fc2_recomputes_product
from meshtron.pipeline.partition import SPLIT_BACKWARD, PipelineLayout
from meshtron.run_layout import (BF16, DTYPE_BYTES, RunLayout, layout_from_config, resolve_layout, shards_gradients,
                                 shards_state, shards_weights)

GIB = 2**30
#: Saved tensors smaller than this stay on the device with --offload-activations (activation_offload.DEFAULT_MIN_BYTES).
OFFLOAD_MIN_BYTES = 1 << 20
#: What ``--recompute-granularity selective`` recomputes (see the module docstring).
SELECTIVE_MODULES: tuple[str, ...] = ("core_attn", "norm", "act")
_KNOWN_MODULES = frozenset(SELECTIVE_MODULES)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per GPU on the most loaded pipeline stage."""

    weights: int
    gradients: int
    optimizer_state: int
    activations: int  # layers, embedding and final norm (without the logits)
    logits: int  # the loss: kept fp32 logits, or the fused loss's weight gradient and transient chunk
    stage: int = 0  # the pipeline rank these figures are for
    microbatches_in_flight: float = 1.0  # on that stage (fractional with interleaving)
    offload_stall_s: float = 0.0  # --offload-activations: seconds a micro-batch's backward waits for fetches
    # --offload-activations: bytes whose copies to the host have not run when the backward starts; freed
    # tensors, so not in ``total`` (nor in max_memory_allocated), but held by the allocator until then.
    pending_copies: int = 0
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.weights + self.gradients + self.optimizer_state
                           + self.activations + self.logits)

    @property
    def device_bytes(self) -> int:
        """What the device must hold: the live peak plus the blocks of freed activations whose copies to the
        host are still running (the allocator hands those out again only when the copy is done)."""
        return self.total + self.pending_copies

    def as_dict(self) -> dict:
        """Bytes of each part, plus the stage and in-flight micro-batches."""
        return {"weights": self.weights, "gradients": self.gradients, "optimizer_state": self.optimizer_state,
                "activations": self.activations, "logits": self.logits, "total": self.total,
                "stage": self.stage, "microbatches_in_flight": self.microbatches_in_flight,
                "pending_copies": self.pending_copies}

    def table(self) -> str:
        """A small human table in GiB."""
        rows = [("weights", self.weights), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("activations", self.activations),
                ("logits", self.logits), ("total", self.total)]
        lines = [f"estimated memory per GPU (pipeline stage {self.stage}; "
                 f"micro-batches in flight: {self.microbatches_in_flight:g})"]
        lines += [f"  {name:<16}{value / GIB:>10.2f} GiB" for name, value in rows]
        if self.pending_copies:
            lines.append(f"  (and {self.pending_copies / GIB:.2f} GiB of freed activations the allocator holds "
                         "until their copies to the host have run)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Activations.
# ---------------------------------------------------------------------------------------------

def _layer_kinds(m: ModelConfig, layer: Optional[int], moe: bool) -> LayerKinds:
    """Layer ``layer``'s kinds; without an index, those of the model's first layer whose MLP has experts exactly
    when ``moe`` (the registry's first such MLP kind if no layer has one)."""
    if layer is not None:
        return layer_at(m, layer)
    kinds = layer_kinds(m)
    match = next((k for k in kinds if k.mlp.has_experts == moe), None)
    if match is not None:
        return match
    return LayerKinds(kinds[0].mixer, next(k for k in MLPS.values() if k.has_experts == moe))


def layer_activation_bytes(m: ModelConfig, *, micro_batch: int, seq: int, tp: int = 1,
                           sequence_parallel: bool = False, act_bytes: int = 2,
                           recompute: Optional[str] = None, moe: bool = False, expert_tp: Optional[int] = None,
                           flash_attention: bool = True,
                           selective_modules: Iterable[str] = SELECTIVE_MODULES, fp8: bool = False,
                           compiled: bool = True, local_experts: bool = True, fc2_keeps_product: bool = False,
                           saves: int = LAYER_SAVES, rowwise_fp8: bool = False,
                           merged_gathers: Optional[bool] = None, cp_kv_replicas: int = 1, cp: int = 1,
                           layer: Optional[int] = None) -> float:
    """Bytes one transformer layer keeps for the backward of one micro-batch, on one TP rank.

    The layer's kinds (:mod:`meshtron.layer_kinds`) add their parts: those of layer ``layer`` of the pattern,
    or without an index those of a layer with (``moe``) or without experts.

    ``seq`` is the sequence per context-parallel rank (``cp``: the context-parallel size, for the mixers whose
    saved tensors depend on it). ``recompute`` is None, ``"selective"``
    or ``"full"`` (then only the layer's input is counted). ``fp8``: the layer's tensor-parallel
    linears run FP8 tensorwise (they keep FP8 copies of their inputs; the per-micro-batch FP8
    weight copies are :func:`fp8_weight_copy_bytes`). ``compiled``: the layer runs under
    ``torch.compile`` (with SP it then keeps the gathered inputs of its column-parallel linears).
    ``local_experts``: a MoE layer's tokens go straight into and out of the grouped GEMM's buffer
    (every expert on this rank, no capacity; else through the token dispatcher). ``fc2_keeps_product``: the
    down projection keeps SwiGLU's product (a zero-bubble schedule's deferred weight gradients, rowwise FP8).
    ``saves``: the revision of what layers keep (:data:`LAYER_SAVES`), to compare with rows measured at
    earlier code. ``rowwise_fp8``: the dense linears run FP8 rowwise, compiled; their autograd function saves
    its bf16 input, which the compiler recomputes where it is a norm's output (the norm's input and statistics
    are kept anyway), and SwiGLU's product too (counted on the CPU, tests/layers/test_saved_activations.py).
    ``merged_gathers``: a compiled layer under SP keeps the all-gathered inputs of its column-parallel linears
    (the compiler merges the backward's all-gather with the forward's): so on the CPU (torch 2.13) and in the
    two-GPU rows of revision 0; not on the GPU since (revision 7 of :data:`LAYER_SAVES`). None: by ``saves``.
    See the module docstring.
    """
    sp = sequence_parallel_in_effect(sequence_parallel, tp)
    fp8_sp_path = sp  # FP8 linears cast before their sequence-parallel collectives
    if recompute not in (None, "selective", "full"):
        raise ValueError(f"recompute must be None, 'selective' or 'full', got {recompute!r}")
    selective = set(selective_modules) if recompute == "selective" else set()
    unknown = selective - _KNOWN_MODULES
    if unknown:
        raise ValueError(f"unknown selective recompute modules {sorted(unknown)}; known: {sorted(_KNOWN_MODULES)}")
    e, h = act_bytes, m.hidden_size
    tokens = micro_batch * seq
    sp_div = tp if sp else 1
    if recompute == "full":
        return tokens * e * h / sp_div
    lin = 1 if fp8 else e  # bytes per element of a saved linear input (FP8 copies under fp8)

    heads = math.ceil(m.num_attention_heads / tp)
    groups = math.ceil(num_kv_heads(m) / tp)  # fewer groups than TP ranks: groups are replicated
    stats = 4 if m.normalization == "RMSNorm" else 8

    # Parts replicated over TP unless sequence parallelism splits them: the layer input and the
    # second residual stream (the input of each norm), the norms' statistics, the norms' outputs.
    rep = 2 * e * h + (0 if "norm" in selective else 2 * stats)
    if m.hidden_dropout > 0:
        rep += 2 * h  # bool masks
    part = 0.0  # parts always split over TP (per-rank heads and MLP columns)
    # A compiled column-parallel linear under SP (linear._ColumnParallelMatmul; in FP8
    # fp8.sequence_parallel, which gathers the one-byte copy) saves its input shard and all-gathers it
    # again in backward; the compiler merges that all-gather with the forward's identical one and, a
    # collective not being recomputed, keeps the gathered input: the whole sequence, ``lin*h*(1 - 1/TP)``
    # per token more than the shard (counted on the CPU, tests/parallel/test_saved_activations_tp.py).
    # Selective recomputation runs the collectives again (meshtron.layers.recompute).
    # On the GPU since revision 7 the merge does not happen (the emulated H100 rows, docs/planning.md "The
    # planner against emulation"): the linears keep their shards, counted in ``rep``.
    if merged_gathers is None:
        merged_gathers = saves < 7
    gathered = lin * h * (1 - 1 / tp) if (sp and compiled and merged_gathers) else 0.0
    if selective and sp:
        # Selective recomputation keeps the output projection's matmul output, which under SP is the
        # whole sequence's partial sum before its reduce-scatter (the collective is recomputed);
        # ``rep`` counts that tensor as the rank's sequence shard (the second residual stream).
        part += e * h * (1 - 1 / tp)

    # The mixer, then the MLP, each adding its own tensors (the sums keep the order they always had).
    kinds = _layer_kinds(m, layer, moe)
    saved = SavedBytes(rep=rep, part=part, e=e, lin=lin, h=h, tp=tp, heads=heads, groups=groups, stats=stats,
                       seq=seq, recompute=recompute, selective=frozenset(selective), saves=saves, gathered=gathered,
                       rowwise_fp8=rowwise_fp8, fp8=fp8, fp8_sp_path=fp8_sp_path,
                       fc2_keeps_product=fc2_keeps_product, local_experts=local_experts,
                       expert_tp=expert_tp or tp, cp_kv_replicas=cp_kv_replicas, flash_attention=flash_attention,
                       cp=cp)
    kinds.mixer.add_saved_bytes(m, saved)
    kinds.mlp.add_saved_bytes(m, saved)
    return tokens * (saved.rep / sp_div + saved.part)


def backward_working_bytes(m: ModelConfig, *, micro_batch: int, seq: int, tp: int = 1,
                           sequence_parallel: bool = False, act_bytes: int = 2, moe: bool = False,
                           expert_tp: Optional[int] = None, layer: Optional[int] = None) -> float:
    """Bytes one layer's backward allocates beyond what the layer saved, at its peak (in its MLP), on one TP rank.

    The gradient it receives (``e*h`` per token, split over TP with SP) and the MLP's: a SwiGLU MLP recomputes
    the product for fc2's weight gradient (``e*f``) and writes the gradient of gate and up (``2*e*f``), both
    alive together (``3*e*f``, split over TP); a GeLU MLP the gradients of the activation's output and input
    (``2*e*f``). Measured on an H100 (llama3-1b, 1 x 131072, compiled layer, bf16): 49,408 bytes per token
    above the saved tensors and the received gradient, against ``3*e*f = 49,152``
    (``benchmarks/long_seq_memory_probe.py``). A MoE layer's experts are counted the same way per routing
    choice, and a shared expert like a dense MLP (not measured).
    """
    e, h = act_bytes, m.hidden_size
    sp_div = tp if sequence_parallel_in_effect(sequence_parallel, tp) else 1
    mlp = _layer_kinds(m, layer, moe).mlp.backward_working_bytes(m, e, tp, expert_tp or tp)
    return micro_batch * seq * (e * h / sp_div + mlp)


def fp8_weight_copy_bytes(m: ModelConfig, layer: int, tp: int = 1, fc2_recast: bool = False) -> float:
    """Bytes of the FP8 (tensorwise) weight copies one layer's linears kept per micro-batch on one TP rank
    before revision 2 of :data:`LAYER_SAVES` (today each linear casts its weight again in backward).

    Each FP8 linear cast its weight once per forward and kept the transposed FP8 copy for the
    backward's input-gradient GEMM: one byte per weight element of the
    attention projections, the dense MLP and a shared expert's fc1 (the router, the routed experts
    and the shared expert's fc2 ran in bf16 then). ``fc2_recast``: the dense SwiGLU fc2 recasts its weight in
    backward (``linear._swiglu_fp8_recomputed``) and keeps no copy.
    """
    kinds = layer_at(m, layer)
    return float(kinds.mixer.fp8_weight_elements(m, tp) + kinds.mlp.fp8_weight_elements(m, tp, fc2_recast))


def _cp_kv_replicas(cfg) -> int:
    """How many times all-to-all context parallelism repeats each key/value head of a TP rank (1 without it)."""
    from meshtron.planning.layer_costs import cp_a2a_size

    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    degree = cp_a2a_size(cfg)
    if degree <= 1:
        return 1
    return max(kinds.mixer.cp_kv_replicas(m, tp, degree) for kinds in layer_kinds(m))


def _fp8_tensorwise(cfg: MeshtronConfig) -> bool:
    """Whether the layers' linears keep FP8 inputs and weight copies (``--fp8-recipe rowwise`` keeps bf16)."""
    return bool(cfg.train.fp8_format) and (cfg.train.fp8_recipe or "tensorwise") == "tensorwise"


# ---------------------------------------------------------------------------------------------
# Layout helpers.
# ---------------------------------------------------------------------------------------------

def _split_backward_in_flight(schedule: str, stages: int, virtual: int, micro_batches: int, rank: int) -> float:
    """Micro-batches' worth of a rank's activations that a zero-bubble plan holds at most (its chunk-forwards
    not yet through their W, over the chunks per rank)."""
    from meshtron.pipeline.schedules import max_in_flight, pipeline_plans

    return max_in_flight(pipeline_plans(stages, virtual, micro_batches, False, 1, schedule)[rank]) / virtual


def stage_chunks(cfg: MeshtronConfig, pipeline: Optional[PipelineLayout] = None) -> list[list[list[int]]]:
    """For each pipeline rank, its model chunks (one per virtual stage) as lists of global layer indices (of
    ``pipeline``, by default ``cfg``'s)."""
    layout = pipeline if pipeline is not None else layout_from_config(cfg)
    return [layout.stage_layers(rank) for rank in range(layout.stages)]


# ---------------------------------------------------------------------------------------------
# Parameters.
# ---------------------------------------------------------------------------------------------

def _sharded_weights_and_grads(strategy: str, dense: float, expert: float, dense_shard: float,
                               expert_shard: float, w_bytes: int, g_bytes: int) -> tuple[float, float]:
    """Weight and gradient bytes of a rank between steps under ``strategy`` (as
    :func:`meshtron.optim.accounting.strategy_bytes_per_parameter` counts them per parameter): ZeRO-2 keeps the
    full weights plus the compact shard the optimizer writes, and fp32 gradient shards; ZeRO-3 keeps only
    weight and fp32 gradient shards."""
    params = dense + expert
    if shards_weights(strategy):
        shards = dense / dense_shard + expert / expert_shard
        return shards * w_bytes, shards * 4
    if shards_gradients(strategy):
        return (params * w_bytes + (dense / dense_shard + expert / expert_shard) * w_bytes,
                (dense / dense_shard + expert / expert_shard) * 4)
    return params * w_bytes, params * g_bytes


def layer_parameters(m: ModelConfig, layer: int, tp: int = 1, ep: int = 1,
                     expert_tp: Optional[int] = None) -> tuple[float, float]:
    """(dense, expert) parameters of one layer held by one rank, as its kinds count them."""
    kinds = layer_at(m, layer)
    dense = kinds.mixer.rank_parameters(m, tp)
    dense += 2 * norm_parameters(m)
    mlp = kinds.mlp.rank_parameters(m, tp, ep, expert_tp or tp)
    return dense + mlp.dense, mlp.expert


# ---------------------------------------------------------------------------------------------
# The estimate.
# ---------------------------------------------------------------------------------------------

def estimate_memory(cfg: MeshtronConfig, vocab_size: int, *, world_size: Optional[int] = None,
                    flash_attention: bool = True, fused_loss: bool = True,
                    selective_modules: Iterable[str] = SELECTIVE_MODULES, profile=None,
                    saves: int = LAYER_SAVES, layout: Optional[RunLayout] = None) -> MemoryEstimate:
    """Estimated training memory per GPU for ``cfg`` on ``world_size`` GPUs (see the module docstring).

    The figures are those of the pipeline rank with the largest total. ``vocab_size`` is the
    tokenizer's; it is padded as the model pads it. Without ``world_size`` the data-parallel
    size is 1 (world = TP x CP x PP). ``profile`` (a :class:`meshtron.planning.profiles.DeviceProfile`,
    default the built-in H200 one) times the host copies of ``--offload-activations``; nothing else uses it.
    ``saves``: see :func:`layer_activation_bytes`. ``layout``: ``cfg``'s
    :class:`~meshtron.run_layout.RunLayout` on ``world_size`` ranks where the caller has it (else resolved here).
    """
    stages = stage_estimates(cfg, vocab_size, world_size=world_size, flash_attention=flash_attention,
                             fused_loss=fused_loss, selective_modules=selective_modules, profile=profile,
                             saves=saves, layout=layout)
    return max(stages, key=lambda est: est.total)


def stage_estimates(cfg: MeshtronConfig, vocab_size: int, *, world_size: Optional[int] = None,
                    flash_attention: bool = True, fused_loss: bool = True,
                    selective_modules: Iterable[str] = SELECTIVE_MODULES, profile=None,
                    saves: int = LAYER_SAVES, layout: Optional[RunLayout] = None) -> list[MemoryEstimate]:
    """:func:`estimate_memory` for every pipeline rank, in rank order."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    if layout is None:
        if world_size is None:  # one data-parallel rank
            world_size = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
        layout = resolve_layout(cfg, world_size)
    tp, pp, cp, ep, dp = layout.tp, layout.pp, layout.cp, layout.ep, layout.dp
    etp = par.expert_tensor_parallel_size or tp
    global_batch = tr.global_batch_size or tr.micro_batch_size * dp
    n_micro = max(1, global_batch // (tr.micro_batch_size * dp))
    v = layout.pipeline.virtual_stages
    sp = layout.sequence_parallel
    sp_div = tp if sp else 1
    seq = m.seq_length // cp
    tokens = tr.micro_batch_size * seq
    bf16 = layout.compute_dtype == BF16
    e = DTYPE_BYTES[layout.compute_dtype]
    vocab = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
    selective_modules = tuple(selective_modules)

    w_bytes = e
    g_bytes = 2 if (bf16 and par.grad_reduce_in_bf16) else 4
    # fp32 masters (unless the weights are fp32) and the optimizer's states of a hidden matrix (Adam's moments,
    # bf16 when asked for; Muon's momentum: its AdamW-updated embeddings and norms are counted at that rate too)
    from meshtron.optim.registry import matrix_state_bytes

    o_bytes = (4 if bf16 else 0) + matrix_state_bytes(cfg)
    opt_gpu = 1.0 - (_offload_fraction(cfg) if cfg.optim.optimizer_cpu_offload else 0.0)
    # --data-parallel-sharding-strategy (meshtron.optim.accounting): what is split over DP x CP (dense) and
    # over the expert-data-parallel ranks (experts).
    strategy = layout.sharding_strategy
    # --release-grad-buffer: no gradients from an iteration's start to its backward.
    releases = releases_gradients(strategy, par.release_grad_buffer)
    # Hybrid sharding (--num-distributed-optimizer-instances R): the state is split over S = DP x CP / R ranks.
    replicas = max(1, getattr(par, "num_distributed_optimizer_instances", 1) or 1)
    dense_shard = dp * cp / replicas if shards_state(strategy) else 1
    expert_shard = max(1.0, dp * cp * tp / (ep * etp) / replicas) if shards_state(strategy) else 1

    fp8 = _fp8_tensorwise(cfg)
    fc2_recomputes = fc2_recomputes_product(cfg, saves)
    compiled = _layers_compiled(cfg)
    rowwise = bool(cfg.train.fp8_format) and not fp8 and compiled and not sp
    # MoELayer.forward's direct path: every expert here, nothing dropped, the grouped GEMM (bf16)
    local_experts = ep == 1 and m.moe_expert_capacity_factor is None and bf16

    kv_replicas = _cp_kv_replicas(cfg)

    def act(layer: int, recompute: Optional[str]) -> float:
        saved = layer_activation_bytes(m, micro_batch=tr.micro_batch_size, seq=seq, tp=tp, sequence_parallel=sp,
                                       act_bytes=e, recompute=recompute, layer=layer,
                                       expert_tp=etp, flash_attention=flash_attention,
                                       selective_modules=selective_modules, fp8=fp8, compiled=compiled,
                                       local_experts=local_experts, saves=saves,
                                       fc2_keeps_product=not fc2_recomputes, rowwise_fp8=rowwise,
                                       cp_kv_replicas=kv_replicas, cp=cp)
        if fp8 and recompute != "full" and saves < 2:  # FP8 weight copies, kept before revision 2
            saved += fp8_weight_copy_bytes(m, layer, tp, fc2_recast=fc2_recomputes)
        return saved

    def backward_work(layers: list[int]) -> float:
        """The largest of the layers' backward working sets (:func:`backward_working_bytes`)."""
        return max((backward_working_bytes(m, micro_batch=tr.micro_batch_size, seq=seq, tp=tp, sequence_parallel=sp,
                                           act_bytes=e, expert_tp=etp, layer=i) for i in layers),
                   default=0.0)

    def chunk_activation(layers: list[int]) -> tuple[float, float]:
        """(bytes kept per micro-batch, extra working bytes while a layer of the chunk runs backward: a recomputed
        chunk's activations, less its input, which is kept, plus the backward's own working set)."""
        gran, n = tr.recompute_granularity, max(1, tr.recompute_num_layers)
        if gran != "full":
            return sum(act(i, gran) for i in layers), backward_work(layers)
        full = [act(i, None) for i in layers]
        if tr.recompute_method == "block":
            kept = sum(act(i, "full") for i in layers[:n]) + sum(full[n:])
            window = max((full[i] - act(layers[i], "full") for i in range(min(n, len(layers)))), default=0.0)
            return kept, window + backward_work(layers)
        kept = sum(act(layers[i], "full") for i in range(0, len(layers), n))  # one input per chunk of n
        window = max((sum(full[i:i + n]) - act(layers[i], "full") for i in range(0, len(layers), n)), default=0.0)
        return kept, window + backward_work(layers)

    out: list[MemoryEstimate] = []
    loss_rank = layout.loss_stage
    for rank, chunks in enumerate(stage_chunks(cfg, layout.pipeline)):
        # ``last``: the rank with the final norm, output layer and loss (the first under ZBV's V).
        first, last = rank == 0, rank == loss_rank
        # Parameters on this rank.
        dense = expert = 0.0
        layer_sizes = []  # parameters of each layer on this rank
        for layers in chunks:
            for i in layers:
                dl, el = layer_parameters(m, i, tp, ep, etp)
                dense, expert = dense + dl, expert + el
                layer_sizes.append(dl + el)
        if first:
            dense += vocab * m.hidden_size / tp
            if m.position_embedding_type == "learned_absolute":
                dense += (m.max_position_embeddings or m.seq_length) * m.hidden_size
        if last:
            dense += m.hidden_size if m.normalization == "RMSNorm" else 2 * m.hidden_size
            if m.untie_embeddings_and_output_weights or pp > 1:
                dense += vocab * m.hidden_size / tp
        mtp = (m.mtp_num_layers or 0) if last else 0
        if mtp:  # each prediction depth: a layer of the last layer's kind, eh_proj [2H -> H], three norms
            dl, el = layer_parameters(m, m.num_layers - 1, tp, ep, etp)
            norms = 3 * (m.hidden_size if m.normalization == "RMSNorm" else 2 * m.hidden_size)
            dense += mtp * (dl + 2 * m.hidden_size * m.hidden_size / tp + norms)
            expert += mtp * el
        params = dense + expert
        weights, grads = _sharded_weights_and_grads(strategy, dense, expert, dense_shard, expert_shard, w_bytes,
                                                    g_bytes)
        if shards_weights(strategy):  # the running unit's and the prefetched unit's gathered weights
            unit = max(layer_sizes, default=0.0)
            weights += 2 * unit * w_bytes
            # Backward sums each unit's gradients whole before its reduce-scatter (sharded_grads._accumulate):
            # the running layer's, and the root unit's (embedding, output layer, final norm), open from the
            # loss's backward to the embedding's. Measured: 1.84 GiB of llama3-3b's peak (h63, h65).
            grads += (params - sum(layer_sizes) + unit) * g_bytes
        optim = (dense / dense_shard + expert / expert_shard) * o_bytes * opt_gpu
        all_grads = grads
        if releases and n_micro == 1:
            # The buckets are allocated as backward reaches them, after the forward's peak, which then holds
            # no gradient. With full recomputation the peak can be the first recomputed layer's backward,
            # beside the output layer's gradient (untied: the loss hands it over as backward starts; a tied
            # embedding's sum waits for the input embedding's part) and that layer's. Measured (h97-h109): the
            # untied MoE shapes' peaks lie 0.4-6.1 GiB under a model that counts those two without
            # recomputation too.
            grads = 0.0
            if tr.recompute_granularity == "full":
                output = vocab * m.hidden_size / tp if last and (m.untie_embeddings_and_output_weights or pp > 1) else 0
                grads = (output + max(layer_sizes, default=0.0)) * g_bytes

        # Activations: in-flight micro-batches (1F1B) or chunk-forwards (interleaved).
        kept_and_work = [chunk_activation(layers) for layers in chunks]
        per_micro = sum(k for k, _ in kept_and_work)
        if mtp:  # per depth: its layer, plus the embedding, the two normed inputs and their concatenation [2H]
            per_micro += mtp * (chunk_activation([m.num_layers - 1])[0] + tokens * 5 * m.hidden_size * e / sp_div)
        working = max(w for _, w in kept_and_work)
        if tr.offload_activations:
            # Every in-flight micro-batch keeps what its layers do not offload; the one in its backward
            # also holds two fetched layers (offload_timeline), and the allocator the copies' backlog.
            offload_kept, extra, stall, pending = 0.0, 0.0, 0.0, 0.0
            for c, layers in enumerate(chunks):
                timeline, kept = _offload_chunk(cfg, layers, [chunk_activation([i])[0] for i in layers],
                                                tokens, last and c == len(chunks) - 1, vocab, profile)
                offload_kept += kept - sum(chunk_activation([i])[0] for i in layers)
                extra = max(extra, timeline.peak_resident - kept)
                stall += timeline.stall_s
                pending = max(pending, timeline.backlog)
            per_micro += offload_kept  # what the offloaded layers moved off the device
            working = max(working, extra + max(backward_work(layers) for layers in chunks))
        if par.pipeline_schedule in SPLIT_BACKWARD and pp > 1:
            # A micro-batch's activations live until its W: as many as the plan holds at once (ZB-H1: PP on
            # every rank; ZBV: at most 2 PP chunk-forwards, each half the rank's layers).
            in_flight = _split_backward_in_flight(par.pipeline_schedule, pp, v, n_micro, rank)
        elif v == 1:
            in_flight = float(min(pp - rank, n_micro))
        else:
            in_flight = min(n_micro * v, 2 * (pp - rank - 1) + (v - 1) * pp + 1) / v
        activations = in_flight * per_micro + working
        if first:
            embed = 8 * tokens + (tokens * m.hidden_size / sp_div if m.hidden_dropout > 0 else 0)
            activations += in_flight * embed
        logits = 0.0
        if last:
            stats = 4 if m.normalization == "RMSNorm" else 8
            head = tokens * (2 * e * m.hidden_size + stats) / sp_div  # the final norm's and output layer's inputs
            logits = loss_bytes(m.hidden_size, vocab // tp, tr.micro_batch_size * m.seq_length // cp, e, fused_loss)
            if mtp:  # each prediction depth's loss keeps its own output-weight gradient (or logits) too
                logits += mtp * (4.0 * m.hidden_size * (vocab // tp) if fused_loss
                                 else 4.0 * tr.micro_batch_size * m.seq_length // cp * (vocab // tp))
            if fused_loss:
                # Two moments never meet: the loss (its chunk, its fp32 weight gradient, the head's inputs) and a
                # layer's backward (the working set above), when the head's inputs are freed and the weight
                # gradient is rounded to the weights' dtype, which a tied embedding keeps until its own part
                # arrives. Measured (llama3-1b, full recomputation, one H100): the loss's moment is the peak at
                # 65,536 tokens, the first recomputed layer's backward at 131,072.
                tied = e * m.hidden_size * (vocab // tp) if (first and not m.untie_embeddings_and_output_weights) else 0
                activations += max(head + logits, working + tied) - logits - working
            else:
                activations += head
        if all_grads > grads:
            # By the optimizer step every gradient is there and the activations are gone: the peak is the
            # larger of the two moments (the step's, for a large model on a small micro-batch).
            grads = max(grads, all_grads - activations - logits)
            if releases and n_micro == 1 and tr.recompute_granularity == "full" and layer_sizes:
                # A third moment: the backward of the stage's first layer, recomputed. Every gradient but that
                # layer's (and an untied input embedding's, which comes last) is allocated by then, beside one
                # kept input and the layer's working set: the peak of a long sequence on a large model
                # (llama3-8b at 32,768 tokens per CP rank: 4.5 GiB above the step's moment).
                untied = m.untie_embeddings_and_output_weights or pp > 1
                embedding = vocab * m.hidden_size / tp if first and untied else 0
                first_input = act(next(layers[0] for layers in chunks if layers), "full")  # (a chunk may hold none)
                late = all_grads - (embedding + layer_sizes[0]) * g_bytes + first_input + working
                grads = max(grads, late - activations - logits)
        out.append(MemoryEstimate(weights=round(weights), gradients=round(grads), optimizer_state=round(optim),
                                  activations=round(activations), logits=round(logits), stage=rank,
                                  microbatches_in_flight=in_flight,
                                  offload_stall_s=stall if tr.offload_activations else 0.0,
                                  pending_copies=round(pending) if tr.offload_activations else 0))
    return out


def loss_bytes(hidden: int, vocab_local: int, tokens: int, act_bytes: int, fused: bool = True) -> float:
    """Bytes the loss holds on the last stage for one micro-batch (see the module docstring)."""
    if not fused:
        return tokens * vocab_local * 4.0
    chunk = chunk_size(tokens, vocab_local)
    if act_bytes < 4:
        # bf16 on GPU: the chunk's logits and its logits-gradient, both bf16 (the element-wise
        # passes are compiled into fused kernels that keep no fp32 copy).
        per_element = 2 * act_bytes
    else:
        # fp32 (CPU, eager): logits, their fp32 copy, exponentials, softmax and the gradient.
        per_element = 5 * act_bytes
    if tokens > chunk:
        # From the second chunk on, the previous chunk's logits-gradient is still referenced while
        # the next chunk's logits and gradient are computed (the loop variable is rebound only after).
        per_element += act_bytes
    return 4.0 * hidden * vocab_local + chunk * vocab_local * per_element


def _offload_chunk(cfg: MeshtronConfig, layers: list[int], saved: list[float], tokens: int, with_loss: bool,
                   vocab: int, profile=None) -> tuple[OffloadTimeline, float]:
    """(the copy timeline, bytes kept on the device) of one micro-batch through one chunk of layers
    that save ``saved`` bytes each, under ``--offload-activations``."""
    from meshtron.planning.layer_costs import Links, head_cost, layer_cost
    from meshtron.planning.profiles import H200

    profile = profile or H200
    t = cfg.train
    stats = 4 if cfg.model.normalization == "RMSNorm" else 8
    small = 2 * stats * tokens if stats * tokens < OFFLOAD_MIN_BYTES else 0  # the norms' statistics stay
    moves = offloaded_layers(cfg, len(layers))
    offloaded = [max(0.0, b - small) if m else 0.0 for b, m in zip(saved, moves)]
    kept = [min(b, small) if m else b for b, m in zip(saved, moves)]
    forward, backward = [], []
    for position, i in enumerate(layers):
        recomputed = t.recompute_granularity == "full" and (t.recompute_method != "block"
                                                            or position < max(1, t.recompute_num_layers))
        cost = layer_cost(cfg, i, recomputed, profile, Links())
        forward.append(cost.forward)
        backward.append(cost.compute - cost.forward)
    gap = head_cost(cfg, vocab, profile)[0] if with_loss else 0.0
    timeline = offload_timeline(offloaded, kept, forward, backward, gap, profile.pcie_gbps * 1e9)
    return timeline, sum(kept)


def _offload_fraction(cfg: MeshtronConfig) -> float:
    """The share of optimizer state moved to the CPU by ``--optimizer-cpu-offload`` (0..1)."""
    return min(1.0, max(0.0, cfg.optim.optimizer_offload_fraction))


@dataclass(frozen=True)
class OffloadTimeline:
    """One micro-batch of one model chunk under ``--offload-activations`` (see the module docstring)."""

    peak_resident: float  # most bytes of the chunk's live activations on the device at once in its backward
    backlog: float  # bytes whose copy to the host had not run when the backward began (freed, still held)
    stall_s: float  # seconds the backward waits for fetches beyond its own compute


def offload_timeline(offloaded: list[float], kept: list[float], forward_s: list[float], backward_s: list[float],
                     gap_s: float, pcie_bytes_per_s: float) -> OffloadTimeline:
    """Replay the side stream's copies for the layers of one chunk, in forward order.

    ``offloaded[i]``: bytes layer ``i`` copies to the host (0 for a layer that keeps its own);
    ``kept[i]``: bytes it keeps on the device; ``forward_s`` / ``backward_s``: its compute times;
    ``gap_s``: time between the chunk's last forward and its first backward (the loss on the last
    stage). A layer's copy starts when its forward has run and the stream is free; its device
    memory is freed as the copy proceeds. In the backward, reaching layer ``j`` queues the fetch of
    ``j`` and ``j - 1`` behind whatever the stream still has; ``j``'s backward starts once its fetch is done.
    """
    n, rate = len(offloaded), max(pcie_bytes_per_s, 1.0)
    t, stream = 0.0, 0.0
    copies: list[tuple[float, float, float]] = []  # (start, end, bytes) of each device-to-host copy
    for i in range(n):
        t += forward_s[i]
        if offloaded[i] > 0:
            start = max(t, stream)
            stream = start + offloaded[i] / rate
            copies.append((start, stream, offloaded[i]))

    def backlog_at(time: float) -> float:
        """Bytes still on the device for copies to the host unfinished at ``time`` (freed as they run)."""
        left = 0.0
        for start, end, size in copies:
            if end > time:
                left += size * min(1.0, (end - time) / (end - start))
        return left

    t += gap_s
    backward_start, backlog = t, backlog_at(t)
    fetched_at: dict[int, float] = {}
    peak = 0.0

    def fetch(i: int, now: float) -> None:
        nonlocal stream
        if 0 <= i < n and offloaded[i] > 0 and i not in fetched_at:
            stream = max(stream, now) + offloaded[i] / rate
            fetched_at[i] = stream

    for j in range(n - 1, -1, -1):
        fetch(j, t)
        fetch(j - 1, t)
        resident = sum(kept[:j + 1]) + offloaded[j] + (offloaded[j - 1] if j > 0 else 0.0)
        peak = max(peak, resident)
        t = max(t, fetched_at.get(j, t)) + backward_s[j]
    stall = max(0.0, t - backward_start - sum(backward_s))
    return OffloadTimeline(peak_resident=peak, backlog=backlog, stall_s=stall)


def offloaded_layers(cfg: MeshtronConfig, count: int) -> list[bool]:
    """Which of a chunk's ``count`` layers offload (ActivationOffloader.offloads): never the last one."""
    if not cfg.train.offload_activations:
        return [False] * count
    n = cfg.train.offload_activations_num_layers
    limit = count - 1 if n is None else min(n, count - 1)
    return [i < limit for i in range(count)]
