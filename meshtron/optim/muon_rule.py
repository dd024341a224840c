"""Which tensors ``--optimizer muon`` updates, and the constants of its Newton-Schulz iteration (torch-free).

Read by the optimizer kind (:mod:`meshtron.optim.kinds.muon`: checks, state names, costs) and by the update
itself (:mod:`meshtron.optim.muon_update`), so that neither imports the other.
"""

from __future__ import annotations

from typing import Sequence

#: Newton-Schulz coefficients by --muon-coefficient-type.
NS_COEFFICIENTS = {"quintic": (3.4445, -4.7750, 2.0315)}
NS_EPS = 1e-7
#: The states of a parameter Muon updates (the others keep AdamW's).
STATES = ("master", "momentum_buffer")


# ------------------------------------------------------------------------------------------------ the rule
def updates_matrix(name: str) -> bool:
    """Whether Muon updates the canonical 2-D tensor ``name`` (a model name, or one relative to a layer): every
    matrix but the embeddings, the output layer, the routers and depthwise convolution filters (``conv1d``:
    one kernel per channel, not a linear map; Megatron and Hugging Face hold it 3-D, where AdamW takes it)."""
    parts = name.split(".")
    return parts[0] not in ("embedding", "output") and "router" not in parts and "conv1d" not in parts


def uses_muon(pieces: Sequence) -> bool:
    """Whether a parameter cut from ``pieces`` is updated by Muon: every piece a hidden matrix (2-D, not an
    embedding, output layer or router)."""
    return bool(pieces) and all(len(p.full_shape) == 2 and updates_matrix(p.name) for p in pieces)
