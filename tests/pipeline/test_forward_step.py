"""The schedules run any model through a caller's forward step, and report each chunk's gradients as
ready through one callback: a toy model with an extra loss, in one process (the interleaved plan of
one stage sends its chunk outputs to itself through a loop-back exchange)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from meshtron.pipeline.schedules import (Compute, forward_backward_no_pipelining, pipeline_plans, run_plan)

HIDDEN = 4


class LoopbackP2P:
    """One pipeline stage whose 'next stage' is itself: what it sends, it receives at the same exchange."""

    stages, stage, device = 1, 0, torch.device("cpu")

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait=True):
        from_prev = send_next.detach().clone() if recv_prev else None
        from_next = send_prev.detach().clone() if recv_next else None
        return from_prev, from_next


def _chunks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(HIDDEN, HIDDEN) for _ in range(n)]


def _micro_batches(m: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(2, HIDDEN, generator=gen)} for _ in range(m)]


def _toy_step(last_chunk: nn.Module, extra_weight: float):
    """A forward step with a main loss and an extra loss on the last chunk."""

    def step(chunk, micro_batch, hidden):
        y = chunk(micro_batch["x"] if hidden is None else hidden)
        if chunk is not last_chunk:
            return y, None
        return None, y.square().sum() + extra_weight * y.abs().sum()

    return step


def _reference(chunks, mbs, extra_weight):
    """Loss and gradients of the same chunks run one after another by hand."""
    total = 0.0
    for mb in mbs:
        y = mb["x"]
        for chunk in chunks:
            y = chunk(y)
        loss = y.square().sum() + extra_weight * y.abs().sum()
        loss.backward()
        total += loss.item()
    grads = [p.grad.clone() for c in chunks for p in c.parameters()]
    for c in chunks:
        c.zero_grad()
    return total, grads


def test_no_pipelining_calls_the_forward_step_and_reports_chunk_zero_before_the_last_backward():
    (model,) = chunks = _chunks(1)
    mbs = _micro_batches(3)
    want_loss, want_grads = _reference(chunks, mbs, 0.5)
    seen = []
    grad_at_call = []

    def ready(chunk: int) -> None:
        seen.append(chunk)
        grad_at_call.append(model.weight.grad.clone())

    total = forward_backward_no_pipelining(chunks, mbs, on_chunk_grads_ready=ready,
                                           forward_step=_toy_step(model, 0.5))
    assert total.item() == pytest.approx(want_loss, rel=1e-6)
    assert seen == [0]
    assert not torch.equal(grad_at_call[0], model.weight.grad)  # the last backward came after the call
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g)


def test_interleaved_plan_runs_the_forward_step_and_reports_each_chunk_once_before_its_last_backward():
    chunks = _chunks(2)
    mbs = _micro_batches(2)
    want_loss, want_grads = _reference(chunks, mbs, 0.25)
    plan = pipeline_plans(1, 2, len(mbs), False)[0]
    backwards = [s for s in plan if isinstance(s, Compute) and s.backward]
    last_of = {s.chunk: i for i, s in enumerate(backwards)}
    done = SimpleNamespace(backwards=0)
    calls = []
    step = _toy_step(chunks[1], 0.25)

    def counting_step(chunk, micro_batch, hidden):
        out = step(chunk, micro_batch, hidden)
        for t in out:
            if t is not None and t.requires_grad:
                t.register_hook(lambda g: setattr(done, "backwards", done.backwards + 1) or g)
        return out

    def ready(chunk: int) -> None:
        calls.append((chunk, done.backwards))

    total = run_plan(plan, chunks, mbs, LoopbackP2P(), counting_step, on_chunk_grads_ready=ready)
    assert total.item() == pytest.approx(want_loss, rel=1e-6)
    assert done.backwards == len(backwards)
    assert sorted(c for c, _ in calls) == [0, 1]
    for chunk, before in calls:  # called just before that chunk's last backward pass
        assert before == last_of[chunk]
    for p, g in zip([p for c in chunks for p in c.parameters()], want_grads):
        torch.testing.assert_close(p.grad, g)


def test_a_forward_step_breaking_the_contract_is_named():
    chunks = _chunks(1)

    def wrong(chunk, micro_batch, hidden):
        return chunk(micro_batch["x"]), None  # an output where the loss belongs

    with pytest.raises(ValueError, match="forward_step must return"):
        forward_backward_no_pipelining(chunks, _micro_batches(1), forward_step=wrong)
