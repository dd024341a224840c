"""The communication profile: interval arithmetic, NCCL kernel classification, and the bench flag."""

from __future__ import annotations

import json

import pytest

from meshtron.bench import bench_main
from meshtron.profiling import (CommunicationProfile, collective_kind, exposed_length, gpu_kernels,
                                merge_intervals, total_length)


def test_merge_and_total_length():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (7, 8), (4, 4)]) == [(0, 3), (5, 8)]
    assert total_length([(0, 2), (1, 3), (10, 11)]) == 4


@pytest.mark.parametrize("comm,compute,want", [
    ([(0, 10)], [], 10),  # nothing to hide behind
    ([(0, 10)], [(0, 10)], 0),  # fully overlapped
    ([(0, 10)], [(2, 4), (3, 5), (8, 20)], 5),  # covered 2-5 and 8-10
    ([(0, 4), (2, 6), (20, 30)], [(5, 25)], 5 + 5),  # merged comm 0-6 (5 exposed) and 20-30 (5 exposed)
])
def test_exposed_length(comm, compute, want):
    assert exposed_length(comm, compute) == pytest.approx(want)


def test_collective_kinds_from_nccl_kernel_names():
    assert collective_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all_gather"
    assert collective_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...)") == "reduce_scatter"
    assert collective_kind("ncclKernel_AllReduce_RING_LL_Sum_bf16") == "all_reduce"
    assert collective_kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "send_recv"
    assert collective_kind("sm90_xmma_gemm_bf16bf16_bf16f32") is None
    assert collective_kind("triton_poi_fused_add_mul_0") is None


def test_profile_from_kernels_in_microseconds():
    kernels = [("gemm", 0, 100), ("ncclDevKernel_AllGather_RING", 50, 150), ("flash_fwd", 150, 200),
               ("ncclDevKernel_SendRecv", 300, 340)]
    prof = CommunicationProfile.from_kernels(kernels)
    assert prof.compute_s == pytest.approx(150e-6)
    assert prof.comm_s == pytest.approx(140e-6)
    assert prof.exposed_comm_s == pytest.approx(50e-6 + 40e-6)  # 100-150 and the whole SendRecv
    assert prof.by_kind_s == {"all_gather": pytest.approx(100e-6), "send_recv": pytest.approx(40e-6)}


def test_gpu_kernels_skip_annotations_and_host_events():
    """GPU-side copies of record_function ranges (nccl:all_to_all spans its kernel, a compiled region's
    range spans everything) must not count as kernels, or every NCCL kernel looks hidden by "compute"."""
    from types import SimpleNamespace as Event

    def event(name, start, end, device="cuda", annotation=False):
        return Event(name=name, time_range=Event(start=start, end=end), device_type=device,
                     is_user_annotation=annotation)

    events = [event("ncclDevKernel_SendRecv", 0, 10), event("nccl:all_to_all", 0, 12, annotation=True),
              event("CompiledFunction", 0, 100, annotation=True), event("sm90_gemm", 10, 30),
              event("aten::mm", 0, 40, device="cpu")]
    kernels = gpu_kernels(events, "cuda")
    assert kernels == [("ncclDevKernel_SendRecv", 0, 10), ("sm90_gemm", 10, 30)]
    profile = CommunicationProfile.from_kernels(kernels)
    assert profile.by_kind_s == {"send_recv": 10e-6} and profile.exposed_comm_s == pytest.approx(10e-6)


def test_bench_profile_comm_flag_on_cpu(tmp_path):
    """Without CUDA the profile is empty (no GPU kernels), but the row carries the fields."""
    out = tmp_path / "rows.jsonl"
    assert bench_main(["--model", "tiny", "--vocab-size", "300", "--device", "cpu", "--seq-length", "16",
                       "--micro-batch-size", "2", "--global-batch-size", "2", "--warmup", "1", "--steps", "1",
                       "--no-split", "--profile-comm", "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["comm_kernel_s"] == 0 and row["exposed_comm_kernel_s"] == 0 and row["comm_by_kind_s"] == {}
