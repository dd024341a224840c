"""Named model shapes with their published dimensions, and parameter counting.

A preset is a dict of ModelConfig fields. ``apply_preset`` copies them onto a
config; flags given by the user are applied afterwards and win.
"""

from __future__ import annotations

from meshtron.config import ModelConfig
from meshtron.layer_kinds.base import norm_parameters
from meshtron.layer_kinds.pattern import format_pattern, layer_kinds

_GPT2 = dict(normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
             vocab_size=50257, seq_length=1024, max_position_embeddings=1024, norm_epsilon=1e-5,
             hidden_dropout=0.0, attention_dropout=0.0)
_LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, group_query_attention=True, hidden_dropout=0.0,
              attention_dropout=0.0, init_method_std=0.02)
_LLAMA2 = dict(_LLAMA, vocab_size=32000, seq_length=4096, max_position_embeddings=4096, rotary_base=10000.0,
               norm_epsilon=1e-5)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, seq_length=8192, max_position_embeddings=131072, rotary_base=500000.0,
               norm_epsilon=1e-5, use_rope_scaling=True, rope_scaling_factor=8.0,
               rope_original_max_position_embeddings=8192)

_QWEN25 = dict(_LLAMA, add_qkv_bias=True, seq_length=4096, rotary_base=1e6, norm_epsilon=1e-6)
_QWEN3 = dict(_LLAMA, qk_layernorm=True, kv_channels=128, vocab_size=151936, seq_length=4096,
              max_position_embeddings=40960, rotary_base=1e6, norm_epsilon=1e-6)

# DeepSeek-V2/V3: multi-latent attention (128 + 64 rotary query/key dims, 128 value dims, key/value latent of
# 512), YaRN x40 over an original 4096-token context, RMSNorm eps 1e-6, one MoE layout.
_DEEPSEEK = dict(_LLAMA, group_query_attention=False, multi_latent_attention=True, kv_lora_rank=512,
                 qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, rope_type="yarn", rotary_base=10000.0,
                 rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                 yarn_original_max_position_embeddings=4096, seq_length=4096, max_position_embeddings=163840,
                 norm_epsilon=1e-6)

# gpt-oss: attention with sinks and biases, sliding-window (128) and full layers alternating, 64 heads of 64
# over 8 key/value heads, experts of 2880 with biases and the clamped SwiGLU (top-4), YaRN x32 over 4096
# (fractional ramp). Shapes: openai/gpt-oss-20b and openai/gpt-oss-120b config.json.
_GPT_OSS = dict(_LLAMA, disable_bias_linear=False, vocab_size=201088, hidden_size=2880, ffn_hidden_size=2880,
                num_attention_heads=64, num_query_groups=8, kv_channels=64, moe_ffn_hidden_size=2880,
                moe_router_topk=4, moe_aux_loss_coeff=0.9, sliding_window_size=128, rope_type="yarn",
                rotary_base=150000.0, rotary_scaling_factor=32.0, mscale=1.0, mscale_all_dim=0.0,
                yarn_original_max_position_embeddings=4096, yarn_truncate=False, seq_length=4096,
                max_position_embeddings=131072, norm_epsilon=1e-5)


def _gpt_oss_pattern(num_layers: int) -> str:
    """gpt-oss's layer_types: sliding-window attention on even layers, full attention on odd ones."""
    return ",".join(("sink_window" if i % 2 == 0 else "sink") + "+oss_moe" for i in range(num_layers))


# Qwen3.5: three gated DeltaNet layers, then one gated attention layer (partial RoPE, 0.25 of each 256-wide
# head), zero-centred norms; the MoE's experts with a sigmoid-gated shared expert.
_QWEN35 = dict(_LLAMA, zero_centred_norm=True, rotary_percent=0.25, kv_channels=256, vocab_size=248320,
               seq_length=4096, max_position_embeddings=32768, rotary_base=10000.0, norm_epsilon=1e-6,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4)


def _qwen35_pattern(num_layers: int, mlp: str) -> str:
    """Qwen3.5's layer_types: full attention on every fourth layer, gated DeltaNet on the others."""
    return format_pattern([f"{'gated_attn' if (i + 1) % 4 == 0 else 'gdn'}+{mlp}" for i in range(num_layers)])


