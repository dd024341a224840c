"""The layer kinds' matrices against the model as built: what Muon's costs count is what it orthogonalises.

Each layer kind describes its 2-D weights without torch (``matrices``); Muon's step-time work
(:func:`meshtron.optim.kinds.muon.layer_matrices`) iterates over the pattern's kinds and keeps those its rule
updates. Here every preset, and patterns that mix dense and MoE layers or use MLA with and without a query
latent, are built on the meta device and their canonical 2-D tensors are compared with the descriptions, names,
shapes and expert flags alike.
"""

from __future__ import annotations

import pytest

from meshtron.build import build_stage
from meshtron.config import MeshtronConfig
from meshtron.layer_kinds.pattern import layer_at, parse_pattern
from meshtron.optim.kinds.muon import MIXER_PART, MLP_PART, layer_matrices
from meshtron.optim.muon_rule import uses_muon
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import spec_of
from meshtron.presets import PRESETS, apply_preset

LAYERS = 4  # enough for a MoE layer after DeepSeek-V3's three dense ones
VOCAB = 512

#: (preset, field overrides): mixed patterns beside the presets' own.
MIXED = {
    "dense-moe alternation": ("qwen3-30b-a3b", {"layer_pattern": "gqa+dense,gqa+moe,gqa+dense,gqa+moe",
                                                "ffn_hidden_size": 1024}),
    "mla without a query latent, moe then dense": ("deepseek-v2-lite", {"layer_pattern":
                                                                         "mla+moe,mla+dense,mla+moe,mla+dense"}),
    "gelu experts with biases": ("gpt2-small", {"num_experts": 4, "layer_pattern": "gqa+moe,gqa+dense*3"}),
}


def _config(preset: str, **fields) -> MeshtronConfig:
    cfg = MeshtronConfig()
    apply_preset(cfg.model, preset)
    cfg.model.num_layers = min(cfg.model.num_layers, LAYERS)
    if cfg.model.layer_pattern:  # a preset's own pattern (gpt-oss, Qwen3.5), cut to the layers kept
        kept = parse_pattern(cfg.model.layer_pattern)[:LAYERS]
        cfg.model.layer_pattern = ",".join(f"{mixer}+{mlp}" for mixer, mlp in kept)
    cfg.model.mtp_num_layers = None
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    return cfg


def _built(cfg: MeshtronConfig) -> dict[int, dict[str, tuple[tuple, bool, bool]]]:
    """Per layer, its canonical 2-D tensors: relative name -> (shape, expert, updated by Muon)."""
    model = build_stage(cfg, ParallelContext(), VOCAB)
    out: dict[int, dict[str, tuple[tuple, bool, bool]]] = {}
    for param in model.parameters():
        spec = spec_of(param)
        for piece in spec.pieces:
            parts = piece.name.split(".")
            if parts[0] == "layers" and len(piece.full_shape) == 2:
                out.setdefault(int(parts[1]), {})[".".join(parts[2:])] = (
                    tuple(piece.full_shape), bool(spec.expert), uses_muon(spec.pieces))
    return out


def _check(cfg: MeshtronConfig) -> None:
    m = cfg.model
    built = _built(cfg)
    assert sorted(built) == list(range(m.num_layers))
    for layer in range(m.num_layers):
        kinds = layer_at(m, layer)
        described = {**{MIXER_PART + x.name: ((x.rows, x.cols), x.expert) for x in kinds.mixer.matrices(m)},
                     **{MLP_PART + x.name: ((x.rows, x.cols), x.expert) for x in kinds.mlp.matrices(m)}}
        assert described == {name: (shape, expert) for name, (shape, expert, _) in built[layer].items()}, layer
        muon = {x.name: ((x.rows, x.cols), x.expert) for x in layer_matrices(m, kinds)}
        assert muon == {name: (shape, expert) for name, (shape, expert, updated) in built[layer].items()
                        if updated}, layer


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_describes_its_matrices(preset):
    _check(_config(preset))


@pytest.mark.parametrize("case", sorted(MIXED))
def test_mixed_patterns_describe_their_matrices(case):
    preset, fields = MIXED[case]
    _check(_config(preset, **fields))


def test_muon_work_follows_the_pattern():
    """A dense layer costs Muon its dense MLP, not the experts: the work of a half-dense pattern lies between."""
    from meshtron.optim.kinds.muon import KIND

    def work(pattern):
        cfg = _config("qwen3-30b-a3b", layer_pattern=pattern, ffn_hidden_size=1024)
        return KIND.step_work(cfg, 1, 1, 1).matmul_flops

    dense, mixed, moe = work("gqa+dense*4"), work("gqa+dense,gqa+moe,gqa+dense,gqa+moe"), work("gqa+moe*4")
    assert dense < mixed < moe
    assert mixed == pytest.approx((dense + moe) / 2)
