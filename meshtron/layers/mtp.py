"""Multi-token prediction (DeepSeek-V3 section 2.2; Megatron-Core's ``--mtp-num-layers``).

Depth ``k = 1..D`` predicts token ``t_{i+k+1}`` at position ``i``. It combines the previous depth's
hidden states ``h^{k-1}`` (``h^0``: the main model's last-layer output, before the final norm; see below for
``--mtp-normed-hidden-states``) with the embedding of token ``t_{i+k}`` (the shared input embedding)::

    h'^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1})])        # [2H -> H], no bias
    h^k  = transformer_layer(h'^k)                               # the main model's layer kind
    L_k  = CE(output_layer(final_norm(h^k)), t_{i+k+1})          # shared output layer

and the objective adds ``L_MTP = (--mtp-loss-scaling-factor / D) * sum_k L_k``. Choices where the
sources differ (docs/models.md says more):

* concatenation order: embedding first, as the released DeepSeek-V3 weights (``eh_proj``), Megatron and
  the inference engines use it (the paper's equation writes the hidden states first);
* each depth has its own final norm (the checkpoint's ``shared_head.norm``, Megatron's per-layer
  ``final_layernorm``); the next depth receives ``h^k`` before that norm, as the paper's ``h^k`` and
  as ``h^0`` is taken. Megatron-Core normalises both: its first depth reads the main model's output after
  the final norm, each next depth the previous one's after its own. ``--mtp-normed-hidden-states``
  computes that (the two differ for every D; reading a Megatron-LM checkpoint sets it);
* ``L_k`` is the mean cross-entropy over the valid positions of the whole global batch (a position
  is valid when its target lies inside the sequence and the loss mask keeps it), normalised like the
  main loss across micro-batches and data-parallel ranks (Megatron normalises per micro-batch);
* the embedding of ``t_{i+k}`` is the word embedding alone (positions reach depth k through
  ``h^{k-1}`` and rotary embeddings).

The shifted inputs are built by :func:`add_mtp_inputs` from the whole micro-batch, before the
context-parallel split, as per-token fields of the micro-batch (``[batch, seq, D]``): every
rank finds its depths' tokens and targets locally, with no exchange between ranks.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.config import ModelConfig
from meshtron.layers.embedding import vocab_parallel_lookup
from meshtron.layers.linear import ColumnParallelLinear
from meshtron.layers.norm import Norm
from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import shard

__all__ = ["HF_MTP_NAMES", "MTP_KEYS", "MTPBlock", "MTPLayer", "MTPMetrics", "add_mtp_inputs", "mtp_blocks",
           "mtp_depths", "mtp_valid_positions", "weigh_mtp_loss"]

#: Per-token fields of a training micro-batch with multi-token prediction, each ``[batch, seq, D]``.
MTP_KEYS = ("mtp_tokens", "mtp_labels", "mtp_loss_mask")

#: Where depth ``k`` (0-based) of meshtron's canonical names sits in a DeepSeek-V3 Hugging Face checkpoint:
#: ``model.layers.{num_hidden_layers + k}.<right side>``; ``{layer}`` stands for the transformer layer's own
#: names (attention, norms, MLP or experts, as for a main layer under ``model.layers.N``). The checkpoint's
#: ``embed_tokens`` and ``shared_head.head`` of each depth are copies of the shared embedding and output layer.
HF_MTP_NAMES = {
    "mtp.layers.{k}.enorm.weight": "enorm.weight",
    "mtp.layers.{k}.hnorm.weight": "hnorm.weight",
    "mtp.layers.{k}.eh_proj.weight": "eh_proj.weight",
    "mtp.layers.{k}.final_norm.weight": "shared_head.norm.weight",
    "mtp.layers.{k}.transformer_layer.{layer}": "{layer}",
    "embedding.word_embeddings.weight": "embed_tokens.weight",
    "output.weight": "shared_head.head.weight",
}


def mtp_depths(cfg: ModelConfig) -> int:
    """Number of multi-token prediction depths of a model (0 when off)."""
    return int(cfg.mtp_num_layers or 0)


def _shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[:, i + n]`` at position ``i`` of [batch, seq]; zeros past the end."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def add_mtp_inputs(micro_batch: dict, depths: int) -> dict:
    """The micro-batch with the inputs of every depth (:data:`MTP_KEYS`), from its whole sequence.

    ``labels[i]`` is token ``t_{i+1}``, so depth k's input token ``t_{i+k}`` is ``labels[i+k-1]`` and
    its target ``t_{i+k+1}`` is ``labels[i+k]`` with the loss mask ``loss_mask[i+k]``; positions whose
    target lies past the end of the sequence get mask 0 (and token/label 0). A micro-batch without
    labels (a stage that computes no loss) is returned unchanged.
    """
    if depths <= 0 or "labels" not in micro_batch:
        return micro_batch
    labels, mask = micro_batch["labels"], micro_batch["loss_mask"]
    out = dict(micro_batch)
    out["mtp_tokens"] = torch.stack([_shift_left(labels, k - 1) for k in range(1, depths + 1)], dim=-1)
    out["mtp_labels"] = torch.stack([_shift_left(labels, k) for k in range(1, depths + 1)], dim=-1)
    out["mtp_loss_mask"] = torch.stack([_shift_left(mask, k) for k in range(1, depths + 1)], dim=-1)
    return out


def mtp_valid_positions(micro_batches: Sequence[dict]) -> Optional[torch.Tensor]:
    """Per depth, the valid positions (loss mask) of this rank's micro-batches, [D] (None without multi-token
    prediction); summed over the data x context-parallel ranks it is what :func:`weigh_mtp_loss` divides by."""
    if not micro_batches or "mtp_loss_mask" not in micro_batches[0]:
        return None
    return sum(mb["mtp_loss_mask"].float().sum(dim=(0, 1)) for mb in micro_batches)


def weigh_mtp_loss(micro_batches: Sequence[dict], global_positions: torch.Tensor) -> None:
    """Replace each ``mtp_loss_mask`` by ``mtp_loss_weight``: per depth, mask / valid positions of the whole
    global batch (``global_positions`` [D], :func:`mtp_valid_positions` summed over the data x
    context-parallel ranks), in place.

    Summed over micro-batches and ranks, ``sum(weight * token loss)`` of depth k is then ``L_k``.
    """
    inv = 1.0 / global_positions.clamp(min=1.0)
    for mb in micro_batches:
        mb["mtp_loss_weight"] = mb.pop("mtp_loss_mask").float() * inv


class MTPLayer(nn.Module):
    """One prediction depth: the two input norms, the projection [2H -> H], a transformer layer and
    the depth's final norm (the output layer is the model's)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, depth: int, sequence_parallel: bool,
                 transformer_layer: nn.Module):
        super().__init__()
        prefix = f"mtp.layers.{depth}"
        H, sp = cfg.hidden_size, sequence_parallel
        self.group = ctx.tp_group
        self.sequence_parallel = sp
        self.enorm = Norm(f"{prefix}.enorm", H, cfg.normalization, cfg.norm_epsilon, sp)
        self.hnorm = Norm(f"{prefix}.hnorm", H, cfg.normalization, cfg.norm_epsilon, sp)
        # Column-parallel (output rows over TP), then gathered: Megatron's layout of eh_proj.
        self.eh_proj = ColumnParallelLinear(
            ctx, [shard(f"{prefix}.eh_proj.weight", (H, 2 * H), 0, ctx.tp_rank, ctx.tp, std=cfg.init_method_std)],
            None, sp)
        self.transformer_layer = transformer_layer
        self.final_norm = Norm(f"{prefix}.final_norm", H, cfg.normalization, cfg.norm_epsilon, sp)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, mask) -> torch.Tensor:
        """``h^k`` (before the final norm) from ``h^{k-1}`` and the embeddings of the tokens k ahead,
        both [seq, batch, hidden] (sequence shards with sequence parallelism)."""
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = comm.gather_last_dim(self.eh_proj(x), self.group)
        if self.sequence_parallel:
            x = comm.scatter_to_sequence(x, self.group)
        return self.transformer_layer(x, rope, mask)


