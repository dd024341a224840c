"""The registry of layer kinds: token mixers and MLPs, each with a torch-free description.

A layer of the model is one entry of its pattern (:mod:`meshtron.layer_kinds.pattern`): a mixer kind and an
MLP kind by name. Everything that needs a layer's numbers (parameters, FLOPs, saved activations, step-time
work, Hugging Face names) or its module asks the description found here; docs/layer-kinds.md tells how to add
a kind. Importing this package imports no torch: the modules are imported when a model is built.
"""

from __future__ import annotations

from meshtron.layer_kinds.base import Counts, MixerKind, MLPKind, RankParameters
from meshtron.layer_kinds.dense import DENSE
from meshtron.layer_kinds.gated_attention import GATED_ATTN
from meshtron.layer_kinds.gated_deltanet import GDN
from meshtron.layer_kinds.gated_shared_moe import GATED_SHARED_MOE
from meshtron.layer_kinds.gqa import GQA
from meshtron.layer_kinds.mla import MLA
from meshtron.layer_kinds.moe import MOE
from meshtron.layer_kinds.oss_moe import OSS_MOE
from meshtron.layer_kinds.sink import SINK, SINK_WINDOW

#: Token-mixer kinds by their name in ``--layer-pattern``.
MIXERS: dict[str, MixerKind] = {kind.name: kind for kind in (GQA, MLA, SINK, SINK_WINDOW, GDN, GATED_ATTN)}
#: MLP kinds by their name in ``--layer-pattern``.
MLPS: dict[str, MLPKind] = {kind.name: kind for kind in (DENSE, MOE, OSS_MOE, GATED_SHARED_MOE)}


def mixer_kind(name: str) -> MixerKind:
    """The mixer kind called ``name``."""
    return MIXERS[name]


def mlp_kind(name: str) -> MLPKind:
    """The MLP kind called ``name``."""
    return MLPS[name]


__all__ = ["Counts", "MIXERS", "MLPS", "MLPKind", "MixerKind", "RankParameters", "mixer_kind", "mlp_kind"]
