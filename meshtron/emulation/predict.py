"""Predicted step time of an emulated rank: measured compute plus modelled communication.

What is measured (on the local device, by :mod:`meshtron.emulation.runner`): the rank's forward and backward
passes over all its micro-batches (communication emulated, so they hold no waiting), its optimizer step and
its data preparation. What is modelled: each recorded collective's time from the device profile's links
(:class:`meshtron.planning.profiles.DeviceProfile`: NVLink inside a node, the network across nodes, a fixed
latency per call) with ring formulas, hidden or exposed by meshtron's overlap rules, and the pipeline bubble
from meshtron's own schedule simulator (:func:`meshtron.planning.step_time.bubble_fraction`) applied to the
measured passes.

Overlap rules (the same as the step-time model's, docs/emulation.md):

* tensor- and expert-parallel operations (``tp``, ``tp_sub*``, ``ep``) lie on the critical path: exposed;
* context-parallel ring transfers overlap the attention they feed: hidden behind the forward and backward; a
  hop's send and receive run at once (full-duplex links), so a hop costs one transfer;
* data-parallel reductions and gathers (``dp``, ``dp_cp``, ``expert_dp``) issued without waiting
  (``--overlap-grad-reduce``, ``--overlap-param-gather``) hide behind the backward pass; otherwise exposed;
* pipeline transfers hide behind compute except on the warm-up and cool-down path (2 x (PP - 1) transfers);
* everything else (norms, tied embeddings, the loss's all-reduce) is exposed.

A hidden operation still costs ``overlap_cost`` of its time (its kernels share the GPU with compute).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from meshtron.planning.profiles import DeviceProfile

_CRITICAL_GROUPS = ("tp", "ep")
_DATA_PARALLEL_GROUPS = ("dp", "dp_cp", "expert_dp")


def collective_seconds(op: str, nbytes: int, group_size: int, bandwidth: float, latency: float) -> float:
    """One operation's time on a ring of ``group_size`` ranks at ``bandwidth`` bytes/s bus bandwidth."""
    if group_size <= 1:
        return 0.0
    if op in ("send", "recv", "broadcast"):
        return nbytes / bandwidth + latency
    if op == "barrier":
        return latency
    factor = 2.0 if op == "all_reduce" else 1.0  # all-gather, reduce-scatter, all-to-all: (n-1)/n of the buffer
    return factor * nbytes * (group_size - 1) / group_size / bandwidth + latency


@dataclass
class CommSummary:
    """The communication of one step of one rank, per group."""

    bytes_by_group: dict = field(default_factory=dict)
    seconds_by_group: dict = field(default_factory=dict)  # modelled time of all its operations
    exposed_by_group: dict = field(default_factory=dict)  # what the overlap rules leave on the critical path
    calls_by_group: dict = field(default_factory=dict)

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed_by_group.values())


#: Groups whose operations come once per micro-batch (the rest once per step).
PER_MICRO_BATCH_GROUPS = ("tp", "ep", "cp", "pp")
#: Phases of a step that run once whatever the micro-batches (a tensor-parallel all-reduce of the sequence-parallel
#: norms' gradients, the gradient norm's): their operations are never scaled by the micro-batches.
PER_STEP_PHASES = ("gradient-sync", "optimizer")


