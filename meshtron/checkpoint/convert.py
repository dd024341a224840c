"""``meshtron convert``: Hugging Face Llama/Mistral/Mixtral/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V2/V3 <-> meshtron
checkpoints.

``meshtron convert --from hf --input HF_DIR --output CKPT`` reads ``config.json``,
the safetensors weights (one file or an index of shards) and the tokenizer
files, and writes a meshtron checkpoint at iteration 0 (no optimizer state) that
``meshtron train --load CKPT`` (any parallel layout) and ``meshtron generate
--load CKPT`` read. DeepSeek-V3's multi-token prediction layers become the
checkpoint's ``--mtp-num-layers`` depths unless ``--skip-mtp`` leaves them out.

``meshtron convert --to hf --input CKPT --output HF_DIR`` writes the model
tensors of a meshtron checkpoint (written in any layout) as safetensors with a
``config.json`` and the tokenizer files, loadable by ``transformers``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtron.checkpoint import hf
from meshtron.checkpoint.conversion_checks import check_complete, first_missing, require_empty
from meshtron.checkpoint.dcp_reader import read_dcp_metadata, safe_dcp_load
from meshtron.checkpoint.errors import (
    DISK_FULL_ERRNOS, CheckpointError, CheckpointSaveError, describe_dcp_failure, describe_os_error, is_disk_full,
)
from meshtron.checkpoint.load import read_checkpoint_tokenizer, resolve_checkpoint
from meshtron.checkpoint.metadata import (
    TOKENIZER_DIR, checkpoint_meta, config_yaml, model_signature, read_config, read_json_file,
    read_meta,
)
from meshtron.checkpoint.pieces import MODEL_PREFIX, SavedShard, model_key, to_state_dict
from meshtron.checkpoint.verify import verify_checkpoint
from meshtron.checkpoint.writer import SaveJob, quiet_single_process_notice, write_and_publish
from meshtron.training.state import TrainingState

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _canonical_order(name: str) -> tuple:
    """Embedding first, then layers by index, then the final norm and output layer."""
    if name.startswith("embedding."):
        return (0, 0, name)
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]), name)
    return (2, 0, name)


# ---------------------------------------------------------------------------------------------
# Hugging Face files.
# ---------------------------------------------------------------------------------------------

def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; CheckpointError naming it when it is truncated or not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, OSError, RuntimeError) as err:  # header, length and dtype problems
        text = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} is not a readable safetensors file ({text}): truncated or damaged?") \
            from None


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory (``model.safetensors`` or a sharded index)."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json_file(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor name -> file name")
        files = sorted(set(weight_map.values()))
        for name in files:
            if Path(name).name != name or name in (".", ".."):
                raise CheckpointError(f"{index} names {name!r}, which is not a file of {directory}")
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        bins = sorted(p.name for p in directory.glob("*.bin"))
        hint = " (it has PyTorch .bin files: re-save the model with safe_serialization=True)" if bins else ""
        raise CheckpointError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{index} names {name}, which is missing")
        tensors.update(read_safetensors(path))
    return tensors


def write_hf_tensors(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> list[str]:
    """Write safetensors shards of at most ``max_shard_bytes`` (one file when it fits); returns the file names."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2) + "\n", encoding="utf-8")
    return names


# ---------------------------------------------------------------------------------------------
# Hugging Face -> meshtron.
# ---------------------------------------------------------------------------------------------

def _hf_tokenizer(directory: Path, notices: list[str]):
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        notices.append(f"{directory} has no tokenizer files: the checkpoint has no tokenizer")
        return None
    from meshtron.data.errors import DataError
    from meshtron.data.tokenizers import HuggingFaceTokenizer

    try:
        return HuggingFaceTokenizer(directory)
    except DataError as err:
        notices.append(f"tokenizer not converted: {err}")
        return None


