"""Re-running a suspicious iteration: NaN/inf and loss spikes told apart into transient and persistent.

``--rerun-mode validate_results`` (Megatron-LM's name): when an iteration's gradient norm or
loss is non-finite (``--check-for-nan-in-loss-and-grad``) or its loss spikes
(``--check-for-spiky-loss``: above ``--spiky-loss-factor`` x the median of the last
``--spiky-loss-window`` accepted losses), the optimizer step is held back and the iteration
is executed again from the same state: the same micro-batches, the same weights (no step was
applied), the random-number generators and the MoE statistics as they were before it.

* The re-run is fine: the fault was transient. Training continues with the re-run's result.
* The re-run is bad too: the fault is persistent (the data, or a device that fails the same
  way twice). ``--rerun-persistent-action skip`` drops the global batch (its sample positions
  are logged) and continues; ``stop`` ends the run with exit code 1.

Either way the rank where the fault first appeared is named: the first rank whose own loss
was non-finite in the first execution (losses are per rank before they are summed), else the
first rank whose own gradients were non-finite in the re-run (checked before the gradient
reduction, which the re-run does not overlap with the backward pass). A fault that shows only
in the first execution's gradients cannot be placed: the reduction has summed them over ranks
by the time they are checked, so the event's rank is then null. Local flags are gathered over
the world only on this failure path.

With ZeRO-2/3 (``--data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``) a rank
keeps only its reduced shard of the gradients, and the gradient norm sums only the elements it
counts; so each rank also checks its whole shard and its own loss, and the verdict is reduced
over the world (:func:`nonfinite_on_any_rank`): a bad step's norm is then NaN on every rank.

``report_stats`` runs every iteration twice and reports how much the two executions differ
(loss and gradient norm, relative): a measure of the run's non-determinism. Its checks act as
in ``validate_results``. ``disabled``: no re-run; a non-finite step is skipped as before.

Nothing here runs on a healthy step beyond :meth:`RerunGuard.capture` (host-side copies of the
generator states and one multi-tensor copy of the MoE statistics).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import capture_rng_state, restore_rng_state

RERUN_MODES: tuple[str, ...] = ("disabled", "validate_results", "report_stats")
PERSISTENT_ACTIONS: tuple[str, ...] = ("skip", "stop")
#: A spike is judged only once the window holds at least this many accepted losses.
MIN_SPIKE_HISTORY = 5


@dataclass
class Verdict:
    """What the checks say about one execution: ``reason`` None (fine), "nonfinite" or "spike"."""

    reason: Optional[str] = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass
class RerunOutcome:
    """The re-run's finding, for the log and the metrics file."""

    iteration: int
    reason: str                # "nonfinite" or "spike"
    result: str                # "transient" or "persistent"
    action: str                # "continued", "skipped" or "stopped"
    rank: Optional[int]        # where the fault first appeared (None: cannot be placed)
    detail: str
    samples: tuple[int, int]   # [first, stop) positions of the global batch in the training sample order

    def event(self) -> dict:
        """The ``rerun`` metrics-file event (DESIGN section 6)."""
        first, stop = self.samples
        return {"type": "rerun", "iteration": self.iteration, "rank": self.rank, "reason": self.reason,
                "result": self.result, "action": self.action, "detail": self.detail,
                "sample_range": [first, stop], "samples": list(range(first, stop))}

    def message(self) -> str:
        """One line naming iteration, rank, samples and what was done."""
        where = f"rank {self.rank}" if self.rank is not None else "a rank that cannot be placed"
        what = {"nonfinite": "non-finite loss or gradient norm", "spike": "loss spike"}[self.reason]
        first, stop = self.samples
        seen = ("not reproduced by a re-run (transient)" if self.result == "transient"
                else "reproduced by a re-run (persistent)")
        then = {"continued": "continuing with the re-run's result",
                "skipped": "this global batch is skipped",
                "stopped": "stopping; the last saved checkpoint is intact"}[self.action]
        return (f"iteration {self.iteration}: {what} ({self.detail}) first on {where}, {seen}; global batch "
                f"samples {first}..{stop - 1}; {then}")


