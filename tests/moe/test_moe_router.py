"""Routing, router losses, capacity dropping and the expert-bias rule, checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe.aux_losses import (attach_aux_loss, load_balancing_loss, sequence_load_balancing_loss,
                                            update_expert_bias, z_loss)
from meshtron.layers.moe.router import (TopKRouter, capacity_mask, expert_capacity, scores_for_aux_loss,
                                        select_experts)
from meshtron.parallel.sharding import initialize_parameters

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0],
                       [0.0, 3.0, 0.5, 0.2],
                       [-1.0, -2.0, 1.5, 1.0]])


def test_softmax_top2_is_softmax_over_the_chosen_logits():
    probs, idx = select_experts(LOGITS, 2, "softmax")
    assert idx.tolist() == [[0, 1], [1, 2], [2, 3]]
    # token 0: softmax([2, 1]) = [e/(e+1), 1/(e+1)]
    e = math.e
    torch.testing.assert_close(probs[0], torch.tensor([e / (e + 1), 1 / (e + 1)]))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_pre_softmax_keeps_the_full_softmax_probabilities():
    probs, idx = select_experts(LOGITS, 2, "softmax", pre_softmax=True)
    full = torch.exp(LOGITS[1]) / torch.exp(LOGITS[1]).sum()
    assert idx[1].tolist() == [1, 2]
    torch.testing.assert_close(probs[1], full[[1, 2]])
    assert (probs.sum(-1) < 1).all()


def test_sigmoid_scores_normalised_over_the_chosen():
    probs, idx = select_experts(LOGITS, 2, "sigmoid")
    s = torch.sigmoid(LOGITS[2])
    assert idx[2].tolist() == [2, 3]
    torch.testing.assert_close(probs[2], s[[2, 3]] / (s[2] + s[3]))
    one, _ = select_experts(LOGITS, 1, "sigmoid")  # k = 1: the raw sigmoid score
    torch.testing.assert_close(one[:, 0], torch.sigmoid(LOGITS.max(-1).values))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_expert_bias_changes_the_choice_not_the_weights(score):
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # forces expert 3 into every token's top 2
    probs, idx = select_experts(LOGITS, 2, score, pre_softmax=False, expert_bias=bias)
    assert (idx == 3).any(-1).all()
    assert idx.tolist() == [[3, 0], [3, 1], [3, 2]]
    if score == "sigmoid":
        s = torch.sigmoid(LOGITS)
        torch.testing.assert_close(probs[0], s[0, [3, 0]] / (s[0, 3] + s[0, 0]))
    else:  # softmax over the chosen (unbiased) logits
        torch.testing.assert_close(probs[0], torch.softmax(LOGITS[0, [3, 0]], -1))


def _hand_aux(scores, idx, topk):
    T, E = scores.shape
    counts = [sum(int(e in idx[t].tolist()) for t in range(T)) for e in range(E)]
    f = [counts[e] / (topk * T) for e in range(E)]
    P = [float(scores[:, e].sum()) / T for e in range(E)]
    return E * sum(f[e] * P[e] for e in range(E))


def test_load_balancing_loss_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 4, generator=g)
    _, idx = select_experts(logits, 2, "softmax")
    scores = scores_for_aux_loss(logits, "softmax")
    counts = torch.bincount(idx.reshape(-1), minlength=4)
    got = load_balancing_loss(scores, counts, 2, 0.1)
    assert got.item() == pytest.approx(0.1 * _hand_aux(scores, idx, 2), rel=1e-6)


def test_uniform_router_scores_the_coefficient():
    scores = torch.full((8, 4), 0.25)
    counts = torch.full((4,), 4)  # 8 tokens x top-2 spread evenly
    assert load_balancing_loss(scores, counts, 2, 0.01).item() == pytest.approx(0.01)


def test_sequence_load_balancing_loss_by_hand():
    g = torch.Generator().manual_seed(1)
    seq, batch, E, k = 6, 3, 4, 2
    logits = torch.randn(seq * batch, E, generator=g)  # [seq, batch] order flattened
    _, idx = select_experts(logits, k, "softmax")
    scores = scores_for_aux_loss(logits, "softmax")
    per_seq = []
    for b in range(batch):
        rows = [s * batch + b for s in range(seq)]
        per_seq.append(_hand_aux(scores[rows], idx[rows], k))
    got = sequence_load_balancing_loss(scores, idx, batch, k, 0.5)
    assert got.item() == pytest.approx(0.5 * sum(per_seq) / batch, rel=1e-6)


def test_z_loss_by_hand():
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS.tolist()) / 3
    assert z_loss(LOGITS, 0.2).item() == pytest.approx(0.2 * expected, rel=1e-6)


def test_capacity_definition():
    assert expert_capacity(32, 2, 4, 0.5) == 8
    assert expert_capacity(10, 2, 4, 1.0) == 5
    assert expert_capacity(10, 1, 4, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(7, 2, 8, 1.5) == 3  # ceil(1.75 * 1.5 = 2.625)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_dropping_matches_the_definition(factor):
    g = torch.Generator().manual_seed(2)
    T, E, k = 40, 4, 2
    logits = torch.randn(T, E, generator=g) + torch.tensor([1.5, 0.0, 0.0, -1.0])  # unbalanced on purpose
    probs, idx = select_experts(logits, k, "softmax")
    cap = expert_capacity(T, k, E, factor)
    keep = capacity_mask(idx, probs, E, cap)
    # By hand: each expert keeps its `cap` assignments of highest weight (ties: earlier token).
    expected = torch.zeros(T, k, dtype=torch.bool)
    for e in range(E):
        assigned = [(-probs[t, j].item(), t, j) for t in range(T) for j in range(k) if idx[t, j] == e]
        for _, t, j in sorted(assigned)[:cap]:
            expected[t, j] = True
    assert torch.equal(keep, expected)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    assert int((~keep).sum()) == int((counts - cap).clamp(min=0).sum())
    if factor == 0.5:
        assert int((~keep).sum()) > 0


def test_ties_keep_the_earlier_token():
    idx = torch.zeros(5, 1, dtype=torch.long)
    probs = torch.ones(5, 1)
    keep = capacity_mask(idx, probs, 2, 3)
    assert keep[:, 0].tolist() == [True, True, True, False, False]


def test_router_drops_and_zeroes_weights():
    cfg = ModelConfig(hidden_size=16, num_experts=4, moe_router_topk=2, moe_expert_capacity_factor=0.5,
                      moe_aux_loss_coeff=0.0)
    router = TopKRouter(cfg, "layers.0.mlp.router")
    initialize_parameters(router, 3, torch.device("cpu"), torch.float32)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(4))
    r = router(x, batch=4)
    counts = r.tokens_per_expert
    assert int(counts.sum()) == 64
    cap = expert_capacity(32, 2, 4, 0.5)
    assert int((~r.keep).sum()) == int((counts - cap).clamp(min=0).sum())
    assert (r.probs[~r.keep] == 0).all() and (r.probs[r.keep] > 0).all()


def test_expert_bias_update_rule():
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    update_expert_bias(bias, torch.tensor([5.0, 1.0, 3.0, 3.0]), 0.1)  # mean 3
    torch.testing.assert_close(bias, torch.tensor([0.4, 0.1, -0.25, 0.0]))


def test_attached_loss_gets_gradient_scale():
    w = torch.tensor(2.0, requires_grad=True)
    out = torch.ones(3, requires_grad=True)
    aux = w * w  # d aux / dw = 2w = 4
    y = attach_aux_loss(out * 1.0, aux, 0.25)
    torch.testing.assert_close(y, out)
    y.sum().backward()
    assert w.grad.item() == pytest.approx(0.25 * 4.0)
    torch.testing.assert_close(out.grad, torch.ones(3))


def test_group_limited_routing_by_hand():
    """8 experts in 4 groups of 2, each token may use 2 groups, top-4: a group scores the sum of its best
    4 // 2 = 2 scores. Scores 0.9 0.85 | 0.1 0.1 | 0.8 0.1 | 0.7 0.1 give groups 1.75, 0.2, 0.9, 0.8: groups 0
    and 2 win, so expert 5 (0.1) is chosen instead of the globally better expert 6 (0.7)."""
    scores = torch.tensor([[0.9, 0.85, 0.1, 0.1, 0.8, 0.1, 0.7, 0.1]])
    logits = torch.logit(scores)
    probs, idx = select_experts(logits, 4, "sigmoid", groups=(4, 2))
    assert sorted(idx[0].tolist()) == [0, 1, 4, 5]
    chosen = scores[0, idx[0]]
    torch.testing.assert_close(probs[0], chosen / chosen.sum())
    _, unlimited = select_experts(logits, 4, "sigmoid")
    assert sorted(unlimited[0].tolist()) == [0, 1, 4, 6]
    # softmax: groups compare sums of probabilities; weights renormalised over the chosen logits
    probs, idx = select_experts(logits, 4, "softmax", groups=(4, 2))
    assert sorted(idx[0].tolist()) == [0, 1, 4, 5]
    torch.testing.assert_close(probs[0], torch.softmax(logits[0, idx[0]], dim=-1))
