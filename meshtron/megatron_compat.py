"""Megatron-LM flags that meshtron accepts without effect: each names a choice that meshtron makes itself.

They exist so that Megatron scripts run unchanged. They are command-line (and ``--config`` YAML) settings only: the
run's configuration (:mod:`meshtron.config`) has no field for them, so they never reach the trainer or a
checkpoint's ``config.yaml``; ``meshtron train`` prints one note for each one given (:mod:`meshtron.cli`).

A value whose no-op would change what a Megatron user gets has a :class:`ValueRule`: ``refuse`` (exit 2) when
meshtron cannot give what it asks for and a run would quietly do something else, ``warn`` (one ``WARNING`` line
instead of the note) when the run still gives what was asked, in another way the user should know of. Each
rule's comment says why it is the one or the other. This module has no imports beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

_COMPILE_FUSES = "torch.compile fuses the element-wise work"

#: Megatron-LM's --offload-modules choices: the modules whose input its fine-grained offloading moves to the host.
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


@dataclass(frozen=True)
class ValueRule:
    """What ``meshtron train`` does when a flag is given one of ``values`` (empty: any value; a list-valued flag
    matches when one of its items does): ``"warn"`` prints ``message`` as a warning instead of the note,
    ``"refuse"`` stops with it (exit 2)."""

    action: str
    message: str
    values: tuple = ()

    def matches(self, value: Any) -> bool:
        items = value if isinstance(value, (list, tuple)) else [value]
        return bool(items) and (not self.values or any(item in self.values for item in items))


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
    rules: tuple[ValueRule, ...] = ()

    @property
    def help(self) -> str:
        text = f"Accepted for Megatron compatibility ({self.reason})."
        for rule in self.rules:
            if rule.action == "refuse":
                text += f" Refused (exit 2) with {' or '.join(map(str, rule.values))}."
            else:
                text += " Given, it prints a warning." if not rule.values else \
                    f" With {' or '.join(map(str, rule.values))}, it prints a warning."
        return text

    def rule_for(self, value: Any) -> Optional[ValueRule]:
        """The first rule that ``value`` matches (None: the plain note)."""
        return next((rule for rule in self.rules if rule.matches(value)), None)


#: Every accepted flag, in the order of the help text.
MEGATRON_COMPAT: tuple[CompatFlag, ...] = (
    CompatFlag("moe_grouped_gemm", bool, False, "meshtron uses grouped GEMM on GPU where available"),
    CompatFlag("moe_shared_expert_overlap", bool, False,
               "meshtron runs the shared experts after the routed experts' dispatch, not overlapped"),
    # Refused beside --grad-reduce-in-bf16 or --main-grads-dtype bf16 (meshtron.cli): they ask for the opposite.
    CompatFlag("accumulate_allreduce_grads_in_fp32", bool, False,
               "meshtron accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16; refused (exit 2) "
               "beside it or --main-grads-dtype bf16"),
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
    # Warned, not refused: the run still keeps the inputs of the named modules off the device (and more), so the
    # memory the user planned for holds; what differs is the host-device traffic, which the user should know of.
    CompatFlag("offload_modules", list, [],
               "with --offload-activations meshtron offloads everything a layer saves for its backward, the "
               "inputs of all of these modules included", choices=OFFLOAD_MODULES, nargs="+",
               rules=(ValueRule("warn", "meshtron does not offload single modules: --offload-activations moves "
                                        "everything each layer saves for its backward to host memory (every layer "
                                        "but each model chunk's last), more host-device traffic than the named "
                                        "modules alone; --offload-activations-num-layers N offloads fewer layers"),)),
    CompatFlag("use_mcore_models", bool, False, "meshtron has one model implementation"),
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
    # cyclic stays a note: meshtron's dataset already serves every epoch in a new shuffled order, which is what
    # Megatron's cyclic sampler adds. external is refused: it says that the script brings its own data loader,
    # and meshtron train, which has no hook for one, would quietly train on something else.
    CompatFlag("dataloader_type", str, "single",
               "meshtron's dataset serves each epoch in a new shuffled order, read in sequence",
               choices=("single", "cyclic", "external"),
               rules=(ValueRule("refuse", "an external data loader comes from a training script of one's own; "
                                          "meshtron train builds its loader from --data-path (or --mock-data, or the "
                                          "built-in corpus) and has no hook for another: drop the flag or give "
                                          "--dataloader-type single", ("external",)),)),
    # torch is refused: it asks for Megatron's legacy per-rank files, which other tools then expect to read, and
    # meshtron writes (and reads) only its own torch.distributed.checkpoint layout.
    CompatFlag("ckpt_format", str, "torch_dist",
               "meshtron writes torch.distributed.checkpoint files in its own layout", choices=("torch_dist", "torch"),
               rules=(ValueRule("refuse", "Megatron's legacy per-rank torch checkpoints are not written or read by "
                                          "meshtron, whose checkpoints are torch.distributed.checkpoint files in its "
                                          "own layout: drop the flag or give --ckpt-format torch_dist",
                                ("torch",)),)),
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
