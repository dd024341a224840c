"""What a checkpoint says about itself, and how a run is matched against it.

Each checkpoint directory holds, besides the DCP tensor files:

* ``meshtron_checkpoint.json``, the manifest: format version, iteration, training
  progress, the optimizer's step count, the model signature (the shape fields below),
  the layout that wrote it (for information only: loading does not depend on it), and
  (from format version 2) the size and CRC-32 of every other file plus a CRC-32 of
  itself (see :mod:`meshtron.checkpoint.checksums`);
* ``config.yaml``: the whole run configuration (``cfg.to_dict()``);
* ``rng/rank_NNNNN.pt``: each rank's random-number-generator states;
* ``tokenizer/``: the tokenizer, when the run had one.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import yaml

from meshtron.checkpoint.errors import CheckpointError
from meshtron.config import SECTIONS, MeshtronConfig, ModelConfig, ffn_size, flag_name, head_dim, num_kv_heads
from meshtron.layer_kinds.pattern import pattern_is_derived, resolved_pattern
from meshtron.training.state import TrainingState

FORMAT_NAME = "meshtron-dcp"
#: 2: the manifest lists every file's size and checksum. Version 1 checkpoints load without verification.
FORMAT_VERSION = 2
META_FILE = "meshtron_checkpoint.json"
CONFIG_FILE = "config.yaml"
RNG_DIR = "rng"
TOKENIZER_DIR = "tokenizer"


def model_signature(m: ModelConfig, vocab_size: Optional[int]) -> dict[str, Any]:
    """The model fields that must agree between a checkpoint and the run loading it (derived values resolved)."""
    sig: dict[str, Any] = {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": num_kv_heads(m),
        "kv_channels": head_dim(m),
        "ffn_hidden_size": ffn_size(m),
        "vocab_size": vocab_size if vocab_size is not None else m.vocab_size,
        "normalization": m.normalization,
        "swiglu": bool(m.swiglu),
        "position_embedding_type": m.position_embedding_type,
        "untie_embeddings_and_output_weights": bool(m.untie_embeddings_and_output_weights),
        "disable_bias_linear": bool(m.disable_bias_linear),
        "add_qkv_bias": bool(m.add_qkv_bias),
        "num_experts": m.num_experts,
    }
    if m.position_embedding_type == "learned_absolute":
        sig["max_position_embeddings"] = m.max_position_embeddings or m.seq_length
    if m.qk_layernorm:
        sig["qk_layernorm"] = True
    if m.multi_latent_attention:  # MLA's shapes; kv_channels and num_query_groups do not apply
        sig.update(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                   qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim)
    if m.num_experts:
        sig["moe_ffn_hidden_size"] = m.moe_ffn_hidden_size or ffn_size(m)
        sig["moe_shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size
        sig["moe_layer_freq"] = m.moe_layer_freq
        sig.update(_routing_signature(m))
    pattern = _pattern_signature(m)
    if pattern:
        sig["layer_pattern"] = pattern
    if m.mtp_num_layers and m.mtp_normed_hidden_states:  # depths trained on normed hidden states compute so
        sig["mtp_normed_hidden_states"] = True
    return sig


def _pattern_signature(m: ModelConfig) -> Optional[str]:
    """The layer pattern where --layer-pattern gives one other than the flags imply (None otherwise, so that
    checkpoints of derived patterns keep their old signature)."""
    return None if pattern_is_derived(m) else resolved_pattern(m)


_ROUTING_FIELDS = ("moe_first_dense_layers", "moe_router_score_function", "moe_router_pre_softmax",
                   "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
                   "moe_router_topk_scaling_factor")
#: signature fields written only when they differ from these values (older checkpoints lack them)
_OMITTED_DEFAULTS = {"qk_layernorm": False, "multi_latent_attention": False, "layer_pattern": None,
                     "mtp_normed_hidden_states": False, **{key: getattr(ModelConfig(), key) for key in _ROUTING_FIELDS}}


def _routing_signature(m: ModelConfig) -> dict[str, Any]:
    """The routing fields that differ from the defaults: a model trained to route one way does not load
    into a run that routes another (checkpoints of default routing keep their old signature)."""
    return {key: getattr(m, key) for key in _ROUTING_FIELDS if getattr(m, key) != _OMITTED_DEFAULTS[key]}


def compare_signatures(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per model field that differs (saved checkpoint vs this run)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, _OMITTED_DEFAULTS.get(key)), current.get(key, _OMITTED_DEFAULTS.get(key))
        if a != b:
            out.append(f"{key} ({flag_name(key)}): checkpoint {a!r}, this run {b!r}")
    return out


_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)\.")


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    nums = sorted(set(numbers))
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def compare_tensors(saved: dict[str, tuple], required: dict[str, tuple], what: str = "tensor") -> list[str]:
    """One line per kind of tensor difference: missing from the checkpoint, only in the checkpoint, other shape.

    Tensors that differ the same way in several layers share one line (``layers.*.x ... (layers 0-31)``),
    so that the list stays complete and short.
    """
    items: list[tuple[str, str, tuple]] = []
    for name in set(required) - set(saved):
        items.append(("missing", name, (tuple(required[name]),)))
    for name in set(saved) - set(required):
        items.append(("extra", name, (tuple(saved[name]),)))
    for name in set(saved) & set(required):
        if tuple(saved[name]) != tuple(required[name]):
            items.append(("shape", name, (tuple(saved[name]), tuple(required[name]))))
    grouped: dict[tuple, list[int]] = {}
    for kind, name, shapes in items:
        m = _LAYER_RE.search(name)
        pattern = _LAYER_RE.sub(lambda g: f"{g.group(1)}layers.*.", name, count=1) if m else name
        grouped.setdefault((kind, pattern, shapes), []).extend([int(m.group(2))] if m else [])
    order = {"missing": 0, "extra": 1, "shape": 2}
    out = []
    for (kind, pattern, shapes), layers in sorted(grouped.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        suffix = f" (layers {_ranges(layers)})" if "layers.*." in pattern else ""
        if kind == "missing":
            out.append(f"{what} {pattern} {shapes[0]} is missing from the checkpoint{suffix}")
        elif kind == "extra":
            out.append(f"{what} {pattern} {shapes[0]} is in the checkpoint but not in this model{suffix}")
        else:
            out.append(f"{what} {pattern}: checkpoint shape {shapes[0]}, this model {shapes[1]}{suffix}")
    return out


def training_state_dict(state: TrainingState) -> dict[str, Any]:
    """The JSON-serialisable part of a TrainingState (everything but the RNG states)."""
    out = {"iteration": int(state.iteration), "consumed_samples": int(state.consumed_samples),
           "nonfinite_in_a_row": int(state.nonfinite_in_a_row), "skipped_iterations": int(state.skipped_iterations),
           "extra": state.extra}
    try:
        json.dumps(out)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"TrainingState.extra must be JSON-serialisable to be checkpointed ({err})") from None
    return out


def training_state_from_dict(d: dict[str, Any]) -> TrainingState:
    return TrainingState(iteration=int(d["iteration"]), consumed_samples=int(d["consumed_samples"]),
                         nonfinite_in_a_row=int(d.get("nonfinite_in_a_row", 0)),
                         skipped_iterations=int(d.get("skipped_iterations", 0)), extra=dict(d.get("extra") or {}))


def config_yaml(cfg: Optional[MeshtronConfig]) -> str:
    return yaml.safe_dump(cfg.to_dict() if cfg is not None else {}, sort_keys=False)


def config_from_dict(values: dict[str, Any]) -> MeshtronConfig:
    """A MeshtronConfig holding the saved values (keys unknown to this version are ignored).

    Each value goes through the command line's conversion for its field, as a ``--config``
    YAML value would: ValueError names the key whose value has the wrong type.
    """
    from meshtron.flags import coerce, spec_by_name  # the one conversion of flag values (YAML included)

    cfg = MeshtronConfig()
    known = {f for cls in SECTIONS.values() for f in cls.__dataclass_fields__}
    specs = spec_by_name()
    for key, value in values.items():
        if key not in known:
            continue
        if key in specs:
            try:
                value = coerce(specs[key], value)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
        cfg.set(key, value)
    return cfg


def read_config(ckpt_dir: str | Path) -> MeshtronConfig:
    """The run configuration saved in a checkpoint directory."""
    f = Path(ckpt_dir) / CONFIG_FILE
    try:
        values = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {ckpt_dir} is not a complete meshtron checkpoint") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{f} is not valid YAML ({first}): the checkpoint is damaged") from None
    except OSError as err:
        raise CheckpointError(f"cannot read {f}: {err.strerror or err}") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{f} holds a YAML {type(values).__name__}, not a mapping of settings")
    try:
        return config_from_dict(values)
    except Exception as err:  # a value of the wrong type for its field: the config's own errors vary
        raise CheckpointError(f"{f} holds a setting this meshtron cannot use: {err}") from None


def read_json_file(path: Path, missing: str = "", invalid: str = "") -> Any:
    """A JSON file's value; CheckpointError naming the file when it is missing (message + ``missing``), not JSON
    (+ ``invalid``) or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing{missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}){invalid}") from None
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's ``meshtron_checkpoint.json``, checked for a known format."""
    f = Path(ckpt_dir) / META_FILE
    meta = read_json_file(f, missing=f": {ckpt_dir} is not a complete meshtron checkpoint",
                          invalid=": the checkpoint is damaged")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f} holds a JSON {type(meta).__name__}, not a checkpoint manifest")
    version = meta.get("version")
    if meta.get("format") != FORMAT_NAME or not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{f}: unsupported checkpoint format {meta.get('format')!r} version "
                              f"{meta.get('version')!r} (this meshtron reads {FORMAT_NAME} up to version "
                              f"{FORMAT_VERSION})")
    return meta


