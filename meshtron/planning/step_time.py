"""A model of one training step's time, from FLOPs, bytes and communication volumes.

Per micro-batch, each transformer layer of a rank costs (forward + backward, and the recomputed
forward when ``--recompute-granularity`` asks for one):

- its GEMMs (QKV, output projection, the MLP or the routed experts, the router), each at the rate
  the profile gives a GEMM of its size (``matmul_tflops * F / (F + F_half)``), FP8 linears faster
  by ``fp8_matmul_speedup``, expert GEMMs at ``moe_gemm_efficiency``; the backward does two GEMMs
  for each forward one;
- causal flash attention at ``attention_tflops`` (the backward has 2.5x the forward's FLOPs); with packed
  documents (``--reset-attention-mask``, flex attention skipping the blocks across documents) this is an
  upper bound: the planner knows no document lengths, and flex attention's own rate is unmeasured;
- its memory-bound kernels (norms, residual adds, RoPE, SwiGLU, the MoE permutation, FP8 casts) by
  the bytes they move at ``hbm_gbps * hbm_efficiency`` (``eager_elementwise_factor`` more bytes
  without ``torch.compile``; the backward moves twice the forward's);
- a fixed ``layer_overhead_us``;
- the communication on its critical path: tensor-parallel collectives (the forward's hidden by
  ``--async-tensor-parallel`` in part, the backward's behind the weight-gradient GEMMs with
  ``--tp-comm-overlap``), the context-parallel ring (behind the attention blocks), the expert
  all-to-alls (not overlapped).

With ``--offload-activations`` each micro-batch's backward also waits where the host copies
(``pcie_gbps`` per direction, on one side stream) have not caught up: the forward's copies still
draining when the backward begins, and fetches slower than the backward of the layer after them
(:func:`meshtron.memory.offload_timeline`).

The last stage adds the output layer and the fused loss, the first the embedding; each multi-token
prediction depth (``--mtp-num-layers``) adds to the last stage a layer of the last layer's kind, an
embedding, its [2H -> H] projection and another pass through the output layer and loss. A step is
``M`` micro-batches of the slowest stage, stretched by the schedule's bubble (the plan-and-simulate
executor's :func:`meshtron.pipeline.schedules.simulated_bubble` for the ``--pipeline-schedule``, a
backward lasting two forwards; ZB-H1 in compiled layers adds ``ZB_H1_BREAK_US`` per linear for the
graph break before each deferred weight-gradient GEMM), plus the exposed data-parallel communication
by ``--data-parallel-sharding-strategy`` (the gradient reduce-scatter / all-reduce behind the last
micro-batch's backward with ``--overlap-grad-reduce``, with ``optim_grads`` and ``optim_grads_params``
a reduce-scatter behind every micro-batch's backward; the parameter all-gather behind the first
forward with ``--overlap-param-gather``, the last/first bucket always exposed; with
``optim_grads_params`` instead each layer's weights gathered before its forward and its backward,
prefetched one layer ahead so that only the first layer's gather of each pass is exposed), blocking
pipeline exchanges (``--no-overlap-p2p-comm``), the optimizer step by its bytes plus the optimizer's own
work (``--optimizer muon``: the Newton-Schulz matmuls of the matrices this rank owns, each whole on every
rank of its TP group, and the TP all-gathers of fp32 momentum that make it whole), and a fixed step
overhead. With hybrid sharding (``--num-distributed-optimizer-instances R``) the data-parallel collectives run
over the S = DP x CP / R ranks of a shard group, plus an exposed all-reduce of 1/S of the gradients over the R
replicas. Each collective moves its ring volume over the links its group spans: NVLink when the
group's ranks share a node, the network otherwise (rank order TP, CP, DP, PP, fastest first).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

from meshtron.config import MeshtronConfig, padded_vocab_size
from meshtron.layer_kinds.pattern import layer_at
from meshtron.memory import layer_parameters, stage_chunks, stage_estimates
from meshtron.pipeline.partition import SPLIT_BACKWARD
from meshtron.planning.layer_costs import (ATTENTION_BACKWARD_FLOPS, LAYER_SAVES, LayerCost, Links, _overlapped,
                                           _ring, attention_rate, cp_a2a_size, gemm_seconds, head_cost, layer_cost)
from meshtron.planning.profiles import DeviceProfile
from meshtron.run_layout import (BF16, RunLayout, compute_dtype_name, resolve_layout, shards_gradients, shards_state,
                                 shards_weights)

# The per-layer costs live in meshtron.planning.layer_costs (the memory model needs them too); these names are
# kept here for the callers that time GEMMs and attention through this module.
__all__ = ["ATTENTION_BACKWARD_FLOPS", "BACKWARD_TICKS", "DATASHEET_PEAK_TFLOPS", "LAYER_SAVES", "Links",
           "StepPrediction", "attention_rate", "bubble_fraction", "cp_a2a_size", "gemm_seconds", "predict_step"]

#: Lock-step ticks of a backward pass in the bubble simulation (two GEMMs per forward GEMM).
BACKWARD_TICKS = 2
#: ZB-H1 in compiled layers: each linear's deferred weight-gradient GEMM runs outside the compiled backward
#: (a graph break per linear), an estimate of the extra seconds per linear and micro-batch (not measured).
ZB_H1_BREAK_US = 5.0
#: Linears of a layer whose weight gradient ZB-H1 defers (QKV, projection, the two MLP projections).
ZB_H1_LINEARS = 4
#: Datasheet dense bf16 peaks for MFU (the same table as meshtron.training.metrics).
DATASHEET_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0}


@dataclass
class StepPrediction:
    """Predicted time of one step on one GPU, and where it goes (seconds)."""

    step_s: float
    compute_s: float  # M micro-batches of the slowest stage, its exposed TP/CP/EP communication included
    bubble_s: float
    bubble_fraction: float
    exposed_comm_s: float  # all exposed communication (TP, CP, EP, DP, PP)
    optimizer_s: float
    overhead_s: float
    tokens_per_sec_per_gpu: float
    model_tflops_per_gpu: float
    mfu: Optional[float]
    comm_by_kind_s: dict = field(default_factory=dict)  # exposed seconds per group kind
    stage_compute_s: list = field(default_factory=list)  # each pipeline rank's M micro-batches (compute_s: the slowest)

    def stage_step_s(self, stage: int) -> float:
        """The step as pipeline rank ``stage`` alone would set it: its own micro-batches where the slowest
        rank's are (what one emulated rank of that stage predicts; the job runs at the slowest's pace)."""
        return self.step_s + (self.stage_compute_s[stage] - self.compute_s) * (1 + self.bubble_fraction)

    def as_dict(self) -> dict:
        """JSON-ready figures."""
        return {k: getattr(self, k) for k in ("step_s", "compute_s", "bubble_s", "bubble_fraction",
                                              "exposed_comm_s", "optimizer_s", "overhead_s",
                                              "tokens_per_sec_per_gpu", "model_tflops_per_gpu", "mfu",
                                              "comm_by_kind_s")}


#: Beyond this many micro-batches the bubble is simulated at fewer and scaled (see bubble_fraction).
SIMULATED_MICRO_BATCHES = 64


@functools.lru_cache(maxsize=4096)
def bubble_fraction(stages: int, virtual: int, micro_batches: int, schedule: Optional[str] = None) -> float:
    """Idle over busy time of the schedule (``schedule``: a ``--pipeline-schedule`` value, None for the
    default of ``virtual``): the executor's own plan, simulated.

    The idle ticks are those of the warm-up and cool-down, which stop growing once every rank reaches
    its steady state; so for many micro-batches the simulation runs at a multiple of ``stages`` near
    :data:`SIMULATED_MICRO_BATCHES` and its idle time is spread over the real number (the search
    evaluates thousands of layouts, and a simulation is linear in the micro-batches).
    """
    if stages <= 1:
        return 0.0
    from meshtron.pipeline.schedules import simulated_bubble

    simulated = micro_batches
    if micro_batches > SIMULATED_MICRO_BATCHES:
        simulated = max(2 * stages, SIMULATED_MICRO_BATCHES // stages * stages)
        if virtual > 1 or micro_batches % stages == 0:
            simulated = max(stages, simulated // stages * stages)
    return simulated_bubble(stages, virtual, simulated, BACKWARD_TICKS, schedule=schedule) * simulated / micro_batches


def _mtp_depth_cost(cfg: MeshtronConfig, layer: LayerCost, loss: float, embed: float,
                    profile: DeviceProfile) -> float:
    """One multi-token prediction depth on the last stage, per micro-batch: its transformer layer (of the
    last layer's kind), the embedding of the shifted tokens, the projection of the two normed inputs
    [2H -> H] (forward and two backward GEMMs) and its own pass through the output layer and loss."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    tokens = t.micro_batch_size * m.seq_length / p.context_parallel_size
    proj = 3 * gemm_seconds(2 * tokens * 2 * m.hidden_size * m.hidden_size / p.tensor_model_parallel_size, profile)
    return layer.compute + layer.comm + embed + proj + loss


def gradient_accumulation_bytes(cfg: MeshtronConfig, strategy: str, micro_batches: int) -> float:
    """HBM bytes per parameter of a rank that taking in one micro-batch's gradients moves, averaged over the
    step's ``micro_batches``: backward hands each gradient over in the weights' dtype and a post-accumulate hook
    puts it into the gradient buffer (fp32, or bf16 with ``--grad-reduce-in-bf16``). The whole buffer
    (:class:`meshtron.optim.grad_buffer.GradBuffer`) takes the first micro-batch's gradient as a copy (read it,
    write the buffer) and adds the others (read both, write the buffer); the sharded gradients of ZeRO-2/3
    (:class:`meshtron.optim.sharded_grads.ShardedGradients`) zero a temporary bucket and add into it for every
    micro-batch (their reduced shard's add, 1/DP of that, is left out). A pass over every parameter per
    micro-batch: with many micro-batches per step and billions of parameters per rank a tenth of the step."""
    weight = 2 if compute_dtype_name(cfg) == BF16 else 4
    buffer = 2 if cfg.parallel.grad_reduce_in_bf16 else 4
    if shards_gradients(strategy):
        return buffer + (buffer + weight + buffer)
    micro_batches = max(1, micro_batches)
    first, later = weight + buffer, buffer + weight + buffer
    return (first + (micro_batches - 1) * later) / micro_batches


def _rank_parameters(cfg: MeshtronConfig, layers: list[int], first: bool, last: bool, vocab: int) -> tuple[float, float]:
    """(dense, expert) parameters of one pipeline rank."""
    m, p = cfg.model, cfg.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    dense = expert = 0.0
    for i in layers:
        dl, el = layer_parameters(m, i, tp, ep, etp)
        dense, expert = dense + dl, expert + el
    v = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp)
    if first:
        dense += v * m.hidden_size / tp
    if last and (m.untie_embeddings_and_output_weights or p.pipeline_model_parallel_size > 1):
        dense += v * m.hidden_size / tp
    return dense, expert


