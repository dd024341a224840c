"""The output layer fused with the chunked cross-entropy equals torch's cross-entropy of the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.layers.cross_entropy import _local_stats, chunk_size, linear_cross_entropy, vocab_parallel_logits_loss
from tests.distributed.launch import run_distributed


@pytest.mark.parametrize("chunk", [None, 7])  # one chunk; chunks of 7 tokens, the last one shorter
def test_fused_loss_and_gradients_equal_torch_cross_entropy(chunk):
    g = torch.Generator().manual_seed(0)
    n, h, vocab, padded = 40, 16, 50, 64  # 14 padding columns that must get no probability
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, h, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (n,), generator=g)
    loss_weight = torch.rand(n, generator=g, dtype=torch.float64)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total, losses = linear_cross_entropy(x, w, target, loss_weight, 0, vocab, chunk_tokens=chunk)
    total.backward()
    xr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_losses = F.cross_entropy(xr @ wr[:vocab].t(), target, reduction="none")
    (ref_losses * loss_weight).sum().backward()
    # The loss works in fp32 (also for these float64 inputs); the reference is float64.
    torch.testing.assert_close(losses.double(), ref_losses.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(w.grad[vocab:]) == 0  # padding rows: no gradient


def test_bf16_weight_gradient_carries_the_upstream_gradient():
    """The fp32 sum of the weight's gradient is scaled by the upstream gradient and rounded to bf16 once."""
    g = torch.Generator().manual_seed(1)
    n, h, vocab = 24, 16, 40
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = torch.randn(vocab, h, generator=g).bfloat16()
    target = torch.randint(0, vocab, (n,), generator=g)
    loss_weight = torch.full((n,), 1.0 / n)
    w = weight.clone().requires_grad_()
    total, _ = linear_cross_entropy(hidden, w, target, loss_weight, 0, vocab)
    (0.3 * total).backward()
    wr = weight.double().requires_grad_()
    (0.3 * F.cross_entropy(hidden.double() @ wr.t(), target)).backward()
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=2e-2, atol=2e-4)


def test_a_block_of_padding_only_contributes_nothing():
    logits = torch.randn(5, 8)
    outside = torch.ones(5, dtype=torch.bool)
    row_max, sum_exp, target = _local_stats(logits, torch.zeros(5, dtype=torch.long), outside, 0)
    assert torch.equal(row_max, torch.full((5,), float("-inf"))) and torch.equal(sum_exp, torch.zeros(5))
    assert torch.equal(target, torch.zeros(5))


def _vocab_parallel_loss(rank, world, logits, target, vocab):
    import torch.distributed as dist

    block = logits.shape[1] // world
    start = rank * block
    valid = max(0, min(block, vocab - start))  # rank 1 holds padding columns only
    return vocab_parallel_logits_loss(logits[:, start:start + block], target, start, valid, dist.group.WORLD)


def test_vocabulary_parallel_loss_with_a_padding_only_rank():
    """Two TP ranks, the second holding only vocabulary padding, and logits far below zero (where a
    stand-in maximum of 0 for the padding rank would win the max and underflow every sum)."""
    g = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(6, 128, generator=g) - 200.0
    target = torch.randint(0, vocab, (6,), generator=g)
    want = F.cross_entropy(logits[:, :vocab], target, reduction="none")
    for got in run_distributed(_vocab_parallel_loss, 2, logits, target, vocab):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_chunks_are_equal_and_bounded():
    assert chunk_size(32768, 128256) == 8192      # four equal chunks, each under 2^30 logits
    assert chunk_size(100, 128256) == 100
    assert chunk_size(1001, 4_000_000) == 251     # 256-token floor: four chunks of 251, 251, 251, 248


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_fused_loss_on_cuda_equals_torch_cross_entropy():
    """On CUDA the element-wise passes are compiled (static shapes, equal chunks); bf16 like training."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, vocab = 3000, 256, 32000
    hidden = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(vocab + 64, h, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    loss_weight = torch.full((n,), 1.0 / n, device="cuda")
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total, losses = linear_cross_entropy(x, w, target, loss_weight, 0, vocab, chunk_tokens=1000)
    total.backward()
    xr, wr = hidden.float().requires_grad_(), weight.float().requires_grad_()
    ref = F.cross_entropy(xr @ wr[:vocab].t(), target, reduction="none")
    (ref * loss_weight).sum().backward()
    torch.testing.assert_close(losses, ref.detach(), rtol=1e-3, atol=2e-3)  # bf16 logits
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):  # bf16 logits and gradients: ~0.5% apart
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2