#: name -> (ModelConfig fields, published parameter count, where the number comes from)
PRESETS: dict[str, tuple[dict, int | None, str]] = {
    "tiny": (dict(_LLAMA, num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=352, seq_length=128, max_position_embeddings=128, rotary_base=10000.0,
                  untie_embeddings_and_output_weights=False, norm_epsilon=1e-5, init_method_std=0.02),
             None, "for CPU runs and tests; vocabulary from the tokenizer"),
    "gpt2-small": (dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12), 124_439_808, "GPT-2 124M"),
    "gpt2-medium": (dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16), 354_823_168, "GPT-2 355M"),
    "gpt2-large": (dict(_GPT2, num_layers=36, hidden_size=1280, num_attention_heads=20), 774_030_080, "GPT-2 774M"),
    "gpt2-xl": (dict(_GPT2, num_layers=48, hidden_size=1600, num_attention_heads=25), 1_557_611_200, "GPT-2 1.5B"),
    "llama2-7b": (dict(_LLAMA2, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
                       ffn_hidden_size=11008), 6_738_415_616, "Llama 2 7B"),
    "llama2-13b": (dict(_LLAMA2, num_layers=40, hidden_size=5120, num_attention_heads=40, num_query_groups=40,
                        ffn_hidden_size=13824), 13_015_864_320, "Llama 2 13B"),
    "llama2-70b": (dict(_LLAMA2, num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                        ffn_hidden_size=28672), 68_976_648_192, "Llama 2 70B"),
    "llama3-1b": (dict(_LLAMA3, num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=8192, untie_embeddings_and_output_weights=False, rope_scaling_factor=32.0),
                  1_235_814_400, "Llama 3.2 1B"),
    "llama3-3b": (dict(_LLAMA3, num_layers=28, hidden_size=3072, num_attention_heads=24, num_query_groups=8,
                       ffn_hidden_size=8192, untie_embeddings_and_output_weights=False, rope_scaling_factor=32.0),
                  3_212_749_824, "Llama 3.2 3B"),
    "llama3-8b": (dict(_LLAMA3, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=14336), 8_030_261_248, "Llama 3.1 8B"),
    "llama3-70b": (dict(_LLAMA3, num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                        ffn_hidden_size=28672), 70_553_706_496, "Llama 3.1 70B"),
    "llama3-405b": (dict(_LLAMA3, num_layers=126, hidden_size=16384, num_attention_heads=128, num_query_groups=8,
                         ffn_hidden_size=53248), 405_853_388_800, "Llama 3.1 405B"),
    "qwen2.5-0.5b": (dict(_QWEN25, num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                          ffn_hidden_size=4864, vocab_size=151936, max_position_embeddings=32768,
                          untie_embeddings_and_output_weights=False), 494_032_768, "Qwen2.5 0.5B"),
    "qwen2.5-7b": (dict(_QWEN25, num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                        ffn_hidden_size=18944, vocab_size=152064, max_position_embeddings=131072),
                   7_615_616_512, "Qwen2.5 7B"),
    "qwen3-0.6b": (dict(_QWEN3, num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                        ffn_hidden_size=3072, untie_embeddings_and_output_weights=False), 600_000_000,
                   "Qwen3 0.6B (model card, rounded)"),
    "qwen3-8b": (dict(_QWEN3, num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=12288), 8_200_000_000, "Qwen3 8B (model card, rounded)"),
    "mistral-7b": (dict(_LLAMA, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                        rotary_base=10000.0, norm_epsilon=1e-5, num_layers=32, hidden_size=4096,
                        num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336),
                   7_241_732_096, "Mistral 7B v0.1"),
    "mixtral-8x7b": (dict(_LLAMA, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                          rotary_base=1e6, norm_epsilon=1e-5, num_layers=32, hidden_size=4096,
                          num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336, num_experts=8,
                          moe_router_topk=2, moe_aux_loss_coeff=0.02),
                     46_702_792_704, "Mixtral 8x7B"),
    "mixtral-8x22b": (dict(_LLAMA, vocab_size=32768, seq_length=4096, max_position_embeddings=65536,
                           rotary_base=1e6, norm_epsilon=1e-5, num_layers=56, hidden_size=6144,
                           num_attention_heads=48, num_query_groups=8, ffn_hidden_size=16384, num_experts=8,
                           moe_router_topk=2, moe_aux_loss_coeff=0.001),
                      140_630_071_296, "Mixtral 8x22B"),
    # Fine-grained experts (64 routed of 1408, top-6, unnormalised softmax weights) plus two shared experts
    # (2 x 1408); layer 0 keeps a dense MLP. Shapes: deepseek-ai/deepseek-moe-16b-base config.json.
    "deepseek-moe-16b": (dict(_LLAMA, vocab_size=102400, seq_length=4096, max_position_embeddings=4096,
                              rotary_base=10000.0, norm_epsilon=1e-6, num_layers=28, hidden_size=2048,
                              num_attention_heads=16, num_query_groups=16, ffn_hidden_size=10944, num_experts=64,
                              moe_ffn_hidden_size=1408, moe_router_topk=6, moe_router_pre_softmax=True,
                              moe_shared_expert_intermediate_size=2816, moe_first_dense_layers=1,
                              moe_aux_loss_coeff=0.001),
                         16_375_728_128, "DeepSeekMoE 16B (16.4B in the paper, 2.8B activated)"),
    # Multi-latent attention without a query latent, 64 routed experts of 1408 (top-6, softmax weights kept
    # unnormalised) plus 2 shared, layer 0 dense, YaRN x40. Shapes: deepseek-ai/DeepSeek-V2-Lite config.json.
    "deepseek-v2-lite": (dict(_DEEPSEEK, vocab_size=102400, num_layers=27, hidden_size=2048, num_attention_heads=16,
                              ffn_hidden_size=10944, q_lora_rank=None, num_experts=64, moe_ffn_hidden_size=1408,
                              moe_router_topk=6, moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=2816,
                              moe_first_dense_layers=1, mscale=0.707, mscale_all_dim=0.707,
                              moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.001),
                         15_706_484_224, "DeepSeek-V2-Lite: 15.7B, 2.4B activated"),
    # 256 routed experts of 2048 (top-8 of sigmoid scores with an expert bias, 4 of 8 groups, x2.5) plus 1
    # shared, first 3 layers dense. Shapes: deepseek-ai/DeepSeek-V3 config.json, without its MTP module.
    "deepseek-v3": (dict(_DEEPSEEK, vocab_size=129280, num_layers=61, hidden_size=7168, num_attention_heads=128,
                         ffn_hidden_size=18432, q_lora_rank=1536, num_experts=256, moe_ffn_hidden_size=2048,
                         moe_router_topk=8, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
                         moe_shared_expert_intermediate_size=2048, moe_first_dense_layers=3,
                         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.0001),
                    671_026_404_352, "DeepSeek-V3: 671B, 37B activated (main model; the hub's 685B adds the 14B "
                                     "multi-token prediction module)"),
    # Every layer MoE: 128 experts, top-8, weights renormalised over the 8 (norm_topk_prob); no shared
    # experts. Shapes: Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json.
    "qwen3-30b-a3b": (dict(_QWEN3, num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                           ffn_hidden_size=6144, num_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
                           moe_aux_loss_coeff=0.001), 30_532_122_624, "Qwen3-30B-A3B: 30.5B, 3.3B activated"),
    "qwen3-235b-a22b": (dict(_QWEN3, num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4,
                             ffn_hidden_size=12288, num_experts=128, moe_ffn_hidden_size=1536, moe_router_topk=8,
                             moe_aux_loss_coeff=0.001), 235_093_634_560, "Qwen3-235B-A22B: 235B, 22B activated"),
    "gpt-oss-20b": (dict(_GPT_OSS, num_layers=24, num_experts=32, layer_pattern=_gpt_oss_pattern(24)),
                    20_914_757_184, "gpt-oss-20b: 20.9B, 3.6B activated"),
    "gpt-oss-120b": (dict(_GPT_OSS, num_layers=36, num_experts=128, layer_pattern=_gpt_oss_pattern(36)),
                     116_829_156_672, "gpt-oss-120b: 116.8B, 5.1B activated"),
    # Dense: an MLP of 12288 on every layer. Shapes: transformers' Qwen3_5TextConfig defaults, documented there as
    # the Qwen3.5-9B style configuration (the text model; the vision encoder is not counted).
    "qwen3.5-9b": (dict(_QWEN35, num_layers=32, hidden_size=4096, num_attention_heads=16, num_query_groups=4,
                        ffn_hidden_size=12288, layer_pattern=_qwen35_pattern(32, "dense")),
                   8_953_803_264, "Qwen3.5-9B (text): 9.0B"),
    # 256 experts of 512 (top-8, softmax renormalised over the 8) and a gated shared expert of 512. Shapes:
    # transformers' Qwen3_5MoeTextConfig defaults, documented as Qwen/Qwen3.5-35B-A3B's.
    "qwen3.5-35b-a3b": (dict(_QWEN35, num_layers=40, hidden_size=2048, num_attention_heads=16, num_query_groups=2,
                             ffn_hidden_size=512, num_experts=256, moe_ffn_hidden_size=512, moe_router_topk=8,
                             moe_shared_expert_intermediate_size=512, moe_aux_loss_coeff=0.001,
                             layer_pattern=_qwen35_pattern(40, "moe_gated_shared")),
                        34_660_610_688, "Qwen3.5-35B-A3B: 35B, 3B activated"),
}