def hf_to_meshtron(input_dir: str | Path, output_dir: str | Path, dtype: Optional[torch.dtype] = None,
                   notices: Optional[list[str]] = None, skip_mtp: bool = False) -> Path:
    """Convert a Hugging Face model directory (a family of :data:`hf.ARCHITECTURES`) into a meshtron checkpoint
    (iteration 0); returns its path.

    DeepSeek-V3's multi-token prediction layers (``model.layers.{num_hidden_layers + k}``, as many as
    ``num_nextn_predict_layers``) become the checkpoint's ``mtp.layers.{k}`` depths (``--mtp-num-layers``), their
    copies of the embedding and output layer checked equal to the model's; with ``skip_mtp``, or when the
    weights hold none of them, they are left out with a notice (a model without ``--mtp-num-layers``)."""
    quiet_single_process_notice()
    notices = notices if notices is not None else []
    src, out = Path(input_dir), Path(output_dir)
    config_file = src / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"--input {src}: config.json not found (expected a Hugging Face model directory)")
    require_empty(out)
    cfg, values = _config_from_file(config_file, notices)
    interleave = hf.rope_interleaved(values)
    hf_tensors = read_hf_tensors(src)
    extra_layers = sorted({layer for layer in map(hf.hf_layer_index, hf_tensors)
                           if layer is not None and layer >= cfg.model.num_layers})
    depths = cfg.model.mtp_num_layers or 0
    if depths and (skip_mtp or not extra_layers):
        cfg.model.mtp_num_layers = None
        if not skip_mtp:
            notices.append(f"config.json: num_nextn_predict_layers {depths}, but the weights hold no layer from "
                           f"model.layers.{values['num_hidden_layers']} on: converted without multi-token "
                           "prediction")
    # DeepSeek-V3's prediction layers follow the last layer; left out when not imported
    skipping = values.get("model_type") == "deepseek_v3" and not cfg.model.mtp_num_layers
    chunks, seen = [], {}
    for hf_name, tensor in hf_tensors.items():
        layer = hf.hf_layer_index(hf_name)
        if skipping and layer is not None and layer >= cfg.model.num_layers:
            continue  # the multi-token prediction layers, left out
        for name, part in hf.hf_to_meshtron_tensors(hf_name, tensor, cfg.model, interleave):
            if not cfg.model.untie_embeddings_and_output_weights and name == "output.weight":
                continue  # tied: the output layer is the embedding
            if name in seen:  # a prediction layer's copy of the embedding or output layer: one tensor in meshtron
                first, kept = seen[name]
                if part.shape != kept.shape or not torch.equal(part, kept):
                    raise CheckpointError(f"{hf_name} differs from {first}: meshtron's multi-token prediction "
                                          f"depths share the model's {name}")
                continue
            seen[name] = (hf_name, part)
            # contiguous copies: a slice of a fused expert tensor must not carry the whole storage along
            t = (part.to(dtype) if dtype is not None else part).contiguous()
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t = t.clone()
            chunks.append(SavedShard(model_key(name), tuple(t.shape), (0,) * t.dim(), t))
    if skipping and extra_layers:
        notices.append(f"skipped the multi-token prediction layer(s) {extra_layers} (model.layers.N with N >= "
                       f"num_hidden_layers {cfg.model.num_layers}): they are not imported")
    check_complete(cfg, {c.key[len(MODEL_PREFIX):]: c.global_shape for c in chunks})
    tokenizer = _hf_tokenizer(src, notices)
    meta = checkpoint_meta(TrainingState(), model_signature(cfg.model, cfg.model.vocab_size),
                           {"world_size": 1, "tp": 1, "cp": 1, "dp": 1, "pp": 1, "ep": 1}, None, None,
                           tokenizer is not None)
    meta["converted_from"] = {"format": "huggingface", "path": str(src.resolve())}
    job = SaveJob(save_dir=out, iteration=0, rank=0, state_dict=to_state_dict(chunks), meta=meta,
                  config_text=config_yaml(cfg), rng=None, group=None, tokenizer=tokenizer)
    created = first_missing(out)
    try:
        return write_and_publish(job)  # on failure it removes its partial iter_0000000.tmp and says why
    except BaseException:
        if created is not None:  # and the --output directory it made, now empty
            shutil.rmtree(created, ignore_errors=True)
        raise


def _config_from_file(config_file: Path, notices: list[str]):
    """(the meshtron configuration a ``config.json`` describes, its values); CheckpointError naming the file
    otherwise."""
    values = read_json_file(config_file)
    if not isinstance(values, dict):
        raise CheckpointError(f"{config_file} holds a JSON {type(values).__name__}, not a model configuration")
    try:
        return hf.config_from_hf(values, notices), values
    except CheckpointError as err:
        raise CheckpointError(f"{config_file}: {err.summary.removeprefix('config.json: ')}", err.differences) \
            from None
    except KeyError as err:
        raise CheckpointError(f"{config_file} has no {err.args[0]!r}, which the model needs") from None
    except (TypeError, ValueError, AttributeError) as err:  # a field of the wrong type ("abc" for a size, ...)
        raise CheckpointError(f"{config_file} holds a value of the wrong type ({err})") from None


