"""Generation with the newer token mixers' decode states: sink attention (full and sliding window, gpt-oss),
gated attention and gated DeltaNet (Qwen3.5). A prompt's prefill and then one token at a time give the logits
of the whole sequence run without a cache, at every step; ``generate_ids`` runs with and without the cache
to the same tokens."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.generate import generate_ids
from meshtron.layers.attention import KVCache
from meshtron.layers.gated_deltanet import DecodeState, GatedDeltaNet, causal_depthwise_conv
from meshtron.layers.sink_kernel import sink_attention
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters

VOCAB = 96


def _common(m: ModelConfig) -> None:
    """The sizes both tiny models share (a seq_length longer than the tests' sequences)."""
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 32, 4, 32
    m.group_query_attention, m.num_query_groups = True, 2
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = VOCAB, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    m.untie_embeddings_and_output_weights = True


def gpt_oss_like() -> ModelConfig:
    """Sliding-window (5 keys) and full sink attention layers with biases and YaRN, gpt-oss's MoE."""
    m = ModelConfig()
    _common(m)
    m.kv_channels, m.disable_bias_linear = 8, False
    m.layer_pattern, m.sliding_window_size = "sink_window+oss_moe,sink+oss_moe,sink_window+oss_moe,sink+oss_moe", 5
    m.rope_type, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings = "yarn", 4.0, 8
    m.mscale, m.mscale_all_dim, m.yarn_truncate = 1.0, 0.0, False
    m.num_experts, m.moe_ffn_hidden_size, m.ffn_hidden_size, m.moe_router_topk = 4, 16, 16, 2
    m.swiglu_clamp_limit = 1.5
    return m


def qwen3_5_like() -> ModelConfig:
    """Gated DeltaNet and gated attention layers (partial RoPE, zero-centred norms), dense MLPs."""
    m = ModelConfig()
    _common(m)
    m.kv_channels, m.ffn_hidden_size, m.disable_bias_linear = 16, 48, True
    m.zero_centred_norm, m.rotary_percent = True, 0.25
    m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim = 2, 4, 8, 6
    m.layer_pattern = "gdn+dense,gated_attn+dense,gdn+dense,gated_attn+dense"
    return m


MODELS = {"gpt_oss": gpt_oss_like, "qwen3_5": qwen3_5_like}


def _model(make) -> GPTModel:
    """A tiny fp32 model whose vectors (biases, norms, sinks, decays) are random too, so that each matters."""
    model = GPTModel(make(), ParallelContext(), VOCAB)
    initialize_parameters(model, 5, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() <= 1:
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return model.eval()


@torch.no_grad()
def incremental_logits(model, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits [b, s, vocab] of ``tokens`` [b, s] decoded with the model's decode states: the first ``prompt``
    tokens in one call (the prefill), then one token per call."""
    caches: dict = {}
    got = [model(tokens=tokens[:, :prompt], caches=caches)]
    for t in range(prompt, tokens.shape[1]):
        got.append(model(tokens=tokens[:, t:t + 1], caches=caches, position_offset=t))
    return torch.cat(got, dim=1)


@pytest.mark.parametrize("name", MODELS)
def test_prefill_then_one_token_steps_equal_the_whole_sequence(name):
    model = _model(MODELS[name])
    tokens = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens=tokens)
    assert want.abs().max() > 0.1  # not a degenerate comparison
    # a prompt longer than the window: the window slides in the prompt and in the steps
    torch.testing.assert_close(incremental_logits(model, tokens, 7), want, rtol=1e-5, atol=1e-5)


def test_sliding_window_caches_keep_only_the_window():
    """A sliding-window layer's cache holds the latest W - 1 keys after each step, a full layer's all of them."""
    model = _model(gpt_oss_like)
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    caches: dict = {}
    with torch.no_grad():
        model(tokens=tokens[:, :9], caches=caches)
        model(tokens=tokens[:, 9:10], caches=caches, position_offset=9)
    lengths = sorted(c.k.shape[2] for c in caches.values())
    assert lengths == [4, 4, 10, 10], lengths  # window 5: two sliding layers, two full ones


def test_a_window_of_one_keeps_no_earlier_key():
    cache = KVCache()
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    cache.keep_last(0)
    assert cache.k.shape[2] == 0 and cache.v.shape[2] == 0


@pytest.mark.parametrize("name", MODELS)
def test_generate_ids_with_the_cache_equals_without(name):
    model = _model(MODELS[name])
    prompt = [5, 17, 42, 7, 3, 11]
    cached = generate_ids(model, prompt, 8, temperature=0.0, use_cache=True)
    plain = generate_ids(model, prompt, 8, temperature=0.0, use_cache=False)
    assert len(cached) == 8 and cached == plain


@pytest.mark.parametrize("window", [None, 3])
def test_sink_attention_with_cached_keys_equals_the_last_rows(window):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=gen) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    whole = sink_attention(q, k, v, sinks, window)
    torch.testing.assert_close(sink_attention(q[:, :, -2:], k, v, sinks, window), whole[:, :, -2:])


def test_gated_deltanet_decode_state_continues_a_prompt():
    layer = GatedDeltaNet(ParallelContext(), "gdn", 32, 2, 4, 8, 6, conv_kernel_size=4)
    initialize_parameters(layer, 3, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        layer.A_log.normal_(0, 0.5)
    x = torch.randn(70, 2, 32, generator=torch.Generator().manual_seed(3))  # a prompt of two chunks
    with torch.no_grad():
        want = layer(x)
        state = DecodeState()
        got = [layer(x[:66], cache=state)] + [layer(x[t:t + 1], cache=state) for t in range(66, 70)]
    assert state.conv.shape == (2, 3, 2 * 2 * 8 + 4 * 6) and state.state.shape == (2, 4, 8, 6)
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)


def test_decode_state_convolution_equals_the_whole_convolution():
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(1, 10, 5, generator=gen), torch.randn(5, 4, generator=gen)
    state = DecodeState()
    parts = [state.convolve(x[:, :2], w)] + [state.convolve(x[:, t:t + 1], w) for t in range(2, 10)]
    torch.testing.assert_close(torch.cat(parts, dim=1), causal_depthwise_conv(x, w))
