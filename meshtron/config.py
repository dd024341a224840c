"""Typed configuration for every meshtron run.

Each section is a dataclass; every field is also a command-line flag (the Megatron-LM flags that meshtron
accepts without effect have no field: :mod:`meshtron.megatron_compat`). The flag
name is the field name with ``_`` replaced by ``-`` (Megatron-LM's names), and a
YAML config file uses the field names as keys. ``MeshtronConfig`` groups the
sections. This module is the schema only: :func:`meshtron.validation.validate_config`
fills the derived fields and checks the whole configuration before any work starts,
raising :class:`~meshtron.errors.ConfigError` (re-exported here), whose message names
the offending flag.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from meshtron.errors import ConfigError  # re-exported: most modules import it from here


def opt(default: Any = None, help: str = "", choices: Optional[tuple] = None, aliases: tuple = (),
        nargs: Optional[str] = None, metavar: Optional[str] = None, megatron_compat: bool = False,
        allow_inf: bool = False) -> Any:
    """A dataclass field carrying what the command line needs to expose it as a flag.

    ``megatron_compat``: a Megatron-LM flag whose only valid value is meshtron's own choice (a flag that
    changes nothing at all belongs in :mod:`meshtron.megatron_compat`); the command line prints its help as a
    one-line note when it is given. ``allow_inf``: a float field for which
    infinity means something (NaN never does; validation refuses non-finite values elsewhere).
    """
    meta = {"help": help, "choices": choices, "aliases": aliases, "nargs": nargs, "metavar": metavar,
            "megatron_compat": megatron_compat, "allow_inf": allow_inf}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


#: ``--data-parallel-sharding-strategy`` values (Megatron-FSDP's names), from least to most sharded: the one list
#: that the flag's choices, validation, the strategy builder and the memory accounting read.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
#: ``--pipeline-schedule`` values (None: 1F1B, or interleaved 1F1B with virtual stages).
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zero-bubble-h1", "zbv")


# Help texts several flags share.
_DELAYED_SCALING_REFUSED = ("Delayed-scaling FP8 setting: refused, meshtron scales FP8 from current values "
                            "(--fp8-recipe).")


@dataclass
class ModelConfig:
    """Shape and architecture of the decoder-only transformer."""

    model: Optional[str] = opt(None, "Named preset (see `meshtron presets`); any flag below overrides its fields. "
                                     "With no preset and no shape flags, the 'tiny' preset is used.", metavar="PRESET")
    num_layers: int = opt(2, "Number of transformer layers.")
    layer_pattern: Optional[str] = opt(None, "Each layer's token mixer and MLP kind, as comma-separated MIXER+MLP "
                                             "entries, each optionally *N (mixers: gqa, mla, sink, sink_window, gdn, "
                                             "gated_attn; MLPs: dense, moe, oss_moe, moe_gated_shared), "
                                             "e.g. gqa+dense*3,gqa+moe*29 (docs/layer-kinds.md). Default: "
                                             "derived from --multi-latent-attention, --num-experts, "
                                             "--moe-layer-freq and --moe-first-dense-layers.")
    hidden_size: int = opt(64, "Hidden (model) dimension.")
    ffn_hidden_size: Optional[int] = opt(None, "MLP inner dimension (default 4*hidden, or 2/3 of that rounded to 64 with --swiglu).")
    num_attention_heads: int = opt(4, "Number of query heads.")
    group_query_attention: bool = opt(False, "Use grouped-query attention with --num-query-groups key/value heads.")
    num_query_groups: Optional[int] = opt(None, "Number of key/value heads with --group-query-attention.")
    kv_channels: Optional[int] = opt(None, "Head dimension (default hidden / heads).")
    seq_length: int = opt(128, "Training sequence length in tokens.")
    max_position_embeddings: Optional[int] = opt(None, "Maximum positions (learned positions table size; default --seq-length).")
    normalization: str = opt("LayerNorm", "Normalisation layer.", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = opt(1e-5, "Epsilon of the normalisation layers.")
    zero_centred_norm: bool = opt(False, "RMSNorm layer norms scale by 1 + weight, the weight starting at 0, in "
                                         "fp32 (Qwen3.5).")
    swiglu: bool = opt(False, "SwiGLU MLP instead of GeLU.")
    position_embedding_type: str = opt("learned_absolute", "Position encoding: learned_absolute, rope, or yarn (RoPE "
                                                           "with YaRN frequencies, Megatron's spelling of "
                                                           "--position-embedding-type rope --rope-type yarn; not with "
                                                           "MLA, whose YaRN is --rope-type yarn).",
                                       choices=("learned_absolute", "rope", "yarn"))
    use_rotary_position_embeddings: bool = opt(False, "Megatron's older spelling of --position-embedding-type rope.")
    no_position_embedding: bool = opt(False, "Megatron's older flag for no learned position embedding: needs "
                                             "rotary embeddings (--position-embedding-type rope).")
    rotary_base: float = opt(10000.0, "RoPE base (theta).")
    use_rope_scaling: bool = opt(False, "Llama-3.1 RoPE frequency scaling.")
    rope_scaling_factor: float = opt(8.0, "Llama-3.1 RoPE scaling factor (with --use-rope-scaling).")
    rope_original_max_position_embeddings: int = opt(8192, "Original context length of the Llama-3.1 RoPE scaling.")
    untie_embeddings_and_output_weights: bool = opt(False, "Separate output layer instead of reusing the input embedding.")
    disable_bias_linear: bool = opt(False, "No biases in linear layers.")
    add_qkv_bias: bool = opt(False, "Bias on the query/key/value projection even with --disable-bias-linear.")
    qk_layernorm: bool = opt(False, "Normalise each query and key head (--normalization over the head dimension) "
                                    "before RoPE, as Qwen3 does.")
    # Multi-latent attention (DeepSeek-V2/V3; docs/models.md).
    multi_latent_attention: bool = opt(False, "Multi-latent attention (DeepSeek-V2/V3) instead of multi-head/"
                                              "grouped-query attention: queries and keys/values pass through "
                                              "low-rank latents and RoPE acts on a separate part of each head.")
    q_lora_rank: Optional[int] = opt(None, "MLA: rank of the query's low-rank compression (unset: one plain "
                                           "query projection).")
    kv_lora_rank: int = opt(32, "MLA: rank of the joint key/value latent.")
    qk_head_dim: int = opt(128, "MLA: query/key head dimension without position embedding (each query/key head "
                                "is this plus --qk-pos-emb-head-dim).")
    qk_pos_emb_head_dim: int = opt(64, "MLA: query/key head dimension that carries RoPE (the key part is one "
                                       "head shared by all heads).")
    v_head_dim: int = opt(128, "MLA: value head dimension.")
    rope_type: Optional[str] = opt(None, "RoPE frequencies: rope, or yarn (YaRN interpolation; without MLA "
                                         "Megatron spells it --position-embedding-type yarn). Default: yarn with "
                                         "MLA (plain RoPE at --rotary-scaling-factor 1), else rope.",
                                   choices=("rope", "yarn"))
    rotary_scaling_factor: float = opt(1.0, "YaRN: context extension factor (DeepSeek-V3: 40).")
    mscale: float = opt(1.0, "YaRN: attention-temperature coefficient of the rotary tables.")
    mscale_all_dim: float = opt(0.0, "YaRN: attention-temperature coefficient of the whole softmax scale.")
    yarn_original_max_position_embeddings: int = opt(4096, "YaRN: context length the model was first trained at.")
    yarn_beta_fast: float = opt(32.0, "YaRN: rotations below which frequencies are interpolated fully.")
    yarn_beta_slow: float = opt(1.0, "YaRN: rotations above which frequencies are kept.")
    yarn_truncate: bool = opt(True, "YaRN: round the ramp's ends to whole frequency indices (DeepSeek); "
                                    "--no-yarn-truncate keeps them fractional (gpt-oss). Megatron's "
                                    "--(no-)yarn-correction-range-round-to-int.",
                              aliases=("--yarn-correction-range-round-to-int",))
    rotary_percent: float = opt(1.0, "Fraction of each head's dimensions that RoPE turns (its first ones) in gqa "
                                     "and gated_attn layers (Qwen3.5: 0.25; Megatron's --rotary-percent).")
    # Gated DeltaNet (gdn layers of --layer-pattern; Qwen3.5, docs/models.md).
    linear_num_key_heads: int = opt(16, "gdn layers: query/key heads.")
    linear_num_value_heads: int = opt(32, "gdn layers: value heads (a multiple of the key heads).")
    linear_key_head_dim: int = opt(128, "gdn layers: query/key head dimension.")
    linear_value_head_dim: int = opt(128, "gdn layers: value head dimension.")
    linear_conv_kernel_dim: int = opt(4, "gdn layers: width of the causal convolution over q, k and v.")
    # gpt-oss (docs/models.md): attention with sinks, sliding-window layers, clamped SwiGLU experts.
    sliding_window_size: Optional[int] = opt(None, "Keys each query of a sink_window layer (--layer-pattern) sees: "
                                                   "itself and the previous N-1 (gpt-oss: 128).")
    swiglu_clamp_limit: float = opt(7.0, "oss_moe experts: gate clamped to at most this, up to +-this.")
    swiglu_clamp_alpha: float = opt(1.702, "oss_moe experts: activation out = (up + 1) * gate * sigmoid(alpha * gate).")
    hidden_dropout: float = opt(0.1, "Dropout after attention and MLP outputs.")
    attention_dropout: float = opt(0.1, "Dropout on attention probabilities.")
    init_method_std: float = opt(0.02, "Std of the normal weight initialisation (output projections are scaled by 1/sqrt(2*layers)).")
    vocab_size: Optional[int] = opt(None, "Vocabulary size (taken from the tokenizer when one is used; required shape for --mock-data).")
    make_vocab_size_divisible_by: int = opt(128, "Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    # Mixture of experts.
    num_experts: Optional[int] = opt(None, "Number of experts (MoE); unset means dense MLP.")
    moe_ffn_hidden_size: Optional[int] = opt(None, "Inner dimension of each expert (default --ffn-hidden-size).")
    moe_router_topk: int = opt(2, "Experts per token.")
    moe_router_load_balancing_type: str = opt("aux_loss", "Load balancing.", choices=("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = opt(0.0, "Auxiliary load-balancing loss coefficient.")
    moe_z_loss_coeff: Optional[float] = opt(None, "Router z-loss coefficient.")
    moe_router_score_function: str = opt("softmax", "Router score function.", choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = opt(False, "Apply softmax before top-k selection.")
    moe_router_enable_expert_bias: bool = opt(False, "Aux-loss-free balancing with a per-expert bias.")
    moe_router_force_load_balancing: bool = opt(False, "For benchmarks and emulation only: experts are chosen from "
                                                       "random logits (balanced over experts on average), not from "
                                                       "the tokens; the router still runs and gets gradients.")
    moe_router_force_skew: float = opt(0.0, "With --moe-router-force-load-balancing (benchmarks and emulation): "
                                            "shift expert e's random logit by -S ln(e + 1), so that expert 0 is "
                                            "chosen most often, expert 1 next, and so on (hot experts, and the "
                                            "first expert-parallel rank the hottest); 0: balanced.")
    moe_router_bias_update_rate: float = opt(1e-3, "Update rate of the per-expert bias.")
    moe_expert_capacity_factor: Optional[float] = opt(None, "Capacity factor; tokens over capacity are dropped.")
    moe_pad_expert_input_to_capacity: bool = opt(False, "With --moe-expert-capacity-factor: send every expert exactly "
                                                        "its capacity of rows (zero-padded), so that the dispatch has "
                                                        "static sizes and no device-to-host synchronisation.")
    moe_shared_expert_intermediate_size: Optional[int] = opt(None, "Inner size of the shared expert(s).")
    moe_layer_freq: int = opt(1, "Every n-th layer is MoE.")
    moe_first_dense_layers: int = opt(0, "The first N layers keep a dense MLP (DeepSeek-MoE's first_k_dense_replace); "
                                         "the later layers follow --moe-layer-freq.")
    moe_token_dispatcher_type: str = opt("alltoall", "Token dispatch between expert-parallel ranks (meshtron "
                                                     "implements all-to-all).", choices=("alltoall",),
                                         megatron_compat=True)
    moe_router_dtype: str = opt("fp32", "Router precision (meshtron routes in fp32).", choices=("fp32",),
                                megatron_compat=True)
    moe_router_topk_scaling_factor: Optional[float] = opt(None, "Multiply the chosen experts' combine weights by "
                                                                 "this factor (DeepSeek-V2/V3 routed scaling).")
    moe_router_num_groups: Optional[int] = opt(None, "Group-limited routing: the experts form this many groups of "
                                                     "consecutive experts (DeepSeek-V3; with --moe-router-group-topk).")
    moe_router_group_topk: Optional[int] = opt(None, "Group-limited routing: groups each token may choose its experts "
                                                     "from (the best by the sum of their top topk/this scores).")
    # Multi-token prediction (DeepSeek-V3; docs/models.md).
    mtp_num_layers: Optional[int] = opt(None, "Multi-token prediction: this many extra prediction depths on the last "
                                              "pipeline stage, depth k predicting the token k+1 positions ahead "
                                              "(each one transformer layer sharing the embedding and output layer).")
    mtp_loss_scaling_factor: float = opt(0.1, "Weight of the multi-token prediction loss: the objective adds this "
                                              "times the mean over depths of their losses.")
    mtp_normed_hidden_states: bool = opt(False, "Multi-token prediction: each depth reads the hidden states after "
                                                "their final norm (the main model's for the first depth, the "
                                                "previous depth's own after that), as Megatron-Core computes them; "
                                                "without it, before that norm (DeepSeek-V3's h^k). Reading a "
                                                "Megatron-LM checkpoint with prediction depths sets it.")


@dataclass
class ParallelConfig:
    """How the model and batch are split over processes."""

    tensor_model_parallel_size: int = opt(1, "Tensor-parallel size (split each layer's matmuls).")
    pipeline_model_parallel_size: int = opt(1, "Pipeline-parallel size (split layers into stages).")
    num_layers_per_virtual_pipeline_stage: Optional[int] = opt(None, "Layers per virtual stage (interleaved 1F1B).")
    virtual_pipeline_model_parallel_size: Optional[int] = opt(None, "Virtual stages per pipeline rank (interleaved 1F1B).",
                                                              aliases=("--num-virtual-stages-per-pipeline-rank",))
    decoder_first_pipeline_num_layers: Optional[int] = opt(None, "Layers on the first pipeline stage (uneven split).")
    decoder_last_pipeline_num_layers: Optional[int] = opt(None, "Layers on the last pipeline stage (uneven split).")
    account_for_embedding_in_pipeline_split: bool = opt(False, "Count the input embedding as one layer when "
                                                               "splitting layers over pipeline stages (the first "
                                                               "model chunk holds one layer fewer).")
    account_for_loss_in_pipeline_split: bool = opt(False, "Count the output layer and loss as one layer when "
                                                          "splitting layers over pipeline stages (the last model "
                                                          "chunk holds one layer fewer).")
    pipeline_model_parallel_layout: Optional[str] = opt(
        None, "Megatron-LM's layout of every model chunk, in model order with | between chunks: E the embedding, "
              "t a transformer layer, m a multi-token prediction depth, L the loss; (...)*n and x*n repeat "
              "(e.g. \"Ett|(tt|)*2,tL\"). Chunks / PP gives the virtual stages.")
    context_parallel_size: int = opt(1, "Context-parallel size (split the sequence).")
    cp_comm_type: str = opt("p2p", "Context-parallel attention communication: p2p (ring attention), allgather "
                                   "(keys and values gathered once), a2a (DeepSpeed-Ulysses: heads exchanged for "
                                   "sequence; the heads per TP rank must divide by CP), a2a+p2p (a2a inside groups, "
                                   "ring across them: --hierarchical-context-parallel-sizes). Megatron's per-layer "
                                   "list is accepted when every value is the same.",
                            choices=("p2p", "allgather", "a2a", "a2a+p2p"), nargs="+")
    hierarchical_context_parallel_sizes: list = opt(
        [], "With --cp-comm-type a2a+p2p: A B, all-to-all inside groups of A consecutive CP ranks and the ring "
            "across the B groups (A x B = --context-parallel-size).", nargs="+", metavar="N")
    expert_model_parallel_size: int = opt(1, "Expert-parallel size.")
    expert_tensor_parallel_size: Optional[int] = opt(None, "Tensor-parallel size inside experts (default: TP).")
    sequence_parallel: bool = opt(False, "Sequence parallelism for norms/dropout (needs TP > 1).")
    use_distributed_optimizer: bool = opt(False, "Shard fp32 optimizer state over data-parallel ranks (ZeRO-1).")
    data_parallel_sharding_strategy: Optional[str] = opt(
        None, "What is sharded over data-parallel (x context-parallel) ranks: no_shard; optim (optimizer state, "
              "= --use-distributed-optimizer, ZeRO-1); optim_grads (and gradients, reduce-scattered as backward "
              "produces them, ZeRO-2); optim_grads_params (and weights, gathered per layer before its forward "
              "and backward, ZeRO-3). Default: optim with --use-distributed-optimizer, else no_shard.",
        choices=SHARDING_STRATEGIES)
    num_distributed_optimizer_instances: int = opt(
        1, "Hybrid sharded data parallelism (HSDP): R replicas of the sharded state. The DP x CP ranks of a "
           "stage split into R groups of S = DP x CP / R consecutive ranks; the sharding strategy (optim, "
           "optim_grads, optim_grads_params) shards inside each group, gradients are reduce-scattered inside "
           "it and then all-reduced across the R replicas. Needs a sharding strategy; not with "
           "--expert-model-parallel-size > 1.")
    data_parallel_shard_size: Optional[int] = opt(
        None, "HSDP by its shard size S (ranks per shard group, inside a node for speed): the same as "
              "--num-distributed-optimizer-instances DP x CP / S.")
    use_megatron_fsdp: bool = opt(False, "Alias of --data-parallel-sharding-strategy optim_grads_params (meshtron "
                                         "shards with its own implementation, not Megatron-FSDP's).")
    overlap_grad_reduce: bool = opt(False, "Overlap the data-parallel gradient reduction with backward.")
    overlap_param_gather: bool = opt(False, "Overlap the distributed optimizer's parameter all-gather with forward.")
    ddp_bucket_size: Optional[int] = opt(None, "Elements per gradient-reduction bucket (default max(40M, 1M*DP)).")
    grad_reduce_in_bf16: bool = opt(False, "Reduce gradients in bf16 instead of fp32.")
    release_grad_buffer: bool = opt(True, "Free the gradient buffer's buckets as each iteration starts and "
                                          "allocate each again when backward reaches it (no_shard and optim, "
                                          "the strategies with a full gradient buffer): with one micro-batch "
                                          "per step the gradients and the forward's activations never take "
                                          "memory together. --no-release-grad-buffer keeps one persistent "
                                          "buffer.")
    async_tensor_parallel: bool = opt(False, "Experimental: let torch.compile split each sequence-parallel "
                                             "all-gather + matmul and matmul + reduce-scatter into overlapping "
                                             "pieces (micro-pipelined TP over symmetric memory; CUDA, compiled "
                                             "layers, --sequence-parallel).")
    overlap_p2p_comm: bool = opt(True, "Pipeline: post point-to-point transfers without waiting and wait for a "
                                       "received tensor only when it is used (avoids stalls, mostly in the "
                                       "interleaved schedule); --no-overlap-p2p-comm for blocking exchanges.",
                                 aliases=("--overlap-p2p-communication",))
    pipeline_schedule: Optional[str] = opt(None, "Pipeline schedule: 1f1b (one model chunk per rank), interleaved "
                                                 "(interleaved 1F1B over virtual stages) or zero-bubble-h1 (ZB-H1: "
                                                 "each backward split into the input gradient and the weight "
                                                 "gradients, deferred to fill the bubble; one chunk per rank) or zbv "
                                                 "(ZB-V: the same split over two chunks per rank placed in a V, "
                                                 "the first stage holding the first and the last layers; half "
                                                 "of ZB-H1's bubble; needs untied embeddings). "
                                                 "Default: interleaved with virtual stages, "
                                                 "else 1f1b. Without pipeline parallelism there is no bubble and "
                                                 "the value has no effect.",
                                           choices=PIPELINE_SCHEDULES)
    tp_comm_overlap: bool = opt(True, "Overlap the tensor-parallel backward collectives (input-gradient all-reduce or "
                                      "reduce-scatter, sequence all-gather) with the weight-gradient matmul.")
    distributed_backend: Optional[str] = opt(None, "torch.distributed backend (default nccl on CUDA, gloo on CPU).", choices=("nccl", "gloo"))
    distributed_timeout_minutes: float = opt(10.0, "Timeout of collective operations, in minutes.")


@dataclass
class LauncherConfig:
    """How the ``meshtron train --nproc-per-node N`` shortcut starts the workers (passed to torch.distributed.run).

    These configure the launch, not the run: the workers get their command line without them, and a checkpoint's
    ``config.yaml`` does not list them (:meth:`MeshtronConfig.to_dict`).
    """

    nproc_per_node: Optional[int] = opt(None, "Start N processes on this node through torch.distributed.run.",
                                        aliases=("--nproc_per_node",))
    nnodes: str = opt("1", "Number of nodes (or MIN:MAX) for the launcher.")
    node_rank: int = opt(0, "This node's rank for the launcher.")
    master_addr: str = opt("127.0.0.1", "Rendezvous address for the launcher.")
    master_port: int = opt(29500, "Rendezvous port for the launcher.")
    rdzv_backend: str = opt("static", "Rendezvous backend for the launcher (static or c10d).")
    rdzv_endpoint: str = opt("", "Rendezvous endpoint HOST:PORT for the launcher (c10d).")
    max_restarts: int = opt(0, "Launcher: restart every worker up to N times after a failure or a detected hang "
                               "(torchrun's --max-restarts); a restarted attempt resumes from the latest "
                               "checkpoint (--load, else --save).")


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and clipping."""

    optimizer: str = opt("adam", "Optimizer: adam (AdamW with decoupled weight decay), muon (momentum orthogonalised "
                                 "by Newton-Schulz for the hidden matrices, AdamW for embeddings, output layer, norms, "
                                 "biases and routers) or lion (the sign of an interpolated momentum; "
                                 "docs/optimizers.md).", choices=("adam", "muon", "lion"))
    muon_momentum: float = opt(0.9, "Muon: momentum of the gradient average that is orthogonalised.")
    muon_nesterov: bool = opt(False, "Muon: Nesterov momentum (orthogonalise the gradient pushed toward the momentum).")
    muon_num_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations per step.")
    muon_coefficient_type: str = opt("quintic", "Muon: Newton-Schulz coefficients (quintic: 3.4445, -4.7750, 2.0315).",
                                     choices=("quintic",))
    muon_scale_mode: str = opt("spectral", "Muon: update scale of an m x n matrix: spectral sqrt(max(m, n)), "
                                           "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n)).",
                               choices=("spectral", "unit_rms_norm", "shape_scaling"))
    muon_extra_scale_factor: float = opt(1.0, "Muon: factor on the update scale (0.2 with spectral: Moonlight's rule, "
                                              "an update RMS like AdamW's).")
    muon_tp_mode: str = opt("duplicated", "Muon: a matrix split by tensor parallelism is all-gathered and every TP "
                                          "rank orthogonalises it whole (duplicated: equal to one process), or each "
                                          "TP shard is orthogonalised on its own (blockwise).",
                            choices=("duplicated", "blockwise"))
    muon_fp32_matmul_prec: str = opt("medium", "Muon: precision of the Newton-Schulz matmuls of fp32 matrices on "
                                               "CUDA, as torch.set_float32_matmul_precision (highest: fp32; high, "
                                               "medium: TF32 tensor cores, about 8x faster on Hopper). CPU always "
                                               "computes in fp32.",
                                     choices=("highest", "high", "medium"))
    lion_beta1: float = opt(0.95, "Lion: weight of the momentum against the gradient in the update's sign.")
    lion_beta2: float = opt(0.98, "Lion: decay of the momentum (its running average of the gradients).")
    lr: float = opt(3e-4, "Peak learning rate.")
    min_lr: float = opt(0.0, "Learning rate at the end of the decay.")
    lr_decay_style: str = opt("linear", "Decay after warm-up (Megatron-LM's default: linear).",
                              choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_warmup_iters: int = opt(0, "Linear warm-up iterations.")
    lr_warmup_samples: Optional[int] = opt(None, "Warm-up in samples (instead of --lr-warmup-iters).")
    lr_warmup_fraction: Optional[float] = opt(None, "Warm-up as a fraction of --lr-decay-iters.")
    lr_warmup_init: float = opt(0.0, "Learning rate at the start of warm-up.")
    lr_decay_iters: Optional[int] = opt(None, "Iterations over which to decay (default --train-iters).")
    lr_decay_samples: Optional[int] = opt(None, "Decay length in samples (instead of --lr-decay-iters).")
    lr_wsd_decay_style: str = opt("exponential", "Shape of the WSD cool-down (Megatron-LM's default: exponential).",
                                  choices=("linear", "cosine", "exponential", "minus_sqrt"))
    lr_wsd_decay_iters: Optional[int] = opt(None, "Length of the WSD cool-down (default 10%% of --lr-decay-iters).")
    lr_wsd_decay_samples: Optional[int] = opt(None, "Length of the WSD cool-down in samples (instead of "
                                                    "--lr-wsd-decay-iters).")
    weight_decay: float = opt(0.01, "Decoupled weight decay (not applied to norms and biases).")
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this value (0 disables).")
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.999, "Adam beta2.")
    adam_eps: float = opt(1e-8, "Adam epsilon.")
    optimizer_cpu_offload: bool = opt(False, "Keep the optimizer state and step on the CPU.", aliases=("--cpu-optimizer",))
    optimizer_offload_fraction: float = opt(1.0, "Fraction of the optimizer state offloaded with --optimizer-cpu-offload.")
    max_nonfinite_steps: int = opt(5, "Stop after this many consecutive steps with a non-finite loss or gradient.")
    use_precision_aware_optimizer: bool = opt(False, "Let --exp-avg-dtype / --exp-avg-sq-dtype store the Adam moments "
                                                     "in bf16 (the step computes in fp32 and rounds what it stores): "
                                                     "4 bytes less per parameter, with a loss curve that can differ "
                                                     "slightly from fp32 moments (docs/precision-and-memory.md).")
    exp_avg_dtype: str = opt("fp32", "With --use-precision-aware-optimizer: dtype of Adam's first moment.",
                             choices=("fp32", "bf16"))
    exp_avg_sq_dtype: str = opt("fp32", "With --use-precision-aware-optimizer: dtype of Adam's second moment.",
                                choices=("fp32", "bf16"))
    main_grads_dtype: str = opt("fp32", "With --use-precision-aware-optimizer: dtype of the gradient buffers that "
                                         "accumulate the micro-batches' gradients, are reduced over data-parallel "
                                         "ranks (bf16 implies --grad-reduce-in-bf16: it is one buffer) and feed "
                                         "the optimizer and the gradient norm, which read bf16 as it is. bf16 "
                                         "halves that memory and traffic; where gradients are summed (micro-"
                                         "batches, ranks, tied weights) the sums are rounded to bf16.",
                                choices=("fp32", "bf16"))
    main_params_dtype: str = opt("fp32", "Dtype of the master weights (meshtron keeps fp32).", choices=("fp32",))


