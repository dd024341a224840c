"""Data parallelism, the distributed optimizer, overlap and CPU offload train the one-process model.

Each test drives a tiny GPTModel the way the trainer does (per-rank micro-batches cut
from one global batch, loss weight = mask / global mask count, the factory's
gradient buffers, reduction, norm, clipping and optimizer) and compares losses,
gradient norms, weights and optimizer state after a few steps with one process.
Several configurations share one process group to keep the number of spawns low.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.model import GPTModel
from meshtron.optim.clip import clip_coefficient
from meshtron.optim.distributed_optimizer import DistributedOptimizer
from meshtron.optim.factory import build_optimization
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.sharding import gather_canonical, initialize_parameters
from tests.distributed.launch import run_distributed

VOCAB = 100
SEQ = 16
GLOBAL_BATCH = 8
STEPS = 3
LR = 1e-2
SMALL_BUCKET = 1500  # elements: many buckets in the tiny model


def model_cfg(query_groups: int = 2) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                       num_query_groups=query_groups, ffn_hidden_size=64, seq_length=SEQ, normalization="RMSNorm",
                       swiglu=True, position_embedding_type="rope", disable_bias_linear=True, hidden_dropout=0.0,
                       attention_dropout=0.0, untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=8)


def run_cfg(query_groups: int = 2, **parallel) -> MeshtronConfig:
    cfg = MeshtronConfig()
    cfg.model = model_cfg(query_groups)
    cfg.optim.lr = LR
    cfg.optim.weight_decay = 0.1
    cfg.optim.clip_grad = 0.5  # below the first steps' norms: clipping is exercised
    cfg.optim.adam_beta2 = 0.95
    for key, value in parallel.items():
        cfg.set(key, value)
    return cfg


def global_batches():
    g = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=g) > 0.25).float()
        yield tokens, labels, mask


def train(cfg: MeshtronConfig, ctx: ParallelContext, micro_batches: int = 2) -> dict:
    """STEPS training iterations; returns losses, norms, canonical weights and optimizer facts."""
    model = GPTModel(cfg.model, ctx, VOCAB, sequence_parallel=cfg.parallel.sequence_parallel)
    initialize_parameters(model, 7, torch.device("cpu"), torch.float32)
    optim = build_optimization(cfg, ctx, [model])
    per_rank = GLOBAL_BATCH // ctx.dp
    mb = per_rank // micro_batches
    out = {"losses": [], "norms": [], "started_in_backward": []}
    for tokens, labels, mask in global_batches():
        weight = mask / mask.sum()
        rows = slice(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank)
        tokens, labels, weight = tokens[rows], labels[rows], weight[rows]
        optim.grad_buffer.zero()
        total = torch.zeros(())
        for j in range(micro_batches):
            part = slice(j * mb, (j + 1) * mb)
            loss, _ = model(tokens[part], labels=labels[part], loss_weight=weight[part])
            if j == micro_batches - 1:
                optim.grad_sync.start_overlap()
            loss.backward()
            total += loss.detach()
        optim.grad_sync.finish()
        out["started_in_backward"].append(optim.grad_sync.buckets_started_in_backward)
        norm = optim.grad_norm()
        optim.grad_buffer.data.mul_(clip_coefficient(norm, cfg.optim.clip_grad))
        optim.optimizer.step(LR)
        if ctx.dp_cp_group is not None:
            dist.all_reduce(total, group=ctx.dp_cp_group)
        out["losses"].append(total.item())
        out["norms"].append(norm.item())
    opt = optim.optimizer
    if isinstance(opt, DistributedOptimizer):
        opt.finish_param_gather()
        out["local_numel"] = opt.local_numel
        out["state_numel"] = opt.state_numel()
        out["pending_gathers_after_step"] = opt.param_gather.pending
    out["total_numel"] = sum(p.numel() for p in model.parameters())
    out["buckets"] = len(optim.layout.buckets)
    out["weights"] = gather_canonical([model])
    if ctx.tp == 1:  # full optimizer state per parameter (a collective with the distributed optimizer)
        out["state"] = [{k: v.clone() for k, v in opt.state_tensors(i).items()} for i in range(len(opt.params))]
    return out


# Adam divides by sqrt(v): an element whose gradient is near rounding noise can move by a small
# fraction of one step (lr) when reductions are summed in another order. A bug moves weights by
# whole steps (or changes the loss), far beyond this.
WEIGHT_ATOL = 2e-3 * LR


def assert_same_training(got: dict, ref: dict, rtol: float = 1e-5, atol: float = 1e-6, state: bool = True) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=rtol, atol=atol)
    assert got["weights"].keys() == ref["weights"].keys()
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=rtol, atol=WEIGHT_ATOL,
                                   msg=lambda m: f"{name}: {m}")
    if state and "state" in got:
        for i, (g, r) in enumerate(zip(got["state"], ref["state"])):
            assert g.keys() == r.keys()
            for key in r:
                tol = WEIGHT_ATOL if key == "master" else atol
                torch.testing.assert_close(g[key], r[key], rtol=rtol, atol=tol, msg=lambda m: f"param {i} {key}: {m}")


VARIANTS = {
    "plain": {},
    "plain-overlap": dict(overlap_grad_reduce=True, ddp_bucket_size=SMALL_BUCKET),
    "distopt": dict(use_distributed_optimizer=True),
    "distopt-overlap": dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                            ddp_bucket_size=SMALL_BUCKET),
    "distopt-offload": dict(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                            optimizer_offload_fraction=0.5, ddp_bucket_size=SMALL_BUCKET),
    "offload-only": dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0),
    "distopt-bf16-grads": dict(use_distributed_optimizer=True, grad_reduce_in_bf16=True, overlap_grad_reduce=True,
                               ddp_bucket_size=SMALL_BUCKET),
}


def _dp_worker(rank, world, names, tp, query_groups, sp):
    ctx = build_groups(tp, 1, 1, 1, torch.device("cpu"))
    results = {}
    for name in names:
        extra = dict(sequence_parallel=True) if sp else {}
        results[name] = train(run_cfg(query_groups, **VARIANTS[name], **extra), ctx)
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, the same global batch (4 micro-batches of 2), plain optimizer."""
    torch.manual_seed(0)
    return train(run_cfg(), ParallelContext(), micro_batches=4)


