"""Shared pieces of the pipeline tests: tiny configs, a fixed global batch, and one training run
driven directly through the model chunks, the schedule and the optimizer (no trainer)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.build import build_model_chunks, gpt_forward_step
from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.optim.clip import clip_coefficient
from meshtron.optim.factory import build_optimization
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.random import RNGTracker
from meshtron.parallel.sharding import gather_canonical, iter_pieces
from meshtron.pipeline import ScheduleStats, get_schedule
from meshtron.pipeline.batches import broadcast_from_loss_stage, empty_micro_batches
from meshtron.run_layout import FP32, resolve_layout
from tests.distributed.late_gather import land_gathers_at_wait
from tests.distributed.launch import rank_device

VOCAB = 96
SEQ = 8
TIED_NAME = "embedding.word_embeddings.weight"


def model_config(tied: bool = True, gpt: bool = False, layers: int = 4) -> ModelConfig:
    """A LLaMA-style (or GPT-2-style) model small enough for eight CPU processes."""
    if gpt:
        return ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                           seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                           make_vocab_size_divisible_by=8, untie_embeddings_and_output_weights=not tied)
    return ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                       num_query_groups=2, ffn_hidden_size=64, seq_length=SEQ, normalization="RMSNorm", swiglu=True,
                       position_embedding_type="rope", disable_bias_linear=True, hidden_dropout=0.0,
                       attention_dropout=0.0, untie_embeddings_and_output_weights=not tied,
                       make_vocab_size_divisible_by=8)


def run_config(model: ModelConfig, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
               first: Optional[int] = None, last: Optional[int] = None, sp: bool = False,
               micro_batch: int = 1, global_batch: int = 8, device: str = "cpu", compile: bool = False,
               **parallel) -> MeshtronConfig:
    """A run on the given layout; ``parallel`` sets further ParallelConfig fields (e.g. the distributed optimizer)."""
    cfg = MeshtronConfig(model=model)
    p = cfg.parallel
    # Blocking exchanges unless a case asks for the overlapped ones (the default of a real run), so
    # that both transfer plans stay covered.
    parallel.setdefault("overlap_p2p_comm", False)
    for key, value in parallel.items():
        setattr(p, key, value)
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.sequence_parallel = tp, pp, sp
    p.virtual_pipeline_model_parallel_size = vpp
    p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = first, last
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.seed, t.device, t.compile = micro_batch, global_batch, 11, device, compile
    cfg.optim.lr, cfg.optim.clip_grad, cfg.optim.weight_decay = 1e-2, 1.0, 0.1
    # Adam divides by sqrt(v) + eps: gradients that are zero in exact arithmetic (the key bias) but
    # rounding noise in practice would otherwise take lr-sized steps in different directions.
    cfg.optim.adam_eps = 1e-5
    return cfg


def global_batch(cfg: MeshtronConfig, iteration: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and loss mask of one global batch (depends only on the iteration)."""
    g = torch.Generator().manual_seed(100 + iteration)
    n = cfg.train.global_batch_size
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = (torch.rand(n, SEQ, generator=g) > 0.25).float()
    return tokens, labels, mask


