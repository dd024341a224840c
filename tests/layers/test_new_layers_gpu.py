"""The CUDA paths of the new layers: sink attention through compiled flex attention (the block table's
BlockMask, the sink folded through the log-sum-exp) in forward and backward, the chunked gated delta rule
on the GPU, and, where ``fla-core`` is installed, its kernel against the chunked form. Needs CUDA."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.documents import DocumentMask
from meshtron.layers.gated_deltanet import (chunk_gated_delta_rule, document_segments, gated_delta_rule,
                                            gated_delta_rule_reference)
from meshtron.layers.sink_attention import sink_attention
from tests.layers.test_sink_attention import allowed_pairs, dense_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _full_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _documents(b: int, s: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(s)
    return (torch.rand(b, s, generator=g) < 0.01).cumsum(1)


@pytest.mark.parametrize("window", [None, 128, 37])
@pytest.mark.parametrize("with_docs", [False, True])
def test_compiled_flex_sink_attention_equals_dense_reference(window, with_docs):
    b, nq, ng, s, d = 2, 8, 2, 300, 64  # ragged last 128-token tile
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=g) for n in (nq, ng, ng))
    sinks = torch.randn(nq, device="cuda", generator=g)
    docs = _documents(b, s).cuda() if with_docs else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    got_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = dense_reference(*ref_in, allowed_pairs(s, window, None if docs is None else docs.cpu()).cuda())
    got = sink_attention(*got_in, window, DocumentMask.causal(docs) if with_docs else None, path="flex")
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    (got * w).sum().backward()
    for name, a, r in zip("q k v sinks".split(), got_in, ref_in):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")


def _delta_inputs(b=2, s=300, h=4, dk=64, dv=64):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(b, s, h, dk, device="cuda", generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, s, h, dk, device="cuda", generator=g), dim=-1)
    v = torch.randn(b, s, h, dv, device="cuda", generator=g)
    decay = -torch.rand(b, s, h, device="cuda", generator=g) * 2
    beta = torch.rand(b, s, h, device="cuda", generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("with_docs", [False, True])
def test_chunked_delta_rule_on_cuda_equals_token_loop(with_docs):
    inputs = _delta_inputs()
    segments = document_segments(_documents(2, 300).cuda()) if with_docs else None
    ref, ref_state = gated_delta_rule_reference(*inputs, segments=segments)
    got, state = chunk_gated_delta_rule(*inputs, segments=segments)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_docs", [False, True])
def test_fla_kernel_equals_chunked_form(with_docs):
    pytest.importorskip("fla")
    q, k, v, decay, beta = _delta_inputs()
    segments = document_segments(_documents(2, 300).cuda()) if with_docs else None
    bf16 = [t.bfloat16().requires_grad_() for t in (q, k, v)] + [decay.clone().requires_grad_(),
                                                                   beta.bfloat16().requires_grad_()]
    ref_in = [t.detach().clone().requires_grad_() for t in bf16]
    got, _ = gated_delta_rule(*bf16, kernel="fla", segments=segments)
    ref, _ = gated_delta_rule(*ref_in, kernel="chunk", segments=segments)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    w = torch.randn_like(ref)
    (got * w).sum().backward()
    (ref * w).sum().backward()
    for name, a, r in zip("q k v g beta".split(), bf16, ref_in):
        torch.testing.assert_close(a.grad.float(), r.grad.float(), rtol=5e-2, atol=5e-2,
                                   msg=lambda m: f"grad of {name}: {m}")
