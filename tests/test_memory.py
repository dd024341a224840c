"""The memory estimate: hand-computed cases and the properties a planner relies on."""

import math

import pytest

from meshtron.layers.cross_entropy import CHUNK_ELEMENTS, chunk_size

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.memory import (
    MemoryEstimate,
    estimate_memory,
    layer_activation_bytes,
    layer_parameters,
    stage_chunks,
    stage_estimates,
)
from meshtron.presets import apply_preset, count_parameters


def config(preset: str = "tiny", **fields) -> MeshtronConfig:
    cfg = MeshtronConfig()
    apply_preset(cfg.model, preset)
    for key, value in fields.items():
        cfg.set(key, value)
    return cfg


def gpt_layer(**overrides) -> ModelConfig:
    """A GPT-style layer: LayerNorm, GeLU with f = 4h, multi-head attention, dropout on."""
    m = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, normalization="LayerNorm",
                    swiglu=False, hidden_dropout=0.1, attention_dropout=0.1, seq_length=2048)
    for key, value in overrides.items():
        setattr(m, key, value)
    return m


B, S, H, A = 2, 2048, 1024, 16
STATS = 2 * 8  # two LayerNorms keep fp32 mean and rstd per token


# ------------------------------------------------------------------------------- one layer by hand

def test_gpt_layer_is_korthikanti_34sbh_with_flash():
    got = layer_activation_bytes(gpt_layer(), micro_batch=B, seq=S, act_bytes=2)
    assert got == B * S * (34 * H + STATS + 4 * A)  # + fp32 log-sum-exp per head


def test_gpt_layer_without_flash_adds_5as_over_h():
    got = layer_activation_bytes(gpt_layer(), micro_batch=B, seq=S, act_bytes=2, flash_attention=False)
    assert got == S * B * H * (34 + 5 * A * S / H) + B * S * STATS


def test_tensor_parallel_without_and_with_sequence_parallel():
    m, t = gpt_layer(), 4
    no_sp = layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, act_bytes=2)
    assert no_sp == B * S * (10 * H + STATS + (24 * H + 4 * A) / t)  # Korthikanti's 10sbh + 24sbh/t
    eager_sp = layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, sequence_parallel=True, act_bytes=2,
                                      compiled=False)
    full = layer_activation_bytes(m, micro_batch=B, seq=S, act_bytes=2)
    assert eager_sp == full / t
    # Compiled, each of the two column-parallel linears keeps its all-gathered input, not its shard.
    sp = layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, sequence_parallel=True, act_bytes=2)
    assert sp == pytest.approx(full / t + B * S * 2 * 2 * H * (1 - 1 / t))
    # FP8 too, the gathered one-byte copies (tests/parallel/test_saved_activations_tp.py counts them).
    fp8_sp = layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, sequence_parallel=True, act_bytes=2, fp8=True)
    assert fp8_sp == pytest.approx(layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, sequence_parallel=True,
                                                          act_bytes=2, fp8=True, compiled=False)
                                   + B * S * 2 * H * (1 - 1 / t))


def test_llama3_8b_swiglu_gqa_layer_by_hand():
    cfg = config("llama3-8b")
    # Per token, e = 2: the two norms' inputs and outputs (4h); the values copied out of the fused QKV
    # output (k), RoPE's new queries and keys (q + k) and the attention output (q); SwiGLU's input (2f:
    # its product is recomputed by the down projection's backward); + 4*heads (lse) + 2*4 (RMSNorm rstd).
    # These are the tensors the compiled layer saves (tests/layers/test_saved_activations.py counts them).
    per_token = 2 * (4 * 4096 + 2 * 4096 + 2 * 1024 + 2 * 14336) + 4 * 32 + 8
    assert per_token == 110_728
    assert layer_activation_bytes(cfg.model, micro_batch=1, seq=4096) == 4096 * per_token
    # Before: the values were a view of the whole QKV output (q + 2k) and the product was kept (f).
    legacy = 2 * (4 * 4096 + 3 * 4096 + 3 * 1024 + 3 * 14336) + 4 * 32 + 8
    assert layer_activation_bytes(cfg.model, micro_batch=1, seq=4096, saves=0) == 4096 * legacy


def test_fp8_layer_keeps_fp8_linear_inputs_and_no_weight_copies():
    from meshtron.memory import fp8_weight_copy_bytes

    m = config("llama3-3b").model
    h, q, k, f = 3072, 3072, 1024, 8192
    bf16 = layer_activation_bytes(m, micro_batch=1, seq=4096)
    fp8 = layer_activation_bytes(m, micro_batch=1, seq=4096, fp8=True)
    # The qkv and fc1 inputs (the two norm outputs, h each) are kept as one-byte FP8 copies instead of
    # bf16; the output projection keeps a one-byte copy of the attention output (q) beside the bf16 one;
    # fc2 recomputes SwiGLU's product (and, in FP8, its casts) in backward in both.
    assert bf16 - fp8 == 4096 * (2 * h - q)
    # Where fc2 keeps the product (zero-bubble deferral; the sequence-parallel FP8 path), its FP8 copy (f).
    kept = layer_activation_bytes(m, micro_batch=1, seq=4096, fp8=True, fc2_keeps_product=True)
    assert kept - fp8 == 4096 * f
    # The weight copies that the linears kept before revision 2 (one byte per weight element; fc2 recast).
    assert fp8_weight_copy_bytes(m, 0) == h * (q + 2 * k) + q * h + 3 * h * f
    assert fp8_weight_copy_bytes(m, 0, fc2_recast=True) == h * (q + 2 * k) + q * h + 2 * h * f
    cfg = config("llama3-3b", micro_batch_size=4, global_batch_size=4)
    plain = estimate_memory(cfg, 128256)
    cfg.train.fp8_format = "e4m3"
    tensorwise = estimate_memory(cfg, 128256)
    tokens = 4 * cfg.model.seq_length
    assert plain.activations - tensorwise.activations == m.num_layers * tokens * (2 * h - q)  # no weight copies
    earlier = estimate_memory(cfg, 128256, saves=1)
    assert earlier.activations - tensorwise.activations == m.num_layers * fp8_weight_copy_bytes(m, 0, fc2_recast=True)
    # Rowwise saves bf16 inputs; compiled, those that are norm outputs and SwiGLU's product are recomputed.
    cfg.train.fp8_recipe = "rowwise"
    rowwise = estimate_memory(cfg, 128256).activations
    assert plain.activations - rowwise == m.num_layers * tokens * 2 * 2 * h


