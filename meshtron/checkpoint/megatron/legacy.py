"""Megatron-LM's legacy format: ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, one file per model-parallel rank.

Each file holds that rank's ``state_dict_for_save_checkpoint()`` under ``model`` (``model0``, ``model1``... with
virtual pipeline stages) beside ``args``, ``iteration``, ``opt_param_scheduler`` and ``rng_state``. Layer
numbers are local to a pipeline stage (and model chunk); experts local to an expert-parallel rank. The shards
are merged here into Megatron's whole per-layer tensors:

* column-parallel weights (``linear_qkv``, ``linear_fc1``, a prediction depth's ``eh_proj``, word embeddings,
  ``output_layer``) along rows, SwiGLU's ``linear_fc1`` as ``[gate of every rank; up of every rank]`` (each rank
  holds ``[gate_r; up_r]``);
* row-parallel weights (``linear_proj``, ``linear_fc2``) along columns;
* everything else (norms, router, biases of row-parallel layers) is replicated: tensor-parallel rank 0's copy.

Layers are numbered by stage in Megatron's order (virtual chunk, then pipeline stage), from the number of
layers each file holds, so uneven first/last stages merge too. Multi-token prediction depths
(``mtp.layers.k.*``, their transformer layer ``mtp_model_layer``) sit on their stage (the last, or a layout
string's own) under their own numbers; that stage's copy of the word embedding that they read (with more than one
stage) is the first stage's tensor, kept equal by Megatron: the first stage's is taken.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron.detect import LEGACY_FILE, RANK_DIR
from meshtron.checkpoint.megatron.unpickler import load_pickled

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.(?:mtp_model_layer|transformer_layer)\.)(.+)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_COLUMN = re.compile(r"(linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias)\d*|word_embeddings\.weight|"
                     r"^output_layer\.weight|^mtp\.layers\.\d+\.eh_proj\.weight)$")
_ROW = re.compile(r"(linear_proj\.weight|linear_fc2\.weight\d*)$")
_FC1 = re.compile(r"linear_fc1\.(weight|bias)\d*$")


def rank_files(directory: Path, expert_only: bool = False) -> dict[tuple[int, int, int], Path]:
    """{(tp, pp, ep): model_optim_rng.pt} of an iteration directory. Megatron-LM leaves the pipeline field out of
    a one-stage checkpoint's names, so ``mp_rank_TT_NNN`` is a pipeline rank unless ``expert_only`` (one stage and
    several expert-parallel ranks, from the checkpoint's ``args``), when it is an expert-parallel rank."""
    out = {}
    for d in directory.iterdir():
        m = RANK_DIR.match(d.name)
        if m and d.is_dir():
            second = int(m.group(2) or 0)
            pp, ep = (0, second) if expert_only and m.group(3) is None else (second, int(m.group(3) or 0))
            out[(int(m.group(1)), pp, ep)] = d / LEGACY_FILE
    if not out:
        raise CheckpointError(f"Megatron-LM checkpoint {directory} holds no mp_rank_* directory")
    tps = sorted({k[0] for k in out})
    pps = sorted({k[1] for k in out})
    eps = sorted({k[2] for k in out})
    missing = [f"mp_rank_{t:02d}_{p:03d}" + (f"_{e:03d}" if len(eps) > 1 else "")
               for t in tps for p in pps for e in eps if (t, p, e) not in out]
    if missing or tps != list(range(len(tps))) or pps != list(range(len(pps))):
        raise CheckpointError(f"Megatron-LM checkpoint {directory} is incomplete: missing "
                              f"{', '.join(missing) or 'a tensor- or pipeline-parallel rank'}")
    for f in out.values():
        if not f.is_file():
            raise CheckpointError(f"Megatron-LM checkpoint file {f} is missing")
    return out


def first_rank_file(directory: Path) -> Path:
    """Model-parallel rank 0's ``model_optim_rng.pt`` (``mp_rank_00``, ``mp_rank_00_000`` or ``mp_rank_00_000_000``),
    whose ``args`` say how the other files are to be read, found before the others are checked."""
    for d in sorted(directory.iterdir()):
        m = RANK_DIR.match(d.name)
        if m and d.is_dir() and not any(int(g or 0) for g in m.groups()):
            return d / LEGACY_FILE
    raise CheckpointError(f"Megatron-LM checkpoint {directory} holds no mp_rank_00* directory (model-parallel "
                          "rank 0)")