# ---------------------------------------------------------------------------------------------
# meshtron -> Hugging Face.
# ---------------------------------------------------------------------------------------------

def read_model_tensors(ckpt_dir: Path, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Every canonical model tensor of a checkpoint, whole, in one process ({name: tensor})."""
    quiet_single_process_notice()
    md = read_dcp_metadata(ckpt_dir)
    state = {}
    for key, tmd in md.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(tmd, TensorStorageMetadata):
            state[key] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    try:
        safe_dcp_load(state, ckpt_dir, md, no_dist=True)
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"reading tensors from {ckpt_dir} failed", describe_dcp_failure(err)) from None
    out = {k[len(MODEL_PREFIX):]: (v.to(dtype) if dtype is not None else v) for k, v in state.items()}
    return dict(sorted(out.items(), key=lambda kv: _canonical_order(kv[0])))


def _export_tokenizer(ckpt_dir: Path, out: Path, notices: list[str]) -> tuple[Optional[int], Optional[int]]:
    """Copy the tokenizer's Hugging Face files; returns (eos id, bos id) where known."""
    tok_dir = ckpt_dir / TOKENIZER_DIR
    if not tok_dir.is_dir():
        notices.append("the checkpoint has no tokenizer: the export has none either")
        return None, None
    source = tok_dir / "hf" if (tok_dir / "hf").is_dir() else tok_dir
    copied = []
    for name in HF_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    tokenizer = read_checkpoint_tokenizer(ckpt_dir)
    if not copied:
        notices.append(f"the checkpoint's {tokenizer.kind} has no Hugging Face tokenizer files: none exported")
        return tokenizer.eod, None
    bos = None
    if "tokenizer.json" in copied:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            fast = HFTokenizer.from_file(str(out / "tokenizer.json"))
        except Exception as err:  # the tokenizers library raises a bare Exception on parse errors
            raise CheckpointError(f"{source / 'tokenizer.json'} cannot be read: {err}") from None
        config_file = out / "tokenizer_config.json"
        config = read_json_file(config_file) if config_file.is_file() else {}
        if not isinstance(config, dict):
            raise CheckpointError(f"{source / 'tokenizer_config.json'} holds no mapping of settings")
        bos_token = config.get("bos_token")
        bos_token = bos_token.get("content") if isinstance(bos_token, dict) else bos_token
        bos = fast.token_to_id(bos_token) if bos_token else None
        if not config_file.is_file():  # transformers needs to know which class reads tokenizer.json
            eos_token = fast.id_to_token(tokenizer.eod) if tokenizer.eod is not None else None
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token}
            config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return tokenizer.eod, bos


