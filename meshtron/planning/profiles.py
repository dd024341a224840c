"""Device profiles: the rates the step-time model (:mod:`meshtron.planning.step_time`) runs on.

A profile holds a handful of physically meaningful rates and efficiencies of one GPU kind and its
links, not a table of measured rows. ``meshtron plan --calibrate`` measures one on the local device
(:mod:`meshtron.planning.calibrate`) and writes it as JSON; ``--profile FILE`` reads such a file and
``--gpu H100|H200|B200`` picks a built-in one. Where each built-in constant comes from is in
:data:`SOURCES` (and docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional

from meshtron.errors import ConfigError


@dataclass(frozen=True)
class DeviceProfile:
    """Rates of one GPU kind, its node's links and the network between nodes.

    Matmul rate of one GEMM of ``F`` FLOPs: ``matmul_tflops * F / (F + matmul_half_gflop * 1e9)``
    (small GEMMs do not fill the device); FP8 linears run ``fp8_matmul_speedup`` times faster.
    Memory-bound kernels move their bytes at ``hbm_gbps * hbm_efficiency``. Collectives run at
    ``nvlink_gbps`` (bus bandwidth per GPU) inside a node and ``network_gbps`` across nodes, each
    call paying ``collective_latency_us``.
    """

    name: str
    memory_gib: float  # device memory the allocator can hand out
    matmul_tflops: float  # large dense bf16 GEMM, achieved
    matmul_half_gflop: float  # GEMM size (GFLOP) at which the achieved rate is half of matmul_tflops
    fp8_matmul_speedup: float  # FP8 linear GEMMs over bf16 (scaled matmul, achieved)
    attention_tflops: float  # causal flash attention, useful FLOPs per second at long sequences
    attention_half_seq: float  # sequence (per CP rank) at which the attention rate is half of attention_tflops
    hbm_gbps: float  # HBM bandwidth (GB/s, 1e9)
    hbm_efficiency: float  # achieved fraction of it by the memory-bound kernels of a layer
    eager_elementwise_factor: float  # memory traffic without torch.compile over compiled (unfused kernels)
    layer_overhead_us: float  # fixed time per layer per micro-batch (forward + backward): launches, small ops
    step_overhead_ms: float  # fixed time per step (optimizer launches, loss bookkeeping, host work)
    optimizer_bytes_per_param: float  # HBM bytes the optimizer step moves per parameter of this rank's shard
    moe_gemm_efficiency: float  # grouped expert GEMMs and token permutation over dense GEMMs of the same size
    nvlink_gbps: float  # collective bus bandwidth per GPU inside a node (GB/s)
    network_gbps: float  # collective bus bandwidth per GPU across nodes (GB/s)
    collective_latency_us: float  # fixed cost of one collective call
    overlap_cost: float  # share of an overlapped collective's time that still slows the compute it hides behind
    async_tp_hidden: float  # share of the forward sequence-parallel communication that --async-tensor-parallel hides
    pcie_gbps: float = 55.0  # host-device copies per direction (GB/s): --offload-activations
    # attention_tflops and attention_half_seq at head dim 64 (0: the same as at 128; step_time.attention_rate)
    attention_tflops_d64: float = 0.0
    attention_half_seq_d64: float = 0.0
    source: str = ""  # where the numbers come from
    extra: dict = field(default_factory=dict)  # what a calibration measured (GEMM sizes and rates, ...)

    def as_dict(self) -> dict:
        """The profile as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def with_(self, **changes) -> "DeviceProfile":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name for f in dataclasses.fields(DeviceProfile)}

#: Fitted to benchmarks/measured.jsonl (one and two H200 SXM, NVLink) by ``python -m meshtron.planning.fit``;
#: the rest from measurements named in SOURCES.
H200 = DeviceProfile(
    name="H200", memory_gib=139.8, matmul_tflops=741.0, matmul_half_gflop=6.12, fp8_matmul_speedup=1.775,
    attention_tflops=560.0, attention_half_seq=2300.0, attention_tflops_d64=430.0, attention_half_seq_d64=700.0,
    hbm_gbps=4800.0, hbm_efficiency=0.74,
    eager_elementwise_factor=3.37, layer_overhead_us=760.0, step_overhead_ms=17.0,
    optimizer_bytes_per_param=18.3, moe_gemm_efficiency=0.6375, nvlink_gbps=290.0, network_gbps=40.0,
    collective_latency_us=20.0, overlap_cost=0.8, async_tp_hidden=0.0,
    source="fitted to benchmarks/measured.jsonl (H200 SXM); matmul from meshtron doctor")