def test_recomputation_levels_by_hand_and_ordered():
    m = gpt_layer()
    none = layer_activation_bytes(m, micro_batch=B, seq=S)
    selective = layer_activation_bytes(m, micro_batch=B, seq=S, recompute="selective")
    full = layer_activation_bytes(m, micro_batch=B, seq=S, recompute="full")
    # selective drops the norm outputs (4h bytes) and statistics and the GeLU output (8h); the attention
    # kernel's outputs (with the lse) are kept, as matmul outputs are.
    assert selective == B * S * (22 * H + 4 * A)
    assert full == B * S * 2 * H  # the layer input only
    assert full < selective < none
    llama = config("llama3-8b").model
    only_core = layer_activation_bytes(llama, micro_batch=B, seq=S, recompute="selective",
                                       selective_modules=("core_attn",))
    # core_attn recomputes RoPE: the rotated queries and keys are not kept, but the QKV output (a saved
    # matmul output) stays whole instead of the values' copy: the same bytes for Llama's q + 2k.
    assert only_core == layer_activation_bytes(llama, micro_batch=B, seq=S)
    with pytest.raises(ValueError):
        layer_activation_bytes(m, micro_batch=B, seq=S, recompute="some")
    with pytest.raises(ValueError, match="mlp"):
        layer_activation_bytes(m, micro_batch=B, seq=S, recompute="selective", selective_modules=("mlp",))


def test_context_parallel_halves_layer_activations():
    m = config("llama3-8b").model
    assert layer_activation_bytes(m, micro_batch=1, seq=2048) * 2 == layer_activation_bytes(m, micro_batch=1, seq=4096)


# ------------------------------------------------------------------------------- parameters

@pytest.mark.parametrize("preset_name,vocab", [("tiny", 4096), ("gpt2-small", 50304), ("llama3-8b", 128256),
                                                ("mixtral-8x7b", 32000)])
def test_one_rank_holds_every_parameter_once(preset_name, vocab):
    # fp32: 4 + 4 + 8 bytes per parameter (the gradients kept between steps)
    cfg = config(preset_name, device="cpu", release_grad_buffer=False)
    total = count_parameters(cfg.model, vocab)["total"]
    est = estimate_memory(cfg, vocab)
    assert est.weights == 4 * total and est.gradients == 4 * total and est.optimizer_state == 8 * total


def test_bf16_bytes_per_parameter_and_grad_reduce_in_bf16():
    cfg = config("tiny", release_grad_buffer=False)  # bf16 weights, fp32 grads, 12 bytes of optimizer state
    total = count_parameters(cfg.model, 4096)["total"]
    est = estimate_memory(cfg, 4096)
    assert (est.weights, est.gradients, est.optimizer_state) == (2 * total, 4 * total, 12 * total)
    cfg.parallel.grad_reduce_in_bf16 = True
    assert estimate_memory(cfg, 4096).gradients == 2 * total


@pytest.mark.parametrize("untied", [False, True])
def test_released_gradients_at_the_peak_of_one_micro_batch(untied):
    """--release-grad-buffer (default): with one micro-batch per step the forward's peak holds no gradient (with
    full recomputation the output layer's, untied, and one layer's); with two, every gradient (the second
    forward runs after the first backward); the distributed optimizer's buffer is released too, ZeRO-2's
    shards are not."""
    cfg = config("llama3-1b", untie_embeddings_and_output_weights=untied, micro_batch_size=2, global_batch_size=2)
    assert estimate_memory(cfg, 128256).gradients == 0
    cfg.train.recompute_granularity = "full"
    layer = sum(layer_parameters(cfg.model, 0))
    output = 128256 * cfg.model.hidden_size if untied else 0
    assert estimate_memory(cfg, 128256).gradients == 4 * (layer + output)
    total = count_parameters(cfg.model, 128256)["total"]
    cfg.train.global_batch_size = 4
    assert estimate_memory(cfg, 128256).gradients == 4 * total
    cfg.train.global_batch_size, cfg.train.recompute_granularity = 2, None
    cfg.parallel.use_distributed_optimizer = True
    assert estimate_memory(cfg, 128256).gradients == 0
    cfg.parallel.data_parallel_sharding_strategy = "optim_grads"
    assert estimate_memory(cfg, 128256).gradients == 4 * total


def test_released_gradients_peak_at_the_optimizer_step_of_a_large_model():
    """A model whose gradients outweigh one micro-batch's activations peaks at the optimizer step."""
    cfg = config("llama3-8b", micro_batch_size=1, global_batch_size=1, seq_length=1024)
    est = estimate_memory(cfg, 128256)
    total = count_parameters(cfg.model, 128256)["total"]
    assert est.gradients + est.activations + est.logits == pytest.approx(4 * total, rel=1e-9)
    assert 0 < est.gradients < 4 * total
