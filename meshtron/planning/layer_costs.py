"""The time and work of one layer, and of the output layer and embedding, for one micro-batch on one rank.

Below both the memory model (:mod:`meshtron.memory`, which times the host copies of ``--offload-activations``
against the layers' compute) and the step-time model (:mod:`meshtron.planning.step_time`, whose module
docstring describes the costs); each layer's numbers come from its kinds (:mod:`meshtron.layer_kinds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtron.config import MeshtronConfig, head_dim, padded_vocab_size
from meshtron.layer_kinds.base import StepInputs
from meshtron.layer_kinds.pattern import layer_at
from meshtron.parallel.layout import sequence_parallel_in_effect
from meshtron.pipeline.partition import SPLIT_BACKWARD
from meshtron.planning.profiles import DeviceProfile
from meshtron.run_layout import BF16, compute_dtype_name

#: Revision of what a layer keeps for backward, so that rows measured at earlier code are compared with
#: the model of that code: 0 = the values a view of the fused QKV output (which stayed whole), SwiGLU's
#: product kept, FP8 weight copies kept; 1 = values copied out, the product recomputed by fc2 (in FP8 with
#: its casts and fc2's weight cast), the other FP8 linears' weight copies kept; 2 = every FP8 linear casts
#: its weight again in backward; 3 = SwiGLU experts on the direct path weigh each row inside the activation
#: and recompute SwiGLU in backward; 4 = grouped SwiGLU experts recompute SwiGLU in backward on every path
#: (through the dispatcher too, with weights 1: the combine weighs); 5 = through the dispatcher too, SwiGLU
#: experts without an output bias weigh their rows inside the activation, so the combine keeps no rows; 6 = the
#: FP8 (tensorwise) SwiGLU block without biases is one function (``fp8.swiglu``), which recomputes the product
#: eagerly too; 7 = a compiled column-parallel linear under SP keeps only its input shard on the GPU (the
#: backward gathers it again): the emulated H100 rows e2-e20 of benchmarks/emulated.jsonl (torch 2.11, today's
#: code) peak where the model without the gathered inputs puts them, the two-GPU rows of revision 0 (c6, c8,
#: d16-g7) where it counts them (which change in between took the merge away is not established; the CPU's
#: compiler, torch 2.13, still merges, :func:`meshtron.memory.layer_activation_bytes`'s ``merged_gathers``).
LAYER_SAVES = 7

#: Flash attention's backward does 2.5x its forward's FLOPs (five matmuls for two, the scores recomputed).
ATTENTION_BACKWARD_FLOPS = 2.5


def _layers_compiled(cfg: MeshtronConfig) -> bool:
    """Whether the layers run under ``torch.compile`` (the GPU default; the CPU runs them eagerly)."""
    return cfg.train.compile is not False and cfg.train.device != "cpu"


def fc2_recomputes_product(cfg: MeshtronConfig, saves: int = LAYER_SAVES) -> bool:
    """Whether SwiGLU's down projection recomputes the product (in FP8 also its and its weight's casts) in
    backward, as ``RowParallelLinear._swiglu_matmul`` and the FP8 SwiGLU block (``fp8.swiglu``) decide: not under
    a zero-bubble schedule's deferred weight gradients, rowwise FP8, the sequence-parallel FP8 path or eager FP8
    with biases (eager FP8 without them before revision 6); not before revision 1 of ``saves``."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not m.swiglu or saves < 1 or p.pipeline_schedule in SPLIT_BACKWARD:
        return False
    if not t.fp8_format:
        return True
    sequence_parallel = sequence_parallel_in_effect(p.sequence_parallel, p.tensor_model_parallel_size)
    fused_block = saves >= 6 and m.disable_bias_linear  # meshtron.layers.linear.fuses_fp8_swiglu
    return t.fp8_recipe == "tensorwise" and not sequence_parallel and (_layers_compiled(cfg) or fused_block)