#: ``head(x, labels, loss_weight) -> (sum of weight * token loss, token losses)`` on normed hidden states.
Head = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MTPBlock(nn.Module):
    """The D prediction depths on the last pipeline stage.

    While training it keeps the sum of its depths' weighted losses since the last metrics read
    (detached, on device; read by :class:`MTPMetrics`).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, sequence_parallel: bool,
                 make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.depths = mtp_depths(cfg)
        self.scale = cfg.mtp_loss_scaling_factor / self.depths
        #: --mtp-normed-hidden-states: a depth passes its output after its final norm on (Megatron-Core's);
        #: the caller then gives ``h^0`` after the main final norm too
        self.normed_hidden = bool(cfg.mtp_normed_hidden_states)
        self.ctx = ctx
        self.sequence_parallel = sequence_parallel
        self.layers = nn.ModuleList([MTPLayer(cfg, ctx, k, sequence_parallel, make_layer(k))
                                     for k in range(self.depths)])
        self.loss_sums: Optional[torch.Tensor] = None  # [D]: a plain attribute, not state

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, loss_weight: torch.Tensor,
                embedding_weight: torch.Tensor, head: Head, rope, mask) -> torch.Tensor:
        """This rank's share of every depth's loss ``L_k`` [D] (``tokens``/``labels``/``loss_weight``:
        [batch, seq, D], this CP rank's part; ``hidden``: ``h^0``, after the main final norm with
        ``normed_hidden``)."""
        vocab_start = self.ctx.tp_rank * embedding_weight.shape[0]
        losses = []
        for k, layer in enumerate(self.layers):
            embedded = vocab_parallel_lookup(tokens[..., k], embedding_weight, vocab_start, self.ctx.tp_group,
                              self.sequence_parallel)
            hidden = layer(hidden, embedded, rope, mask)
            normed = layer.final_norm(hidden)
            total, _ = head(normed, labels[..., k], loss_weight[..., k])
            losses.append(total)
            if self.normed_hidden:
                hidden = normed
        per_depth = torch.stack(losses)
        if self.training:
            detached = per_depth.detach().float()
            self.loss_sums = detached if self.loss_sums is None else self.loss_sums + detached
        return per_depth

    def objective(self, per_depth: torch.Tensor) -> torch.Tensor:
        """``(scaling factor / D) * sum_k L_k``: what the multi-token prediction adds to the objective."""
        return per_depth.sum() * self.scale


def attach_loss(main: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``main``'s value, with the backward pass of ``main + extra`` (the logged loss stays the main one)."""
    return main + (extra - extra.detach())