def rank_micro_batches(cfg: MeshtronConfig, ctx: ParallelContext, iteration: int) -> list[dict]:
    """Data-parallel rank r's contiguous slice of the global batch, cut into micro-batches, with
    loss weights mask / (loss tokens of the global batch) as the trainer attaches them.
    Middle pipeline stages get empty micro-batches, as in training."""
    tokens, labels, mask = global_batch(cfg, iteration)
    mbs, per_rank = cfg.train.micro_batch_size, cfg.train.global_batch_size // ctx.dp
    if not (ctx.is_first_stage or ctx.is_loss_stage):
        return empty_micro_batches(per_rank // mbs)
    start = ctx.dp_rank * per_rank
    inv = 1.0 / mask.sum()
    dev = ctx.device
    return [{"tokens": tokens[i:i + mbs].to(dev), "labels": labels[i:i + mbs].to(dev),
             "loss_weight": (mask[i:i + mbs] * inv).to(dev)} for i in range(start, start + per_rank, mbs)]


def tied_copies(chunks) -> list[torch.Tensor]:
    """This rank's pieces of the tied embedding (the embedding on the first stage, its copy on the last)."""
    return [part.detach().cpu().clone() for chunk in chunks for piece, part, _ in iter_pieces(chunk, "param")
            if piece.name == TIED_NAME]


def train_and_collect(cfg: MeshtronConfig, ctx: ParallelContext, iterations: int = 2) -> dict:
    """Run ``iterations`` optimizer steps and a forward-only pass; return what the tests compare.

    Every rank returns: losses (global-batch mean, as logged), grad norms, the canonical gradients of
    the first iteration and the canonical parameters after the last step (gathered over the world),
    the evaluation loss, this rank's schedule statistics of the first iteration, and its tied pieces.
    """
    # These runs build fp32 chunks, FP8 ones too (FP8 matmuls on fp32 weights, unvalidated): stages exchange fp32.
    layout = dataclasses.replace(resolve_layout(cfg, ctx.world_size), compute_dtype=FP32)
    # The groups were built without the run's layout: the same groups with its loss stage (ZBV: the first stage).
    ctx = dataclasses.replace(ctx, loss_stage=layout.loss_stage)
    tracker = RNGTracker(cfg.train.seed, ctx.tp_rank, ctx.pp_rank, ctx.device)
    tracker.seed_default()
    chunks = build_model_chunks(cfg, ctx, VOCAB, tracker, torch.float32, pipeline=layout.pipeline)
    optim = build_optimization(cfg, ctx, chunks)
    schedule = get_schedule(cfg, ctx, gpt_forward_step, layout)
    extra = {}
    stats = ScheduleStats()
    if ctx.pp > 1:
        extra["stats"] = stats
    out: dict = {"losses": [], "norms": []}
    for it in range(iterations):
        for chunk in chunks:
            chunk.train()
        optim.grad_buffer.zero()
        mbs = rank_micro_batches(cfg, ctx, it)
        loss = schedule(chunks, mbs, on_chunk_grads_ready=optim.grad_sync.start_overlap,
                        **(extra if it == 0 else {}))
        optim.grad_sync.finish()
        if it == 0 and not cfg.parallel.use_distributed_optimizer:  # (which keeps only its shard of them)
            out["grads"] = gather_canonical(chunks, "grad")
        norm = optim.grad_norm()
        optim.optimizer.step(cfg.optim.lr, grad_coef=clip_coefficient(norm, cfg.optim.clip_grad))
        out["losses"].append(_reduce(loss, ctx))
        out["norms"].append(float(norm))
    if hasattr(optim.optimizer, "finish_param_gather"):  # the distributed optimizer gathers weights lazily
        optim.optimizer.finish_param_gather()
    out["params"] = gather_canonical(chunks, "param")
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        out["eval_loss"] = _reduce(schedule(chunks, rank_micro_batches(cfg, ctx, iterations), forward_only=True), ctx)
    out["max_in_flight"] = stats.max_in_flight
    out["deferred_gemms"] = stats.deferred_gemms  # zero-bubble schedules: weight-gradient GEMMs run in W passes
    out["buckets_in_backward"] = getattr(optim.grad_sync, "buckets_started_in_backward", 0)
    out["stage"] = ctx.pp_rank
    out["tied"] = tied_copies(chunks)
    return out


def _reduce(loss: torch.Tensor, ctx: ParallelContext) -> float:
    """The global-batch loss as the trainer logs it: summed over DP, taken from the stage with the loss."""
    loss = loss.float().clone().reshape(1)
    if ctx.dp_cp_group is not None:
        dist.all_reduce(loss, group=ctx.dp_cp_group)
    return float(broadcast_from_loss_stage(loss, ctx))


def layout_worker(rank: int, world: int, cases: list, device: str = "cpu") -> list[dict]:
    """Run every (config) case on this rank (all ranks build the same groups in the same order)."""
    results = []
    dev = rank_device(rank) if device == "cuda" else torch.device("cpu")
    if device == "cpu":
        land_gathers_at_wait()  # a weight read before its overlapped gather's wait fails every run
    for cfg in cases:
        p = cfg.parallel
        ctx = build_groups(p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                           p.expert_model_parallel_size, dev)
        results.append(train_and_collect(cfg, ctx))
    return results