def meshtron_to_hf(input_path: str | Path, output_dir: str | Path, architecture: Optional[str] = None,
                   dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 * 10**9,
                   notices: Optional[list[str]] = None, verify: bool = True, skip_mtp: bool = False) -> Path:
    """Write a meshtron checkpoint as a Hugging Face model directory of ``architecture`` (a key of
    :data:`hf.ARCHITECTURES`; None: :func:`hf.default_architecture` picks it from the model).
    ``verify``: check the checkpoint's files against their checksums first. Multi-token prediction depths
    are written as DeepSeek-V3's ``model.layers.{num_layers + k}``; ``skip_mtp`` leaves them out (the only
    way to export them to another architecture)."""
    notices = notices if notices is not None else []
    out = Path(output_dir)
    require_empty(out)
    ckpt_dir = resolve_checkpoint(input_path)
    if ckpt_dir is None:
        raise CheckpointError(f"--input {input_path}: no meshtron checkpoint found")
    verify_checkpoint(ckpt_dir, None, verify)
    meta = read_meta(ckpt_dir)
    cfg = read_config(ckpt_dir)
    architecture = architecture or hf.default_architecture(cfg.model)
    tensors = read_model_tensors(ckpt_dir, dtype)
    if skip_mtp and cfg.model.mtp_num_layers:
        notices.append(f"left out the {cfg.model.mtp_num_layers} multi-token prediction depth(s) (mtp.layers.*)")
        cfg.model.mtp_num_layers = None
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    hf.check_exportable(cfg.model, architecture)
    vocab = int(tensors["embedding.word_embeddings.weight"].shape[0])
    if meta.get("model", {}).get("vocab_size") not in (None, vocab):
        raise CheckpointError(f"{ckpt_dir}: the embedding has {vocab} rows but the metadata says vocabulary "
                              f"{meta['model']['vocab_size']}")
    hf_tensors = hf.meshtron_to_hf_tensors(tensors, cfg.model, architecture)

    def write(directory: Path) -> None:
        write_hf_tensors(hf_tensors, directory, max_shard_bytes)
        eos, bos = _export_tokenizer(ckpt_dir, directory, notices)
        dtype_name = DTYPE_NAMES.get(next(iter(tensors.values())).dtype, "float32")
        config = hf.hf_config(cfg.model, vocab, architecture, dtype_name, eos, bos)
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        gen = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
        (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")

    needed = sum(t.numel() * t.element_size() for t in hf_tensors.values())
    return write_all_or_nothing(out, write, f"the export needs about {needed / 1e9:.2f} GB")


# ---------------------------------------------------------------------------------------------
# Writing an output directory whole or not at all.
# ---------------------------------------------------------------------------------------------

def write_all_or_nothing(out: Path, write: Callable[[Path], None], size_hint: str) -> Path:
    """Run ``write(directory)`` into a fresh directory beside ``out``, then rename it to ``out`` (absent or
    empty: rename replaces an empty directory in one step). On any failure the partial directory, and the
    parents of ``out`` this call created, are removed: ``--output`` is as it was. A write that failed (full
    disk, I/O error; from Python or from safetensors) becomes one CheckpointSaveError (exit 1) naming ``out``
    and the error, with ``size_hint``; a process killed meanwhile leaves a hidden ``.NAME.tmp-*`` beside it."""
    created = first_missing(out.parent)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        write(tmp)
        os.replace(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        cause = _write_failure(err)
        if cause is None:
            raise
        raise CheckpointSaveError(f"writing {out} failed: {cause} ({size_hint}); nothing was left there") from None
    return out


#: How safetensors (Rust) words an operating-system error: "... I/O error: No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _write_failure(err: BaseException) -> Optional[str]:
    """The cause of a failed write in a few words, or None when ``err`` is not a failed write."""
    if isinstance(err, OSError):
        return "no space left on device" if is_disk_full(err) else describe_os_error(err)
    from safetensors import SafetensorError

    if isinstance(err, SafetensorError):
        match = _RUST_OS_ERROR.search(str(err))
        if match is None:
            return f"safetensors: {str(err).strip().splitlines()[0] if str(err).strip() else 'error'}"
        code = int(match.group(1))
        return "no space left on device" if code in DISK_FULL_ERRNOS else os.strerror(code)
    return None


# ---------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------

def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * factor)
    return int(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshtron convert",
        description="Convert between Hugging Face Llama/Mistral/Mixtral/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V2/V3 "
                    "models or Megatron-LM checkpoints and meshtron checkpoints. meshtron "
                    "checkpoints load into any parallel layout as they are: no resharding step is needed.")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from", dest="source", choices=("hf", "megatron"),
                           help="read a Hugging Face model directory, or a Megatron-LM checkpoint (torch_dist or "
                                "legacy; a save directory or one iter_N directory), from --input and write a "
                                "meshtron checkpoint")
    direction.add_argument("--to", dest="target", choices=("hf", "megatron"),
                           help="read a meshtron checkpoint (--input) and write a Hugging Face model directory, or a "
                                "Megatron-LM torch_dist save directory (latest_checkpointed_iteration.txt and "
                                "iter_NNNNNNN/, with the optimizer state in the fully reshardable format)")
    p.add_argument("--input", required=True, help="source directory (a save directory or one iter_N directory "
                                                  "for meshtron)")
    p.add_argument("--output", required=True, help="destination directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="convert the weights to this type "
                                                                        "(default: keep the stored type)")
    p.add_argument("--hf-architecture", choices=sorted(hf.ARCHITECTURES), default=None,
                   help="with --to hf: the Hugging Face model class to write (default: deepseek_v3, or "
                        "deepseek_v2 with softmax routing, for multi-latent attention; qwen3_moe or mixtral for a "
                        "mixture of experts with or without query/key norms; qwen3, qwen2 or llama otherwise)")
    p.add_argument("--max-shard-size", type=_size, default=5 * 10**9,
                   help="with --to hf: largest safetensors file, e.g. 5GB (default)")
    p.add_argument("--skip-mtp", action="store_true",
                   help="leave the multi-token prediction layers out: with --from hf DeepSeek-V3's "
                        "model.layers.{num_hidden_layers + k} (imported as --mtp-num-layers depths by default), "
                        "with --to hf the checkpoint's mtp.layers.* depths")
    p.add_argument("--megatron-spec", choices=("transformer_engine", "local"), default="transformer_engine",
                   help="with --to megatron: the Megatron-LM layer spec whose tensor names to write: "
                        "transformer_engine (Megatron-LM's default --transformer-impl) or local; they differ only "
                        "in a mixture-of-experts layer's pre-MLP norm")
    p.add_argument("--megatron-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="with --to megatron: the tensor-parallel size to record in args and pad the vocabulary for "
                        "(default: the checkpoint's own)")
    p.add_argument("--megatron-expert-parallel-size", type=int, default=None, metavar="N",
                   help="with --to megatron: the expert-parallel size to record in args (default: the checkpoint's "
                        "own). Megatron keeps experts in an optimizer of their own only above 1, so the optimizer "
                        "state is shaped for a run on the same side of 1")
    p.add_argument("--megatron-rotary-interleaved", action="store_true",
                   help="with --to megatron: for a Megatron-LM run with --rotary-interleaved, write each query/key "
                        "head's rotated rows in its interleaved pairs and args.rotary_interleaved (the same "
                        "attention; grouped-query attention only). Default: meshtron's rotate-half layout")
    p.add_argument("--add-to-existing", action="store_true",
                   help="with --to megatron: write into a non-empty Megatron-LM save directory (a new iter_NNNNNNN "
                        "beside the others, which latest_checkpointed_iteration.txt then names)")
    p.add_argument("--no-optimizer", action="store_true",
                   help="with --to megatron or --from megatron: leave the optimizer state out (weights only)")
    p.add_argument("--no-verify-checkpoint", action="store_true",
                   help="with --to hf or --to megatron: read the checkpoint without checking its files against "
                        "their checksums")
    return p


