"""``meshtron plan --calibrate [--out FILE]``: measure this device's rates into a profile.

Measures, on the first CUDA device (or the CPU, with small shapes, so that it runs anywhere):

- dense GEMMs of several sizes (bf16 on CUDA, fp32 on the CPU), fitted to the profile's
  ``rate = matmul_tflops * F / (F + matmul_half_gflop)`` by least squares of ``1/rate`` on ``1/F``;
- FP8 scaled GEMMs where the device has them (compute capability 8.9+): ``fp8_matmul_speedup``;
- causal scaled-dot-product attention at several sequence lengths, fitted the same way to
  ``attention_tflops * s / (s + attention_half_seq)``, at head dim 128 and at head dim 64 (``_d64``);
- a large copy: the memory bandwidth ``hbm_gbps``; the layers' share of it (``hbm_efficiency``) keeps
  the H200 fit's ratio to a plain copy;
- copies between the device and pinned host memory, each way (CUDA only): ``pcie_gbps`` as the slower
  direction (``--offload-activations`` copies out in the forward and back in the backward);
- an all-reduce over the process group when one is initialised with more than one rank (``torchrun
  ... meshtron plan --calibrate``): ``nvlink_gbps`` as bus bandwidth; skipped with one rank.

Overheads, optimizer bytes and the MoE, eager and overlap factors are not measurable in isolation
and stay those of the H200 fit. The JSON written is what ``--profile FILE`` reads.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Callable, Optional, Sequence

import torch

from meshtron.planning.profiles import H200, DeviceProfile, save_profile

#: A plain device-to-device copy on one H200 (the guidance's ~4.2 TB/s): the layers' memory-bound
#: kernels reached hbm_efficiency x 4.8 TB/s, i.e. this share of a copy.
H200_COPY_GBPS = 4200.0


def _timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def fit_saturating(sizes: Sequence[float], rates: Sequence[float]) -> tuple[float, float]:
    """(peak, half) of ``rate = peak * x / (x + half)`` by least squares of ``1/rate = 1/peak + half/(peak x)``."""
    xs = [1.0 / s for s in sizes]
    ys = [1.0 / r for r in rates]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    intercept = my - slope * mx
    if intercept <= 0:  # the largest size is not yet saturated: take its rate as the peak
        return max(rates), 0.0
    peak = 1.0 / intercept
    return peak, max(0.0, slope * peak)


def measure_matmul(device: torch.device, dims: Sequence[int], dtype: torch.dtype, repeat: int) -> list[dict]:
    """Rates (TFLOP/s) of square GEMMs ``n x n x n``."""
    rows = []
    for n in dims:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = _timed(lambda: a @ b, device, repeat)
        rows.append({"n": n, "gflop": 2 * n**3 / 1e9, "tflops": 2 * n**3 / seconds / 1e12})
    return rows


def measure_fp8_speedup(device: torch.device, n: int, repeat: int) -> Optional[float]:
    """FP8 over bf16 GEMM rate at ``n x n x n``, or None where the device has no FP8 GEMM."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    fp8 = _timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device, repeat)
    bf16 = _timed(lambda: a @ b, device, repeat)
    return bf16 / fp8