def summarise_step(records: Sequence[dict], spans_nodes: dict, profile: DeviceProfile, forward_s: float,
                   backward_s: float, pp: int, micro_batch_scale: float = 1.0) -> CommSummary:
    """Model the operations of one step (``records`` of one iteration) and apply the overlap rules.

    ``spans_nodes``: group name -> whether its ranks sit on more than one node. ``micro_batch_scale``: the
    step ran that many times fewer micro-batches than the job has (``--measure-micro-batches``): the
    per-micro-batch groups' operations (outside :data:`PER_STEP_PHASES`) are counted that many times over;
    ``forward_s`` and ``backward_s`` are the job's (already scaled)."""
    seconds, nbytes, calls = defaultdict(float), defaultdict(int), defaultdict(int)
    async_seconds = defaultdict(float)
    per_transfer = defaultdict(list)
    for r in records:
        group = r["group"]
        bw = (profile.network_gbps if spans_nodes.get(group, False) else profile.nvlink_gbps) * 1e9
        t = collective_seconds(r["op"], r["bytes"], r["group_size"], bw, profile.collective_latency_us * 1e-6)
        if group == "cp" and r["op"] == "recv":
            # A ring hop's receive runs at once with its send (one batched isend/irecv over full-duplex links):
            # the hop costs one transfer, counted on the send.
            t = 0.0
        per_micro_batch = group in PER_MICRO_BATCH_GROUPS or group.startswith("tp_sub")
        if per_micro_batch and r.get("phase") not in PER_STEP_PHASES:
            t *= micro_batch_scale
        seconds[group] += t
        nbytes[group] += r["bytes"]
        calls[group] += 1
        if r.get("async"):
            async_seconds[group] += t
        if group == "pp":
            per_transfer[group].append(t)
    exposed = {}
    compute = forward_s + backward_s
    for group, t in seconds.items():
        if group in _CRITICAL_GROUPS or group.startswith("tp_sub"):
            exposed[group] = t
        elif group == "cp":
            exposed[group] = _overlapped(t, compute, profile)
        elif group in _DATA_PARALLEL_GROUPS:
            hidden = async_seconds[group]
            exposed[group] = (t - hidden) + _overlapped(hidden, backward_s, profile)
        elif group == "pp":
            transfers = per_transfer[group]
            mean = t / max(1.0, len(transfers) * micro_batch_scale)
            path = min(len(transfers) * micro_batch_scale, 2 * (pp - 1))
            exposed[group] = path * mean + profile.overlap_cost * (t - path * mean)
        else:
            exposed[group] = t
    return CommSummary(dict(nbytes), dict(seconds), exposed, dict(calls))


def _overlapped(comm: float, cover: float, profile: DeviceProfile) -> float:
    hidden = min(comm, cover)
    return comm - hidden + profile.overlap_cost * hidden


@dataclass
class RankPrediction:
    """The predicted step of one emulated rank."""

    compute_s: float  # measured forward + backward of all micro-batches
    bubble_s: float
    exposed_comm_s: float
    optimizer_s: float
    other_s: float  # data preparation and what the split passes do not cover
    step_s: float
    comm: CommSummary


def fit_passes(forward_s: float, backward_s: float, step_s: float, data_s: float = 0.0) -> tuple[float, float]:
    """The forward and backward seconds of the measured micro-batches, held to the whole step.

    The whole step (timed without a sync between its passes, communication completing at once) measures the
    rank's work; the passes timed one by one, each synchronised and so paying its launch latency alone, only
    apportion it. Where they add up to more than the step less its data preparation, both are scaled down to it
    (the remainder ``meshtron bench`` reports as the optimizer's is then 0); otherwise they are kept."""
    passes, budget = forward_s + backward_s, step_s - data_s
    if passes > budget > 0:
        return forward_s * budget / passes, backward_s * budget / passes
    return forward_s, backward_s


def predict_rank(forward_s: float, backward_s: float, optimizer_s: float, other_s: float, comm: CommSummary,
                 bubble_fraction: float) -> RankPrediction:
    """Step = compute x (1 + bubble) + exposed communication + optimizer + the rest."""
    compute = forward_s + backward_s
    bubble = compute * bubble_fraction
    step = compute + bubble + comm.exposed_s + optimizer_s + other_s
    return RankPrediction(compute, bubble, comm.exposed_s, optimizer_s, other_s, step, comm)


def steady_iteration(records: Sequence[dict]) -> Optional[int]:
    """The last training iteration in a trace (the one whose operations model a step)."""
    its = [r["iteration"] for r in records if r["iteration"] > 0 and r.get("phase") != "eval"]
    return max(its) if its else None