@dataclass
class RerunStats:
    """``report_stats``: the largest relative differences between the two executions since the last log."""

    max_loss_diff: float = 0.0
    max_grad_norm_diff: float = 0.0
    count: int = 0

    def add(self, first: Sequence[float], second: Sequence[float]) -> None:
        def rel(a: float, b: float) -> float:
            if not (math.isfinite(a) and math.isfinite(b)):
                return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
            return abs(a - b) / max(abs(a), abs(b), 1e-30)

        self.max_grad_norm_diff = max(self.max_grad_norm_diff, rel(first[0], second[0]))
        if len(first) > 1:
            self.max_loss_diff = max(self.max_loss_diff, rel(first[1], second[1]))
        self.count += 1

    def pop(self) -> dict:
        """The train-record entries, then reset."""
        out = {"rerun_max_loss_diff": self.max_loss_diff, "rerun_max_grad_norm_diff": self.max_grad_norm_diff}
        self.max_loss_diff, self.max_grad_norm_diff, self.count = 0.0, 0.0, 0
        return out


def _moe_statistics(model_chunks: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The buffers MoE layers accumulate during a forward pass (restored before a re-run)."""
    from meshtron.layers.moe.training import moe_layers

    out = []
    for layer in moe_layers(model_chunks):
        out += [b for b in (getattr(layer, n, None) for n in ("load_tokens", "step_tokens", "aux_sum", "z_sum",
                                                               "calls")) if isinstance(b, torch.Tensor)]
    return out


class RerunGuard:
    """Checks each iteration's result and re-runs a suspicious one (see the module doc).

    The trainer calls :meth:`capture` before the first execution, :meth:`judge` on the synced
    values ``[grad norm]`` or ``[grad norm, global loss]``, and, on a bad verdict, :meth:`restore`
    before the re-run and :meth:`conclude` after it.
    """

    def __init__(self, ctx: ParallelContext, tracker, model_chunks: Sequence[nn.Module], *, mode: str,
                 check_nan: bool, check_spike: bool, spike_factor: float, spike_window: int,
                 persistent_action: str, global_batch_size: int):
        self.ctx = ctx
        self.tracker = tracker
        self.mode = mode
        self.check_nan = check_nan
        self.check_spike = check_spike
        self.spike_factor = spike_factor
        self.persistent_action = persistent_action
        self.global_batch_size = global_batch_size
        self.history: deque[float] = deque(maxlen=max(1, spike_window))
        self.stats = RerunStats() if mode == "report_stats" else None
        self._moe_live = _moe_statistics(model_chunks)
        self._moe_saved = [t.clone() for t in self._moe_live]
        self._rng: Optional[dict] = None

    @classmethod
    def from_config(cls, cfg, ctx: ParallelContext, tracker, model_chunks: Sequence[nn.Module]) -> Optional["RerunGuard"]:
        """The guard of ``cfg``'s re-run flags, or None when nothing is checked (the step then skips a
        non-finite result without a re-run, as before)."""
        t = cfg.train
        checks = t.check_for_nan_in_loss_and_grad or t.check_for_spiky_loss
        if t.rerun_mode == "disabled" or not (checks or t.rerun_mode == "report_stats"):
            return None
        return cls(ctx, tracker, model_chunks, mode=t.rerun_mode, check_nan=t.check_for_nan_in_loss_and_grad,
                   check_spike=t.check_for_spiky_loss, spike_factor=t.spiky_loss_factor,
                   spike_window=t.spiky_loss_window, persistent_action=t.rerun_persistent_action,
                   global_batch_size=t.global_batch_size)

    @property
    def needs_loss(self) -> bool:
        """Whether the step must reduce the global loss every iteration (fused into the norm's sync)."""
        return self.check_spike or self.mode == "report_stats"

    @property
    def always_rerun(self) -> bool:
        return self.mode == "report_stats"

    # -- state ------------------------------------------------------------------------------
    def capture(self) -> None:
        """Remember what a forward/backward pass changes besides the gradients (host copies, no sync)."""
        self._rng = capture_rng_state(self.tracker)
        if self._moe_live:
            torch._foreach_copy_(self._moe_saved, self._moe_live)

    def restore(self) -> None:
        """Put that state back before executing the iteration again."""
        restore_rng_state(self._rng, self.tracker)
        if self._moe_live:
            torch._foreach_copy_(self._moe_live, self._moe_saved)

    # -- checks -----------------------------------------------------------------------------
    def judge(self, values: Sequence[float]) -> Verdict:
        """The verdict on ``[grad norm]`` or ``[grad norm, global mean loss]``, identical on every rank."""
        norm = values[0]
        loss = values[1] if len(values) > 1 else None
        if not math.isfinite(norm) or (loss is not None and not math.isfinite(loss)):
            if not self.check_nan:
                return Verdict()  # not re-run: the trainer skips the step as without a guard
            return Verdict("nonfinite", f"loss {loss}, gradient norm {norm}" if loss is not None
                           else f"gradient norm {norm}")
        if self.check_spike and loss is not None and len(self.history) >= min(MIN_SPIKE_HISTORY,
                                                                                  self.history.maxlen):
            median = statistics.median(self.history)
            if median > 0 and loss > self.spike_factor * median:
                return Verdict("spike", f"loss {loss:.4g} > {self.spike_factor:g} x running median {median:.4g}")
        return Verdict()

    def accept(self, values: Sequence[float]) -> None:
        """Record an applied step's loss in the spike window."""
        if self.check_spike and len(values) > 1 and math.isfinite(values[1]):
            self.history.append(values[1])

    def samples_of(self, iteration: int) -> tuple[int, int]:
        """[first, stop) positions of iteration ``iteration``'s global batch in the training sample order."""
        first = (iteration - 1) * self.global_batch_size
        return first, first + self.global_batch_size

    def conclude(self, iteration: int, first: Verdict, second: Verdict, first_loss_bad: torch.Tensor,
                 rerun_grads_bad: Optional[torch.Tensor], local_loss: torch.Tensor) -> RerunOutcome:
        """Classify the fault after the re-run and place it (one all-gather over the world, all ranks)."""
        flags = torch.stack([first_loss_bad.float().reshape(()),
                             (rerun_grads_bad if rerun_grads_bad is not None
                              else torch.zeros((), device=first_loss_bad.device)).float().reshape(()),
                             local_loss.detach().float().reshape(())])
        table = [flags.tolist()]
        if self.ctx.world_size > 1 and dist.is_initialized():
            rows = [torch.empty_like(flags) for _ in range(self.ctx.world_size)]
            dist.all_gather(rows, flags)
            table = torch.stack(rows).tolist()
        rank = _first_rank(table, first.reason)
        result = "transient" if second.ok else "persistent"
        if result == "transient":
            action = "continued"
        else:
            action = "skipped" if self.persistent_action == "skip" else "stopped"
        return RerunOutcome(iteration, first.reason, result, action, rank, first.detail, self.samples_of(iteration))


def _first_rank(table: Sequence[Sequence[float]], reason: Optional[str]) -> Optional[int]:
    """The rank to name: first with a non-finite own loss, else first with non-finite own gradients in the
    re-run; for a spike, the rank with the largest share of the loss."""
    if reason == "spike":
        finite = [(row[2], r) for r, row in enumerate(table) if math.isfinite(row[2])]
        return max(finite)[1] if finite else None
    for column in (0, 1):
        for r, row in enumerate(table):
            if row[column] > 0:
                return r
    return None


def nonfinite_on_any_rank(tensors: Sequence[torch.Tensor], ctx: ParallelContext) -> torch.Tensor:
    """Whether any rank's ``tensors`` hold a NaN/inf: a 0-d float tensor, 1.0 or 0.0, the same on every rank.

    Used for what no global norm sees whole: a ZeRO-2/3 rank's gradient shard and own loss (the
    gradient norm counts only some of the elements), and the weights at the end of a run. Each rank
    reads its tensors once (their max-abs, which a NaN or inf survives, without a copy of the
    tensors), and the flag is maximised over the world: it holds every data-parallel group, dense
    and expert, and every rank must take the same decision (skip or re-run) to stay in step. No host sync.
    """
    tensors = [t.detach() for t in tensors if t.numel() > 0]
    device = tensors[0].device if tensors else ctx.device
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    if tensors:
        peaks = torch.stack([m.float() for m in torch._foreach_norm(tensors, float("inf"))])
        flag = (~torch.isfinite(peaks)).any().float().reshape(1)
    if ctx.world_size > 1 and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag[0]


def local_nonfinite(loss_sum: torch.Tensor, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether this rank's own loss or gradient views hold a NaN/inf (a 0-d bool tensor, no sync)."""
    flags = [~torch.isfinite(loss_sum.detach().float()).all()]
    flags += [~torch.isfinite(g).all() for g in grads if g.numel() > 0]
    return torch.stack(flags).any()