def meta_json(meta: dict[str, Any]) -> bytes:
    return (json.dumps(meta, indent=2, sort_keys=False) + "\n").encode()


def checkpoint_meta(state: TrainingState, signature: dict[str, Any], layout: dict[str, int],
                    optimizer_step: Optional[int], rng_world_size: Optional[int], has_tokenizer: bool) -> dict[str, Any]:
    """The content of ``meshtron_checkpoint.json`` (``optimizer_step``/``rng_world_size`` None: not saved)."""
    import meshtron

    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "iteration": int(state.iteration),
        "training_state": training_state_dict(state),
        "optimizer": {"present": optimizer_step is not None, "step_count": int(optimizer_step or 0)},
        "model": signature,
        "layout": layout,
        "rng": {"present": rng_world_size is not None, "world_size": int(rng_world_size or 0)},
        "tokenizer": has_tokenizer,
        "meshtron_version": meshtron.__version__,
        "torch_version": torch.__version__,
    }


def layout_dict(ctx) -> dict[str, int]:
    return {"world_size": ctx.world_size, "tp": ctx.tp, "cp": ctx.cp, "dp": ctx.dp, "pp": ctx.pp, "ep": ctx.ep}


# ---------------------------------------------------------------------------------------------
# RNG states, stored so that ``torch.load(weights_only=True)`` can read them back.
# ---------------------------------------------------------------------------------------------