def predict_step(cfg: MeshtronConfig, world_size: int, profile: DeviceProfile, vocab_size: Optional[int] = None,
                 links: Links = Links(), saves: int = LAYER_SAVES,
                 layout: Optional[RunLayout] = None) -> StepPrediction:
    """Predicted step time of a resolved configuration on ``world_size`` GPUs (see the module docstring;
    ``saves``: for rows measured at earlier layer code, see :func:`meshtron.planning.layer_costs.layer_cost`;
    ``layout``: ``cfg``'s :class:`~meshtron.run_layout.RunLayout` on ``world_size`` ranks, else resolved here)."""
    from meshtron.training.metrics import flops_per_token

    m, p, t = cfg.model, cfg.parallel, cfg.train
    layout = layout if layout is not None else resolve_layout(cfg, world_size)
    vocab = vocab_size or m.vocab_size
    tp, cp, pp, ep, dp = layout.tp, layout.cp, layout.pp, layout.ep, layout.dp
    etp = p.expert_tensor_parallel_size or tp
    gbs = t.global_batch_size or t.micro_batch_size * dp
    micro = max(1, gbs // (t.micro_batch_size * dp))
    chunks = stage_chunks(cfg, layout.pipeline)
    virtual = len(chunks[0])
    latency = profile.collective_latency_us * 1e-6
    loss, embed = head_cost(cfg, vocab, profile)
    # each micro-batch's gradients taken into the gradient buffer: seconds per parameter of a rank
    accumulation_s_per_param = (gradient_accumulation_bytes(cfg, layout.sharding_strategy, micro)
                                / (profile.hbm_gbps * 1e9 * profile.hbm_efficiency))

    cache: dict[tuple[str, bool], LayerCost] = {}

    def cost(layer: int, recomputed: bool) -> LayerCost:
        key = (layer_at(m, layer).entry, recomputed)
        if key not in cache:  # every layer of the same kinds costs the same
            cache[key] = layer_cost(cfg, layer, recomputed, profile, links, saves)
        return cache[key]

    def recomputed(position: int) -> bool:
        """Whether the layer at ``position`` of its stage has its forward recomputed."""
        if t.recompute_granularity != "full":
            return False
        return t.recompute_method != "block" or position < max(1, t.recompute_num_layers)

    stage_times, stage_fwd, stage_comm, stage_layers = [], [], [], []
    kinds = {"tp": 0.0, "cp": 0.0, "ep": 0.0, "dp": 0.0, "pp": 0.0}
    slowest_kind: dict = {}
    params_by_stage = []
    loss_rank = layout.loss_stage
    for rank, rank_chunks in enumerate(chunks):
        layers = [i for c in rank_chunks for i in c]
        costs = [cost(i, recomputed(pos)) for pos, i in enumerate(layers)]
        time = (sum(c.compute + c.comm for c in costs) + (loss if rank == loss_rank else 0.0)
                + (embed if rank == 0 else 0.0))
        if rank == loss_rank and m.mtp_num_layers:
            time += m.mtp_num_layers * _mtp_depth_cost(cfg, cost(m.num_layers - 1, recomputed(len(layers))), loss,
                                                       embed, profile)
        if p.pipeline_schedule in SPLIT_BACKWARD and t.compile:
            time += len(layers) * ZB_H1_LINEARS * ZB_H1_BREAK_US * 1e-6
        stage_times.append(time)
        stage_layers.append(len(layers))
        stage_fwd.append(sum(c.forward for c in costs))
        stage_comm.append({k: sum(c.comm_kind[k] for c in costs) for k in ("tp", "cp", "ep")})
        params_by_stage.append(_rank_parameters(cfg, layers, rank == 0, rank == loss_rank, vocab))
        stage_times[-1] += sum(params_by_stage[-1]) * accumulation_s_per_param
    if t.offload_activations:
        # The backward's waits for the host copies the side stream has not finished (memory.offload_timeline).
        for rank, est in enumerate(stage_estimates(cfg, vocab, world_size=world_size, profile=profile,
                                                   layout=layout)):
            stage_times[rank] += est.offload_stall_s
    slowest = max(range(pp), key=lambda r: stage_times[r])
    per_micro = stage_times[slowest]
    slowest_kind = stage_comm[slowest]
    bubble = bubble_fraction(pp, virtual, micro, p.pipeline_schedule)
    compute = micro * per_micro
    bubble_s = compute * bubble
    for k, v in slowest_kind.items():
        kinds[k] = micro * v

    # Data-parallel gradient reduction and parameter gather (the stage with the most parameters), by the
    # sharding strategy (meshtron.optim.strategy): no_shard all-reduces the gradients once per step; optim
    # reduce-scatters them once and all-gathers the updated weights once; optim_grads reduce-scatters every
    # micro-batch's gradients (behind its backward) and gathers once; optim_grads_params reduce-scatters
    # every micro-batch's and all-gathers each layer's weights before its forward and again before its
    # backward, prefetched one layer ahead (so all but the first layer's gather run behind compute).
    strategy = layout.sharding_strategy
    dense, expert = max(params_by_stage, key=lambda de: de[0] + de[1])
    sharded = shards_state(strategy)
    # Hybrid sharding (--num-distributed-optimizer-instances R): everything below runs inside a shard group of
    # S = DP x CP / R consecutive ranks (a node's, where S x TP fits in it), then the reduced shards (1/S of the
    # gradients) are all-reduced over the R replicas (ranks S x TP apart: across nodes), once per step, after
    # the last reduce-scatter.
    replicas = max(1, getattr(p, "num_distributed_optimizer_instances", 1) or 1) if sharded else 1
    n_dense = dp * cp // replicas
    n_expert = max(1, dp * cp * tp // (ep * etp) // replicas)
    grad_bytes = 2 if p.grad_reduce_in_bf16 else 4
    dp_bw = links.bandwidth(profile, n_dense, tp)
    ep_bw = links.bandwidth(profile, n_expert, tp * ep)
    red_factor = 1.0 if sharded else 2.0
    grad_comm = (_ring(dense * grad_bytes, n_dense, dp_bw, latency, red_factor)
                 + _ring(expert * grad_bytes, n_expert, ep_bw, latency, red_factor))
    replica_comm = 0.0
    if replicas > 1:
        replica_bw = links.bandwidth(profile, replicas, tp * n_dense)
        replica_comm = _ring((dense / n_dense + expert / n_expert) * grad_bytes, replicas, replica_bw, latency, 2.0)
    bucket = max(40_000_000, 1_000_000 * dp) if p.ddp_bucket_size is None else p.ddp_bucket_size
    share = min(1.0, bucket / max(1.0, dense + expert))
    last_backward = per_micro - stage_fwd[slowest]
    if shards_gradients(strategy):
        # Every micro-batch's reduce-scatter runs behind its own backward; the last bucket of the last one is exposed.
        grad_exposed = grad_comm * share + micro * _overlapped(grad_comm * (1 - share), last_backward, profile)
    elif p.overlap_grad_reduce and grad_comm > 0:
        grad_exposed = grad_comm * share + _overlapped(grad_comm * (1 - share), last_backward, profile)
    else:
        grad_exposed = grad_comm
    gather = (_ring(dense * 2, n_dense, dp_bw, latency) + _ring(expert * 2, n_expert, ep_bw, latency))
    if shards_weights(strategy):
        # Per micro-batch, two passes (forward, backward) each gather the stage's weights layer by layer.
        first = gather / max(1, stage_layers[slowest])
        passes = (_overlapped(gather - first, stage_fwd[slowest], profile)
                  + _overlapped(gather - first, last_backward, profile))
        gather = micro * (2 * first + passes) if gather > 0 else 0.0
    elif sharded:
        if p.overlap_param_gather and gather > 0:
            gather = gather * share + _overlapped(gather * (1 - share), stage_fwd[slowest], profile)
    else:
        gather = 0.0
    kinds["dp"] = grad_exposed + replica_comm + gather

    if pp > 1 and not p.overlap_p2p_comm:
        bw = links.bandwidth(profile, 2, tp * cp * dp)
        msg = t.micro_batch_size * m.seq_length / cp * m.hidden_size * 2 / (tp if layout.sequence_parallel else 1)
        kinds["pp"] = micro * virtual * 2 * (msg / bw + latency)

    # Optimizer: this rank's shard of the master weights, moments and gradients.
    shard = dense / (n_dense if sharded else 1) + expert / (n_expert if sharded else 1)
    optimizer = shard * profile.optimizer_bytes_per_param / (profile.hbm_gbps * 1e9 * profile.hbm_efficiency)
    # The optimizer's own extra work (meshtron.optim.registry.StepWork): Muon's Newton-Schulz matmuls on the
    # matrices this rank owns, and the TP all-gathers of the momentum that make each matrix whole.
    from meshtron.optim.registry import kind_of

    step_work = kind_of(cfg).step_work
    if step_work is not None:
        work = step_work(cfg, tp, dp * cp, pp, ep)
        optimizer += gemm_seconds(work.matmul_flops, profile, efficiency=work.matmul_rate)
        if work.gathers:
            optimizer += _ring(work.gather_bytes, tp, links.bandwidth(profile, tp, 1), 0.0) + work.gathers * latency
    overhead = profile.step_overhead_ms * 1e-3
    exposed = sum(kinds.values())
    step = compute + bubble_s + kinds["dp"] + kinds["pp"] + optimizer + overhead

    tokens_per_gpu = gbs * m.seq_length / world_size / step
    model_tflops = flops_per_token(m, vocab) * tokens_per_gpu / 1e12
    peak = DATASHEET_PEAK_TFLOPS.get(profile.name.upper(), profile.extra.get("peak_tflops") if profile.extra else None)
    return StepPrediction(step_s=step, compute_s=compute, bubble_s=bubble_s, bubble_fraction=bubble,
                          stage_compute_s=[micro * t for t in stage_times],
                          exposed_comm_s=exposed, optimizer_s=optimizer, overhead_s=overhead,
                          tokens_per_sec_per_gpu=tokens_per_gpu, model_tflops_per_gpu=model_tflops,
                          mfu=(model_tflops / peak) if peak else None, comm_by_kind_s=kinds)
