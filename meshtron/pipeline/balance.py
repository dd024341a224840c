"""How evenly an even layer split loads the pipeline stages, and a split that loads them better.

The last stage runs its transformer layers *and* the output layer with the loss. With a large
vocabulary that is several layers' worth of matmuls (llama3-3b: 6·h·V ≈ 3.1 layers at 128K tokens
of vocabulary), so an even split makes the last stage the slowest and every other stage waits
for it once per micro-batch. Costs are training FLOPs per token (DESIGN.md section 7), counted in
transformer layers of the model's mean cost; each layer's own cost comes from its kinds
(:mod:`meshtron.layer_kinds`), so a pattern of unlike layers (dense and MoE) is split by cost, not by count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshtron.config import ConfigError, MeshtronConfig, ModelConfig
from meshtron.layer_kinds.pattern import layer_kinds
from meshtron.pipeline.partition import partition_layers
from meshtron.run_layout import layout_from_config


@dataclass(frozen=True)
class SplitSuggestion:
    """Give the last stage ``last_stage_layers`` (the others share the rest evenly)."""

    last_stage_layers: int
    output_layer_cost: float  # the output layer and loss, in transformer layers
    slowest_stage_speedup: float  # even split's slowest stage cost / the suggestion's


def output_layer_cost(cfg: MeshtronConfig, vocab_size: int) -> float:
    """FLOPs of the output layer and loss per token, in units of one transformer layer's."""
    # Imported here: the FLOPs count reads the attention kind's head dims from the layers, and importing
    # the pipeline package must not load the model's layers.
    from meshtron.training.metrics import flops_per_token

    m = cfg.model
    total = flops_per_token(m, vocab_size)
    output = 6.0 * m.hidden_size * vocab_size
    return output / ((total - output) / m.num_layers)


def layer_costs(m: ModelConfig) -> list[float]:
    """Each layer's training FLOPs per token, in units of the model's mean layer (all 1.0 when alike)."""
    flops = [k.mixer.forward_flops_per_token(m, m.seq_length) + 2 * k.mlp.parameters(m).matmul
             for k in layer_kinds(m)]
    mean = sum(flops) / len(flops)
    return [f / mean for f in flops]


def _slowest(cfg: MeshtronConfig, last: Optional[int], costs: list[float], out_cost: float) -> float:
    """The slowest stage's cost with ``last`` layers on the last stage (None: the even split)."""
    p = cfg.parallel
    layout = partition_layers(cfg.model.num_layers, p.pipeline_model_parallel_size, last=last,
                              virtual_size=p.virtual_pipeline_model_parallel_size,
                              layers_per_virtual=p.num_layers_per_virtual_pipeline_stage,
                              v_shape=p.pipeline_schedule == "zbv")
    stages = [sum(costs[i] for chunk in layout.stage_layers(r) for i in chunk) for r in range(layout.stages)]
    return max(stages[:-1] + [stages[-1] + out_cost])


def suggest_last_stage_layers(cfg: MeshtronConfig, vocab_size: int,
                              min_speedup: float = 1.03) -> Optional[SplitSuggestion]:
    """A ``--decoder-last-pipeline-num-layers`` that makes the slowest stage at least ``min_speedup``
    times faster than the even split, or None (one stage, a split already chosen by flags, or nothing
    to gain). Every stage's layer count stays divisible by the virtual stages."""
    p = cfg.parallel
    stages, layers = p.pipeline_model_parallel_size, cfg.model.num_layers
    if (stages < 2 or p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers
            or p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split):
        return None  # the user chose the split
    virtual = layout_from_config(cfg).virtual_stages
    out_cost = output_layer_cost(cfg, vocab_size)
    costs = layer_costs(cfg.model)
    even = _slowest(cfg, None, costs, out_cost)
    best: Optional[tuple[float, int]] = None
    for last in range(virtual, layers - (stages - 1) * virtual + 1, virtual):
        rest = layers - last
        if rest % (stages - 1) or (rest // (stages - 1)) % virtual:
            continue
        try:
            cost = _slowest(cfg, last, costs, out_cost)
        except ConfigError:  # a split the layout cannot make
            continue
        if best is None or cost < best[0]:
            best = (cost, last)
    if best is None or even / best[0] < min_speedup:
        return None
    return SplitSuggestion(best[1], out_cost, even / best[0])


def pipeline_balance_hint(cfg: MeshtronConfig, vocab_size: int) -> Optional[str]:
    """A one-line hint for the training log when the even split leaves the last stage much slower."""
    s = suggest_last_stage_layers(cfg, vocab_size)
    if s is None:
        return None
    return (f"pipeline balance: the last stage also runs the output layer and loss (about "
            f"{s.output_layer_cost:.1f} layers of work), so it is the slowest with an even split; "
            f"--decoder-last-pipeline-num-layers {s.last_stage_layers} would make the slowest stage "
            f"{s.slowest_stage_speedup:.2f}x faster by FLOP count")
