"""The flex kernel of context-parallel blocks (packed documents): a row's blocks merged through their
log-sum-exp, and backward from the merged output, equal the math kernel with dense masks (fp32, CPU,
with torch's CPU check on flex attention's backward lifted: its eager implementation is math)."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.documents import DocumentMask
from meshtron.parallel.context_parallel.kernels import FLEX, MATH, kernel_mask
from tests.layers.test_documents import documents, flex_backward_on_cpu


def _blocks(kernel, q, ks, vs, masks, dout, scale):
    """Forward each key block, merge, then backward each block from the merged output and lse."""
    outs = [kernel.forward(q, k, v, False, kernel_mask(kernel, m), 0.0, scale) for k, v, m in zip(ks, vs, masks)]
    lse = torch.logsumexp(torch.stack([o[1] for o in outs]), 0)
    row = lse.masked_fill(torch.isinf(lse), 0.0)
    out = sum(o[0].float() * torch.exp(o[1] - row).unsqueeze(-1) for o in outs)
    grads = [kernel.backward(dout, q, k, v, out, lse, False, kernel_mask(kernel, m), 0.0, scale, o[2])
             for k, v, m, o in zip(ks, vs, masks, outs)]
    dq = sum(g[0] for g in grads)
    return out, dq, [g[1] for g in grads], [g[2] for g in grads]


@pytest.mark.parametrize("hq,hk,d,dv", [(4, 2, 16, 16), (4, 1, 24, 8)], ids=["gqa", "mla-dims"])
def test_flex_kernel_equals_math_kernel(hq, hk, d, dv):
    g = torch.Generator().manual_seed(7)
    seq, b = 96, 2
    docs = documents(g, b, seq, 0.04)
    # queries: a rank's two chunks (0-23 and 72-95); keys: two blocks of other positions
    q_pos = torch.cat([torch.arange(0, 24), torch.arange(72, 96)])
    k_pos = [torch.arange(0, 48), torch.arange(48, 96)]
    q = torch.randn(b, hq, 48, d, generator=g)
    ks = [torch.randn(b, hk, 48, d, generator=g) for _ in k_pos]
    vs = [torch.randn(b, hk, 48, dv, generator=g) for _ in k_pos]
    dout = torch.randn(b, hq, 48, dv, generator=g)
    masks = [DocumentMask(docs[:, q_pos], docs[:, kp], q_pos, kp, block_size=8) for kp in k_pos]
    ref = _blocks(MATH, q, ks, vs, masks, dout, 0.25)
    with flex_backward_on_cpu():
        got = _blocks(FLEX, q, ks, vs, masks, dout, 0.25)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    for a, r in zip(got[2] + got[3], ref[2] + ref[3]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