def read_rank(f: Path) -> dict:
    state = load_pickled(f, str(f))
    if not isinstance(state, dict) or not any(k == "model" or re.fullmatch(r"model\d+", str(k)) for k in state):
        raise CheckpointError(f"Megatron-LM checkpoint file {f} holds no 'model' state dict")
    return state


def _chunks(state: dict) -> list[dict]:
    if "model" in state:
        return [state["model"]]
    return [state[f"model{v}"] for v in range(len([k for k in state if re.fullmatch(r"model\d+", str(k))]))]


def _layer_count(sd: dict) -> int:
    layers = {int(m.group(1)) for k in sd if (m := _LAYER.match(k))}
    return max(layers) + 1 if layers else 0


def merge(directory: Path, swiglu: bool, files: Optional[dict[tuple[int, int, int], Path]] = None
          ) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int, int], dict], list[str]]:
    """(Megatron's whole per-layer tensors, every file's state by (tp, pp, ep), notices) of a legacy directory
    (its files as :func:`rank_files` found them, by default without the checkpoint's ``args``)."""
    files = files or rank_files(directory)
    tp = 1 + max(k[0] for k in files)
    pp = 1 + max(k[1] for k in files)
    states = {k: read_rank(f) for k, f in files.items()}
    first = states[(0, 0, 0)]
    vp = len(_chunks(first))
    # global layer offset of (virtual chunk v, stage p): Megatron's order is chunk-major
    offsets, start = {}, 0
    for v in range(vp):
        for p in range(pp):
            offsets[(v, p)] = start
            start += _layer_count(_chunks(states[(0, p, 0)])[v])
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for (t, p, e), state in states.items():
        for v, sd in enumerate(_chunks(state)):
            experts_here = None
            for key, value in sd.items():
                if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
                    continue
                name = key
                m = _LAYER.match(key) or _MTP_LAYER.match(key)
                if m:
                    rest = m.group(2)
                    em = _LOCAL_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
                    if em is not None:
                        if experts_here is None:
                            experts_here = _local_expert_count(sd)
                        idx = int(em.group(2)) + e * experts_here
                        rest = (f"{em.group(1)}{idx}{em.group(3)}" if em.re is _LOCAL_EXPERT
                                else f"{em.group(1)}{idx}")
                    elif e > 0:
                        continue  # non-expert tensors repeat on every expert-parallel rank
                    name = (f"decoder.layers.{int(m.group(1)) + offsets[(v, p)]}.{rest}" if m.re is _LAYER
                            else f"{m.group(1)}{rest}")
                elif e > 0:
                    continue
                elif key == "embedding.word_embeddings.weight" and (p, v) != (0, 0):
                    continue  # the prediction depths' copy on their stage: the first stage's is kept
                shards.setdefault(name, {})[t] = value
    merged = {name: _merge_tp(name, parts, tp, swiglu) for name, parts in shards.items()}
    return merged, states, []


def _local_expert_count(sd: dict) -> int:
    ids = set()
    for k in sd:
        m = _LAYER.match(k) or _MTP_LAYER.match(k)
        if m:
            em = _LOCAL_EXPERT.match(m.group(2)) or _GROUPED_EXPERT.match(m.group(2))
            if em:
                ids.add(int(em.group(2)))
    return len(ids)


def _merge_tp(name: str, parts: dict[int, torch.Tensor], tp: int, swiglu: bool) -> torch.Tensor:
    if len(parts) == 1:
        return parts[next(iter(parts))]
    if sorted(parts) != list(range(tp)):
        raise CheckpointError(f"Megatron-LM tensor {name}: tensor-parallel shards {sorted(parts)} of {tp}")
    ordered = [parts[r] for r in range(tp)]
    if _ROW.search(name):
        return torch.cat(ordered, dim=1)
    if _COLUMN.search(name) and not name.endswith("layer_norm_weight"):
        if swiglu and _FC1.search(name):
            halves = [x.chunk(2, dim=0) for x in ordered]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(ordered, dim=0)
    return ordered[0]  # replicated over tensor parallelism