def check_variants(results: list[dict], ref: dict, dp: int, names) -> None:
    for rank_result in results:
        for name in names:
            got = rank_result[name]
            if name == "distopt-bf16-grads":  # bf16 gradients: the same training to bf16 precision
                assert all(torch.isfinite(torch.tensor(got["losses"])))
                torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=2e-2,
                                           atol=1e-2)
                continue
            assert_same_training(got, ref)
            if "overlap" in name:  # every bucket's reduction started inside the last backward
                assert got["started_in_backward"] == [got["buckets"]] * STEPS, name
                assert got["buckets"] > 3
            if name.startswith("distopt"):
                assert got["pending_gathers_after_step"] == 0
    for name in names:
        if name.startswith("distopt"):
            # Each rank keeps optimizer state for its shard only; the shards partition the parameters.
            locals_ = [r[name]["local_numel"] for r in results]
            total = results[0][name]["total_numel"]
            assert sum(locals_) == total
            assert max(locals_) <= total // dp + results[0][name]["buckets"] * 64 * dp
            for r in results:
                assert r[name]["state_numel"] == {k: r[name]["local_numel"] for k in r[name]["state_numel"]}


DP2 = list(VARIANTS)
DP4 = ["plain", "distopt-overlap", "distopt-offload"]


def test_dp2_matches_single_process(reference):
    results = run_distributed(_dp_worker, 2, DP2, 1, 2, False)
    check_variants(results, reference, 2, DP2)


def test_dp4_matches_single_process(reference):
    results = run_distributed(_dp_worker, 4, DP4, 1, 2, False)
    check_variants(results, reference, 4, DP4)


def test_tp2_dp2_matches_single_process():
    """TP=2 x DP=2 with sequence parallelism and key/value heads replicated over TP (both TP syncs)."""
    names = ["plain-overlap", "distopt-overlap"]
    ref = train(run_cfg(1), ParallelContext(), micro_batches=4)
    results = run_distributed(_dp_worker, 4, names, 2, 1, True)
    for rank_result in results:
        for name in names:
            assert_same_training(rank_result[name], ref, state=False)
