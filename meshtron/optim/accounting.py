"""Bytes per parameter of weights, gradients and optimizer state (what docs/parallelism-data.md tabulates).

With bf16 weights and fp32 gradients the distributed optimizer needs
2 + 4 + 12/DP bytes per parameter on the device (6 + 12/DP); without it 18.
With fp32 weights the masters are the weights themselves, so the state is Adam's
two moments (8 bytes). CPU offload moves the given fraction of the state to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import SHARDING_STRATEGIES
from meshtron.run_layout import sharding_strategy  # noqa: F401 (re-exported: the rule lives in run_layout)
from meshtron.run_layout import shards_gradients, shards_state, shards_weights


@dataclass(frozen=True)
class BytesPerParameter:
    """Device and host bytes per parameter of one rank."""

    weights: float
    gradients: float
    optimizer_device: float
    optimizer_host: float

    @property
    def device_total(self) -> float:
        return self.weights + self.gradients + self.optimizer_device


def bytes_per_parameter(weight_bytes: int = 2, grad_bytes: int = 4, state_shards: int = 1,
                        offload_fraction: float = 0.0, moment_bytes: float = 8.0) -> BytesPerParameter:
    """Per-parameter memory with ``weight_bytes``-byte weights, ``grad_bytes``-byte main gradients,
    optimizer state split over ``state_shards`` ranks (the data-parallel size with
    ``--use-distributed-optimizer``, else 1), ``offload_fraction`` of it on the host, and Adam's two
    moments in ``moment_bytes`` together (8 in fp32; 4 in bf16 with --use-precision-aware-optimizer)."""
    if state_shards < 1:
        raise ValueError(f"state_shards must be >= 1 (got {state_shards})")
    state = (moment_bytes + (0.0 if weight_bytes == 4 else 4.0)) / state_shards  # fp32 masters unless the weights
    return BytesPerParameter(float(weight_bytes), float(grad_bytes), state * (1.0 - offload_fraction),
                             state * offload_fraction)


def releases_gradients(name: str, release_grad_buffer: bool) -> bool:
    """Whether strategy ``name`` frees its gradient buffer between steps (``--release-grad-buffer``; the
    strategies with a full gradient buffer, ``no_shard`` and ``optim``)."""
    return release_grad_buffer and not shards_gradients(name)


def strategy_bytes_per_parameter(strategy: str, weight_bytes: int = 2, grad_bytes: int = 4, dp: int = 1,
                                 offload_fraction: float = 0.0, moment_bytes: float = 8.0) -> BytesPerParameter:
    """Per-parameter device memory of ``strategy`` over ``dp`` data-parallel ranks (DP x CP), between steps.

    ``optim_grads`` keeps the full weights plus the compact copy of its shard that the optimizer writes
    (weight_bytes x (1 + 1/DP)) and fp32 gradient shards (4/DP; the reduction's temporary buckets come and
    go within backward); ``optim_grads_params`` keeps weight and gradient shards only (one unit's
    weights are gathered while it runs)."""
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r} (valid: {', '.join(SHARDING_STRATEGIES)})")
    shards = dp if shards_state(strategy) else 1
    base = bytes_per_parameter(weight_bytes, grad_bytes, shards, offload_fraction, moment_bytes)
    if not shards_gradients(strategy):
        return base
    weights = weight_bytes / dp if shards_weights(strategy) else weight_bytes * (1.0 + 1.0 / dp)
    return BytesPerParameter(float(weights), 4.0 / dp, base.optimizer_device, base.optimizer_host)