@dataclass
class TrainConfig:
    """Batching, iterations, precision, recomputation and evaluation."""

    micro_batch_size: int = opt(1, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = opt(None, "Samples per iteration across all data-parallel ranks "
                                                 "(default micro-batch * data-parallel size).")
    train_iters: int = opt(300, "Training iterations.")
    train_samples: Optional[int] = opt(None, "Train on this many samples instead: --train-iters becomes "
                                             "train samples / --global-batch-size (takes precedence).")
    seed: int = opt(1234, "Seed of weights, data order and dropout.")
    device: Optional[str] = opt(None, "cpu or cuda (default cuda when available).", choices=("cpu", "cuda"))
    bf16: bool = opt(False, "bf16 weights and compute with fp32 master weights and gradients (default on CUDA).")
    fp32: bool = opt(False, "Force fp32 weights and compute (default on CPU).")
    fp16: bool = opt(False, "Not supported: use --bf16.")
    loss_scale: Optional[float] = opt(None, "fp16 loss scaling: refused (fp16 is not supported; use --bf16).")
    initial_loss_scale: Optional[float] = opt(None, "fp16 loss scaling: refused (fp16 is not supported; use --bf16).")
    check_for_nan_in_loss_and_grad: bool = opt(True, "Re-run an iteration whose loss or gradient norm is NaN/inf "
                                                     "(per --rerun-mode; the check reads the norm's existing host "
                                                     "sync). Off, or with --rerun-mode disabled, such a step is "
                                                     "skipped without a re-run. A non-finite step is never applied; "
                                                     "training stops after --max-nonfinite-steps skipped in a row.")
    check_for_spiky_loss: bool = opt(False, "Also treat a loss above --spiky-loss-factor x the median of the last "
                                            "--spiky-loss-window applied losses as suspicious (re-run per "
                                            "--rerun-mode). The global loss is then reduced every step, read in "
                                            "the same host sync as the gradient norm.")
    spiky_loss_factor: float = opt(10.0, "With --check-for-spiky-loss: how many times the running median a loss "
                                         "must exceed to count as a spike.")
    spiky_loss_window: int = opt(100, "With --check-for-spiky-loss: applied losses in the running median.")
    rerun_mode: str = opt("validate_results", "What happens to a suspicious iteration (non-finite, or a spike): "
                                              "validate_results executes it again from the same state and "
                                              "micro-batches before any step is applied: a clean re-run is a "
                                              "transient fault (training continues with it), a bad one is "
                                              "persistent (--rerun-persistent-action); report_stats executes "
                                              "every iteration twice and logs how much the two differ "
                                              "(rerun_max_*_diff in train records), checking as validate_results; "
                                              "disabled skips a non-finite step without a re-run.",
                          choices=("disabled", "validate_results", "report_stats"))
    rerun_persistent_action: str = opt("skip", "A fault that the re-run reproduces: skip drops that global batch "
                                               "(its sample positions are logged) and continues; stop ends the "
                                               "run (exit 1) naming iteration, rank and samples, without saving.",
                                       choices=("skip", "stop"))
    check_weight_hash_across_dp_replicas_interval: Optional[int] = opt(
        None, "Every N iterations (and before each checkpoint) the data-parallel replicas compare an exact hash "
              "of the weights they share (expert weights over the expert-data-parallel group); ranks that differ "
              "from the majority (with two replicas: both) are named and the run ends without saving "
              "(--weight-hash-mismatch).")
    weight_hash_mismatch: str = opt("stop", "After a weight-hash mismatch: stop (exit 1), or restart (exit 1 as "
                                            "well, for an automatic restart (--max-restarts) that resumes from the "
                                            "last checkpoint; refused without one).", choices=("stop", "restart"))
    fp8_format: Optional[str] = opt(None, "FP8 linear layers (and with --fp8-experts the MoE expert GEMMs, their "
                                          "gradients in e4m3 under either format).", choices=("e4m3", "hybrid"))
    fp8_experts: bool = opt(False, "With --fp8-format: run the routed experts' GEMMs in FP8 too (the recipe's "
                                   "scaling, grouped kernels). Off by default: on one H100 they were slower than "
                                   "bf16 at the shapes measured (docs/fp8.md).")
    fp8_hybrid: bool = opt(False, "Alias of --fp8-format hybrid.")
    fp8_recipe: str = opt("tensorwise", "FP8 scaling: tensorwise (one current scale per tensor), rowwise (one per "
                          "row, e4m3) or blockwise (DeepSeek-V3's: one per 1x128 tile of activations and gradients, "
                          "one per 128x128 block of weights, e4m3); delayed is not implemented.",
                          choices=("tensorwise", "rowwise", "blockwise", "delayed"))
    recompute_granularity: Optional[str] = opt(None, "Activation recomputation.", choices=("full", "selective"))
    recompute_activations: bool = opt(False, "Megatron's shorthand for --recompute-granularity selective.")
    recompute_method: Optional[str] = opt(None, "Which layers to recompute with --recompute-granularity full.",
                                          choices=("uniform", "block"))
    recompute_num_layers: int = opt(1, "Layers per recomputed chunk (uniform) or recomputed layers (block).")
    offload_activations: bool = opt(False, "Keep what each transformer layer saves for its backward in pinned host "
                                           "memory between its forward and backward (copies on a side stream, "
                                           "overlapped with compute; every model chunk's last layer keeps its "
                                           "own). For long sequences, where recomputation costs more than the "
                                           "copies.", aliases=("--fine-grained-activation-offloading",))
    offload_activations_num_layers: Optional[int] = opt(None, "With --offload-activations: only the first N layers "
                                                              "of each model chunk offload (default: all but its "
                                                              "last).", aliases=("--cpu-offloading-num-layers",))
    compile: Optional[bool] = opt(None, "torch.compile each transformer layer (default on CUDA).")
    enable_cuda_graph: bool = opt(False, "Replay each dense transformer layer's compiled forward and backward as "
                                         "CUDA graphs (torch.compile's CUDA graph trees), so that the host no "
                                         "longer launches its kernels one by one; for steps that wait on the "
                                         "host (small layers or micro batches, FP8). Needs compiled layers on "
                                         "CUDA and one GPU per layer: tensor, context and pipeline parallel "
                                         "sizes of 1. Mixture-of-experts layers keep plain compiled code (their "
                                         "token counts change every step).")
    eval_interval: int = opt(100, "Evaluate on the validation split every N iterations (0 disables).")
    eval_iters: int = opt(10, "Validation iterations per evaluation.")
    skip_train: bool = opt(False, "Do not train: load the checkpoint (--load), evaluate on the validation split "
                                  "and exit.")
    dry_run: bool = opt(False, "Do not train: print the plan of this run's first and last rank (exact static "
                               "memory from meta-device stages, activation estimate; meshtron plan) and exit 0, "
                               "without GPUs or process groups.")
    exit_signal_handler: bool = opt(False, "On SIGTERM, save a checkpoint and exit cleanly.")
    exit_duration_in_mins: Optional[float] = opt(None, "Save and exit after this many minutes of training.",
                                                 allow_inf=True)
    exit_interval: Optional[int] = opt(None, "Save and exit at the first iteration divisible by this.")
    hang_timeout_seconds: float = opt(300.0, "Declare the job hung when a rank issues no collective and its "
                                             "iteration and phase do not move for this long: the live ranks "
                                             "report who is behind in which collective, then the job exits "
                                             "(0 disables; below --distributed-timeout-minutes).")
    hang_startup_timeout_seconds: float = opt(1200.0, "The hang allowance until the first iteration completes "
                                                      "(compilation) and while a checkpoint is read or written; "
                                                      "at least --hang-timeout-seconds.")
    inject_fault: list = opt([], "Drill: make a rank fail on purpose (repeatable). KIND is crash, hang, "
                                 "hang-send (a pipeline send), slow (ARG seconds per iteration), nan, "
                                 "nan-persistent or bitflip; see "
                                 "docs/resilience.md.", nargs="+", metavar="KIND:RANK:ITERATION[:ARG]")
    generate_sample: bool = opt(True, "After training, print a sample generated by the model (default corpus only).")
    fp8_amax_history_len: Optional[int] = opt(None, _DELAYED_SCALING_REFUSED)
    fp8_amax_compute_algo: Optional[str] = opt(None, _DELAYED_SCALING_REFUSED,
                                                 choices=("max", "most_recent"))
    use_torch_fsdp2: bool = opt(False, "Alias of --data-parallel-sharding-strategy optim_grads_params (meshtron "
                                       "shards with its own implementation, not torch's FSDP2).")
    rampup_batch_size: list = opt([], "Not supported: batch-size ramp-up.", nargs="+")
    manual_gc: bool = opt(False, "Turn Python's automatic garbage collection off during training and collect at fixed "
                                 "iterations instead, so that ranks do not pause at different times.")
    manual_gc_interval: int = opt(0, "With --manual-gc: collect every N iterations (0: only at evaluations, "
                                     "checkpoints and the end).")
    manual_gc_eval: bool = opt(True, "With --manual-gc: collect before and after each evaluation.")


@dataclass
class DataConfig:
    """Training data and tokenizer."""

    data_path: list = opt([], "Dataset prefixes, optionally weighted: PREFIX or W1 PREFIX1 W2 PREFIX2 ...", nargs="+")
    split: str = opt("969,30,1", "Train,valid,test proportions of --data-path (and of --mock-data).")
    train_data_path: list = opt([], "Separate training dataset prefixes (weighted like --data-path).", nargs="+")
    valid_data_path: list = opt([], "Separate validation dataset prefixes.", nargs="+")
    test_data_path: list = opt([], "Separate test dataset prefixes.", nargs="+")
    mock_data: bool = opt(False, "Synthetic random tokens (for benchmarks).")
    data_order: str = opt("meshtron", "Sample order of --data-path data: meshtron (prefix-stable: a longer run "
                                      "serves a shorter one's samples first) or megatron (Megatron-Core's "
                                      "GPTDataset and BlendedDataset indices, split and sample counts: the "
                                      "batches Megatron-LM serves from the same data and flags; docs/data.md).",
                          choices=("meshtron", "megatron"))
    data_cache_path: Optional[str] = opt(None, "Where dataset index caches go (default beside the data).")
    tokenizer_type: Optional[str] = opt(None, "Tokenizer kind.", choices=(
        "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer", "ByteTokenizer",
        "NullTokenizer"))
    null_tokenizer_eod_id: Optional[int] = opt(None, "End-of-document id of --tokenizer-type NullTokenizer "
                                                     "(default --vocab-size - 1, as Megatron-Core 0.18+).")
    tokenizer_model: Optional[str] = opt(None, "Tokenizer file or directory (tokenizer.json, HF directory, .model, tiktoken file).")
    vocab_file: Optional[str] = opt(None, "GPT-2 BPE vocabulary (vocab.json).")
    merge_file: Optional[str] = opt(None, "GPT-2 BPE merges (merges.txt).")
    num_workers: int = opt(2, "Data loader worker processes.")
    reset_position_ids: bool = opt(False, "Restart position ids after each end-of-document token.")
    reset_attention_mask: bool = opt(False, "Do not attend across end-of-document tokens.")
    eod_mask_loss: bool = opt(False, "Exclude end-of-document tokens from the loss.")


@dataclass
class CheckpointConfig:
    """Saving and loading checkpoints."""

    save: Optional[str] = opt(None, "Directory to save checkpoints in.")
    load: Optional[str] = opt(None, "Directory to load a checkpoint from.")
    save_interval: Optional[int] = opt(None, "Save every N iterations (and at the end of training).")
    async_save: bool = opt(False, "Write checkpoints in the background.")
    save_retain: Optional[int] = opt(None, "Keep only the newest K checkpoints.")
    no_save_optim: bool = opt(False, "Save checkpoints without the optimizer state (weights only; a run that "
                                     "loads one starts fresh Adam moments).")
    no_save_rng: bool = opt(False, "Save checkpoints without the random-number generators' states.")
    export_megatron: Optional[str] = opt(None, "At the end of training, also write the last checkpoint saved to "
                                               "--save as a Megatron-LM torch_dist checkpoint (iter_NNNNNNN/ and "
                                               "latest_checkpointed_iteration.txt) in this directory, as `meshtron "
                                               "convert --to megatron --add-to-existing` does (rank 0 converts; "
                                               "needs --save).", metavar="DIR")
    transformer_impl: str = opt("transformer_engine", "Megatron-LM's layer implementation: meshtron runs its own "
                                                      "layers either way; --export-megatron names the checkpoint's "
                                                      "keys as this one's (they differ in a mixture-of-experts "
                                                      "layer's pre-MLP norm; --megatron-spec of meshtron convert).",
                                choices=("transformer_engine", "local"))
    no_load_optim: bool = opt(False, "Do not load the optimizer state.")
    no_load_rng: bool = opt(False, "Do not load the RNG state.")
    no_verify_checkpoint: bool = opt(False, "Load a checkpoint without checking its files against the checksums "
                                            "its save recorded (a damaged file then loads silently).")
    finetune: bool = opt(False, "Load weights only and start at iteration 0.")
    use_checkpoint_args: bool = opt(False, "With --load: take the model's architecture (every model flag) from the "
                                           "checkpoint's saved configuration.")
    exit_on_missing_checkpoint: bool = opt(False, "With --load: stop with an error when there is no checkpoint "
                                                  "instead of training from scratch.")


@dataclass
class LogConfig:
    """Logging and metrics."""

    log_interval: int = opt(10, "Log every N iterations.")
    metrics_file: Optional[str] = opt(None, "Append JSON metrics, one object per line (rank 0).")
    tensorboard_dir: Optional[str] = opt(None, "Write TensorBoard scalars here.")
    record_collectives: Optional[str] = opt(None, "Write every collective and point-to-point operation of this "
                                            "rank (iteration, op, group, group size, bytes, dtype, async) as JSON "
                                            "lines to PATH.rank<r>.jsonl; recorded steps run slower "
                                            "(docs/emulation.md).")
    wandb_project: Optional[str] = opt(None, "Log to this Weights & Biases project (needs wandb installed).")
    wandb_exp_name: Optional[str] = opt(None, "Weights & Biases run name.")
    wandb_save_dir: Optional[str] = opt(None, "Directory for Weights & Biases' local files.")
    peak_tflops: Optional[float] = opt(None, "Peak dense bf16 TFLOP/s per device for MFU (default by device name).")
    progress_bar: Optional[bool] = opt(None, "Live progress bar (default: when stdout is a terminal).")
    quiet: bool = opt(False, "Only errors and the final summary.")
    profile: bool = opt(False, "Profile iterations [--profile-step-start, --profile-step-end): with "
                               "--use-pytorch-profiler a torch.profiler trace, else the CUDA profiler's capture "
                               "range (nsys --capture-range=cudaProfilerApi).")
    use_pytorch_profiler: bool = opt(False, "With --profile: record with torch.profiler (a trace per rank).")
    profile_step_start: int = opt(10, "First profiled iteration.")
    profile_step_end: int = opt(12, "Iteration after the last profiled one.")
    profile_ranks: list = opt([0], "Global ranks that profile.", nargs="+")
    profile_dir: Optional[str] = opt(None, "Where torch.profiler traces go (default --tensorboard-dir, else "
                                           "./profile).")
    record_memory_history: bool = opt(False, "Record the CUDA allocator's history during training and write a "
                                             "snapshot at the end (--memory-snapshot-path; for "
                                             "pytorch.org/memory_viz).")
    memory_snapshot_path: str = opt("snapshot.pickle", "Where --record-memory-history writes (a _rankN suffix per "
                                                       "rank when there are several).")
    log_num_zeros_in_grad: bool = opt(False, "Log how many gradient elements are exactly zero "
                                             "(\"num_zeros_in_grad\") every --log-interval.")
    log_params_norm: bool = opt(False, "Log the L2 norm of all weights (\"params_norm\") every --log-interval.")
    log_straggler_interval: int = opt(0, "Straggler detection: every N iterations gather each rank's step-section "
                                         "times (data, forward_backward, communication, optimizer; CUDA events on "
                                         "GPU, no added host sync) with one all-gather, score them against the "
                                         "median rank and the rank's own best, name ranks beyond "
                                         "--straggler-threshold and write a \"straggler\" event (0: off, no "
                                         "timing at all).")
    log_straggler: bool = opt(False, "Megatron's switch for straggler detection: every --log-interval unless "
                                     "--log-straggler-interval is given.")
    straggler_threshold: float = opt(1.2, "A rank is named a straggler when a section of its own work takes more "
                                          "than this times the median rank's (and at least 10%% of a step more).")
    straggler_minmax_count: int = opt(0, "With straggler detection: also log the N slowest and fastest ranks by "
                                         "their own work per step.")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "launcher": LauncherConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}


