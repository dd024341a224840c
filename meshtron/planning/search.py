"""The layout search of ``meshtron plan --model PRESET --gpus N ...``.

Every layout of the model on ``N`` GPUs is enumerated: tensor parallelism (a power of two within a
node, with sequence parallelism), context parallelism, pipeline stages (an uneven first/last stage
where the layers do not divide) and virtual stages, expert parallelism, the data-parallel size that
is left, the micro batch, recomputation (none, selective, full), the data-parallel sharding strategy
(no_shard, optim = the distributed optimizer, and where they are needed optim_grads / optim_grads_params),
FP8, --async-tensor-parallel, the ZB-H1 pipeline schedule (PP > 1 without virtual stages), activation
offloading (where a layout does not fit without it, or for long sequences) and hybrid sharding (beside every
sharded layout whose DP x CP ranks span nodes: shards of the most ranks that fit in a node with its TP,
``--num-distributed-optimizer-instances`` replicas across nodes, where the larger state still fits).
Options that can only cost time are tried only where they may be needed, to keep the search fast: ZeRO-2
and ZeRO-3 only with DP x CP > 1 and when the layout with ZeRO-1 does not fit but could once the gradients
(and weights) are sharded; ZB-H1 only where 1F1B at the same layout fits; offloading only for layouts that
do not fit without it but could once the activations leave the device, and only when no layout fits
without it or the sequence is at least ``OFFLOAD_SEQ`` tokens. Numerics choices (``--use-precision-aware-optimizer``) are left to the user:
given to ``meshtron plan`` they stay in the base configuration and in the memory.
Each is given the memory of :func:`meshtron.memory.estimate_memory` (the one memory model) and the
step time of :func:`meshtron.planning.step_time.predict_step`, both from formulas, so thousands of
layouts take seconds. Those whose estimate plus the stated headroom exceeds the device's memory are
dropped; the rest are ranked by predicted tokens/s/GPU. The best few are then checked by the real
configuration check (:func:`meshtron.planning.validate.validate_for_plan`) on the flags of the
``meshtron train`` command line printed for them.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

from meshtron.config import MeshtronConfig, ffn_size, num_kv_heads
from meshtron.errors import ConfigError
from meshtron.planning.profiles import DeviceProfile
from meshtron.planning.step_time import Links, StepPrediction, predict_step

GIB = 2**30
RECOMPUTE = ("none", "selective", "full")
#: Activation offloading is also tried for layouts that fit without it from this sequence length on.
OFFLOAD_SEQ = 16384


@dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    dp: int
    micro_batch: int
    recompute: str
    sharding: str  # --data-parallel-sharding-strategy: no_shard, optim (distopt), optim_grads, optim_grads_params
    fp8: bool
    async_tp: bool = False  # --async-tensor-parallel (compiled, sequence-parallel TP)
    first_layers: Optional[int] = None  # uneven pipeline split: layers of the first and last stage
    last_layers: Optional[int] = None
    zb_h1: bool = False  # --pipeline-schedule zero-bubble-h1 (PP > 1, no virtual stages)
    offload: bool = False  # --offload-activations
    cp_comm: str = "p2p"  # --cp-comm-type: p2p (ring) or a2a (Ulysses, where the heads split over CP)
    replicas: int = 1  # --num-distributed-optimizer-instances: hybrid sharding, shards of DP x CP / R ranks

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the optimizer state is sharded (every strategy but no_shard)."""
        return self.sharding != "no_shard"

    def describe(self) -> str:
        """``TP=2 CP=1 PP=4 (V=2) EP=1 DP=4 mbs=1 recompute=full distopt fp8``."""
        parts = [f"TP={self.tp}", f"CP={self.cp}", f"PP={self.pp}" + (f" (V={self.vpp})" if self.vpp > 1 else ""),
                 f"EP={self.ep}", f"DP={self.dp}", f"mbs={self.micro_batch}", f"recompute={self.recompute}"]
        parts += {"optim": ["distopt"], "optim_grads": ["zero2"], "optim_grads_params": ["zero3"]}.get(self.sharding, [])
        if self.fp8:
            parts.append("fp8")
        if self.async_tp:
            parts.append("async-tp")
        if self.zb_h1:
            parts.append("zb-h1")
        if self.offload:
            parts.append("offload")
        if self.cp > 1 and self.cp_comm != "p2p":
            parts.append(f"cp-{self.cp_comm}")
        if self.replicas > 1:
            parts.append(f"hsdp={self.dp * self.cp // self.replicas}x{self.replicas}")
        return " ".join(parts)

    def flags(self) -> list[str]:
        """The ``meshtron train`` flags of this layout (model, sequence and batch flags excluded)."""
        out = ["--micro-batch-size", str(self.micro_batch)]
        if self.tp > 1:
            out += ["--tensor-model-parallel-size", str(self.tp), "--sequence-parallel"]
            if self.async_tp:
                out += ["--async-tensor-parallel"]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
            if self.cp_comm != "p2p":
                out += ["--cp-comm-type", self.cp_comm]
        if self.pp > 1:
            out += ["--pipeline-model-parallel-size", str(self.pp)]
            if self.first_layers is not None:
                out += ["--decoder-first-pipeline-num-layers", str(self.first_layers),
                        "--decoder-last-pipeline-num-layers", str(self.last_layers)]
            if self.vpp > 1:
                out += ["--virtual-pipeline-model-parallel-size", str(self.vpp)]
            if self.zb_h1:
                out += ["--pipeline-schedule", "zero-bubble-h1"]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.sharding == "optim":
            out += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        elif self.sharding == "optim_grads":
            out += ["--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce",
                    "--overlap-param-gather"]
        elif self.sharding == "optim_grads_params":  # each layer's gather is always prefetched
            out += ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce"]
        elif self.dp * self.cp > 1:
            out += ["--overlap-grad-reduce"]
        if self.replicas > 1:
            out += ["--num-distributed-optimizer-instances", str(self.replicas)]
        if self.recompute != "none":
            out += ["--recompute-granularity", self.recompute]
        if self.offload:
            out += ["--offload-activations"]
        if self.fp8:
            out += ["--fp8-format", "e4m3"]
        return out


