"""The per-layer pattern: which mixer and which MLP kind each layer has.

``--layer-pattern`` gives it as comma-separated ``MIXER+MLP`` entries, each optionally repeated with ``*N``,
one layer per repetition, in layer order: ``gqa+dense*3,gqa+moe*29`` is three dense layers, then 29 MoE
layers. Without it the pattern follows from the other flags: ``mla`` with --multi-latent-attention (else
``gqa``), ``moe`` where --num-experts, --moe-layer-freq and --moe-first-dense-layers put experts (else
``dense``). In the spirit of Megatron-Core's hybrid layer pattern, with a mixer and an MLP per layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from meshtron.config import ConfigError, ModelConfig
from meshtron.layer_kinds import MIXERS, MLPS, MixerKind, MLPKind

FLAG = "--layer-pattern"


@dataclass(frozen=True)
class LayerKinds:
    """The kinds of one layer."""

    mixer: MixerKind
    mlp: MLPKind

    @property
    def entry(self) -> str:
        """Its ``MIXER+MLP`` entry."""
        return f"{self.mixer.name}+{self.mlp.name}"


def _syntax() -> str:
    return (f"expected comma-separated MIXER+MLP entries, each optionally *N (mixers: {', '.join(MIXERS)}; "
            f"MLPs: {', '.join(MLPS)}), e.g. gqa+dense*3,gqa+moe*29")


def parse_pattern(text: str) -> list[tuple[str, str]]:
    """``(mixer, mlp)`` names of each layer of a ``--layer-pattern`` value; a one-line ConfigError if malformed."""
    layers: list[tuple[str, str]] = []
    for raw in text.split(","):
        entry = raw.strip()
        body, star, count = entry.partition("*")
        mixer, plus, mlp = body.strip().partition("+")
        mixer, mlp = mixer.strip(), mlp.strip()
        if not plus or mixer not in MIXERS or mlp not in MLPS or (star and not count.strip().isdigit()):
            raise ConfigError(f"{FLAG}: bad entry {entry!r}; {_syntax()}")
        repeat = int(count) if star else 1
        if repeat < 1:
            raise ConfigError(f"{FLAG}: bad entry {entry!r} (a repeat must be at least 1); {_syntax()}")
        layers += [(mixer, mlp)] * repeat
    return layers


def format_pattern(entries: list[str]) -> str:
    """The compact ``--layer-pattern`` form of per-layer ``MIXER+MLP`` entries (runs folded into ``*N``)."""
    out: list[str] = []
    i = 0
    while i < len(entries):
        j = i
        while j < len(entries) and entries[j] == entries[i]:
            j += 1
        out.append(entries[i] if j - i == 1 else f"{entries[i]}*{j - i}")
        i = j
    return ",".join(out)


def derived_entries(m: ModelConfig) -> list[str]:
    """The per-layer entries today's flags imply (see the module docstring)."""
    return list(_derived(m.num_layers, bool(m.multi_latent_attention), bool(m.num_experts), m.moe_layer_freq,
                         m.moe_first_dense_layers))


@functools.lru_cache(maxsize=256)
def _derived(num_layers: int, mla: bool, experts: bool, freq: int, first_dense: int) -> tuple[str, ...]:
    mixer = "mla" if mla else "gqa"

    def moe(layer: int) -> bool:
        return experts and layer >= first_dense and layer % max(1, freq) == 0

    return tuple(f"{mixer}+{'moe' if moe(i) else 'dense'}" for i in range(num_layers))


@functools.lru_cache(maxsize=256)
def _kinds(pattern: Optional[str], num_layers: int, derived: tuple[str, ...]) -> tuple[LayerKinds, ...]:
    if pattern is None:
        names = [tuple(entry.split("+")) for entry in derived]
    else:
        names = parse_pattern(pattern)
        if len(names) != num_layers:
            raise ConfigError(f"{FLAG} gives {len(names)} layers but --num-layers is {num_layers}")
    return tuple(LayerKinds(MIXERS[mixer], MLPS[mlp]) for mixer, mlp in names)


def layer_kinds(m: ModelConfig) -> tuple[LayerKinds, ...]:
    """The kinds of each of ``m``'s layers, in layer order (looked up often: cached by the fields they follow)."""
    derived = _derived(m.num_layers, bool(m.multi_latent_attention), bool(m.num_experts), m.moe_layer_freq,
                       m.moe_first_dense_layers)
    return _kinds(m.layer_pattern or None, m.num_layers, derived)


def layer_at(m: ModelConfig, layer: int) -> LayerKinds:
    """The kinds of layer ``layer`` (0-based, global)."""
    return layer_kinds(m)[layer]


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` (0-based, global) has a mixture-of-experts MLP, by the layer pattern (by default
    every --moe-layer-freq-th layer counting from layer 0, except the first --moe-first-dense-layers)."""
    return layer_at(m, layer).mlp.has_experts


def resolved_pattern(m: ModelConfig) -> str:
    """``m``'s pattern in the compact form, given or derived."""
    return format_pattern([kinds.entry for kinds in layer_kinds(m)])


def pattern_is_derived(m: ModelConfig) -> bool:
    """Whether ``m``'s layers are those its flags imply (no --layer-pattern, or one equal to the derived)."""
    return not m.layer_pattern or [k.entry for k in layer_kinds(m)] == derived_entries(m)


def check_pattern(m: ModelConfig) -> None:
    """Refuse, in one line, a pattern that is malformed, of the wrong length, or that names a kind the other
    flags cannot give (each kind's own check), or mixers that need different rotary tables."""
    kinds = layer_kinds(m)
    used = {**{f"mixer {k.mixer.name}": k.mixer for k in kinds}, **{f"mlp {k.mlp.name}": k.mlp for k in kinds}}
    for kind in used.values():
        problem = kind.check(m)
        if problem:
            raise ConfigError(f"{FLAG}: {problem}")
    rope = {k.mixer.rope_dim(m) for k in kinds if k.mixer.rope_dim(m)}
    if len(rope) > 1:
        raise ConfigError(f"{FLAG}: the mixers need rotary tables of different widths {sorted(rope)}; one model "
                          "has one")
