"""Bytes per parameter of weights, gradients and optimizer state (what docs/parallelism-data.md tabulates).

With bf16 weights and fp32 gradients the distributed optimizer needs
2 + 4 + 12/DP bytes per parameter on the device (6 + 12/DP); without it 18.
With fp32 weights the masters are the weights themselves, so the state is Adam's
two moments (8 bytes). CPU offload moves the given fraction of the state to the host.
"""

from __future__ import annotations

from dataclasses import dataclass


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
                        offload_fraction: float = 0.0) -> BytesPerParameter:
    """Per-parameter memory with ``weight_bytes``-byte weights, ``grad_bytes``-byte main gradients,
    optimizer state split over ``state_shards`` ranks (the data-parallel size with
    ``--use-distributed-optimizer``, else 1) and ``offload_fraction`` of it on the host."""
    if state_shards < 1:
        raise ValueError(f"state_shards must be >= 1 (got {state_shards})")
    state = (8.0 if weight_bytes == 4 else 12.0) / state_shards  # fp32 masters (unless the weights) + m + v
    return BytesPerParameter(float(weight_bytes), float(grad_bytes), state * (1.0 - offload_fraction),
                             state * offload_fraction)
