"""The MoE dispatch's gather-only permutations (meshtron.layers.moe.dispatcher.expand_tokens / permute_rows and
the grouped GEMM's unpadding) give the same values and gradients as ``index_select``'s own autograd, and the
expert-parallel and single-rank MoE layers still match one process (tests/moe/test_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.moe.dispatcher import expand_tokens, inverse_permutation, permute_rows
from meshtron.layers.moe.experts import _aligned_groups
from meshtron.layers.moe.slots import RowsAt


def _reference_grad(fn, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    out = fn(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_tokens_sums_each_tokens_gradients(dtype):
    g = torch.Generator().manual_seed(0)
    T, k, H = 13, 4, 6
    x = torch.randn(T, H, generator=g).to(dtype)
    order = torch.randperm(T * k, generator=g)
    weight = torch.randn(T * k, H, generator=g).to(dtype)
    want, want_grad = _reference_grad(lambda t: t.index_select(0, order // k), x, weight)
    got, got_grad = _reference_grad(lambda t: expand_tokens(t, order, inverse_permutation(order), k), x, weight)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    if dtype == torch.bfloat16:  # the k bf16 gradients of a token are summed in fp32 and rounded once
        exact = weight.double().index_select(0, inverse_permutation(order)).view(T, k, H).sum(1).to(dtype)
        assert torch.equal(got_grad, exact)


def test_permute_rows_is_a_gather_both_ways():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(20, 5, generator=g)
    perm = torch.randperm(20, generator=g)
    weight = torch.randn(20, 5, generator=g)
    want, want_grad = _reference_grad(lambda t: t.index_select(0, perm), y, weight)
    got, got_grad = _reference_grad(lambda t: permute_rows(t, perm, inverse_permutation(perm)), y, weight)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_unpadding_the_aligned_groups_scatters_the_gradient_back():
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 9, 1])
    x = torch.randn(int(counts.sum()), 4, generator=g)
    padded, _, dest, _ = _aligned_groups(x, counts)
    weight = torch.randn(x.shape[0], 4, generator=g)
    want, want_grad = _reference_grad(lambda t: t.index_select(0, dest), padded, weight)
    got, got_grad = _reference_grad(lambda t: RowsAt.apply(t, dest), padded, weight)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert torch.equal(got, x)  # the unpadded rows are the input rows