def measure_attention(device: torch.device, seqs: Sequence[int], heads: int, dim: int, dtype: torch.dtype,
                      repeat: int) -> list[dict]:
    """Causal attention forward + backward rates (useful TFLOP/s, the model's FLOP count)."""
    import torch.nn.functional as F

    rows = []
    for s in seqs:
        q, k, v = (torch.randn(1, heads, s, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        seconds = _timed(step, device, repeat)
        flops = (1 + 2.5) * s * s * heads * 2 * dim  # causal forward s^2 * heads * (d_qk + d_v), backward 2.5x
        rows.append({"seq": s, "tflops": flops / seconds / 1e12})
    return rows


def measure_bandwidth(device: torch.device, numel: int, repeat: int) -> float:
    """GB/s of a copy (read + write) of ``numel`` bf16/fp32 elements."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    src = torch.empty(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, repeat)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def measure_host_copies(device: torch.device, numel: int, repeat: int) -> dict[str, float]:
    """GB/s of copies of ``numel`` bf16 elements to pinned host memory and back (CUDA only)."""
    src = torch.empty(numel, device=device, dtype=torch.bfloat16)
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    nbytes = numel * 2
    out = _timed(lambda: host.copy_(src, non_blocking=True), device, repeat)
    back = _timed(lambda: src.copy_(host, non_blocking=True), device, repeat)
    return {"to_host_gbps": nbytes / out / 1e9, "to_device_gbps": nbytes / back / 1e9}


def measure_allreduce(device: torch.device, numel: int, repeat: int) -> Optional[float]:
    """All-reduce bus bandwidth (GB/s) over the default group, or None without one of 2+ ranks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    n = dist.get_world_size()
    buf = torch.ones(numel, device=device, dtype=torch.bfloat16)
    seconds = _timed(lambda: dist.all_reduce(buf), device, repeat)
    return 2 * (n - 1) / n * buf.numel() * buf.element_size() / seconds / 1e9


def calibrate(device: Optional[torch.device] = None, quick: Optional[bool] = None) -> DeviceProfile:
    """Measure ``device`` (default: the first CUDA device, else the CPU) into a profile."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gpu = device.type == "cuda"
    quick = (not gpu) if quick is None else quick
    dtype = torch.bfloat16 if gpu else torch.float32
    repeat = 3 if quick else 10
    dims = (64, 128, 256) if quick else (512, 1024, 2048, 4096, 8192)
    matmul = measure_matmul(device, dims, dtype, repeat)
    peak, half = fit_saturating([r["gflop"] for r in matmul], [r["tflops"] for r in matmul])
    seqs = (128, 256) if quick else (1024, 2048, 4096, 8192, 16384)
    attention = measure_attention(device, seqs, 4 if quick else 32, 64 if quick else 128, dtype, repeat)
    attn_peak, attn_half = fit_saturating([r["seq"] for r in attention], [r["tflops"] for r in attention])
    # Head dim 64 at the same width (twice the heads): its own ceiling and half-way sequence (step_time.attention_rate).
    attention64 = attention if quick else measure_attention(device, seqs, 64, 64, dtype, repeat)
    peak64, half64 = fit_saturating([r["seq"] for r in attention64], [r["tflops"] for r in attention64])
    bandwidth = measure_bandwidth(device, 2**20 if quick else 2**30, repeat)
    fp8 = measure_fp8_speedup(device, 8192, repeat) if gpu and not quick else None
    allreduce = measure_allreduce(device, 2**26, repeat) if gpu else None
    host_copies = measure_host_copies(device, 2**29, repeat) if gpu else None
    if gpu:
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, props.total_memory / 2**30 - 0.6
    else:
        name = platform.processor() or platform.machine() or "cpu"
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    changes = dict(name=name, memory_gib=memory, matmul_tflops=peak, matmul_half_gflop=half,
                   attention_tflops=attn_peak, attention_half_seq=attn_half, attention_tflops_d64=peak64,
                   attention_half_seq_d64=half64, hbm_gbps=bandwidth,
                   hbm_efficiency=min(1.0, H200.hbm_efficiency * H200.hbm_gbps / H200_COPY_GBPS),
                   source=f"meshtron plan --calibrate on {name} ({'CUDA' if gpu else 'CPU'}, torch {torch.__version__})"
                          "; overheads and MoE/eager/overlap factors from the H200 fit",
                   extra={"matmul": matmul, "attention": attention, "attention_d64": attention64,
                          "copy_gbps": bandwidth,
                          "allreduce_busbw_gbps": allreduce, "fp8_matmul_speedup": fp8, "host_copies": host_copies})
    if fp8 is not None:
        changes["fp8_matmul_speedup"] = fp8
    if allreduce is not None:
        changes["nvlink_gbps"] = allreduce
    if host_copies is not None:
        changes["pcie_gbps"] = min(host_copies.values())
    return H200.with_(**changes)


def calibrate_main(out: Optional[str], as_json: bool = False) -> int:
    """``meshtron plan --calibrate``: measure, then write ``out`` (or print the JSON)."""
    profile = calibrate()
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        save_profile(profile, out)
    if as_json or not out:
        print(json.dumps(profile.as_dict(), indent=2, sort_keys=True))
    else:
        print(f"{profile.name}: matmul {profile.matmul_tflops:.1f} TFLOP/s (half rate at {profile.matmul_half_gflop:.2f} "
              f"GFLOP), attention {profile.attention_tflops:.1f} TFLOP/s, copy {profile.hbm_gbps:.0f} GB/s, "
              f"all-reduce {profile.extra.get('allreduce_busbw_gbps') or 'not measured (one rank)'}; wrote {out}")
    return 0