SOURCES: dict[str, str] = {
    "matmul_tflops": "H200/H100: 741 TFLOP/s, the dense bf16 GEMM `meshtron doctor` measured on one H200 (75% of the "
                     "989 TFLOP/s datasheet peak; the H100 SXM has the same GH100 compute); B200: the same 75% of "
                     "its 2,250 TFLOP/s dense bf16 datasheet peak",
    "fp8_matmul_speedup": "fitted to the FP8 rows of measured.jsonl (1.6-1.9x in practice on H100/H200)",
    "hbm_gbps": "datasheets: H200 4.8 TB/s, H100 SXM 3.35 TB/s, B200 8 TB/s",
    "nvlink_gbps": "NVLink 4 (H100/H200): 450 GB/s per direction, ~80% as NCCL bus bandwidth; NVLink 5 (B200) twice",
    "network_gbps": "one 400 Gb/s NDR InfiniBand NIC per GPU: 50 GB/s, ~80% achieved",
    "pcie_gbps": "PCIe 5 x16 between an H100/H200/B200 SXM and its host: 64 GB/s per direction, ~55 achieved by "
                 "pinned copies",
    "memory_gib": "nvidia-smi totals: H200 143,771 MiB, H100 81,559 MiB, B200 183,359 MiB, less ~0.6 GiB of CUDA context",
    "attention_tflops_d64": "head dim 64 (llama3-1b): the ceiling from the quadratic part of h152-h154 (one H100, "
                            "1 x 64K-128K tokens: 417 TFLOP/s counted like the model), the half-way sequence such "
                            "that the 4,096-token llama3-1b rows stay as predicted (cuDNN at 4,096: 1.36 ms forward, "
                            "4.0 ms backward per layer, docs/benchmarks.md)",
    "other": "attention rate, HBM efficiency, overheads, optimizer bytes, MoE and eager factors: fitted to "
             "measured.jsonl on H200 and assumed the same on the other GPUs",
}

H100 = H200.with_(name="H100", memory_gib=79.0, hbm_gbps=3350.0,
                  source="H200 fit with the H100 SXM's memory size and bandwidth (same compute and NVLink)")
B200 = H200.with_(name="B200", memory_gib=178.5, matmul_tflops=1687.0, attention_tflops=H200.attention_tflops * 2250 / 989,
                  attention_tflops_d64=H200.attention_tflops_d64 * 2250 / 989,
                  hbm_gbps=8000.0, nvlink_gbps=720.0, network_gbps=40.0,
                  source="published B200 peaks at the H200's fitted efficiencies (not measured)")

BUILTIN: dict[str, DeviceProfile] = {"H100": H100, "H200": H200, "B200": B200}


def builtin_profile(name: str) -> DeviceProfile:
    """A built-in profile by GPU name (``--gpu``); ConfigError naming the flag otherwise."""
    key = name.upper()
    if key not in BUILTIN:
        raise ConfigError(f"--gpu {name!r}: built-in profiles are {', '.join(BUILTIN)} (or give --profile FILE)")
    return BUILTIN[key]


def profile_from_dict(data: dict, origin: str = "--profile") -> DeviceProfile:
    """A profile from a dict (a calibration file): missing rates come from the H200 profile."""
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ConfigError(f"{origin}: unknown profile fields {unknown}; known: {sorted(_FIELDS)}")
    merged = {**H200.as_dict(), **data}
    for key, value in merged.items():
        if key not in ("name", "source", "extra") and not (isinstance(value, (int, float)) and value >= 0):
            raise ConfigError(f"{origin}: profile field {key} must be a non-negative number, got {value!r}")
    return DeviceProfile(**merged)


def load_profile(path: str) -> DeviceProfile:
    """Read a profile JSON file (``--profile FILE``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--profile {path}: cannot read a JSON profile ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--profile {path}: expected a JSON object")
    return profile_from_dict(data, f"--profile {path}")


def save_profile(profile: DeviceProfile, path: str) -> None:
    """Write ``profile`` as JSON (what ``--calibrate --out`` does)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.as_dict(), f, indent=2, sort_keys=True)
        f.write("\n")


def choose_profile(gpu: Optional[str], path: Optional[str]) -> DeviceProfile:
    """``--profile FILE`` if given, else ``--gpu NAME`` (default H100, the guide's GPU)."""
    if gpu and path:
        raise ConfigError("give either --gpu or --profile, not both")
    if path:
        return load_profile(path)
    return builtin_profile(gpu or "H100")