#: Activated parameters as the model cards publish them (rounded), and whether that figure counts the input
#: embedding: DeepSeek-V2/V3's and gpt-oss's figures leave it out (DeepSeek-V2-Lite: 2.66B with it, 2.45B without), the
#: DeepSeekMoE and Qwen3 figures count it. ``count_parameters(...)["active"]`` always counts it.
PUBLISHED_ACTIVE: dict[str, tuple[int, bool]] = {
    "deepseek-moe-16b": (2_800_000_000, True), "deepseek-v2-lite": (2_400_000_000, False),
    "deepseek-v3": (37_000_000_000, False), "qwen3-30b-a3b": (3_300_000_000, True),
    "qwen3-235b-a22b": (22_000_000_000, True), "gpt-oss-20b": (3_600_000_000, False),
    "gpt-oss-120b": (5_100_000_000, False), "qwen3.5-35b-a3b": (3_000_000_000, False),
}


def apply_preset(cfg: ModelConfig, name: str) -> None:
    """Copy a preset's fields onto ``cfg`` (user flags are applied afterwards)."""
    fields, _, _ = PRESETS[name]
    for key, value in fields.items():
        setattr(cfg, key, value)
    cfg.model = name


def count_parameters(m: ModelConfig, vocab_size: int | None = None) -> dict[str, int]:
    """Parameter counts computed from the shape, without building the model: each layer's kinds count their
    parts (:mod:`meshtron.layer_kinds`).

    Returns ``total`` (every parameter), ``active`` (the parameters one token uses: ``total`` less
    the experts it is not routed to, the "activated" count of MoE model cards; ``total`` for dense
    models), ``matmul`` (the weights a token passes through in matrix multiplications: attention,
    MLP/active experts, router and output layer; not the input embedding, norms or biases; used
    for FLOPs) and ``embedding``.
    """
    V = vocab_size if vocab_size is not None else (m.vocab_size or 0)
    H = m.hidden_size
    norm_params = norm_parameters(m)
    kinds = layer_kinds(m)
    total = matmul = inactive = 0
    mtp = m.mtp_num_layers or 0  # each prediction depth: one layer of the last layer's kind (meshtron.layers.mtp)
    for layer in kinds + (kinds[-1:] * mtp):
        mixer, mlp = layer.mixer.parameters(m), layer.mlp.parameters(m)
        total += mixer.total + mlp.total + 2 * norm_params
        matmul += mixer.matmul + mlp.matmul
        inactive += mixer.inactive + mlp.inactive
    embedding = V * H
    total += embedding + norm_params
    if m.position_embedding_type == "learned_absolute":
        total += (m.max_position_embeddings or m.seq_length) * H
    if m.untie_embeddings_and_output_weights:
        total += V * H
    matmul += V * H  # the output layer, tied or not
    total += mtp * (2 * H * H + 3 * norm_params)  # per depth: eh_proj, enorm, hnorm, final norm
    matmul += mtp * (2 * H * H + V * H)  # eh_proj and the shared output layer once more
    return {"total": total, "matmul": matmul, "embedding": embedding, "active": total - inactive}


#: What `meshtron train` does with no arguments: the tiny preset on the built-in corpus, a few minutes on
#: two CPU cores (or seconds on a GPU), then a checkpoint and a generated sample.
QUICKSTART: dict = {
    "model": "tiny",
    "seq_length": 256,
    "max_position_embeddings": 256,
    "micro_batch_size": 8,
    "global_batch_size": 8,
    "train_iters": 1200,
    "lr": 3.0e-3,
    "min_lr": 3.0e-4,
    "lr_decay_style": "cosine",
    "lr_warmup_iters": 30,
    "weight_decay": 0.1,
    "clip_grad": 1.0,
    "eval_interval": 200,
    "eval_iters": 8,
    "log_interval": 50,
    "save": "runs/quickstart",
    "metrics_file": "runs/quickstart/metrics.jsonl",
}
