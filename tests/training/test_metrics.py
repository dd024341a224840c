"""FLOPs per token, peak TFLOP/s table, throughput and MFU arithmetic."""

import math

import numpy as np
import pytest
import torch

from meshtron.config import ConfigError, ModelConfig
from meshtron.presets import apply_preset
from meshtron.training.metrics import (
    PEAK_BF16_TFLOPS,
    ThroughputMeter,
    compute_throughput,
    flops_per_token,
    peak_memory_stats,
    peak_tflops,
    peak_tflops_for_name,
    perplexity,
)


def preset(name: str, **overrides) -> ModelConfig:
    m = ModelConfig()
    apply_preset(m, name)
    for key, value in overrides.items():
        setattr(m, key, value)
    return m


def test_flops_llama3_8b_by_hand():
    # Llama-3.1-8B: L=32, H=4096, 32 query heads, 8 KV heads of 128, FFN 14336 (SwiGLU), vocab 128256.
    L, H, kv, F, V, S = 32, 4096, 8 * 128, 14336, 128256, 8192
    attention = H * H + 2 * H * kv + H * H  # q, k, v, o
    mlp = 3 * H * F  # gate, up, down
    n_matmul = L * (attention + mlp) + V * H  # + output layer, no input embedding
    assert n_matmul == 7_504_658_432
    expected = 6 * n_matmul + 12 * L * H * S
    assert flops_per_token(preset("llama3-8b"), V) == expected
    assert flops_per_token(preset("llama3-8b", seq_length=4096), V) == 6 * n_matmul + 12 * L * H * 4096


def test_flops_mixtral_counts_router_and_topk_experts():
    L, H, kv, F, V, S, E, k = 32, 4096, 1024, 14336, 32000, 4096, 8, 2
    per_layer = (2 * H * H + 2 * H * kv) + k * 3 * H * F + H * E
    expected = 6 * (L * per_layer + V * H) + 12 * L * H * S
    assert flops_per_token(preset("mixtral-8x7b"), V) == expected


def test_flops_attention_term_uses_full_sequence_and_output_uses_given_vocab():
    m1, m2 = preset("llama3-1b", seq_length=2048), preset("llama3-1b", seq_length=4096)
    assert flops_per_token(m2, 128256) - flops_per_token(m1, 128256) == 12 * 16 * 2048 * 2048
    # The vocabulary enters only through the output layer: 6 FLOPs per extra row element.
    assert flops_per_token(m1, 128256 + 128) - flops_per_token(m1, 128256) == 6 * 128 * 2048
    with pytest.raises(ValueError):
        flops_per_token(m1, 0)


@pytest.mark.parametrize("name,micro_batch,gpus,tok_s_per_gpu,mfu_percent", [
    # Published torchtitan rows on H200 (seq 4096, vocab 128256), PEERS table: our formula must reproduce them.
    ("llama3-1b", 8, 1, 61_728, 56.3),
    ("llama3-3b", 4, 1, 24_282, 57.7),
    ("llama3-8b", 2, 2, 10_146, 52.8),
])
def test_mfu_reproduces_published_rows(name, micro_batch, gpus, tok_s_per_gpu, mfu_percent):
    m = preset(name, seq_length=4096)
    tokens_per_iter = micro_batch * gpus * 4096
    step_time = tokens_per_iter / (tok_s_per_gpu * gpus)
    t = compute_throughput(tokens_per_iter, gpus, step_time, flops_per_token(m, 128256), 989.4)
    assert t.tokens_per_sec_per_gpu == pytest.approx(tok_s_per_gpu)
    assert round(t.mfu * 100, 1) == mfu_percent
    assert t.tflops_per_gpu == pytest.approx(t.mfu * 989.4)


def test_throughput_arithmetic_and_meter():
    m = preset("tiny", seq_length=128)
    fpt = flops_per_token(m, 4096)
    # 32 samples x 128 tokens over 4 GPUs in 0.5 s -> 2048 tok/s/GPU.
    t = compute_throughput(32 * 128, 4, 0.5, fpt, 100.0)
    assert t.tokens_per_sec_per_gpu == 2048.0
    assert t.tflops_per_gpu == pytest.approx(2048.0 * fpt / 1e12)
    assert t.mfu == pytest.approx(t.tflops_per_gpu / 100.0)
    assert compute_throughput(32 * 128, 4, 0.5, fpt, None).mfu is None

    meter = ThroughputMeter(m, 4096, global_batch_size=32, world_size=4, peak=100.0)
    assert meter.tokens_per_iteration == 32 * 128
    assert meter.measure(2.0, iterations=4) == t  # mean step time of a logging interval
    for bad in (dict(elapsed_s=1.0, iterations=0), dict(elapsed_s=0.0, iterations=1)):
        with pytest.raises(ValueError):
            meter.measure(**bad)
    with pytest.raises(ValueError):
        compute_throughput(1, 0, 1.0, fpt, None)


@pytest.mark.parametrize("device_name,expected", [
    ("NVIDIA H100 80GB HBM3", 989.4),
    ("NVIDIA H200", 989.4),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L40S", 362.05),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA GeForce RTX 3090", None),
])
def test_peak_table_by_device_name(device_name, expected):
    assert peak_tflops_for_name(device_name) == expected


def test_peak_table_entries_are_sourced():
    for key, tflops, source in PEAK_BF16_TFLOPS:
        assert tflops > 0 and "datasheet" in source, key


def test_peak_tflops_cpu_and_override():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), 123.0) == 123.0
    for bad in (0.0, -5.0, float("nan")):
        with pytest.raises(ConfigError, match="--peak-tflops"):
            peak_tflops(torch.device("cpu"), bad)


def test_perplexity_overflow_is_inf():
    assert perplexity(2.0) == pytest.approx(math.exp(2.0))
    assert perplexity(np.float32(1.0)) == pytest.approx(math.e)
    assert perplexity(1e4) == math.inf


def test_peak_memory_stats_cpu_is_a_positive_float():
    stats = peak_memory_stats(torch.device("cpu"))
    assert set(stats) == {"peak_mem_gib"}
    assert isinstance(stats["peak_mem_gib"], float) and stats["peak_mem_gib"] > 0
