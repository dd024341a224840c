"""MoE on CUDA: the grouped-GEMM experts (bf16) equal the expert loop, also with empty and odd-sized
groups; expert parallelism over NCCL equals one GPU. Needs CUDA (two devices for NCCL)."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtron.layers.moe.experts import GroupedExperts
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from test_expert_parallel import cfg_a, cfg_b, check_layouts, layouts_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_bf16_matches_expert_loop(bias):
    cfg = cfg_a()
    cfg.hidden_size, cfg.disable_bias_linear = 256, not bias
    dev = torch.device("cuda")
    modules = []
    for grouped in (False, True):
        with torch.device("meta"):
            m = GroupedExperts(cfg, ParallelContext(device=dev), "layers.0.mlp.experts", 0, 8, 512, grouped=grouped)
        initialize_parameters(m, 3, dev, torch.bfloat16)
        modules.append(m)
    counts = torch.tensor([0, 17, 1, 64, 0, 33, 5, 200], device=dev)  # empty and unaligned groups
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(int(counts.sum()), 256, device=dev, generator=g, dtype=torch.bfloat16)
    grad = torch.randn(x.shape, device=dev, generator=g, dtype=torch.bfloat16)
    outs = []
    for m in modules:
        xi = x.clone().requires_grad_()
        y = m(xi, counts)
        y.backward(grad)
        outs.append([y.float(), xi.grad.float()] + [p.grad.float() for p in m.parameters()])
    for loop, grouped in zip(*outs):
        scale = loop.abs().max().clamp(min=1e-6)
        assert ((grouped - loop).abs().max() / scale).item() < 2e-2


def _nccl_worker(rank: int, world: int, port: int, out_dir: str, layouts: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        result = ("ok", layouts_worker(rank, world, layouts, dev))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_expert_parallel_over_nccl_equals_one_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    world = 2
    layouts = [("ep2-a", cfg_a, 1, 1, 2, False), ("ep2-b", cfg_b, 1, 1, 2, False)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_nccl_worker, args=(r, world, port, out_dir, layouts)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not hung, f"ranks {hung} hung"
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            assert status == "ok", value
            results.append(value)
    check_layouts(results, layouts, world, torch.device("cuda", 0))
