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
import torch.nn as nn

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.model import GPTModel
from meshtron.optim.clip import clip_coefficient
from meshtron.optim.distributed_optimizer import DistributedOptimizer
from meshtron.optim.factory import build_optimization
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.sharding import ShardSpec, gather_canonical, initialize_parameters, new_param, spec_of, whole
from tests.distributed.late_gather import land_gathers_at_wait
from tests.distributed.launch import rank_device, run_distributed

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


def single_stage(cfg: MeshtronConfig, ctx: ParallelContext) -> GPTModel:
    return GPTModel(cfg.model, ctx, VOCAB, sequence_parallel=cfg.parallel.sequence_parallel)


def run_micro_batch(model, ctx, tokens, labels, weight, before_backward) -> torch.Tensor:
    """Forward and backward of one micro-batch on a one-stage model; returns its weighted loss sum."""
    loss, _ = model(tokens, labels=labels, loss_weight=weight)
    before_backward()
    loss.backward()
    return loss.detach()


def train_step(model, optim, cfg: MeshtronConfig, ctx: ParallelContext, batch, micro_batches: int,
               run_micro) -> tuple[float, float]:
    """One iteration as the trainer runs it; returns (global-batch loss, gradient norm)."""
    tokens, labels, mask = (t.to(ctx.device) for t in batch)
    weight = mask / mask.sum()
    per_rank = GLOBAL_BATCH // ctx.dp
    mb = per_rank // micro_batches
    rows = slice(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank)
    tokens, labels, weight = tokens[rows], labels[rows], weight[rows]
    optim.grad_buffer.zero()
    total = torch.zeros((), device=ctx.device)
    for j in range(micro_batches):
        part = slice(j * mb, (j + 1) * mb)
        last = j == micro_batches - 1
        total += run_micro(model, ctx, tokens[part], labels[part], weight[part],
                           optim.grad_sync.start_overlap if last else (lambda: None))
    gather = getattr(optim.optimizer, "param_gather", None)
    if getattr(gather, "overlap", False):  # every bucket was waited for by a forward pre-hook
        assert gather.pending == 0
    optim.grad_sync.finish()
    norm = optim.grad_norm()
    optim.optimizer.step(LR, grad_coef=clip_coefficient(norm, cfg.optim.clip_grad))  # as the trainer does
    if ctx.dp_cp_group is not None:
        dist.all_reduce(total, group=ctx.dp_cp_group)
    return total.item(), norm.item()


def all_states(opt) -> list[dict]:
    return [{k: v.clone() for k, v in opt.state_tensors(i).items()} for i in range(len(opt.params))]


def resume_difference(model, optim, cfg: MeshtronConfig, ctx: ParallelContext, build, run_micro) -> float:
    """Copy weights and optimizer state (through the checkpoint interface) into a fresh model and
    optimizer, run one more step on both: the largest difference of any weight or state afterwards."""
    states = all_states(optim.optimizer)
    other = build(cfg, ctx)
    initialize_parameters(other, 8, ctx.device, torch.float32)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            q.copy_(p)
    other_optim = build_optimization(cfg, ctx, [other])
    other_optim.optimizer.ensure_state()
    for i, tensors in enumerate(states):
        other_optim.optimizer.load_state_tensors(i, tensors)
    other_optim.optimizer.set_step_count(optim.optimizer.step_count)
    batch = next(iter(global_batches()))
    for m, o in ((model, optim), (other, other_optim)):
        train_step(m, o, cfg, ctx, batch, 2, run_micro)
        if isinstance(o.optimizer, DistributedOptimizer):
            o.optimizer.finish_param_gather()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), other.parameters()))
    for a, b in zip(all_states(optim.optimizer), all_states(other_optim.optimizer)):
        diff = max([diff] + [(a[k] - b[k]).abs().max().item() for k in a])
    return diff


