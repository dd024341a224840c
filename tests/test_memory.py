"""The memory estimate: hand-computed cases and the properties a planner relies on."""

import math

import pytest

from meshtron.layers.cross_entropy import CHUNK_ELEMENTS, chunk_size

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.memory import (
    MemoryEstimate,
    backward_working_bytes,
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
    # Compiled on the GPU today (revision 7 of the saves: the emulated H100 rows), the shards, as eager.
    sp = layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, sequence_parallel=True, act_bytes=2)
    assert sp == eager_sp
    # Where the compiler merges the backward's all-gather with the forward's (the CPU; the two-GPU rows of
    # revision 0), each of the two column-parallel linears keeps its all-gathered input, not its shard.
    for merged in (dict(merged_gathers=True), dict(saves=6)):
        sp = layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, sequence_parallel=True, act_bytes=2, **merged)
        assert sp == pytest.approx(full / t + B * S * 2 * 2 * H * (1 - 1 / t))
    # FP8 too, the gathered one-byte copies (tests/parallel/test_saved_activations_tp.py counts them).
    fp8_sp = layer_activation_bytes(m, micro_batch=B, seq=S, tp=t, sequence_parallel=True, act_bytes=2, fp8=True,
                                    merged_gathers=True)
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


def test_distributed_optimizer_divides_optimizer_state_by_dp():
    cfg = config("llama3-1b", global_batch_size=8)
    plain = estimate_memory(cfg, 128256, world_size=4)
    cfg.parallel.use_distributed_optimizer = True
    sharded = estimate_memory(cfg, 128256, world_size=4)
    assert sharded.optimizer_state == plain.optimizer_state / 4
    assert (sharded.weights, sharded.gradients, sharded.activations) == (plain.weights, plain.gradients,
                                                                         plain.activations)
    cfg.optim.optimizer_cpu_offload, cfg.optim.optimizer_offload_fraction = True, 0.5
    assert estimate_memory(cfg, 128256, world_size=4).optimizer_state == sharded.optimizer_state / 2


def test_tensor_parallel_shards_all_but_norms():
    cfg = config("tiny", device="cpu", tensor_model_parallel_size=2)
    total = count_parameters(cfg.model, 4096)["total"]
    replicated_norms = (2 * cfg.model.num_layers + 1) * cfg.model.hidden_size
    per_rank = estimate_memory(cfg, 4096).weights / 4
    assert 2 * per_rank == total + replicated_norms


def test_experts_are_split_over_expert_parallel_ranks():
    m = config("mixtral-8x7b").model
    dense1, expert1 = layer_parameters(m, 0, tp=1, ep=1)
    dense2, expert2 = layer_parameters(m, 0, tp=1, ep=2)
    assert dense1 == dense2 and expert2 == expert1 / 2 == 4 * 3 * 4096 * 14336


def test_vocab_is_padded_like_the_model():
    cfg = config("tiny", device="cpu")
    # 4000 pads to 4096 (multiple of 128): same memory as 4096.
    assert estimate_memory(cfg, 4000).weights == estimate_memory(cfg, 4096).weights


# ------------------------------------------------------------------------------- pipeline

