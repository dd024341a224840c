"""Attention with sinks and sliding window equals transformers' GptOssAttention and a dense reference."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.documents import DocumentMask
from meshtron.layers.rotary import rope_tables
from meshtron.layers.sink_attention import SinkAttention, sink_attention, window_block_tables
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import gather_canonical
from tests.layers.canonical import close, load_canonical
from tests.layers.test_documents import flex_backward_on_cpu

TOL = dict(rtol=1e-5, atol=1e-5)
NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}


def dense_reference(q, k, v, sinks, allowed):
    """softmax over [scores, sink] with the sink's column dropped; ``allowed`` [b|1, 1, s, s]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def allowed_pairs(s, window, docs=None):
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = (j <= i) & ((i - j < window) if window else True)
    keep = keep[None, None]
    if docs is not None:
        keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
    return keep


def _qkv(b=2, nq=4, ng=2, s=40, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, nq, s, d, generator=g), torch.randn(b, ng, s, d, generator=g),
            torch.randn(b, ng, s, d, generator=g), torch.randn(nq, generator=g))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("path", ["flex", "sdpa"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("with_docs", [False, True])
def test_both_paths_equal_the_dense_reference(path, window, with_docs):
    """flex attention folding the sink through the log-sum-exp (its eager kernel, whose backward runs on the
    CPU once torch's device check is lifted: the gradient through the log-sum-exp included), and the CPU
    path with the extra key, both against softmax over [scores, sink]: outputs and gradients."""
    q, k, v, sinks = _qkv()
    docs = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [5] * 40]) if with_docs else None
    mask = DocumentMask.causal(docs) if with_docs else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = dense_reference(*ref_in, allowed_pairs(40, window, docs))
    got_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    w = torch.randn_like(ref)
    with flex_backward_on_cpu():
        got = sink_attention(*got_in, window, mask, path=path)
        (got * w).sum().backward()
    torch.testing.assert_close(got, ref, **TOL)
    (ref * w).sum().backward()
    for name, a, b in zip("q k v sinks".split(), got_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 100])
def test_window_block_table_is_exact(window):
    """Tiles called full have every pair visible, tiles called empty none, for ragged and whole tiles."""
    for s in (40, 48):
        partial, full = window_block_tables(s, window, 16, torch.device("cpu"))
        pairs = allowed_pairs(s, window)[0, 0]
        n = partial.shape[0]
        for a in range(n):
            for c in range(n):
                tile = pairs[a * 16:(a + 1) * 16, c * 16:(c + 1) * 16]
                if full[a, c]:
                    assert tile.all()
                elif not partial[a, c]:
                    assert not tile.any()
                assert not (full[a, c] and partial[a, c])


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_matches_transformers_gpt_oss_attention(layer_type):
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    torch.manual_seed(0)
    W, s = 6, 24
    cfg = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=W,
                       num_hidden_layers=1, layer_types=[layer_type], attention_bias=True, vocab_size=64,
                       num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
    cfg._attn_implementation = "eager"
    hf = GptOssAttention(cfg, 0).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    canonical = {}
    for n, p in hf.named_parameters():
        mod, _, kind = n.partition(".")
        canonical[f"layers.0.attention.{NAMES.get(mod, mod)}" + (f".{kind}" if kind else "")] = p.detach()
    window = W if layer_type == "sliding_attention" else None
    ours = SinkAttention(ParallelContext(), "layers.0.attention", 32, 4, 2, 8, sliding_window=window, bias=True)
    load_canonical(ours, canonical)

    rotary = GptOssRotaryEmbedding(cfg)
    positions = torch.arange(s)
    x = torch.randn(2, s, 32)
    cos, sin = rotary(x, positions[None].expand(2, -1))
    additive = torch.zeros(1, 1, s, s).masked_fill(~allowed_pairs(s, window), float("-inf"))
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    y_hf, _ = hf(x_hf, (cos, sin), additive)
    y = ours(x_ours, rope_tables(positions, rotary.inv_freq, torch.float32, rotary.attention_scaling))
    torch.testing.assert_close(y.transpose(0, 1), y_hf, **TOL)
    w = torch.randn_like(y_hf)
    (y_hf * w).sum().backward()
    (y * w.transpose(0, 1)).sum().backward()
    close(x_ours.grad.transpose(0, 1), x_hf.grad, "input gradient")
    grads = gather_canonical([ours], "grad")
    for n, p in hf.named_parameters():
        mod, _, kind = n.partition(".")
        name = f"layers.0.attention.{NAMES.get(mod, mod)}" + (f".{kind}" if kind else "")
        close(grads[name], p.grad, n)
