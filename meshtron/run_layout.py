"""What a validated configuration implies about the run's layout, resolved once (torch-free).

The data-parallel size, the layer split over pipeline stages, the stage with the loss, the data-parallel sharding
strategy, whether sequence parallelism is in effect and the compute dtype each follow from several flags. Each
rule is written here once, and :class:`RunLayout` holds their values for one run: the command line resolves it
after validating (:func:`meshtron.validation.validate_run`), the process groups take the loss stage from it at
construction, and the trainer, the builder, the pipeline and the planner read it instead of deriving the values
again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshtron.config import MeshtronConfig
from meshtron.parallel.layout import check_expert_ranks, data_parallel_size_of, sequence_parallel_in_effect
from meshtron.pipeline.partition import PipelineLayout, partition_layers

#: The compute dtypes by name (the torch dtype of the same name), so that this module needs no torch.
BF16, FP32 = "bfloat16", "float32"
#: Bytes of one element of each compute dtype.
DTYPE_BYTES = {BF16: 2, FP32: 4}
#: The sharding strategies that keep only this rank's shard of the reduced gradients (ZeRO-2 and ZeRO-3).
SHARDED_GRADIENT_STRATEGIES = ("optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class RunLayout:
    """The resolved layout of one run: sizes, stage layout, loss stage, strategy, effective SP and dtype."""

    world_size: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    pipeline: PipelineLayout       # the layers of every stage and virtual stage
    sharding_strategy: str         # one of config.SHARDING_STRATEGIES
    sequence_parallel: bool        # --sequence-parallel, in effect only with TP > 1
    compute_dtype: str             # BF16 or FP32: the dtype of weights and activations

    @property
    def loss_stage(self) -> int:
        """The pipeline stage with the final norm, output layer and loss: the last, or the first under ZBV."""
        return self.pipeline.loss_stage


def layout_from_config(cfg: MeshtronConfig) -> PipelineLayout:
    """:func:`~meshtron.pipeline.partition.partition_layers` with the run's flags."""
    p = cfg.parallel
    return partition_layers(cfg.model.num_layers, p.pipeline_model_parallel_size,
                            first=p.decoder_first_pipeline_num_layers, last=p.decoder_last_pipeline_num_layers,
                            virtual_size=p.virtual_pipeline_model_parallel_size,
                            layers_per_virtual=p.num_layers_per_virtual_pipeline_stage,
                            embedding_slot=p.account_for_embedding_in_pipeline_split,
                            loss_slot=p.account_for_loss_in_pipeline_split, v_shape=p.pipeline_schedule == "zbv",
                            layout=p.pipeline_model_parallel_layout, mtp_layers=cfg.model.mtp_num_layers or 0)


def sharding_strategy(cfg) -> str:
    """The run's data-parallel sharding strategy: ``--data-parallel-sharding-strategy`` when given, else
    ``optim_grads_params`` for ``--use-megatron-fsdp`` / ``--use-torch-fsdp2``, ``optim`` for
    ``--use-distributed-optimizer``, ``no_shard`` otherwise (meshtron.validation rejects contradictions)."""
    p = cfg.parallel
    explicit = getattr(p, "data_parallel_sharding_strategy", None)
    if explicit:
        return explicit
    if getattr(p, "use_megatron_fsdp", False) or getattr(cfg.train, "use_torch_fsdp2", False):
        return "optim_grads_params"
    return "optim" if p.use_distributed_optimizer else "no_shard"


def shards_state(strategy: str) -> bool:
    """Whether ``strategy`` splits the optimizer state over the DP x CP ranks (all but ``no_shard``)."""
    return strategy != "no_shard"


def shards_gradients(strategy: str) -> bool:
    """Whether ``strategy`` reduce-scatters every micro-batch's gradients and keeps only this rank's shard."""
    return strategy in SHARDED_GRADIENT_STRATEGIES


def shards_weights(strategy: str) -> bool:
    """Whether ``strategy`` keeps only a shard of the weights, gathering each unit's before it runs (ZeRO-3)."""
    return strategy == "optim_grads_params"


def compute_dtype_name(cfg: MeshtronConfig, device: Optional[str] = None) -> str:
    """The dtype of weights and activations: bf16 with ``--bf16`` (FP8 runs keep bf16 weights), fp32 with
    ``--fp32``. A configuration not yet resolved (neither given; the planner's) gets what validation would give
    it: fp32 on CPU, else bf16, the GPU default; ``device`` ("cpu", "cuda") is the one it runs on where
    ``--device`` does not say."""
    t = cfg.train
    if t.bf16 or t.fp8_format:
        return BF16
    return FP32 if t.fp32 or (t.device or device) == "cpu" else BF16


def resolve_layout(cfg: MeshtronConfig, world_size: int) -> RunLayout:
    """The :class:`RunLayout` of a validated ``cfg`` on ``world_size`` ranks (ConfigError if it does not factor)."""
    p = cfg.parallel
    tp, cp, pp, ep = (p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                      p.expert_model_parallel_size)
    dp = data_parallel_size_of(world_size, tp, cp, pp)
    check_expert_ranks(ep, dp, cp)
    return RunLayout(world_size=world_size, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, pipeline=layout_from_config(cfg),
                     sharding_strategy=sharding_strategy(cfg),
                     sequence_parallel=sequence_parallel_in_effect(p.sequence_parallel, tp),
                     compute_dtype=compute_dtype_name(cfg))
