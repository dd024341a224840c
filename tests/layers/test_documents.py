"""Packed documents without a dense mask: the block table, flex attention and the model against the
dense reference (fp32, CPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F

from meshtron.layers.attention import attention_mask_from_documents
from meshtron.layers.sdpa import core_attention
from meshtron.layers.documents import PATH_ENV, DocumentMask, flex


def documents(g: torch.Generator, batch: int, seq: int, p: float = 0.05) -> torch.Tensor:
    starts = (torch.rand(batch, seq, generator=g) < p).int()
    starts[:, 0] = 0
    return starts.cumsum(1).int()


@contextlib.contextmanager
def flex_backward_on_cpu():
    """torch refuses flex attention's backward on the CPU by a device check before its (math) eager
    implementation, which supports it: lift the check to compare the kernel's gradients here."""
    saved = flex_module._validate_device
    flex_module._validate_device = lambda *a: None
    try:
        yield
    finally:
        flex_module._validate_device = saved


@pytest.mark.parametrize("seq,block,p", [(128, 8, 0.03), (70, 8, 0.05), (96, 8, 0.02), (40, 16, 0.0)])
def test_block_table_matches_the_dense_mask(seq, block, p):
    g = torch.Generator().manual_seed(seq + block)
    docs = documents(g, 3, seq, p)
    m = DocumentMask(docs, block_size=block)
    dense = attention_mask_from_documents(docs)
    assert torch.equal(m.dense(), dense)
    assert torch.equal(m.allowed(), dense)
    partial, full = m.tables()
    nb = -(-seq // block)
    assert partial.shape == full.shape == (3, nb, nb)
    # the table is tight for sorted document ids: a block is skipped iff it has no visible pair, full iff all are
    pad = nb * block - seq
    d = F.pad(dense[:, 0], (0, pad, 0, pad)).unflatten(1, (nb, block)).unflatten(3, (nb, block))
    any_visible, all_visible = d.any(4).any(2), d.all(4).all(2)
    assert torch.equal(partial | full, any_visible)
    if seq % block == 0:
        assert torch.equal(full, all_visible)
    assert full.any() and partial.any() and (~(partial | full)).any()


def test_block_mask_agrees_with_create_block_mask():
    g = torch.Generator().manual_seed(3)
    docs = documents(g, 2, 128, 0.04)
    m = DocumentMask(docs, block_size=16)
    ours = m.block_mask()
    ref = flex_module.create_block_mask(lambda b, h, q, k: (q >= k) & (docs[b, q] == docs[b, k]), 2, None, 128, 128,
                                        device="cpu", BLOCK_SIZE=16)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)


def test_shifted_positions_under_cp_blocks():
    """Queries and keys with other positions (a CP block): the rule and the table stay exact."""
    g = torch.Generator().manual_seed(5)
    docs = documents(g, 2, 96, 0.05)
    q_pos = torch.cat([torch.arange(0, 24), torch.arange(72, 96)])
    k_pos = torch.arange(24, 72)
    m = DocumentMask(docs[:, q_pos], docs[:, k_pos], q_pos, k_pos, block_size=8)
    full_dense = attention_mask_from_documents(docs)[:, :, q_pos][:, :, :, k_pos]
    assert torch.equal(m.dense(), full_dense)
    assert torch.equal(m.allowed(), full_dense)


@pytest.mark.parametrize("window", [1, 5, 8, 19])
@pytest.mark.parametrize("positions", ["arange", "cp"])
def test_window_rule_table_and_block_mask(window, positions):
    """A sliding window (the query's own and the window - 1 before it) with and without documents, by index and at
    the shifted positions of a CP block: the rule, the expanded table and flex's block mask all equal the dense
    reference, and the table is tight (a tile is skipped iff it has no visible pair, full iff all are)."""
    g = torch.Generator().manual_seed(window)
    seq = 96
    for docs in (documents(g, 2, seq, 0.05), torch.zeros(2, seq, dtype=torch.int32)):
        i = torch.arange(seq)
        ref = attention_mask_from_documents(docs) & (i[:, None] - i[None, :] < window)
        if positions == "cp":
            q_pos = torch.cat([torch.arange(0, 24), torch.arange(72, 96)])
            k_pos = torch.arange(16, 80)
            m = DocumentMask(docs[:, q_pos], docs[:, k_pos], q_pos, k_pos, block_size=8, window=window)
            ref = ref[:, :, q_pos][:, :, :, k_pos]
        else:
            m = DocumentMask(docs, block_size=8, window=window)
        assert torch.equal(m.dense(), ref) and torch.equal(m.allowed(), ref)
        partial, full = m.tables()
        d = ref[:, 0].unflatten(1, (-1, 8)).unflatten(3, (-1, 8))
        assert torch.equal(partial | full, d.any(4).any(2)) and torch.equal(full, d.all(4).all(2))
        tiles = m.block_mask().to_dense().bool().repeat_interleave(8, 2).repeat_interleave(8, 3)
        assert torch.equal(tiles & m.dense(), ref)
        if positions == "arange":  # flex's eager kernel evaluates the block mask's rule: the dense path's output
            q, k, v = (t.detach() for t in _qkv(g, 2, 2, 2, seq, 8, 8))
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=ref)
            torch.testing.assert_close(flex(q, k, v, m.block_mask(), None), want, rtol=1e-5, atol=1e-5)


def _qkv(g, b, hq, hk, s, d, dv):
    q = torch.randn(b, hq, s, d, generator=g, requires_grad=True)
    k = torch.randn(b, hk, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, hk, s, dv, generator=g, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("hq,hk,d,dv", [(4, 4, 16, 16), (4, 2, 16, 16), (4, 1, 24, 8)],
                         ids=["mha", "gqa", "mla-dims"])
def test_flex_attention_equals_dense(hq, hk, d, dv):
    """The flex kernel (eager, math) with our BlockMask: outputs and gradients equal the dense path."""
    g = torch.Generator().manual_seed(hq * 10 + hk)
    docs = documents(g, 2, 80, 0.05)
    q, k, v = _qkv(g, 2, hq, hk, 80, d, dv)
    scale = 0.3
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask_from_documents(docs), scale=scale,
                                         enable_gqa=hk != hq)
    dout = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    with flex_backward_on_cpu():
        out = flex(q, k, v, DocumentMask(docs, block_size=16).block_mask(), scale)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["blocks", "dense"])
def test_core_attention_paths(path, monkeypatch):
    monkeypatch.setenv(PATH_ENV, path)
    g = torch.Generator().manual_seed(1)
    docs = documents(g, 2, 48, 0.06)
    q, k, v = _qkv(g, 2, 4, 2, 48, 8, 8)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask_from_documents(docs), enable_gqa=True)
    out = core_attention(q, k, v, DocumentMask.causal(docs), 0.0)
    assert torch.equal(out, ref) if path == "dense" else torch.allclose(out, ref, atol=1e-6)


def test_unknown_path(monkeypatch):
    monkeypatch.setenv(PATH_ENV, "sparse")
    with pytest.raises(ValueError, match=PATH_ENV):
        DocumentMask(torch.zeros(1, 4, dtype=torch.int32))