@dataclass
class Planned:
    """A layout with its memory and step-time predictions."""

    layout: Layout
    memory_bytes: int
    step: StepPrediction
    command: list[str] = field(default_factory=list)

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.step.tokens_per_sec_per_gpu

    def as_dict(self) -> dict:
        """JSON-ready figures (memory in GiB)."""
        lay = self.layout
        return {"layout": lay.describe(), "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep,
                "dp": lay.dp, "micro_batch": lay.micro_batch, "recompute": lay.recompute,
                "distributed_optimizer": lay.distributed_optimizer, "sharding": lay.sharding, "fp8": lay.fp8,
                "async_tp": lay.async_tp, "pipeline_schedule": "zero-bubble-h1" if lay.zb_h1 else None,
                "offload_activations": lay.offload, "cp_comm_type": lay.cp_comm,
                "memory_gib": self.memory_bytes / GIB, **self.step.as_dict(), "command": " ".join(self.command)}


@dataclass
class SearchSpace:
    """What the search may choose (``allow_fp8``: FP8 linears; needs a GPU with FP8 tensor cores;
    ``allow_zero``: ZeRO-2/3 sharding; ``allow_zb_h1``: the ZB-H1 schedule; ``allow_offload``:
    --offload-activations; ``allow_cp_a2a``: all-to-all context parallelism beside the ring; ``allow_hybrid``:
    hybrid sharding (``--num-distributed-optimizer-instances``) beside a sharded layout spanning nodes)."""

    max_micro_batch: int = 8  # every micro batch up to this that divides the global batch per DP rank
    recompute: Sequence[str] = RECOMPUTE
    max_virtual: int = 4
    allow_fp8: bool = True
    allow_zero: bool = True
    allow_zb_h1: bool = True
    allow_offload: bool = True
    allow_cp_a2a: bool = True
    allow_hybrid: bool = True
    fixed: dict = field(default_factory=dict)  # e.g. {"tp": 4, "pp": 4}: only layouts with these sizes


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_split(layers: int, pp: int) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(first, last) stage layers for ``pp`` stages: (None, None) for an even split, an uneven one with
    the first and last stages at most as large as the middle ones, or None when there is none."""
    if layers % pp == 0:
        return None, None
    if pp < 3:
        return None
    middle = math.ceil(layers / pp)
    for mid in range(middle, layers):
        rest = layers - mid * (pp - 2)
        if rest < 2:
            return None
        first, last = rest // 2, rest - rest // 2
        if 1 <= first <= mid and last <= mid:
            return first, last
    return None


def layouts(cfg: MeshtronConfig, gpus: int, gpus_per_node: int, space: SearchSpace) -> Iterator[Layout]:
    """Every base layout the search considers (sizes that divide; the configuration check runs later),
    with no_shard or optim; :func:`variants` adds ZeRO-2/3, ZB-H1 and offloading where they may pay."""
    m, t = cfg.model, cfg.train
    gbs, seq, layers = t.global_batch_size, m.seq_length, m.num_layers
    heads, groups = m.num_attention_heads, num_kv_heads(m)
    fixed = space.fixed
    for tp in _powers_of_two(min(gpus, gpus_per_node, 8)):
        if heads % tp or (groups % tp and tp % groups) or ffn_size(m) % tp:
            continue
        for cp in _powers_of_two(min(8, gpus // tp)):
            if seq % (2 * cp) or (cp > 1 and seq // cp < 1024):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                if pp > layers:
                    continue
                split = pipeline_split(layers, pp)
                if split is None:
                    continue
                dp = gpus // (tp * cp * pp)
                for vpp in [v for v in (1, 2, 4, 8) if v <= space.max_virtual]:
                    if vpp > 1 and (pp == 1 or split[0] is not None or (layers // pp) % vpp):
                        continue
                    experts = m.num_experts or 1
                    for ep in _divisors(experts):
                        if (dp * cp) % ep:
                            continue
                        for mbs in range(1, space.max_micro_batch + 1):
                            if gbs % (mbs * dp):
                                continue
                            micro = gbs // (mbs * dp)
                            if vpp > 1 and micro % pp:
                                continue
                            for rec, distopt, fp8, async_tp in itertools.product(
                                    space.recompute, ("no_shard", "optim") if dp * cp > 1 else ("no_shard",),
                                    (False, True) if space.allow_fp8 else (False,),
                                    (False, True) if tp > 1 else (False,)):
                                lay = Layout(tp, cp, pp, vpp, ep, dp, mbs, rec, distopt, fp8, async_tp, *split)
                                if all(getattr(lay, k) == v for k, v in fixed.items()):
                                    yield lay


def _fitting_variants(lay: Layout, estimate, limit: float, space: SearchSpace,
                      offload_candidates: list[Layout]) -> Iterator[tuple[Layout, int]]:
    """``lay`` and the variants of it worth trying, those that fit, with their memory.

    ``estimate(layout)`` gives a :class:`meshtron.memory.MemoryEstimate` (None: not a valid layout).
    A stronger sharding strategy only costs communication, so ZeRO-2 is tried only where ZeRO-1 does not
    fit and sharding the gradients could make it fit, ZeRO-3 only where ZeRO-2 does not fit and sharding
    the weights too could; ZB-H1 (more activations in flight, a smaller bubble) where the same layout fits
    with 1F1B. Offloading also only costs time (the backward's waits for the host copies), so the
    variants that do not fit but could without their activations on the device (not with full
    recomputation, which keeps only each layer's input) are appended to ``offload_candidates`` for
    :func:`search` to try when it needs them."""
    est = estimate(lay)
    if est is None:
        return
    shards = lay.dp * lay.cp
    tried = [(lay, est)]
    if est.device_bytes > limit and space.allow_zero and lay.sharding == "optim":
        for strategy, saved in (("optim_grads", est.gradients), ("optim_grads_params", est.gradients + est.weights)):
            if est.device_bytes - saved * (1 - 1 / shards) > limit:
                continue
            variant = dataclasses.replace(lay, sharding=strategy)
            variant_est = estimate(variant)
            if variant_est is None:
                continue
            tried.append((variant, variant_est))
            if variant_est.device_bytes <= limit:
                break  # ZeRO-3 would only add communication
    for variant, variant_est in tried:
        if variant_est.device_bytes <= limit:
            yield from _with_zb_h1(variant, variant_est.device_bytes, estimate, limit, space)
        elif (space.allow_offload and lay.recompute != "full" and (lay.sharding != "no_shard" or shards == 1)
              and variant_est.total - variant_est.activations <= limit):
            offload_candidates.append(dataclasses.replace(variant, offload=True))


def _with_zb_h1(lay: Layout, mem: int, estimate, limit: float, space: SearchSpace) -> Iterator[tuple[Layout, int]]:
    """``lay`` (which fits in ``mem`` bytes) and, with PP > 1 and no virtual stages, its ZB-H1 variant if it fits."""
    yield lay, mem
    if space.allow_zb_h1 and lay.pp > 1 and lay.vpp == 1:
        zb = dataclasses.replace(lay, zb_h1=True)
        zb_est = estimate(zb)
        if zb_est is not None and zb_est.device_bytes <= limit:
            yield zb, zb_est.device_bytes


def apply_layout(base: MeshtronConfig, lay: Layout) -> MeshtronConfig:
    """``base`` with the layout's flags set (as the printed command line would set them)."""
    cfg = copy.copy(base)  # the sections the layout changes are copied; the model is shared, unchanged
    cfg.parallel, cfg.train = copy.copy(base.parallel), copy.copy(base.train)
    p, t = cfg.parallel, cfg.train
    p.tensor_model_parallel_size, p.context_parallel_size = lay.tp, lay.cp
    p.pipeline_model_parallel_size, p.expert_model_parallel_size = lay.pp, lay.ep
    p.virtual_pipeline_model_parallel_size = lay.vpp if lay.vpp > 1 else None
    p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = lay.first_layers, lay.last_layers
    p.sequence_parallel = lay.tp > 1
    p.async_tensor_parallel = lay.async_tp
    p.use_distributed_optimizer = lay.sharding == "optim"
    p.data_parallel_sharding_strategy = lay.sharding if lay.sharding in ("optim_grads", "optim_grads_params") else None
    p.overlap_grad_reduce = lay.dp * lay.cp > 1
    p.overlap_param_gather = lay.sharding in ("optim", "optim_grads")
    p.num_distributed_optimizer_instances, p.data_parallel_shard_size = lay.replicas, None
    p.pipeline_schedule = "zero-bubble-h1" if lay.zb_h1 else None
    if lay.cp > 1 and (lay.cp_comm != "p2p" or p.cp_comm_type in ("a2a", "a2a+p2p")):
        p.cp_comm_type, p.hierarchical_context_parallel_sizes = lay.cp_comm, []
    t.micro_batch_size = lay.micro_batch
    t.recompute_granularity = None if lay.recompute == "none" else lay.recompute
    t.fp8_format = "e4m3" if lay.fp8 else None
    t.offload_activations = lay.offload
    return cfg


def command_line(base_argv: Sequence[str], lay: Layout, gpus: int, gpus_per_node: int) -> list[str]:
    """The ``meshtron train`` command of a layout: the user's flags, the layout's, the launcher's."""
    nodes = max(1, gpus // gpus_per_node)
    per_node = gpus if gpus < gpus_per_node else gpus_per_node
    launch = ["--nproc-per-node", str(per_node)] + (["--nnodes", str(nodes)] if nodes > 1 else [])
    return ["meshtron", "train", *base_argv, *lay.flags(), *launch]


def search(base: MeshtronConfig, base_argv: Sequence[str], gpus: int, profile: DeviceProfile,
           gpus_per_node: int = 8, headroom: float = 0.1, top: int = 5,
           space: Optional[SearchSpace] = None) -> tuple[list[Planned], int, int]:
    """The ``top`` fastest layouts that fit, each validated; (them, layouts considered, layouts that fit)."""
    from meshtron.memory import estimate_memory

    space = space or SearchSpace()
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom must be a fraction of device memory in [0, 1), got {headroom}")
    from meshtron.validation import resolve

    base = copy.deepcopy(base)
    if base.train.device is None:
        base.train.device = "cuda"  # the plan is for GPUs: bf16 and compiled layers, the GPU defaults
    resolve(base, None)
    limit = profile.memory_gib * GIB * (1 - headroom)
    links = Links(gpus_per_node)
    vocab = base.model.vocab_size
    fitting: list[Planned] = []
    considered = 0

    def estimate(lay: Layout):
        nonlocal considered
        considered += 1
        try:
            return estimate_memory(apply_layout(base, lay), vocab, world_size=gpus, profile=profile)
        except (ConfigError, ValueError):
            return None

    def keep(lay: Layout, mem: int) -> None:
        fitting.append(Planned(lay, mem, predict_step(apply_layout(base, lay), gpus, profile, vocab, links)))
        # Hybrid sharding beside a sharded layout whose DP x CP ranks span nodes: shard inside a node, all-reduce
        # 1/S of the gradients across the nodes (more state per rank: only where it still fits).
        replicas = hybrid_replicas(lay, gpus_per_node)
        if replicas > 1 and space.allow_hybrid:
            hybrid = dataclasses.replace(lay, replicas=replicas)
            est = estimate(hybrid)
            if est is not None and est.device_bytes <= limit:
                fitting.append(Planned(hybrid, est.device_bytes,
                                       predict_step(apply_layout(base, hybrid), gpus, profile, vocab, links)))
        # All-to-all CP beside the ring, where every TP rank's heads split over the CP ranks: its
        # exchanges are not hidden behind attention, but it sends 4 tensors (CP-1)/CP once instead of CP-1 hops
        if lay.cp > 1 and lay.cp_comm == "p2p" and space.allow_cp_a2a and _a2a_heads_split(base, lay):
            a2a = dataclasses.replace(lay, cp_comm="a2a")
            est = estimate(a2a)
            if est is not None and est.device_bytes <= limit:
                fitting.append(Planned(a2a, est.device_bytes,
                                       predict_step(apply_layout(base, a2a), gpus, profile, vocab, links)))

    offload_candidates: list[Layout] = []
    for lay in layouts(base, gpus, gpus_per_node, space):
        for variant, mem in _fitting_variants(lay, estimate, limit, space, offload_candidates):
            keep(variant, mem)
    if not fitting or base.model.seq_length >= OFFLOAD_SEQ:
        for lay in offload_candidates:
            est = estimate(lay)
            # With offloading the device also holds the blocks of activations still being copied out.
            if est is not None and est.device_bytes <= limit:
                for variant, mem in _with_zb_h1(lay, est.device_bytes, estimate, limit, space):
                    keep(variant, mem)
    fitting.sort(key=lambda c: -c.tokens_per_sec_per_gpu)
    chosen: list[Planned] = []
    for cand in fitting:
        if len(chosen) == top:
            break
        command = command_line(base_argv, cand.layout, gpus, gpus_per_node)
        if _valid(command, gpus):
            cand.command = command
            chosen.append(cand)
    return chosen, considered, len(fitting)


def hybrid_replicas(lay: Layout, gpus_per_node: int) -> int:
    """R for hybrid sharding of ``lay`` with the largest shard group inside one node (1: none worth trying:
    no sharding, experts split over ranks, or the DP x CP ranks already inside a node)."""
    ranks = lay.dp * lay.cp
    if lay.sharding == "no_shard" or lay.ep > 1 or ranks * lay.tp <= gpus_per_node:
        return 1
    shard = max([s for s in _divisors(ranks) if s * lay.tp <= gpus_per_node] or [1])
    return ranks // shard


def _a2a_heads_split(base: MeshtronConfig, lay: Layout) -> bool:
    """Whether ``--cp-comm-type a2a`` accepts the model's heads with the layout's TP and CP."""
    from meshtron.cp_comm_types import check_a2a_heads

    m = base.model
    try:
        check_a2a_heads(m.num_attention_heads // lay.tp, max(1, num_kv_heads(m) // lay.tp), lay.cp, lay.tp)
    except ConfigError:
        return False
    return True


def _valid(command: Sequence[str], gpus: int) -> bool:
    """Whether the configuration check accepts the command line's flags on ``gpus`` GPUs."""
    from meshtron.cli import build_config
    from meshtron.planning.validate import validate_for_plan

    try:
        validate_for_plan(build_config(list(command[2:])), gpus)
    except ConfigError:
        return False
    return True


def format_plans(plans: Iterable[Planned], profile: DeviceProfile, headroom: float) -> str:
    """A human table of the chosen layouts and their command lines."""
    lines = [f"{'#':>2} {'layout':<58} {'mem GiB':>8} {'tok/s/GPU':>10} {'MFU':>6} {'bubble':>7} {'exposed comm':>13}"]
    plans = list(plans)
    for i, c in enumerate(plans, 1):
        s = c.step
        mfu = f"{s.mfu:.1%}" if s.mfu is not None else "-"
        lines.append(f"{i:>2} {c.layout.describe():<58} {c.memory_bytes / GIB:>8.1f} {s.tokens_per_sec_per_gpu:>10,.0f} "
                     f"{mfu:>6} {s.bubble_fraction:>7.1%} {s.exposed_comm_s * 1000:>10.0f} ms")
    offload = " (with offloading, plus the activations still being copied to the host)" if any(
        c.layout.offload for c in plans) else ""
    lines.append(f"(memory: estimated peak per GPU{offload}, at most {profile.memory_gib * (1 - headroom):.1f} GiB = "
                 f"{profile.name} {profile.memory_gib:.1f} GiB less {headroom:.0%} headroom)")
    for i, c in enumerate(plans, 1):
        lines.append(f"{i:>2} {' '.join(c.command)}")
    return "\n".join(lines)