def convert_main(argv: list[str]) -> int:
    """Entry point of ``meshtron convert``; returns the exit code (2 for bad input, 1 for a failed write)."""
    args = build_parser().parse_args(argv)
    notices: list[str] = []
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.source == "hf":
            path = hf_to_meshtron(args.input, args.output, dtype, notices, skip_mtp=args.skip_mtp)
        elif args.source == "megatron":
            from meshtron.checkpoint.megatron.convert import megatron_to_meshtron

            path = megatron_to_meshtron(args.input, args.output, dtype, notices, optimizer=not args.no_optimizer)
        elif args.target == "megatron":
            from meshtron.checkpoint.megatron.export import meshtron_to_megatron

            sizes = {k: v for k, v in (("tp", args.megatron_tensor_parallel_size),
                                       ("ep", args.megatron_expert_parallel_size)) if v is not None}
            if any(v < 1 for v in sizes.values()):
                raise CheckpointError("--megatron-tensor-parallel-size / --megatron-expert-parallel-size: expected "
                                      "a size of 1 or more")
            path = meshtron_to_megatron(args.input, args.output, args.megatron_spec, args.add_to_existing,
                                        optimizer=not args.no_optimizer, dtype=dtype, notices=notices,
                                        verify=not args.no_verify_checkpoint, layout=sizes,
                                        rotary_interleaved=args.megatron_rotary_interleaved)
        else:
            path = meshtron_to_hf(args.input, args.output, args.hf_architecture, dtype, args.max_shard_size, notices,
                                  verify=not args.no_verify_checkpoint, skip_mtp=args.skip_mtp)
    except CheckpointError as err:
        for note in notices:
            print(f"meshtron convert: note: {note}", file=sys.stderr)
        print(f"meshtron convert: error: {err.summary}", file=sys.stderr)
        for line in err.differences:
            print(f"  - {line}", file=sys.stderr)
        return err.exit_code  # 2: bad input; 1: writing the output failed
    for note in notices:
        print(f"meshtron convert: note: {note}", file=sys.stderr)
    print(f"wrote {path}")
    return 0
