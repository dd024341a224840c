"""The staged group (ranks sharing a GPU, collectives through host memory) gives what gloo gives, for every
operation meshtron uses; on CPU here, on one GPU in the GPU suite (tests marked gpu that run several ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tests.distributed.launch import run_distributed
from tests.distributed.staged_group import BACKEND as STAGED


def _exercise(rank: int, world: int, device: str, group, sub) -> dict:
    dev = torch.device(device, rank % max(1, torch.cuda.device_count())) if device == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(rank)
    out = {}
    x = torch.randn(6, 4, generator=g).to(dev)
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        dist.all_reduce(y, group=group)
        out[f"all_reduce_{dtype}"] = y.float().cpu()
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
    out["all_reduce_max"] = y.cpu()
    gathered = torch.empty(world * 6, 4, device=dev)
    dist.all_gather_into_tensor(gathered, x, group=group)
    out["all_gather_into_tensor"] = gathered.cpu()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    out["all_gather"] = torch.cat(parts).cpu()
    if dist.get_backend(group) == STAGED.lower():  # gloo has no FP8; checked against the fp32 gather below
        gathered8 = torch.empty(world * 6, 4, device=dev, dtype=torch.float8_e4m3fn)
        dist.all_gather_into_tensor(gathered8, x.to(torch.float8_e4m3fn), group=group)
        out["fp8_all_gather"] = gathered8.float().cpu()
    whole = torch.randn(world * 3, 4, generator=g).to(dev)
    mine = torch.empty(3, 4, device=dev)
    dist.reduce_scatter_tensor(mine, whole, group=group)
    out["reduce_scatter_tensor"] = mine.cpu()
    # Uneven all-to-all: rank r sends r + p + 1 rows to peer p.
    send = [r + p + 1 for p in range(world) for r in [rank]]
    recv = [p + rank + 1 for p in range(world)]
    a2a_in = torch.arange(sum(send) * 2, dtype=torch.float32, device=dev).view(-1, 2) + 100 * rank
    a2a_out = torch.empty(sum(recv), 2, device=dev)
    dist.all_to_all_single(a2a_out, a2a_in, recv, send, group=group)
    out["all_to_all_single"] = a2a_out.cpu()
    b = torch.full((3,), float(rank), device=dev)
    dist.broadcast(b, src=world - 1, group=group)
    out["broadcast"] = b.cpu()
    # Point to point both ways at once (each rank posts its receive before its send in one batch).
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(5, device=dev)
    ops = [dist.P2POp(dist.irecv, got, prv, group), dist.P2POp(dist.isend, torch.full((5,), float(rank), device=dev), nxt, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["p2p"] = got.cpu()
    # Functional collectives (what compiled layers call).
    out["funcol_all_gather"] = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group)).cpu()
    out["funcol_reduce_scatter"] = funcol.wait_tensor(
        funcol.reduce_scatter_tensor(whole, "sum", 0, group)).cpu()
    out["funcol_all_reduce"] = funcol.wait_tensor(funcol.all_reduce(x, "sum", group)).cpu()
    if rank in (0, 1):
        z = x.clone()
        dist.all_reduce(z, group=sub)
        out["subgroup_all_reduce"] = z.cpu()
    dist.barrier(group=group)
    return out


def _both(rank: int, world: int, device: str) -> tuple[dict, dict]:
    """The operations on the staged world, then on gloo groups of the same members (on CPU tensors)."""
    staged_sub = dist.new_group([0, 1])
    gloo, gloo_sub = dist.new_group(list(range(world)), backend="gloo"), dist.new_group([0, 1], backend="gloo")
    return (_exercise(rank, world, device, dist.group.WORLD, staged_sub),
            _exercise(rank, world, "cpu", gloo, gloo_sub))


def compare_with_gloo(device: str) -> None:
    world = 3
    results = run_distributed(_both, world, device, backend=STAGED)
    got, want = [r[0] for r in results], [r[1] for r in results]
    for rank in range(world):
        fp8 = got[rank].pop("fp8_all_gather")
        assert torch.equal(fp8, want[rank]["all_gather_into_tensor"].to(torch.float8_e4m3fn).float())
        assert got[rank].keys() == want[rank].keys()
        for key in want[rank]:
            torch.testing.assert_close(got[rank][key], want[rank][key], rtol=0, atol=0,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.slow  # test infrastructure for the GPU suite, where its GPU twin runs
def test_every_operation_equals_gloo_on_cpu():
    compare_with_gloo("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_operation_equals_gloo_with_ranks_sharing_one_gpu():
    compare_with_gloo("cuda")