@dataclass(frozen=True)
class Links:
    """Where the ranks sit: ``gpus_per_node`` GPUs share NVLink, nodes talk over the network."""

    gpus_per_node: int = 8

    def bandwidth(self, profile: DeviceProfile, size: int, stride: int) -> float:
        """Bus bandwidth (bytes/s) of a group of ``size`` ranks ``stride`` apart."""
        spans_nodes = size * stride > self.gpus_per_node
        return (profile.network_gbps if spans_nodes else profile.nvlink_gbps) * 1e9


#: A recurrent mixer's loop (:meth:`meshtron.layer_kinds.MixerKind.recurrence_work`): the time of one step of
#: its sequential loop and the rate of its small fp32 matmuls as a fraction of the profile's GEMM rate, fitted to
#: the gated DeltaNet rows of an H100 (h175, h176: Qwen3.5-9B's shape, 8 layers, micro batch 1 and 2 of 4,096).
RECURRENCE_STEP_US = 33.0
RECURRENCE_RATE = 0.011


def gemm_seconds(flops: float, profile: DeviceProfile, fp8: bool = False, efficiency: float = 1.0) -> float:
    """One GEMM of ``flops`` at the profile's size-dependent rate."""
    if flops <= 0:
        return 0.0
    rate = profile.matmul_tflops * 1e12 * flops / (flops + profile.matmul_half_gflop * 1e9)
    return flops / (rate * (profile.fp8_matmul_speedup if fp8 else 1.0) * efficiency)


