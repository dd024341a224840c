"""The decoder-only transformer (GPT / LLaMA / Mistral family), as one pipeline stage.

A stage holds a slice of the layers, keyed by their global index (layer i is
``layers.i`` on whichever stage holds it); the first stage also holds the
embedding, the last the final norm, output layer and loss. With one stage it is
the whole model. Activations between layers are [seq, batch, hidden] (the
sequence split in shards with sequence parallelism).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.config import ConfigError, ModelConfig, padded_vocab_size
from meshtron.layers.attention import KVCache
from meshtron.layers.documents import DocumentMask
from meshtron.layers.activation_offload import ActivationOffloader
from meshtron.layer_kinds.pattern import layer_at, layer_kinds
from meshtron.parallel.context_parallel.attention import check_comm_type, context_parallel_inputs, cp_subgroups
from meshtron.layers.cross_entropy import linear_cross_entropy
from meshtron.layers.embedding import VocabParallelEmbedding
from meshtron.layers.mtp import MTPBlock, attach_loss, mtp_depths
from meshtron.layers.norm import Norm
from meshtron.layers.recompute import run_with_recompute
from meshtron.layers.rotary import inverse_frequencies, rope_table_scale, rope_tables
from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.context_parallel.split import local_token_indices
from meshtron.parallel.layout import sequence_parallel_in_effect
from meshtron.parallel.random import RNGTracker
from meshtron.parallel.sharding import ShardSpec, new_param, shard


class TransformerLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then + mlp(norm(.)).

    The mixer and MLP kinds are layer ``index``'s entry of the layer pattern
    (:mod:`meshtron.layer_kinds.pattern`); ``mlp`` replaces the pattern's MLP (tests).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, index: int, sequence_parallel: bool,
                 mlp: Optional[nn.Module] = None, prefix: Optional[str] = None):
        super().__init__()
        prefix = prefix or f"layers.{index}"  # a multi-token prediction depth's layer has its own name
        self.sequence_parallel = sequence_parallel
        self.input_norm = Norm(f"{prefix}.input_norm", cfg.hidden_size, cfg.normalization, cfg.norm_epsilon,
                               sequence_parallel, cfg.zero_centred_norm)
        kinds = layer_at(cfg, index)
        self.mixer_kind = kinds.mixer  # its description: what it is, and its decode state
        self.attention = kinds.mixer.build(cfg, ctx, f"{prefix}.attention", sequence_parallel)
        self.post_attention_norm = Norm(f"{prefix}.post_attention_norm", cfg.hidden_size, cfg.normalization,
                                        cfg.norm_epsilon, sequence_parallel, cfg.zero_centred_norm)
        self.mlp = mlp if mlp is not None else kinds.mlp.build(cfg, ctx, index, f"{prefix}.mlp", sequence_parallel)
        self.hidden_dropout = cfg.hidden_dropout
        self.tracker: Optional[RNGTracker] = None
        self.recompute: Optional[str] = None  # "full" or "selective" (set by GPTModel)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0:
            return x
        if self.sequence_parallel and self.tracker is not None:  # shards differ across TP: own stream
            with self.tracker.fork():
                return F.dropout(x, self.hidden_dropout, True)
        return F.dropout(x, self.hidden_dropout, True)

    def forward(self, x: torch.Tensor, rope, mask, cache: Optional[KVCache] = None) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled() and cache is None:
            # Inside forward (not around the module) so that a compiled layer traces the checkpoint.
            return run_with_recompute(self._forward, self.recompute, x, rope, mask)
        return self._forward(x, rope, mask, cache)

    def _forward(self, x: torch.Tensor, rope, mask, cache: Optional[KVCache] = None) -> torch.Tensor:
        x = x + self._dropout(self.attention(self.input_norm(x), rope, mask, cache))
        return x + self._dropout(self.mlp(self.post_attention_norm(x)))


class GPTModel(nn.Module):
    """One pipeline stage of the transformer (the whole model when ``layer_ids`` covers every layer).

    Parameters are created on the meta device; call
    :func:`meshtron.parallel.sharding.initialize_parameters` to materialise them. A run builds its
    stages through :mod:`meshtron.build`, which makes every choice the configuration implies.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, vocab_size: int,
                 layer_ids: Optional[Sequence[int]] = None, pre_process: bool = True, post_process: bool = True,
                 sequence_parallel: bool = False, recompute_layers: Sequence[int] = (),
                 selective_recompute: bool = False,
                 make_mlp=None, cp_comm_type: str = "p2p", cp_a2a_size: Optional[int] = None):
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        check_comm_type(cp_comm_type)  # how CP attention exchanges keys and values (--cp-comm-type)
        self.cp_comm_type = cp_comm_type
        # a2a+p2p: ranks of one all-to-all group (A of --hierarchical-context-parallel-sizes A B); its groups
        # are made now, while every rank builds its model, not at the first forward
        self.cp_a2a_size = cp_a2a_size
        if cp_comm_type == "a2a+p2p" and ctx.cp > 1:
            if not cp_a2a_size or ctx.cp % cp_a2a_size:
                raise ConfigError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B with "
                                  f"A x B = --context-parallel-size ({ctx.cp})")
            if 1 < cp_a2a_size < ctx.cp:
                cp_subgroups(ctx, cp_a2a_size)
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, ctx.tp)
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel_in_effect(sequence_parallel, ctx.tp)
        self.recompute_layers = set(recompute_layers)
        layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        sp = self.sequence_parallel
        with torch.device("meta"):
            if pre_process:
                self.embedding = VocabParallelEmbedding(
                    ctx, vocab_size, self.padded_vocab, cfg.hidden_size, cfg.init_method_std, sp,
                    (cfg.max_position_embeddings or cfg.seq_length)
                    if cfg.position_embedding_type == "learned_absolute" else None)
            self.layers = nn.ModuleDict({
                str(i): TransformerLayer(cfg, ctx, i, sp, make_mlp(cfg, ctx, i, sp) if make_mlp else None)
                for i in layer_ids})
            for key, layer in self.layers.items():
                layer.recompute = ("full" if int(key) in self.recompute_layers
                                   else "selective" if selective_recompute else None)
            # Set by meshtron.build with --offload-activations: moves the layers' saved tensors to host memory.
            self.activation_offloader: Optional[ActivationOffloader] = None
            # Set by meshtron.build with --enable-cuda-graph: each forward of this stage begins a new step of
            # torch.compile's CUDA graph trees (the memory of the previous step's graphs may be reused).
            self.cuda_graph_layers = False
            if post_process:
                self.final_norm = Norm("final_norm", cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, sp,
                                       cfg.zero_centred_norm)
                tied = not cfg.untie_embeddings_and_output_weights
                if not (tied and pre_process):
                    name = "embedding.word_embeddings.weight" if tied else "output.weight"
                    self.output_weight = new_param(ShardSpec((shard(
                        name, (vocab_size, cfg.hidden_size), 0, ctx.tp_rank, ctx.tp, std=cfg.init_method_std,
                        padded_size=self.padded_vocab),), extra={"tied_copy": tied}))
                if mtp_depths(cfg):
                    self.mtp = self._build_mtp(cfg, ctx, make_mlp, selective_recompute)
        if cfg.position_embedding_type == "yarn":
            # Megatron's spelling, which validation resolves to rope with --rope-type yarn; unresolved it would
            # build a model without positions.
            raise ValueError("position_embedding_type 'yarn' is resolved by meshtron.validation.validate_config "
                             "(to 'rope' with rope_type 'yarn'); validate the configuration, or set those two")
        self.use_rope = cfg.position_embedding_type == "rope"
        # One rotary table for every layer (the pattern's check refuses mixers of different widths).
        self.rope_dim = max(kinds.mixer.rope_dim(cfg) for kinds in layer_kinds(cfg))
        self.rope_scale = rope_table_scale(cfg)

    def set_rng_tracker(self, tracker: RNGTracker) -> None:
        for module in self.modules():
            if hasattr(module, "tracker"):
                module.tracker = tracker

    def _build_mtp(self, cfg: ModelConfig, ctx: ParallelContext, make_mlp, selective_recompute: bool) -> MTPBlock:
        """The multi-token prediction depths (last stage). Each depth's transformer layer is of the kind
        of the main model's last layer (its MLP: MoE or dense), as in Megatron-Core; full recomputation
        applies to it when it applies to every layer of the stage."""
        sp, last = self.sequence_parallel, cfg.num_layers - 1

        def make_layer(k: int) -> TransformerLayer:
            prefix = f"mtp.layers.{k}.transformer_layer"
            mlp = make_mlp(cfg, ctx, last, sp, prefix=f"{prefix}.mlp") if make_mlp else None
            layer = TransformerLayer(cfg, ctx, last, sp, mlp, prefix=prefix)
            layer.recompute = "full" if full else "selective" if selective_recompute else None
            return layer

        stage_layers = {int(key) for key in self.layers}
        full = bool(self.recompute_layers) and stage_layers <= self.recompute_layers

        # Tied embeddings: the last stage's copy of the output layer is the embedding's copy as well.
        if not self.pre_process and cfg.untie_embeddings_and_output_weights:
            # The input embedding on a stage without it: a copy whose gradient is summed with the first
            # stage's (as the tied output layer's copy).
            self.mtp_embedding_weight = new_param(ShardSpec((shard(
                "embedding.word_embeddings.weight", (self.vocab_size, cfg.hidden_size), 0, ctx.tp_rank, ctx.tp,
                std=cfg.init_method_std, padded_size=self.padded_vocab),), extra={"tied_copy": True}))
        return MTPBlock(cfg, ctx, sp, make_layer)

    @property
    def output_projection(self) -> torch.Tensor:
        return self.output_weight if hasattr(self, "output_weight") else self.embedding.weight

    @property
    def input_embedding_weight(self) -> torch.Tensor:
        """The word embeddings on this stage: the embedding's own, or (last stage) its copy."""
        if self.pre_process:
            return self.embedding.weight
        return self.mtp_embedding_weight if hasattr(self, "mtp_embedding_weight") else self.output_weight

    def _rope(self, seq: int, position_ids: Optional[torch.Tensor], device, dtype, offset: int = 0):
        if not self.use_rope:
            return None
        inv = inverse_frequencies(self.rope_dim, self.cfg.rotary_base, device, self.cfg)
        pos = position_ids if position_ids is not None else torch.arange(offset, offset + seq, device=device)
        # Whole-sequence tables even with sequence parallelism: attention sees the gathered sequence.
        return rope_tables(pos, inv, dtype, self.rope_scale)

    def forward(self, tokens: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_weight: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
                caches: Optional[dict] = None, position_offset: int = 0,
                mtp_tokens: Optional[torch.Tensor] = None, mtp_labels: Optional[torch.Tensor] = None,
                mtp_loss_weight: Optional[torch.Tensor] = None):
        """Run this stage.

        First stage: ``tokens`` [batch, seq]; other stages: ``hidden`` from the previous stage.
        With context parallelism every per-token input is this CP rank's part of the sequence
        (:func:`meshtron.parallel.context_parallel.split.split_micro_batch`); positions default to those tokens'.
        Last stage with ``labels``: returns (sum of loss_weight * token loss, token losses [batch, seq]).
        Last stage without labels: logits [batch, seq, vocab]. Other stages: hidden [seq, batch, hidden].
        With ``mtp_labels`` (training with multi-token prediction, fields of
        :func:`meshtron.layers.mtp.add_mtp_inputs`) the loss sum's backward pass also carries the
        multi-token prediction objective; its value stays the main loss.
        """
        if self.cuda_graph_layers:
            torch.compiler.cudagraph_mark_step_begin()
        cp = self.ctx.cp
        if cp > 1 and position_ids is None:  # the global positions of this CP rank's two chunks
            seq = tokens.shape[1] if self.pre_process else hidden.shape[0] * (
                self.ctx.tp if self.sequence_parallel else 1)
            device = tokens.device if self.pre_process else hidden.device
            position_ids = local_token_indices(seq, cp, self.ctx.cp_rank, device)
        if self.pre_process:
            pos_for_embedding = position_ids
            if pos_for_embedding is not None and pos_for_embedding.dim() == 1:
                pos_for_embedding = pos_for_embedding[None].expand(tokens.shape[0], -1)
            if pos_for_embedding is None and position_offset:
                pos_for_embedding = torch.arange(position_offset, position_offset + tokens.shape[1],
                                                 device=tokens.device)[None].expand(tokens.shape[0], -1)
            x = self.embedding(tokens, pos_for_embedding)
            seq = tokens.shape[1]
        else:
            x = hidden
            seq = x.shape[0] * (self.ctx.tp if self.sequence_parallel else 1)
        rope = self._rope(seq, position_ids, x.device, x.dtype, position_offset)
        if cp > 1:
            mask = context_parallel_inputs(self.ctx, self.cp_comm_type, document_ids, self.cp_a2a_size)
        else:
            # packed documents: one block mask for every layer (no S x S tensor on CUDA)
            mask = DocumentMask.causal(document_ids) if document_ids is not None else None
        x = self._run_layers(x, rope, mask, caches)
        if not self.post_process:
            return x
        out = self.output(x, labels, loss_weight)
        if mtp_labels is None or labels is None or not hasattr(self, "mtp"):
            return out  # generation and evaluation ignore the prediction depths
        # h^0: the last layer's output, or (--mtp-normed-hidden-states, Megatron-Core's) after the final norm
        h0 = self.final_norm(x) if self.mtp.normed_hidden else x
        per_depth = self.mtp(h0, mtp_tokens, mtp_labels, mtp_loss_weight, self.input_embedding_weight, self._head,
                             rope, mask)
        total, losses = out
        return attach_loss(total, self.mtp.objective(per_depth)), losses

    def _run_layers(self, x: torch.Tensor, rope, mask, caches: Optional[dict]) -> torch.Tensor:
        offloader, previous = self.activation_offloader, None
        for i, (key, layer) in enumerate(self.layers.items()):
            cache = caches.setdefault(key, layer.mixer_kind.new_decode_state()) if caches is not None else None
            if offloader is None or cache is not None:
                x = layer(x, rope, mask, cache)
                continue
            with offloader.layer(offload=offloader.offloads(i, len(self.layers))) as group:
                x = layer(x, rope, mask, cache)
            offloader.fetch_when_backward_reaches(x, group, previous)
            previous = group
        return x

    def output(self, x: torch.Tensor, labels: Optional[torch.Tensor], loss_weight: Optional[torch.Tensor]):
        return self._head(self.final_norm(x), labels, loss_weight)

    def _head(self, x: torch.Tensor, labels: Optional[torch.Tensor], loss_weight: Optional[torch.Tensor]):
        """The output layer (and loss with ``labels``) on normed hidden states [seq, batch, hidden]."""
        group = self.ctx.tp_group
        x = (comm.gather_from_sequence(x, group, grad_is_partial=True) if self.sequence_parallel
             else comm.copy_to_tp(x, group))
        weight = self.output_projection
        rows = weight.shape[0]
        vocab_start = self.ctx.tp_rank * rows
        valid_cols = max(0, min(rows, self.vocab_size - vocab_start))
        s, b, h = x.shape
        if labels is None:
            logits = comm.gather_last_dim(F.linear(x, weight), group)[..., :self.vocab_size]
            return logits.transpose(0, 1)
        flat_labels = labels.t().reshape(-1)
        flat_weight = loss_weight.t().reshape(-1) if loss_weight is not None else None
        total, losses = linear_cross_entropy(x.reshape(s * b, h), weight, flat_labels, flat_weight, vocab_start,
                                             valid_cols, group)
        return total, losses.view(s, b).t()
