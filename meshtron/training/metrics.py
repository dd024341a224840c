"""Model FLOPs, peak device throughput, MFU and peak memory.

Convention (docs/metrics.md, DESIGN section 7): a training token costs
``6*N + 12*L*A*S`` model FLOPs, where N is the number of matmul weights the
token passes through (attention q/k/v/o with grouped-query sizes, the MLP or
the router plus the top-k and shared experts, and the output layer; not the
input embedding lookup, norms or biases), L the number of layers, A the width
of the attention (query heads x head dim, which is the hidden size for every
preset), and S the full training sequence length. The attention term is not
halved for the causal mask (the PaLM / Megatron-Core r0.8 / torchtitan
convention). Recomputed work is never counted as useful work, so MFU does not
rise when activation recomputation is switched on.

MFU = achieved model FLOP/s per GPU / the device's dense bf16 peak. FP8 runs
are reported against the same bf16 peak.
"""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from meshtron.config import ConfigError, ModelConfig
from meshtron.layer_kinds.pattern import layer_kinds
from meshtron.presets import count_parameters

#: Dense (no structured sparsity) bf16 tensor-core peaks in TFLOP/s, matched against
#: ``torch.cuda.get_device_name()`` by substring, first match wins (so the more specific
#: names come first). All values are from NVIDIA's datasheets, where the headline figure is
#: quoted "with sparsity" and the dense peak is half of it.
PEAK_BF16_TFLOPS: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756.0, "datasheet: H100 PCIe, 1,513 TFLOP/s with sparsity"),
    ("H100 NVL", 835.5, "datasheet: H100 NVL, 1,671 TFLOP/s with sparsity"),
    ("H200 NVL", 835.5, "datasheet: H200 NVL, 1,671 TFLOP/s with sparsity"),
    ("GH200", 989.4, "datasheet: GH200 (H100 SXM compute), 1,979 TFLOP/s with sparsity"),
    ("H100", 989.4, "datasheet: H100 SXM5, 1,979 TFLOP/s with sparsity"),
    ("H200", 989.4, "datasheet: H200 SXM, 1,979 TFLOP/s with sparsity"),
    ("H800", 989.4, "datasheet: H800 SXM, same tensor cores as H100 SXM"),
    ("GB200", 2500.0, "datasheet: GB200 NVL72, 5 PFLOP/s per GPU with sparsity"),
    ("B200", 2250.0, "datasheet: HGX B200, 4.5 PFLOP/s with sparsity"),
    ("A100", 312.0, "datasheet: A100, 624 TFLOP/s with sparsity"),
    ("L40S", 362.05, "datasheet: L40S, 733 TFLOP/s with sparsity"),
)


def flops_per_token(model_cfg: ModelConfig, vocab_size: int) -> float:
    """Training model FLOPs per token: ``6*N + 6*L*S*heads*(d_qk + d_v)`` (forward + backward, no recomputation).

    ``vocab_size`` is the tokenizer's (unpadded) vocabulary: the padding rows that make the
    output layer divisible by ``--make-vocab-size-divisible-by`` x TP are not useful work.
    The second term is the scores (query/key head dim ``d_qk``) and the weighted values (``d_v``);
    with equal head dims ``d`` it is DESIGN.md's ``12*L*A*S``, ``A`` = heads x d. Each layer's mixer kind gives
    its own (:meth:`meshtron.layer_kinds.MixerKind.sequence_flops_per_token`; multi-latent attention has
    d_qk = --qk-head-dim + --qk-pos-emb-head-dim and d_v = --v-head-dim). Multi-token prediction adds per depth
    one layer (of the last layer's kinds), its projection [2H -> H] and the output layer again.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    n_matmul = count_parameters(model_cfg, vocab_size)["matmul"]
    kinds = layer_kinds(model_cfg)
    kinds += kinds[-1:] * (model_cfg.mtp_num_layers or 0)  # a prediction depth's layer attends too
    sequence = sum(k.mixer.sequence_flops_per_token(model_cfg, model_cfg.seq_length) for k in kinds)
    return float(6 * n_matmul + 3 * sequence)  # forward + backward: three times the forward


def peak_tflops_for_name(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a CUDA device by its name, or None when it is not in the table."""
    for key, tflops, _source in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """Peak dense bf16 TFLOP/s of ``device``: ``override`` (``--peak-tflops``) wins, else the table.

    Returns None on a CPU or an unknown GPU without an override; MFU is then reported as null.
    """
    if override is not None:
        if not math.isfinite(override) or override <= 0:
            raise ConfigError(f"--peak-tflops must be a positive number of TFLOP/s, got {override}")
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops_for_name(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class Throughput:
    """Per-GPU speed of one training step (or the mean over a logging interval)."""

    tokens_per_sec_per_gpu: float
    tflops_per_gpu: float
    mfu: Optional[float]  # a fraction (0.563 means 56.3%); None without a known peak


def compute_throughput(tokens_per_iteration: int, world_size: int, step_time_s: float,
                       model_flops_per_token: float, peak: Optional[float]) -> Throughput:
    """Tokens/s/GPU, model TFLOP/s/GPU and MFU from one iteration's global token count and time.

    ``tokens_per_iteration`` is global batch x sequence length (all data-parallel ranks);
    it is divided over every GPU of the job, model-parallel ones included (Megatron's
    per-GPU convention).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not step_time_s > 0:
        raise ValueError(f"step_time_s must be positive, got {step_time_s}")
    tok_s = tokens_per_iteration / (world_size * step_time_s)
    tflops = tok_s * model_flops_per_token / 1e12
    mfu = tflops / peak if peak else None
    return Throughput(tokens_per_sec_per_gpu=tok_s, tflops_per_gpu=tflops, mfu=mfu)


class ThroughputMeter:
    """Holds a run's constants and turns a measured step time into :class:`Throughput`.

    ``measure(elapsed_s, iterations)`` takes the wall time of ``iterations`` consecutive
    steps (e.g. one logging interval), so the mean step time is what gets reported.
    """

    def __init__(self, model_cfg: ModelConfig, vocab_size: int, global_batch_size: int, world_size: int,
                 peak: Optional[float]) -> None:
        self.flops_per_token = flops_per_token(model_cfg, vocab_size)
        self.tokens_per_iteration = global_batch_size * model_cfg.seq_length
        self.world_size = world_size
        self.peak = peak

    def measure(self, elapsed_s: float, iterations: int = 1) -> Throughput:
        """Throughput of ``iterations`` steps that took ``elapsed_s`` seconds in total."""
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        return compute_throughput(self.tokens_per_iteration, self.world_size, elapsed_s / iterations,
                                  self.flops_per_token, self.peak)


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows (the metrics file then writes null + nonfinite)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def peak_memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset, in GiB, as metrics-record fields.

    On CUDA, ``peak_mem_gib`` is the peak of live tensors (``max_memory_allocated``: Megatron's
    "max allocated", and what the memory estimate predicts) and ``peak_mem_reserved_gib`` the
    caching allocator's peak reserved memory (what the process took from the device, what
    decides an out-of-memory error, and what torchtitan prints as its memory).
    On a CPU, ``peak_mem_gib`` is the process's peak resident set size.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_mem_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
    return {"peak_mem_gib": rss_bytes / 2**30}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; a process's peak RSS cannot be reset)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