def mtp_blocks(model_chunks: Sequence[nn.Module]) -> list[MTPBlock]:
    """The multi-token prediction blocks of this rank's chunks (one on the last stage's last chunk)."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MTPBlock)]


class MTPMetrics:
    """The ``mtp_loss`` entries of a train record.

    ``mtp_loss``: the mean over depths of ``L_k`` (without the scaling factor), averaged over the
    iterations of the logging interval; with several depths also ``mtp_{k}_loss`` for each.
    Every rank must call :meth:`metrics` at the same iterations (it reduces over the data x
    context-parallel and pipeline groups).
    """

    def __init__(self, model_chunks: Sequence[nn.Module], ctx: ParallelContext, depths: int):
        self.ctx = ctx
        self.depths = depths
        self.blocks = mtp_blocks(model_chunks)

    @torch.no_grad()
    def metrics(self, iterations: int) -> dict:
        """The entries since the last call, over ``iterations`` training iterations; resets the sums."""
        ctx = self.ctx
        sums = torch.zeros(self.depths, device=ctx.device)
        for block in self.blocks:
            if block.loss_sums is not None:
                sums += block.loss_sums
                block.loss_sums = None
        if ctx.dp_cp_group is not None:
            dist.all_reduce(sums, group=ctx.dp_cp_group)
        if ctx.pp_group is not None:  # only the last stage holds the block: the sum is its value
            dist.all_reduce(sums, group=ctx.pp_group)
        values = (sums / max(1, iterations)).tolist()
        out = {"mtp_loss": sum(values) / self.depths}
        if self.depths > 1:
            out.update({f"mtp_{k + 1}_loss": v for k, v in enumerate(values)})
        return out
