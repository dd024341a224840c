"""--moe-router-force-load-balancing: experts chosen from random logits, balanced on average, router still trained."""

from __future__ import annotations

import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe.router import TopKRouter, forced_balanced_logits


def _router(force: bool) -> TopKRouter:
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_experts=8, moe_router_topk=2,
                      moe_router_force_load_balancing=force)
    torch.manual_seed(0)
    router = TopKRouter(cfg, "layers.0.mlp.router")
    weight = torch.randn(8, 16)
    weight[0] += 50.0  # a router that sends every token of positive inputs to expert 0
    router.weight = torch.nn.Parameter(weight)  # built on the meta device: given real values here
    return router


def test_forced_balance_spreads_tokens_that_the_router_would_send_to_one_expert():
    tokens = torch.randn(4096, 16).abs()
    skewed = _router(False)(tokens, batch=1).tokens_per_expert
    assert skewed[0] == 4096  # every token picks expert 0 on its own
    torch.manual_seed(1)
    balanced = _router(True)(tokens, batch=1).tokens_per_expert.float()
    assert balanced.sum() == 4096 * 2
    assert (balanced / balanced.mean() - 1).abs().max() < 0.1  # within 10% of an even split


def test_forced_balance_keeps_the_routers_gradient():
    logits = torch.randn(32, 8, requires_grad=True)
    forced = forced_balanced_logits(logits)
    assert not torch.equal(forced.detach(), logits.detach())
    (forced * torch.arange(8.0)).sum().backward()
    assert torch.equal(logits.grad, torch.arange(8.0).expand(32, 8))


def test_forced_skew_makes_the_first_experts_hot():
    tokens = torch.randn(4096, 16)
    router = _router(True)
    router.force_skew = 1.0
    torch.manual_seed(2)
    counts = router(tokens, batch=1).tokens_per_expert.float()
    assert counts.sum() == 4096 * 2
    assert (counts[:-1] >= counts[1:]).all()  # expert 0 the most chosen, then 1, ...
    assert counts[0] > 2 * counts.mean() and counts[-1] < counts.mean() / 2