def train(cfg: MeshtronConfig, ctx: ParallelContext, micro_batches: int = 2, build=single_stage,
          run_micro=run_micro_batch, resume: bool = False) -> dict:
    """STEPS training iterations; returns losses, norms, canonical weights and optimizer facts."""
    model = build(cfg, ctx)
    initialize_parameters(model, 7, ctx.device, torch.float32)
    optim = build_optimization(cfg, ctx, [model])
    out = {"losses": [], "norms": [], "started_in_backward": []}
    for batch in global_batches():
        loss, norm = train_step(model, optim, cfg, ctx, batch, micro_batches, run_micro)
        out["started_in_backward"].append(optim.grad_sync.buckets_started_in_backward)
        out["losses"].append(loss)
        out["norms"].append(norm)
    opt = optim.optimizer
    if isinstance(opt, DistributedOptimizer):
        opt.finish_param_gather()
        out["local_numel"] = opt.local_numel
        out["state_numel"] = opt.state_numel()
        out["pending_gathers_after_step"] = opt.param_gather.pending
    out["total_numel"] = sum(p.numel() for p in model.parameters())
    out["buckets"] = len(optim.layout.buckets)
    out["local_weights"] = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    out["weights"] = gather_canonical([model])
    if ctx.tp == 1 and ctx.pp == 1:  # full optimizer state per parameter (collective with the distributed optimizer)
        out["state"] = [{k: v.cpu() for k, v in d.items()} for d in all_states(opt)]
    if resume:
        out["resume_difference"] = resume_difference(model, optim, cfg, ctx, build, run_micro)
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


RESUME = ("distopt-offload", "offload-only", "plain")  # checkpoint interface round trip


def _dp_worker(rank, world, names, tp, query_groups, sp):
    land_gathers_at_wait()  # this process only: a weight read before its gather's wait reads stale values
    ctx = build_groups(tp, 1, 1, 1, torch.device("cpu"))
    results = {}
    for name in names:
        extra = dict(sequence_parallel=True) if sp else {}
        results[name] = train(run_cfg(query_groups, **VARIANTS[name], **extra), ctx, resume=name in RESUME)
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
            if name in RESUME:
                assert got["resume_difference"] < 1e-7, name
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


# ------------------------------------------------------------------------------------------------
# Two pipeline stages with a tied embedding: the embedding copies are summed over the stages after
# the data-parallel reduction (a bucket of their own, so a reduce-scatter leaves aligned shards).

def two_stages(cfg: MeshtronConfig, ctx: ParallelContext) -> GPTModel:
    first = ctx.pp_rank == 0
    return GPTModel(cfg.model, ctx, VOCAB, layer_ids=[0] if first else [1], pre_process=first, post_process=not first)


def run_pipeline_micro_batch(model, ctx, tokens, labels, weight, before_backward) -> torch.Tensor:
    """One micro-batch through two stages, forward then backward (no interleaving needed here)."""
    hidden_shape = (tokens.shape[1], tokens.shape[0], model.cfg.hidden_size)
    if ctx.pp_rank == 0:
        hidden = model(tokens)
        dist.send(hidden.detach(), ctx.pp_ranks[1])
        grad = torch.empty(hidden_shape)
        dist.recv(grad, ctx.pp_ranks[1])
        before_backward()
        hidden.backward(grad)
        return torch.zeros(())
    hidden = torch.empty(hidden_shape)
    dist.recv(hidden, ctx.pp_ranks[0])
    hidden.requires_grad_()
    loss, _ = model(hidden=hidden, labels=labels, loss_weight=weight)
    before_backward()
    loss.backward()
    dist.send(hidden.grad, ctx.pp_ranks[0])
    return loss.detach()


def tied_cfg(**parallel) -> MeshtronConfig:
    cfg = run_cfg(**parallel)
    cfg.model.untie_embeddings_and_output_weights = False
    return cfg


PP_VARIANTS = ["plain-overlap", "distopt-overlap"]


def _pp_worker(rank, world):
    ctx = build_groups(1, 1, 2, 1, torch.device("cpu"))
    return ctx.pp_rank, {name: train(tied_cfg(**VARIANTS[name]), ctx, build=two_stages,
                                     run_micro=run_pipeline_micro_batch) for name in PP_VARIANTS}


def test_pp2_dp2_tied_embedding_matches_single_process():
    ref = train(tied_cfg(), ParallelContext(), micro_batches=4)
    results = run_distributed(_pp_worker, 4)
    embedding = ref["weights"]["embedding.word_embeddings.weight"]
    for stage, per_variant in results:
        for name, got in per_variant.items():
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
            if stage == 1:
                torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5,
                                           atol=1e-6)
            for key, w in ref["weights"].items():
                torch.testing.assert_close(got["weights"][key], w, rtol=1e-5, atol=WEIGHT_ATOL,
                                           msg=lambda m: f"{name} {key}: {m}")
            # Each stage's own copy of the tied embedding (first: the input embedding, last: the output layer).
            local = got["local_weights"]["embedding.weight" if stage == 0 else "output_weight"]
            torch.testing.assert_close(local[:VOCAB], embedding, rtol=1e-5, atol=WEIGHT_ATOL,
                                       msg=lambda m: f"{name} stage {stage}: {m}")


