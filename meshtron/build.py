"""The one place a model stage is built: from the run's configuration to ready-to-train chunks.

Every construction of a :class:`~meshtron.model.GPTModel` outside the tests goes through here
(training, checkpoint loading and conversion, the benchmarks, the memory planner), so each choice
the configuration makes about the model is made once:

* the MLP of each layer: mixture of experts when ``--num-experts`` is set, dense otherwise;
* ``--cp-comm-type``, ``--sequence-parallel`` and activation recomputation, at construction;
* after construction (:func:`prepare_stage`), in this order: layout-independent initialisation,
  the RNG tracker, FP8 linears, the tensor-parallel communication overlap, regional compilation.
It also holds :func:`gpt_forward_step`, the forward step the pipeline schedules call: it is the
only code that knows GPTModel's keyword arguments and its ``(loss sum, per-token losses)`` output,
so :mod:`meshtron.pipeline` never imports the model.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn as nn

from meshtron.config import MeshtronConfig
from meshtron.layers.activation_offload import ActivationOffloader
from meshtron.layers.linear import enable_fp8, set_tp_comm_overlap
from meshtron.layers.moe import MoELayer
from meshtron.model import GPTModel
from meshtron.parallel import comm
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import RNGTracker
from meshtron.parallel.sharding import canonical_shapes, initialize_parameters
from meshtron.pipeline import PipelineLayout, check_stage_count
from meshtron.pipeline.schedules import MicroBatch
from meshtron.run_layout import layout_from_config

__all__ = ["build_model_chunks", "build_stage", "built_parameter_count", "gpt_forward_step", "prepare_stage",
           "recompute_layer_ids"]


def recompute_layer_ids(cfg: MeshtronConfig, layer_ids: Sequence[int]) -> list[int]:
    """Layers run under full activation recomputation in one model chunk (``block``: its first N)."""
    t = cfg.train
    if t.recompute_granularity != "full":
        return []
    if t.recompute_method == "block":
        return list(layer_ids)[: t.recompute_num_layers]
    return list(layer_ids)


def build_stage(cfg: MeshtronConfig, ctx: ParallelContext, vocab_size: int,
                layer_ids: Optional[Sequence[int]] = None, pre_process: bool = True, post_process: bool = True,
                make_mlp=None) -> GPTModel:
    """One model stage on the meta device, shaped by ``cfg`` (the whole model by default).

    ``make_mlp`` overrides the MLP choice (tests); by default each layer's MLP is the kind its entry of the
    layer pattern names (:mod:`meshtron.layer_kinds.pattern`).
    """
    ids = list(range(cfg.model.num_layers)) if layer_ids is None else list(layer_ids)
    return GPTModel(cfg.model, ctx, vocab_size, layer_ids=ids, pre_process=pre_process, post_process=post_process,
                    sequence_parallel=cfg.parallel.sequence_parallel,
                    recompute_layers=recompute_layer_ids(cfg, ids),
                    selective_recompute=cfg.train.recompute_granularity == "selective",
                    make_mlp=make_mlp,
                    cp_comm_type=cfg.parallel.cp_comm_type,
                    cp_a2a_size=(cfg.parallel.hierarchical_context_parallel_sizes or [None])[0])


def prepare_stage(model: GPTModel, cfg: MeshtronConfig, ctx: ParallelContext, tracker: RNGTracker,
                  dtype: torch.dtype) -> GPTModel:
    """Materialise a built stage for training: initial values, RNG tracker, FP8, TP overlap, compile."""
    initialize_parameters(model, cfg.train.seed, ctx.device, dtype)
    model.set_rng_tracker(tracker)
    if cfg.train.fp8_format:
        enable_fp8(model, cfg.train.fp8_format, cfg.train.fp8_recipe, cfg.train.fp8_experts)
    set_tp_comm_overlap(model, cfg.parallel.tp_comm_overlap)
    if cfg.train.offload_activations:
        model.activation_offloader = ActivationOffloader(model, ctx.device, cfg.train.offload_activations_num_layers)
    if cfg.train.compile:
        comm.set_micro_pipelined_tp(cfg.parallel.async_tensor_parallel, ctx.tp_group)
        graphs = cfg.train.enable_cuda_graph
        layers = list(model.layers.values())
        if hasattr(model, "mtp"):  # the same regions as the main layers
            layers += [depth.transformer_layer for depth in model.mtp.layers]
        for layer in layers:
            layer.compile(**compile_options(layer, graphs))
        model.cuda_graph_layers = graphs
    return model


def compile_options(layer: nn.Module, cuda_graphs: bool) -> dict:
    """``torch.compile`` options of one transformer layer: with ``cuda_graphs``, dense layers run as CUDA graphs
    (the ``reduce-overhead`` mode's graph trees); a mixture-of-experts layer sizes its dispatch from the routing
    on the host every step, so it keeps plain compiled code."""
    if cuda_graphs and not isinstance(layer.mlp, MoELayer):
        return {"mode": "reduce-overhead"}
    return {}


def build_model_chunks(cfg: MeshtronConfig, ctx: ParallelContext, vocab_size: int, tracker: RNGTracker,
                       dtype: torch.dtype, make_mlp=None,
                       pipeline: Optional[PipelineLayout] = None) -> list[nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), initialised and ready to train.

    Chunk ``v`` of pipeline rank ``p`` holds the layers of ``pipeline``, the run's resolved stage layout
    (:attr:`meshtron.run_layout.RunLayout.pipeline`; derived from ``cfg`` when not given); the embedding is on
    the first model chunk, the output layer and loss on the last.
    """
    layout = pipeline if pipeline is not None else layout_from_config(cfg)
    check_stage_count(layout, ctx)
    chunks: list[nn.Module] = []
    for v in range(layout.virtual_stages):
        model = build_stage(cfg, ctx, vocab_size, layout.layers(ctx.pp_rank, v),
                            pre_process=layout.has_embedding(ctx.pp_rank, v),
                            post_process=layout.has_loss(ctx.pp_rank, v), make_mlp=make_mlp)
        chunks.append(prepare_stage(model, cfg, ctx, tracker, dtype))
    return chunks


def built_parameter_count(cfg: MeshtronConfig, vocab_size: Optional[int] = None) -> int:
    """Parameters of the whole model as :func:`build_stage` builds it (on the meta device: nothing is
    allocated), counted from its canonical tensors, so padding and tied copies count once."""
    model = build_stage(cfg, ParallelContext(), vocab_size if vocab_size is not None else cfg.model.vocab_size)
    return sum(math.prod(shape) for shape in canonical_shapes([model]).values())


def gpt_forward_step(chunk: nn.Module, micro_batch: MicroBatch,
                     hidden: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Forward one micro-batch through a GPTModel stage, in the schedules' contract.

    Returns ``(output hidden states, None)`` on a stage without the loss, and ``(None, summed weighted
    loss)`` on the one with it (GPTModel's per-token losses are not needed by the schedule). With the
    multi-token prediction fields of a training micro-batch, that loss's backward pass carries the
    prediction depths' objective too, while its value (what the schedule sums and logs) is the main loss.
    """
    out = chunk(tokens=micro_batch.get("tokens"), position_ids=micro_batch.get("position_ids"),
                labels=micro_batch.get("labels"), loss_weight=micro_batch.get("loss_weight"),
                document_ids=micro_batch.get("document_ids"), hidden=hidden,
                mtp_tokens=micro_batch.get("mtp_tokens"), mtp_labels=micro_batch.get("mtp_labels"),
                mtp_loss_weight=micro_batch.get("mtp_loss_weight"))
    if chunk.post_process:
        loss_sum, _per_token = out
        return None, loss_sum
    return out, None
