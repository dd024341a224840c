"""Megatron-LM flags that meshtron accepts without effect: each names a choice that meshtron makes itself.

They exist so that Megatron scripts run unchanged. They are command-line (and ``--config`` YAML) settings only: the
run's configuration (:mod:`meshtron.config`) has no field for them, so they never reach the trainer or a
checkpoint's ``config.yaml``; ``meshtron train`` prints one note for each one given (:mod:`meshtron.cli`). This
module has no imports beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

_COMPILE_FUSES = "torch.compile fuses the element-wise work"


@dataclass(frozen=True)
class CompatFlag:
    """One accepted Megatron-LM flag: its field-style ``name`` (``use_flash_attn`` is ``--use-flash-attn``), value
    type, Megatron's default and ``reason``, what meshtron does instead."""

    name: str
    kind: type
    default: Any
    reason: str
    choices: Optional[tuple] = None
    nargs: Optional[str] = None
    aliases: tuple[str, ...] = ()
    optional: bool = False

    @property
    def help(self) -> str:
        return f"Accepted for Megatron compatibility ({self.reason})."


#: Every accepted flag, in the order of the help text.
MEGATRON_COMPAT: tuple[CompatFlag, ...] = (
    CompatFlag("moe_grouped_gemm", bool, False, "meshtron uses grouped GEMM on GPU where available"),
    CompatFlag("moe_shared_expert_overlap", bool, False,
               "meshtron runs the shared experts after the routed experts' dispatch, not overlapped"),
    CompatFlag("accumulate_allreduce_grads_in_fp32", bool, False,
               "meshtron accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16"),
    CompatFlag("ddp_average_in_collective", bool, False,
               "the loss is already scaled by 1 / the global batch's tokens, so the reduction is a plain sum"),
    CompatFlag("no_async_tensor_model_parallel_allreduce", bool, False,
               "see --no-tp-comm-overlap for meshtron's switch"),
    CompatFlag("override_opt_param_scheduler", bool, False,
               "meshtron's learning-rate schedule always comes from the flags and the iteration",
               aliases=("--override-opt_param-scheduler",)),
    CompatFlag("cpu_optimizer_type", str, "ADAM", "meshtron's CPU step is AdamW", choices=("ADAM", "adam")),
    CompatFlag("attention_softmax_in_fp32", bool, False, "SDPA's softmax accumulates in fp32"),
    CompatFlag("calculate_per_token_loss", bool, False,
               "meshtron always averages the loss over all loss tokens of the global batch"),
    CompatFlag("offload_modules", list, [],
               "with --offload-activations meshtron offloads everything a layer saves for its backward, the "
               "inputs of all of these modules included", nargs="+"),
    CompatFlag("use_mcore_models", bool, False, "meshtron has one model implementation"),
    CompatFlag("transformer_impl", str, None,
               "meshtron uses its own layers", choices=("local", "transformer_engine"), optional=True),
    CompatFlag("use_flash_attn", bool, False, "flash/cuDNN attention is the default on CUDA"),
    CompatFlag("attention_backend", str, "auto",
               "meshtron's attention is SDPA with the fused cuDNN kernel first, then flash",
               choices=("auto", "flash", "fused")),
    CompatFlag("no_gradient_accumulation_fusion", bool, False,
               "meshtron accumulates gradients in fp32 buffers without a fused matmul"),
    CompatFlag("cross_entropy_loss_fusion", bool, False, "meshtron's loss is always fused with the output layer"),
    CompatFlag("moe_permute_fusion", bool, False, "token permutation is index-based"),
    CompatFlag("no_masked_softmax_fusion", bool, False, "softmax runs inside SDPA"),
    CompatFlag("no_bias_swiglu_fusion", bool, False, _COMPILE_FUSES),
    CompatFlag("no_bias_gelu_fusion", bool, False, _COMPILE_FUSES),
    CompatFlag("no_bias_dropout_fusion", bool, False, _COMPILE_FUSES),
    CompatFlag("no_rope_fusion", bool, False, _COMPILE_FUSES),
    CompatFlag("log_throughput", bool, False, "meshtron always logs tokens/s, TFLOP/s and MFU"),
    CompatFlag("timing_log_level", int, 0,
               "meshtron logs the step time; `meshtron bench` gives the step split; 0, 1 or 2"),
    CompatFlag("dataloader_type", str, "single",
               "meshtron's sampler is deterministic", choices=("single", "cyclic", "external")),
    CompatFlag("ckpt_format", str, "torch_dist",
               "meshtron writes torch.distributed.checkpoint", choices=("torch_dist", "torch")),
    CompatFlag("use_dist_ckpt", bool, False, "meshtron always writes torch.distributed.checkpoint"),
    CompatFlag("auto_detect_ckpt_format", bool, False, "one checkpoint format"),
    CompatFlag("ckpt_fully_parallel_save", bool, True, "every rank writes its own shards"),
    CompatFlag("ckpt_fully_parallel_load", bool, False, "every rank reads its own shards"),
    CompatFlag("ckpt_assume_constant_structure", bool, False,
               "meshtron checks a checkpoint's structure whenever it loads one"),
    CompatFlag("log_memory_to_tensorboard", bool, False,
               "every logged number, peak memory included, goes to TensorBoard"),
    CompatFlag("apply_query_key_layer_scaling", bool, False,
               "an fp16 safeguard that does not change the math; meshtron trains in bf16/fp32"),
    CompatFlag("log_timers_to_tensorboard", bool, False,
               "the step time goes to TensorBoard with every logged record"),
    CompatFlag("log_world_size_to_tensorboard", bool, False, "the layout and world size are printed at start"),
    CompatFlag("log_validation_ppl_to_tensorboard", bool, False,
               "validation loss and perplexity always go to TensorBoard"),
)