@dataclass
class MeshtronConfig:
    """A whole run's configuration: one instance of each section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        """A flat {field: value} dict (YAML-compatible) of the run's settings: every section but the launcher's."""
        out: dict = {}
        for name in SECTIONS:
            if name != "launcher":
                out.update(dataclasses.asdict(getattr(self, name)))
        return out

    def set(self, key: str, value: Any) -> None:
        """Set one field by its flat name (``hidden_size``); raises ConfigError for unknown keys."""
        section = FIELD_SECTION.get(key)
        if section is None:
            raise ConfigError(f"unknown option '{key}'")
        setattr(getattr(self, section), key, value)

    def get(self, key: str) -> Any:
        """The value of one field by its flat name."""
        return getattr(getattr(self, FIELD_SECTION[key]), key)


FIELD_SECTION: dict[str, str] = {f.name: sec for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def flag_name(field_name: str) -> str:
    """``hidden_size`` -> ``--hidden-size``."""
    return "--" + field_name.replace("_", "-")


# ---------------------------------------------------------------------------------------------
# Derived quantities used throughout the code.
# ---------------------------------------------------------------------------------------------

def head_dim(m: ModelConfig) -> int:
    return m.kv_channels if m.kv_channels else m.hidden_size // m.num_attention_heads


def num_kv_heads(m: ModelConfig) -> int:
    return m.num_query_groups if (m.group_query_attention and m.num_query_groups) else m.num_attention_heads


def ffn_size(m: ModelConfig) -> int:
    if m.ffn_hidden_size:
        return m.ffn_hidden_size
    if m.swiglu:
        return int((4 * m.hidden_size * 2 / 3) / 64) * 64 or 4 * m.hidden_size
    return 4 * m.hidden_size


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary padded to a multiple of divisible_by * tp (Megatron's rule)."""
    multiple = max(1, divisible_by) * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
