"""Shared pieces of the checkpoint tests: tiny models in any layout, a deterministic training step,
canonical views of model and optimizer state, and a gloo multi-process runner."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from meshtron.config import MeshtronConfig
from meshtron.model import GPTModel
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.optimizer import MixedPrecisionAdamW
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters, spec_of, split_local
from meshtron.validation import validate_config
from tests.distributed.launch import run_distributed

VOCAB = 100
SEQ = 16


def tiny_config(**overrides: Any) -> MeshtronConfig:
    """A validated Llama-style configuration small enough for many processes on two cores."""
    cfg = MeshtronConfig()
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, ffn_hidden_size=64, seq_length=SEQ, normalization="RMSNorm", swiglu=True,
                  position_embedding_type="rope", disable_bias_linear=True, hidden_dropout=0.0,
                  attention_dropout=0.0, untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=8,
                  vocab_size=VOCAB, mock_data=True, device="cpu", lr=1e-2, weight_decay=0.1)
    values.update(overrides)
    for key, value in values.items():
        cfg.set(key, value)
    return validate_config(cfg, 1)


def stage_layers(num_layers: int, pp: int, virtual: int = 1) -> list[list[list[int]]]:
    """Layer ids of each model chunk of each pipeline rank: [pp_rank][chunk] -> layers (interleaved order)."""
    chunks = pp * virtual
    per = num_layers // chunks
    layers = [list(range(c * per, (c + 1) * per)) for c in range(chunks)]
    return [[layers[v * pp + r] for v in range(virtual)] for r in range(pp)]


def build_chunks(cfg: MeshtronConfig, ctx: ParallelContext, seed: int = 1, virtual: int = 1,
                 sequence_parallel: bool = False) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage), initialised from ``seed``."""
    mine = stage_layers(cfg.model.num_layers, ctx.pp, virtual)[ctx.pp_rank]
    chunks = []
    for v, layer_ids in enumerate(mine):
        first = ctx.pp_rank == 0 and v == 0
        last = ctx.pp_rank == ctx.pp - 1 and v == virtual - 1
        model = GPTModel(cfg.model, ctx, VOCAB, layer_ids=layer_ids, pre_process=first, post_process=last,
                         sequence_parallel=sequence_parallel)
        initialize_parameters(model, seed, torch.device("cpu"), torch.float32)
        chunks.append(model)
    return chunks


def make_optimizer(cfg: MeshtronConfig, chunks: Sequence[torch.nn.Module], ctx: Optional[ParallelContext] = None,
                   distributed: bool = False):
    """(optimizer, gradient buffer): MixedPrecisionAdamW, or the distributed optimizer sharded over DP."""
    if distributed:
        from meshtron.optim.factory import build_optimization

        cfg.parallel.use_distributed_optimizer = True
        try:
            opt = build_optimization(cfg, ctx, chunks)
        finally:
            cfg.parallel.use_distributed_optimizer = False
        return opt.optimizer, opt.grad_buffer
    params = [p for c in chunks for p in c.parameters()]
    buffer = GradBuffer(params)
    return MixedPrecisionAdamW(params, cfg.optim), buffer


def elementwise_steps(optimizer, buffer: GradBuffer, steps: int, lr: float = 1e-2) -> None:
    """Optimizer steps with gradients that are an elementwise function of the weights.

    The resulting weights and moments do not depend on the parallel layout, which makes
    them comparable across layouts exactly (replicas stay identical too).
    """
    for _ in range(steps):
        buffer.zero()
        buffer.zero_unwritten()  # allocated (a released buffer frees its buckets in zero()) before writing
        for p in optimizer.params:
            p.main_grad.copy_(torch.sin(7.0 * p.detach().float()) + 0.1)
        optimizer.step(lr)
        if hasattr(optimizer, "finish_param_gather"):
            optimizer.finish_param_gather()


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return tokens, labels, torch.full((2, SEQ), 1.0 / (2 * SEQ))