_NDARRAY = "__ndarray__"


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj)).clone()}
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_encode(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_NDARRAY}:
            return obj[_NDARRAY].numpy()
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_decode(v) for v in obj)
    return obj


def rng_file(ckpt_dir: str | Path, rank: int) -> Path:
    return Path(ckpt_dir) / RNG_DIR / f"rank_{rank:05d}.pt"


def rng_bytes(rng_state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(_encode(rng_state), buf)
    return buf.getvalue()


_RNG_KEYS = ("python", "numpy", "torch")


def read_rng(ckpt_dir: str | Path, rank: int) -> dict:
    """Rank ``rank``'s saved RNG states (``torch.load(weights_only=True)``: tensors and plain containers only)."""
    f = rng_file(ckpt_dir, rank)
    try:
        state = _decode(torch.load(f, map_location="cpu", weights_only=True))
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing (RNG state of rank {rank}); load with --no-load-rng to skip it") from None
    except Exception as err:  # truncated or garbage bytes, or globals weights_only refuses: errors vary
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{f} is corrupt or truncated (RNG state of rank {rank}: {reason}); load with "
                              "--no-load-rng to skip it") from None
    if not isinstance(state, dict) or any(k not in state for k in _RNG_KEYS):
        raise CheckpointError(f"{f} does not hold RNG states (expected {', '.join(_RNG_KEYS)}); load with "
                              "--no-load-rng to skip it")
    return state