# ------------------------------------------------------------------------------------------------
# Expert parameters (ShardSpec.expert) are reduced and sharded over the expert-data-parallel group
# and counted once per expert in the norm. A toy layer stands in for a mixture of experts: DP x CP
# index d runs its tokens through expert d % EP (its expert-parallel rank), which only the ranks of
# that expert-parallel rank hold.

HIDDEN = 16


class ToyExperts(nn.Module):
    """A dense projection shared by every rank, then one of ``experts`` expert matrices."""

    def __init__(self, experts: list[int]):
        super().__init__()
        with torch.device("meta"):
            self.dense = new_param(ShardSpec((whole("dense.weight", (HIDDEN, HIDDEN), std=0.3),)))
            self.bias = new_param(ShardSpec((whole("dense.bias", (HIDDEN,), "zeros"),)))
            self.experts = nn.ParameterList([
                new_param(ShardSpec((whole(f"experts.{e}.weight", (HIDDEN, HIDDEN), std=0.3),), expert=True))
                for e in experts])

    def forward(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        return torch.tanh(x @ self.dense.t() + self.bias) @ self.experts[slot].t()


def toy_data(parts: int):
    g = torch.Generator().manual_seed(99)
    for _ in range(STEPS):
        x = torch.randn(parts, 6, HIDDEN, generator=g)
        target = torch.randn(parts, 6, HIDDEN, generator=g)
        yield x, target


def train_toy(cfg: MeshtronConfig, ctx: ParallelContext, ep: int, dp: int) -> dict:
    """dp data parts; part d uses expert d % ep. Without ctx.dp > 1, one process does every part."""
    experts = list(range(ep)) if ctx.dp == 1 else [ctx.ep_rank]
    model = ToyExperts(experts)
    initialize_parameters(model, 3, torch.device("cpu"), torch.float32)
    optim = build_optimization(cfg, ctx, [model])
    parts = range(dp) if ctx.dp == 1 else [ctx.dp_rank]
    out = {"norms": []}
    for x, target in toy_data(dp):
        optim.grad_buffer.zero()
        for j, d in enumerate(parts):
            slot = d % ep if ctx.dp == 1 else 0
            loss = ((model(x[d], slot) - target[d]) ** 2).sum() / x.numel()
            if j == len(parts) - 1:
                optim.grad_sync.start_overlap()
            loss.backward()
        optim.grad_sync.finish()
        norm = optim.grad_norm()
        optim.optimizer.step(LR, grad_coef=clip_coefficient(norm, cfg.optim.clip_grad))
        out["norms"].append(norm.item())
    if isinstance(optim.optimizer, DistributedOptimizer):
        optim.optimizer.finish_param_gather()
    out["weights"] = {spec_of(p).pieces[0].name: p.detach().clone() for p in model.parameters()}
    return out


TOY_VARIANTS = ["plain-overlap", "distopt-overlap", "distopt-offload"]


def _expert_worker(rank, world, ep):
    ctx = build_groups(1, 1, 1, ep, torch.device("cpu"))
    return {name: train_toy(run_cfg(**dict(VARIANTS[name], ddp_bucket_size=300)), ctx, ep, world)
            for name in TOY_VARIANTS}


def test_expert_parameters_reduce_and_shard_over_expert_data_parallel_group():
    ep, dp = 2, 4
    ref = train_toy(run_cfg(), ParallelContext(), ep, dp)
    results = run_distributed(_expert_worker, dp, ep)
    for per_variant in results:
        for name, got in per_variant.items():
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
            for key, w in got["weights"].items():
                torch.testing.assert_close(w, ref["weights"][key], rtol=1e-5, atol=WEIGHT_ATOL,
                                           msg=lambda m: f"{name} {key}: {m}")


# ------------------------------------------------------------------------------------------------
# The CUDA paths (NCCL in-place reduce-scatter / all-gather, fused CUDA AdamW on segments, pinned
# host staging and side-stream copies of the offload) against one GPU.

def _nccl_worker(rank: int, world: int, names: list) -> dict:
    ctx = build_groups(1, 1, 1, 1, rank_device(rank))
    return {name: train(run_cfg(**VARIANTS[name]), ctx, resume=name in RESUME) for name in names}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")
def test_dp2_nccl_matches_single_gpu():
    names = ["plain", "plain-overlap", "distopt-overlap", "distopt-offload", "offload-only", "distopt-bf16-grads"]
    ref = train(run_cfg(), ParallelContext(device=torch.device("cuda", 0)), micro_batches=4)
    results = run_distributed(_nccl_worker, 2, names, backend="nccl", timeout=600)
    check_variants(results, ref, 2, names)