def _ring(bytes_: float, n: int, bw: float, latency: float, factor: float = 1.0) -> float:
    """A ring collective over ``n`` ranks: all-gather / reduce-scatter (factor 1), all-reduce (2)."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    return factor * bytes_ * (n - 1) / n / bw + latency


def _overlapped(comm: float, cover: float, profile: DeviceProfile) -> float:
    """Exposed seconds of ``comm`` run beside ``cover`` seconds of compute: what sticks out, plus
    ``overlap_cost`` of the hidden part (the collective's kernels share SMs and memory bandwidth)."""
    hidden = min(comm, cover)
    return comm - hidden + profile.overlap_cost * hidden


@dataclass
class LayerCost:
    """One layer's time for one micro-batch on one rank (seconds)."""

    compute: float  # seconds of forward + backward (+ recompute) kernels
    forward: float  # the forward part of it
    comm: float  # exposed communication on the critical path
    comm_kind: dict


def attention_rate(profile: DeviceProfile, seq: float, head_dim: int) -> float:
    """Useful FLOP/s of causal flash attention over ``seq`` tokens (per CP rank) at query/key head dim ``head_dim``.

    ``attention_tflops * seq / (seq + attention_half_seq)`` at head dim 128 and above; towards head dim 64 both
    constants move linearly in ``128 / head_dim`` to the profile's head-dim-64 pair (the kernels' per-score work,
    the softmax, does not shrink with the head dim: a lower ceiling, reached at shorter sequences), and stay there
    below 64.
    """
    x = min(1.0, max(0.0, 128.0 / head_dim - 1.0))
    peak = profile.attention_tflops + x * ((profile.attention_tflops_d64 or profile.attention_tflops)
                                           - profile.attention_tflops)
    half = profile.attention_half_seq + x * ((profile.attention_half_seq_d64 or profile.attention_half_seq)
                                             - profile.attention_half_seq)
    return peak * 1e12 * seq / (seq + half)


def cp_a2a_size(cfg: MeshtronConfig) -> int:
    """Ranks that exchange heads for sequence (``--cp-comm-type a2a``: CP; ``a2a+p2p``: A of
    ``--hierarchical-context-parallel-sizes A B``; the ring and the all-gather: 1)."""
    from meshtron.cp_comm_types import a2a_degree, single_comm_type

    p = cfg.parallel
    if p.context_parallel_size <= 1:
        return 1
    return a2a_degree(single_comm_type(p.cp_comm_type), p.context_parallel_size,
                      p.hierarchical_context_parallel_sizes)


def reruns_forward_collectives(cfg: MeshtronConfig, recomputed: bool) -> bool:
    """Whether a layer's backward runs its forward's collectives again, as far as it needs them: under
    ``--recompute-granularity full`` on a recomputed layer, and always under selective (its policy saves no
    collective's output)."""
    gran = cfg.train.recompute_granularity
    return gran == "selective" or (gran == "full" and recomputed)


def expert_all_to_alls(cfg: MeshtronConfig, recomputed: bool) -> int:
    """The token all-to-alls of one MoE layer and micro-batch: dispatch and combine, forward and backward, and
    both again where the forward's collectives run again (:func:`reruns_forward_collectives`)."""
    return 6 if reruns_forward_collectives(cfg, recomputed) else 4


def layer_cost(cfg: MeshtronConfig, layer: int, recomputed: bool, profile: DeviceProfile, links: Links,
               saves: int = LAYER_SAVES) -> LayerCost:
    """Forward + backward time of layer ``layer`` for one micro-batch on one rank, from what its kinds
    (:mod:`meshtron.layer_kinds`) say they do (``recomputed``: its forward runs again in the backward,
    ``--recompute-granularity full``; ``saves``: the revision of what the layers keep, :data:`LAYER_SAVES`, for
    rows measured at earlier code)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    kinds = layer_at(m, layer)
    tp, cp, ep = p.tensor_model_parallel_size, p.context_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    sp = sequence_parallel_in_effect(p.sequence_parallel, tp)
    fp8 = bool(t.fp8_format)
    e = 2
    h, d = m.hidden_size, head_dim(m)
    seq = m.seq_length
    tokens = t.micro_batch_size * seq / cp
    heads = math.ceil(m.num_attention_heads / tp)
    q_out, kv_out = kinds.mixer.projection_widths(m, tp)
    rep_div = tp if sp else 1
    latency = profile.collective_latency_us * 1e-6
    hbm = profile.hbm_gbps * 1e9 * profile.hbm_efficiency * (1.0 if t.compile else 1.0 / profile.eager_elementwise_factor)

    def gemm(flops: float, fp8: bool = False, experts: bool = False) -> float:
        return gemm_seconds(flops, profile, fp8, profile.moe_gemm_efficiency if experts else 1.0)

    # GEMMs (forward FLOPs of each call) and the matching elementwise traffic: the mixer's, then the MLP's.
    fwd_gemm = sum(gemm_seconds(f, profile, fp8) for f in kinds.mixer.forward_gemms(m, tokens, tp))
    wgrad = fwd_gemm
    work = kinds.mlp.step_work(m, StepInputs(tokens=tokens, tp=tp, ep=ep, expert_tp=etp, rep_div=rep_div, e=e,
                                             fp8=fp8, fp8_experts=fp8 and t.fp8_experts,
                                             bf16=compute_dtype_name(cfg) == BF16, saves=saves,
                                             fc2_recomputes=fc2_recomputes_product(cfg, saves), gemm=gemm))
    fwd_gemm += work.fwd_gemm
    wgrad += work.wgrad
    mlp_elem, swiglu_recompute = work.elementwise, work.recompute_elementwise
    # Norms (read + write), residual adds (two reads, one write), RoPE on q and k.
    norm_elem = tokens * e * 4 * h / rep_div
    other_elem = tokens * e * (6 * h / rep_div + 2 * (q_out + kv_out / 2))
    fwd_elem = norm_elem + other_elem + mlp_elem
    fp8_fwd = fp8_bwd = 0.0
    if work.fp8_cast_width:
        # Each linear's input (forward) and output gradient (backward) cast to both FP8 layouts:
        # read bf16, write two FP8 copies; and the weights, once per micro-batch.
        f = work.fp8_cast_width
        inputs = tokens * (2 * h + q_out + f / tp)
        grads = tokens * (q_out + kv_out + h + 2 * f / tp + h)
        weights = (h * (q_out + kv_out) + q_out * h + 3 * h * f / tp)
        # The backward reads the inputs' saved copies and casts the gradients; since revision 2 of the
        # layers' saves the forward writes the weight's own layout only and the backward casts it again,
        # transposed (read bf16, write FP8).
        recast = saves >= 2
        fp8_fwd = 4 * inputs + (3 if recast else 4) * weights
        fp8_bwd = 4 * grads + (3 * weights if recast else 0.0)

    d_qk, d_v = kinds.mixer.head_dims(m)
    attn_flops = t.micro_batch_size * (seq / cp) * seq * heads * (d_qk + d_v)  # causal: half of 2 * 2 * s^2 ...
    a2a = cp_a2a_size(cfg)
    local_seq = seq / cp * a2a  # the all-to-all hands attention A x the tokens on 1/A of the heads
    attn_fwd = attn_flops / attention_rate(profile, local_seq, d_qk) if attn_flops else 0.0
    attn_bwd = ATTENTION_BACKWARD_FLOPS * attn_fwd

    rec_fwd = rec_bwd = 0.0
    recurrence = kinds.mixer.recurrence_work(m, tp, t.micro_batch_size, seq / cp, cp)
    if recurrence is not None:  # a recurrent mixer's loop of small matmuls: latency-bound, well below GEMM rates
        steps, flops = recurrence
        rec = steps * RECURRENCE_STEP_US * 1e-6 + flops / (profile.matmul_tflops * 1e12 * RECURRENCE_RATE)
        rec_fwd, rec_bwd = rec / 4, 3 * rec / 4  # its forward; the forward again, then its backward

    forward = fwd_gemm + attn_fwd + rec_fwd + (fwd_elem + fp8_fwd) / hbm
    backward = fwd_gemm + wgrad + attn_bwd + rec_bwd + (2 * fwd_elem + fp8_bwd + swiglu_recompute) / hbm
    recompute = 0.0
    gran = t.recompute_granularity
    if gran == "full":
        recompute = forward if recomputed else 0.0
    elif gran == "selective":
        # meshtron.layers.recompute saves every matmul's and attention kernel's output (MUST_SAVE) and
        # recomputes the element-wise work around them: the norms, RoPE and the MLP's own (a dense MLP's SwiGLU; a
        # MoE layer's routing, permutation copies and SwiGLU over its routed rows).
        recompute = (norm_elem + tokens * e * 2 * (q_out + kv_out / 2) + mlp_elem) / hbm
    overhead = profile.layer_overhead_us * 1e-6 * (1.5 if gran == "full" else 1.0)
    compute = forward + backward + recompute + overhead

    # Communication on the critical path.
    by_kind = {"tp": 0.0, "cp": 0.0, "ep": 0.0}
    again = reruns_forward_collectives(cfg, recomputed)
    if tp > 1:
        bw = links.bandwidth(profile, tp, 1)
        act = tokens * h * e
        if sp:
            gather = act * (0.5 if fp8 else 1.0)  # FP8 sequence parallelism gathers the FP8 input
            # Forward: all-gather before QKV and fc1, reduce-scatter after the projections. Backward:
            # the mirrored pair, and the inputs gathered again for the weight gradients.
            fwd_comm = 2 * _ring(gather, tp, bw, latency) + 2 * _ring(act, tp, bw, latency)
            bwd_comm = 4 * _ring(act, tp, bw, latency) + 2 * _ring(gather, tp, bw, latency)
            # A recomputed forward (selective, or full on this layer) runs again only as far as the backward
            # needs: both all-gathers and the attention's reduce-scatter, not the MLP's (the traces of CPU ranks).
            again_comm = 2 * _ring(gather, tp, bw, latency) + _ring(act, tp, bw, latency)
        else:
            fwd_comm = bwd_comm = 2 * _ring(act, tp, bw, latency, 2.0)
            again_comm = _ring(act, tp, bw, latency, 2.0)  # the attention's all-reduce
        hidden = profile.async_tp_hidden if (p.async_tensor_parallel and sp) else 0.0
        fwd_exposed = _overlapped(fwd_comm, fwd_comm * hidden, profile)
        bwd_exposed = bwd_comm * (1 - hidden)
        if p.tp_comm_overlap:
            bwd_exposed = _overlapped(bwd_exposed, wgrad, profile)
        by_kind["tp"] = fwd_exposed + bwd_exposed + (_overlapped(again_comm, again_comm * hidden, profile)
                                                     if again else 0.0)
    state_bytes = kinds.mixer.cp_state_bytes(m, tp, t.micro_batch_size) if cp > 1 else 0.0
    if state_bytes:
        # A recurrence (gdn): every rank's two chunks' states and convolution halos all-gathered in the
        # forward (two collectives), their gradients reduce-scattered in the backward; the composition
        # waits for them, so nothing hides them. A recomputed forward (selective too) gathers them again.
        one_way = _ring(2 * cp * state_bytes, cp, links.bandwidth(profile, cp, tp), 2 * latency)
        by_kind["cp"] += (3 if again else 2) * one_way
    elif cp > 1:
        ring = cp // a2a  # ranks of the ring (p2p, all-gather: CP; a2a: none; a2a+p2p: B)
        if a2a > 1:
            # q, k, v in and the output back, each moving (A - 1) / A of its local bytes; backward the same
            # four (the output's gradient in, those of q, k, v back). On the critical path, not overlapped.
            g = math.lcm(kinds.mixer.cp_exchange_heads(m, tp), a2a)  # key/value heads repeated until they split over the A ranks
            width = heads * d_qk + g * (d_qk + d_v) + heads * d_v
            moved = t.micro_batch_size * (seq / cp) * width * e * (a2a - 1) / a2a
            one_way = moved / links.bandwidth(profile, a2a, tp) + 4 * latency
            # A recomputed forward (selective too) exchanges all four again: none of them is saved.
            by_kind["cp"] += (3 if again else 2) * one_way
            kv_out = (2 * g * d) / a2a  # the ring below carries this rank's heads after the exchange
        if ring > 1:
            bw = links.bandwidth(profile, ring, tp * a2a)
            kv = t.micro_batch_size * (seq / ring) * kv_out * e
            ring_fwd = (ring - 1) * (kv / bw + latency)
            # Backward: each hop carries the key/value block again with its gradient, accumulated in fp32 (the
            # ring's own gradient and the all-gather's reduce-scatter alike), and the gradient goes home at the end.
            ring_bwd = (ring - 1) * (kv * (1 + 4 / e) / bw + latency) + kv * 4 / e / bw
            by_kind["cp"] += _overlapped(ring_fwd, attn_fwd, profile) + _overlapped(ring_bwd, attn_bwd, profile)
            if again:  # the recomputed forward runs the ring again (selective too: the hops are not saved)
                by_kind["cp"] += _overlapped(ring_fwd, attn_fwd, profile)
    if work.ep_bytes and ep > 1:
        bw = links.bandwidth(profile, ep, tp)
        by_kind["ep"] = expert_all_to_alls(cfg, recomputed) * _ring(work.ep_bytes, ep, bw, latency)
    return LayerCost(compute=compute, forward=forward, comm=sum(by_kind.values()), comm_kind=by_kind)




def head_cost(cfg: MeshtronConfig, vocab: int, profile: DeviceProfile) -> tuple[float, float]:
    """(last stage's output layer + loss, first stage's embedding) per micro-batch, seconds."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    tokens = t.micro_batch_size * m.seq_length / cp
    v_local = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp) / tp
    hbm = profile.hbm_gbps * 1e9 * profile.hbm_efficiency
    logits = gemm_seconds(2 * tokens * m.hidden_size * v_local, profile)
    loss = 3 * logits + tokens * v_local * 12 / hbm  # forward, input and weight gradients; fp32 logits passes
    embed = tokens * m.hidden_size * 2 * 3 / hbm
    return loss, embed