def forward_loss(model: GPTModel, seed: int = 0) -> float:
    """Loss of a whole (one-stage) model on a fixed batch."""
    tokens, labels, weight = batch(seed)
    with torch.no_grad():
        total, _ = model(tokens, labels=labels, loss_weight=weight)
    return float(total)


def canonical_state(chunks: Sequence[torch.nn.Module], optimizer=None) -> dict[str, torch.Tensor]:
    """Full canonical tensors of the model (``model.<name>``) and optimizer (``<state>.<name>``), on every rank."""
    local = []

    def add(prefix: str, tensor: torch.Tensor, spec) -> None:
        for piece, part in zip(spec.pieces, split_local(tensor, spec)):
            local.append((prefix + piece.name, piece, part.narrow(piece.dim, 0, max(piece.valid_length, 0))
                          .detach().float().clone()))

    for chunk in chunks:
        for _, p in chunk.named_parameters():
            add("model.", p.detach(), spec_of(p))
    if optimizer is not None:
        for i, p in enumerate(optimizer.params):
            for key, t in optimizer.state_tensors(i).items():
                add(f"{key}.", t, spec_of(p))
    gathered = [local]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    out: dict[str, torch.Tensor] = {}
    for items in gathered:
        for name, piece, part in items:
            full = out.setdefault(name, torch.full(piece.full_shape, float("nan")))
            if piece.valid_length > 0:
                full.narrow(piece.dim, piece.start, piece.valid_length).copy_(part)
    return out


def assert_same_state(got: dict, ref: dict, atol: float = 0.0) -> None:
    assert sorted(got) == sorted(ref), f"different tensors: {sorted(set(got) ^ set(ref))}"
    for name in ref:
        assert not torch.isnan(ref[name]).any(), f"{name}: reference not fully covered"
        if atol == 0.0:
            assert torch.equal(got[name], ref[name]), f"{name} differs (max {(got[name] - ref[name]).abs().max()})"
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


# Multi-process runner: the shared gloo launcher (a hang fails the test after ``timeout`` seconds).
run_ranks = run_distributed


def mtp_losses(model: GPTModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, each prediction depth's loss [D]) of a one-stage model with multi-token prediction on ``batch``
    (``tokens``, ``labels``, ``loss_mask`` [b, s]; the main loss averaged over the mask, depth k's over its shifted
    mask, as megatron-core's ``MTPLossLoggingHelper`` records them), in evaluation mode (no dropout)."""
    from meshtron.build import gpt_forward_step
    from meshtron.layers.mtp import add_mtp_inputs

    mask = batch["loss_mask"].float()
    mb = add_mtp_inputs({"tokens": batch["tokens"], "labels": batch["labels"], "loss_mask": mask},
                        model.mtp.depths)
    depth_mask = mb.pop("mtp_loss_mask")
    mb["loss_weight"] = mb.pop("loss_mask") / mask.sum()
    mb["mtp_loss_weight"] = depth_mask / depth_mask.sum(dim=(0, 1))
    seen: list[torch.Tensor] = []
    hook = model.mtp.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    model.eval()
    try:
        with torch.no_grad():
            _, loss = gpt_forward_step(model, mb, None)
    finally:
        hook.remove()
    return loss.detach(), seen[0]


def train_on_from_megatron(directory: Any) -> str:
    """``meshtron train --load DIRECTORY --use-checkpoint-args`` on a Megatron fixture saved at iteration 7, to
    iteration 8 (mock data, CPU); asserts that it resumed with the optimizer state (no notice that the Adam moments
    start from zero or that a part is not read) and returns its output."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "meshtron", "train", "--load", str(directory), "--use-checkpoint-args",
           "--mock-data", "--train-iters", "8", "--global-batch-size", "8", "--micro-batch-size", "8", "--device",
           "cpu", "--lr", "3e-4", "--log-interval", "1", "--eval-iters", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-2000:]
    assert "resumed from" in text and "iteration 8/8" in text
    assert "start from zero" not in text and "is not read" not in text
    return text