def test_stage_chunks_even_uneven_and_interleaved():
    assert stage_chunks(config("tiny", num_layers=8, pipeline_model_parallel_size=4)) == [
        [[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    uneven = config("tiny", num_layers=8, pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=2)
    assert stage_chunks(uneven) == [[[0, 1]], [[2, 3, 4]], [[5, 6, 7]]]
    inter = config("tiny", num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert stage_chunks(inter) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_pipeline_stages_split_parameters_and_last_stage_copies_tied_embedding():
    cfg = config("tiny", device="cpu", pipeline_model_parallel_size=2, global_batch_size=8)
    total = count_parameters(cfg.model, 4096)["total"]
    stages = stage_estimates(cfg, 4096, world_size=2)
    assert sum(s.weights for s in stages) == 4 * (total + 4096 * cfg.model.hidden_size)
    assert stages[0].logits == 0 and stages[1].logits > 0


def test_1f1b_in_flight_micro_batches():
    cfg = config("tiny", num_layers=8, pipeline_model_parallel_size=4, global_batch_size=16)
    assert [s.microbatches_in_flight for s in stage_estimates(cfg, 4096, world_size=4)] == [4, 3, 2, 1]
    cfg.train.global_batch_size = 2  # fewer micro-batches than stages
    assert [s.microbatches_in_flight for s in stage_estimates(cfg, 4096, world_size=4)] == [2, 2, 2, 1]


def test_interleaved_first_stage_factor():
    p, v, L = 4, 2, 16
    cfg = config("tiny", num_layers=L, pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v,
                 global_batch_size=8)
    stages = stage_estimates(cfg, 4096, world_size=p)
    first = stages[0]
    layers_on_rank = L // p
    # Layer-forwards kept on rank 0: L * (1 + (p-1)/(p*v)) = 22.
    assert first.microbatches_in_flight * layers_on_rank == L * (1 + (p - 1) / (p * v)) == 22
    per_layer = layer_activation_bytes(cfg.model, micro_batch=1, seq=128)
    token_ids = 8 * 128
    work = backward_working_bytes(cfg.model, micro_batch=1, seq=128)  # the one layer in its backward
    assert first.activations == round(first.microbatches_in_flight * (layers_on_rank * per_layer + token_ids) + work)


# ------------------------------------------------------------------------------- whole estimate

def test_backward_working_set_by_hand():
    """The received gradient and, in the MLP, SwiGLU's recomputed product and the gradient of gate and up."""
    m = config("llama3-1b").model
    h, f = 2048, 8192
    assert backward_working_bytes(m, micro_batch=1, seq=131072) == 131072 * (2 * h + 3 * 2 * f)
    assert (backward_working_bytes(m, micro_batch=2, seq=1024, tp=2, sequence_parallel=True)
            == 2048 * (2 * h / 2 + 3 * 2 * f / 2))
    assert backward_working_bytes(gpt_layer(), micro_batch=1, seq=S) == S * (2 * H + 2 * 2 * 4 * H)  # GeLU: two
    moe = config("mixtral-8x7b").model
    assert (backward_working_bytes(moe, micro_batch=1, seq=4096, moe=True, expert_tp=1)
            == 4096 * (2 * 4096 + 2 * 3 * 2 * 14336))  # per routing choice


def test_activation_totals_by_hand_with_full_recompute():
    """Two moments never meet: the loss (its chunk and fp32 weight gradient, the head's inputs) and the first
    recomputed chunk's backward (its layers' activations less its input, which is kept, the backward's working
    set, and the tied output weight's gradient in bf16)."""
    cfg = config("tiny", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    m, tokens, h = cfg.model, 128, 128
    layer = layer_activation_bytes(m, micro_batch=1, seq=128)
    work = backward_working_bytes(m, micro_batch=1, seq=128)
    chunk_input = tokens * 2 * h
    head = tokens * (2 * 2 * h + 4)  # final norm input + output-layer input + rstd
    tied = 2 * h * 4096
    est = estimate_memory(cfg, 4096)
    # Fused chunked loss: fp32 output-weight gradient + one chunk (all 128 tokens) of bf16 logits and
    # their bf16 gradient.
    loss_chunk = tokens * 4096 * 4
    assert est.logits == 4 * h * 4096 + loss_chunk
    # 2 checkpoints (token ids too) and the larger moment.
    backward = 2 * layer - chunk_input + work + tied
    assert est.activations == round(2 * chunk_input + 8 * tokens + max(head + est.logits, backward) - est.logits)
    cfg.train.recompute_method, cfg.train.recompute_num_layers = "block", 1
    backward = layer - chunk_input + work + tied
    assert (estimate_memory(cfg, 4096).activations
            == round(chunk_input + 3 * layer + 8 * tokens + max(head + est.logits, backward) - est.logits))


def test_long_sequence_peaks_in_the_first_recomputed_layers_backward():
    """llama3-1b, 1 x 131072, full recomputation: the recomputed layer's backward outgrows the loss (measured on
    an H100: 38.15 GiB; benchmarks/measured.jsonl h154), at 65,536 the loss still leads (27.79 GiB, h152)."""
    def estimate(seq: int) -> MemoryEstimate:
        cfg = config("llama3-1b", seq_length=seq, micro_batch_size=1, global_batch_size=1,
                     recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return estimate_memory(cfg, 128256)

    m, h, v = config("llama3-1b").model, 2048, 128256
    long, short = estimate(131072), estimate(65536)
    tokens = 131072
    kept = 16 * tokens * 2 * h
    backward = layer_activation_bytes(m, micro_batch=1, seq=tokens) - tokens * 2 * h + backward_working_bytes(
        m, micro_batch=1, seq=tokens) + 2 * h * v
    assert long.activations == round(kept + 8 * tokens + backward - long.logits)
    assert long.total / 2**30 == pytest.approx(38.15, rel=0.01)
    assert short.total / 2**30 == pytest.approx(27.79, rel=0.01)


def test_recompute_orders_totals():
    totals = {}
    for gran in (None, "selective", "full"):
        # A persistent gradient buffer: with a released one this one-micro-batch step peaks at the optimizer
        # step, whatever the recomputation.
        cfg = config("llama3-8b", seq_length=4096, micro_batch_size=2, recompute_granularity=gran,
                     recompute_method="uniform" if gran == "full" else None, release_grad_buffer=False)
        totals[gran] = estimate_memory(cfg, 128256).total
    assert totals["full"] < totals["selective"] < totals[None]


def test_sequence_parallel_and_context_parallel_reduce_activations():
    def acts(**fields):
        return estimate_memory(config("llama3-8b", seq_length=4096, **fields), 128256, fused_loss=False)

    tp2 = acts(tensor_model_parallel_size=2)
    tp2_sp = acts(tensor_model_parallel_size=2, sequence_parallel=True)
    tp1 = acts()
    assert tp2_sp.activations < tp2.activations < tp1.activations
    # Compiled on the GPU the column-parallel linears keep their shards (revision 7 of the saves); token ids are
    # not split.
    assert tp2_sp.activations == pytest.approx(tp1.activations / 2, rel=1e-3)
    cfg = config("llama3-8b", seq_length=4096)
    tokens, layers = cfg.train.micro_batch_size * 4096, cfg.model.num_layers
    gathered = layers * tokens * 2 * 2 * 4096 * (1 - 1 / 2)  # QKV's and fc1's all-gathered inputs (compiled)
    merged = estimate_memory(config("llama3-8b", seq_length=4096, tensor_model_parallel_size=2,
                                    sequence_parallel=True), 128256, fused_loss=False, saves=6)
    assert merged.activations - gathered == pytest.approx(tp1.activations / 2, rel=1e-3)
    assert tp2.logits == tp2_sp.logits == tp1.logits / 2
    cp2 = acts(context_parallel_size=2)
    assert cp2.logits == tp1.logits / 2 and cp2.activations == pytest.approx(tp1.activations / 2, rel=1e-6)


def test_loss_memory_fused_and_unfused_and_fp32_doubles_activations():
    cfg = config("llama3-1b", seq_length=4096, micro_batch_size=4)
    tokens, v, h = 4 * 4096, 128256, 2048
    assert estimate_memory(cfg, v, fused_loss=False).logits == tokens * v * 4  # fp32 logits kept
    chunk = chunk_size(tokens, v)  # the fused loss's chunk of logits: two equal halves of the micro-batch
    assert chunk == tokens // 2 and chunk * v <= CHUNK_ELEMENTS
    fused = estimate_memory(cfg, v)
    # bf16 logits and their gradient, and the first chunk's gradient still referenced in the second
    assert fused.logits == 4 * h * v + chunk * v * 6
    assert fused.logits < estimate_memory(cfg, v, fused_loss=False).logits
    # one chunk (8192 tokens): no earlier gradient
    one_chunk = estimate_memory(config("llama3-1b", seq_length=4096, micro_batch_size=2), v)
    assert one_chunk.logits == 4 * h * v + 8192 * v * 4
    cfg.train.device = "cpu"
    fp32 = estimate_memory(cfg, v)
    assert fp32.logits == 4 * h * v + chunk * v * (20 + 4)  # eager fp32 temporaries, the earlier gradient
    assert fp32.activations > 1.9 * fused.activations


def test_world_size_must_fit_the_layout():
    # The layout's own rule (meshtron.parallel.layout.data_parallel_size_of), which names the flags.
    with pytest.raises(ValueError, match=r"not divisible by TP\(2\) x CP\(1\) x PP\(1\)"):
        estimate_memory(config("tiny", tensor_model_parallel_size=2), 4096, world_size=3)


def test_llama3_8b_figures_and_report():
    cfg = config("llama3-8b", seq_length=4096, micro_batch_size=2, global_batch_size=4,
                 use_distributed_optimizer=True)
    est = estimate_memory(cfg, 128256, world_size=2)
    total_params = count_parameters(cfg.model, 128256)["total"]
    assert est.weights == 2 * total_params and est.optimizer_state == 6 * total_params
    assert est.activations == pytest.approx(32 * 2 * 4096 * 110_728, rel=0.01)  # 32 layers dominate
    assert est.logits == 4 * 4096 * 128256 + min(2 * 4096, CHUNK_ELEMENTS // 128256) * 128256 * 4
    d = est.as_dict()
    assert d["total"] == est.total == sum(d[k] for k in ("weights", "gradients", "optimizer_state",
                                                          "activations", "logits"))
    table = est.table()
    assert "total" in table and f"{est.total / 2**30:.2f} GiB" in table
    assert isinstance(est, MemoryEstimate) and math.isfinite(est.total)


def test_offload_timeline_backlog_fetches_and_stall():
    from meshtron.memory import offload_timeline

    # Three layers of 10 bytes, the last kept; copies at 1 byte/s behind 1 s forwards. Copy 1 runs 1..11 s,
    # copy 2 11..21 s; the backward begins at 3 s with 8 + 10 bytes not yet copied, fetches layer 1 at
    # 21..31 s and layer 0 at 31..41 s, so its three 1 s layers end at 42 s: 36 s of waiting.
    t = offload_timeline([10.0, 10.0, 0.0], [0.0, 0.0, 10.0], [1.0] * 3, [1.0] * 3, 0.0, 1.0)
    assert t.backlog == 18.0  # freed tensors whose blocks the allocator holds: not in the live peak
    assert t.peak_resident == 10.0 + 10.0  # kept last layer + layer 1 fetched
    assert t.stall_s == 36.0
    fast = offload_timeline([10.0, 10.0, 0.0], [0.0, 0.0, 10.0], [1.0] * 3, [1.0] * 3, 0.0, 1e6)
    assert fast.backlog < 1e-3 and fast.stall_s < 1e-3
    assert fast.peak_resident == pytest.approx(10.0 + 10.0 + 0.0, rel=1e-3)  # last layer kept + layer 1 fetched


def test_offloading_lowers_the_estimate_and_keeps_the_last_layer():
    cfg = config("llama3-1b", seq_length=8192, micro_batch_size=1)
    base = estimate_memory(cfg, 128256)
    cfg.set("offload_activations", True)
    off = estimate_memory(cfg, 128256)
    per_layer = layer_activation_bytes(cfg.model, micro_batch=1, seq=8192)
    assert off.activations < base.activations - 2 * per_layer
    # The chunk's last layer and a fetched one at least (in the backward, where the loss's chunk is gone).
    assert off.activations + off.logits >= 2 * per_layer


def test_fc2_recomputes_the_product_as_the_layers_decide():
    """The memory model's rule for SwiGLU's product against the layers' own choice: compiled FP8 tensorwise
    recomputes it (revision 1 on); eager FP8 without biases does since revision 6 (the fused FP8 block,
    meshtron.layers.linear.fuses_fp8_swiglu), with biases it keeps the product's one-byte copy."""
    from meshtron.cli import build_config
    from meshtron.memory import fc2_recomputes_product

    base = ["--model", "tiny", "--bf16", "--fp8-format", "e4m3"]
    eager = build_config(base + ["--device", "cpu"])
    assert eager.model.disable_bias_linear
    assert fc2_recomputes_product(eager) and not fc2_recomputes_product(eager, saves=5)
    eager.model.disable_bias_linear = False
    assert not fc2_recomputes_product(eager)
    compiled = build_config(base + ["--device", "cuda"])
    compiled.model.disable_bias_linear = False
    assert fc2_recomputes_product(compiled, saves=5) and fc2_recomputes_product(compiled)
    assert not fc2_recomputes_product(build_config(base + ["--device", "cuda", "--fp8-recipe", "rowwise"]))
