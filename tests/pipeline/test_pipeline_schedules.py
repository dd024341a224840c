"""Schedule plans, checked without processes: every pass runs once and after its inputs, every
exchange has its counterpart on the neighbouring rank (so blocking NCCL groups cannot deadlock),
the activations held per stage respect the schedule's bound, and the bubble is the textbook one."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from meshtron.config import ConfigError
from meshtron.pipeline.p2p import free_output
from meshtron.pipeline.schedules import (Compute, Exchange, Placement, interleaved_warmup, max_in_flight,
                                         pipeline_plans, simulated_bubble)

LAYOUTS = [(pp, 1, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 16)]
LAYOUTS += [(pp, v, m) for pp in (2, 3, 4) for v in (2, 3, 4) for m in (pp, 2 * pp, 4 * pp)]


def _messages(step: Exchange, stage: int, stages: int) -> list[tuple]:
    """The ops of one exchange as (op, peer, kind, unit), in the order PipelineP2P posts them: to the next
    stage, from the previous, to the previous, from the next (``kind``: "fwd" an activation, "bwd" a
    gradient; ZBV's second chunk sends activations to the previous stage and gradients to the next)."""
    nxt, prev = (stage + 1) % stages, (stage - 1) % stages
    ops = []
    for op, peer, fields in (("send", nxt, (("fwd", step.send_next), ("bwd", step.send_next_grad))),
                             ("recv", prev, (("fwd", step.recv_prev), ("bwd", step.recv_prev_grad))),
                             ("send", prev, (("bwd", step.send_prev), ("fwd", step.send_prev_activation))),
                             ("recv", nxt, (("bwd", step.recv_next), ("fwd", step.recv_next_activation)))):
        present = [(kind, unit) for kind, unit in fields if unit is not None]
        assert len(present) <= 1, f"stage {stage}: two tensors to one neighbour in one exchange: {step}"
        ops += [(op, peer, kind, unit) for kind, unit in present]
    return ops


def _consumer(stage: int, place: Placement, direction: str, unit: tuple) -> tuple:
    """The (chunk, micro-batch) on the receiving rank that consumes what ``stage`` sends for ``unit``."""
    chunk, mb = unit
    pos = place.position(stage, chunk) + (1 if direction == "fwd" else -1)
    return place.at(pos)[1], mb


def execute_like_nccl(plans, stages: int, virtual: int, v_shape: bool = False) -> None:
    """Run the plans with NCCL's semantics: an exchange completes only once every send in it is
    matched by the peer's receive (per pair of ranks, in posting order) and every receive by a send.
    Fails on a deadlock, on a message delivered to the wrong pass, or on a pass run before its input.
    ``v_shape``: ZBV's placement (the last stage hands its first chunk's tensors to its second itself)."""
    place = Placement(stages, virtual, v_shape)
    pos = [0] * stages
    posted = [False] * stages
    channel = defaultdict(list)  # (src, dst) -> sends posted, in order
    receives = defaultdict(list)  # (src, dst) -> receives posted, in order
    my_index: dict = {}  # (rank, op index in exchange) -> index in its channel
    have = [set() for _ in range(stages)]  # units whose input (fwd) / output gradient (bwd) arrived
    done = [set() for _ in range(stages)]
    while any(pos[s] < len(plans[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(plans[s]) and isinstance(plans[s][pos[s]], Compute):
                c = plans[s][pos[s]]
                needs_input = not (c.backward and place.has_loss(s, c.chunk)) and not (
                    not c.backward and place.has_embedding(s, c.chunk))
                if needs_input:
                    assert (("bwd" if c.backward else "fwd"), c.unit) in have[s], f"rank {s} runs {c} before its input"
                if c.backward:
                    assert (False, c.unit) in done[s], f"rank {s} runs {c} before its forward"
                done[s].add((c.backward, c.unit))
                step_pos = place.position(s, c.chunk) + (-1 if c.backward else 1)
                if 0 <= step_pos < stages * virtual and place.at(step_pos)[0] == s:  # a V's turn: no message
                    have[s].add((("bwd" if c.backward else "fwd"), (place.at(step_pos)[1], c.micro_batch)))
                pos[s] += 1
                progressed = True
            if pos[s] == len(plans[s]):
                continue
            step = plans[s][pos[s]]
            ops = _messages(step, s, stages)
            if not posted[s]:
                for i, (op, peer, direction, unit) in enumerate(ops):
                    queue = channel[(s, peer)] if op == "send" else receives[(peer, s)]
                    my_index[(s, i)] = len(queue)
                    queue.append((direction, unit))
                posted[s] = True
                progressed = True
            complete = True
            for i, (op, peer, direction, unit) in enumerate(ops):
                k = my_index[(s, i)]
                other = receives[(s, peer)] if op == "send" else channel[(peer, s)]
                if len(other) <= k:
                    complete = False
            if complete:
                for i, (op, peer, direction, unit) in enumerate(ops):
                    if op == "recv":
                        sent_direction, sent_unit = channel[(peer, s)][my_index[(s, i)]]
                        assert sent_direction == direction, f"rank {s} received a {sent_direction} tensor as {direction}"
                        assert _consumer(peer, place, sent_direction, sent_unit) == unit, \
                            f"rank {s} received {sent_unit} of rank {peer} for {unit}"
                        have[s].add((direction, unit))
                pos[s] += 1
                posted[s] = False
                progressed = True
        assert progressed, f"deadlock at {[plans[s][pos[s]] if pos[s] < len(plans[s]) else None for s in range(stages)]}"


def assert_split_passes_once_in_order(plan, stage: int, chunks: int, m: int) -> None:
    """A zero-bubble plan runs every F, B and W of its ``chunks`` chunks and ``m`` micro-batches once, each B
    after its forward and each W after its B."""
    from meshtron.pipeline.schedules import WeightGrad

    seen = []
    for step in plan:
        if isinstance(step, WeightGrad):
            assert ("B", step.unit) in seen, f"stage {stage}: {step} before its B"
            seen.append(("W", step.unit))
        elif isinstance(step, Compute):
            if step.backward:
                assert ("F", step.unit) in seen, f"stage {stage}: {step} before its forward"
            seen.append(("B" if step.backward else "F", step.unit))
    expected = {(kind, (c, i)) for kind in "FBW" for c in range(chunks) for i in range(m)}
    assert len(seen) == len(expected) and set(seen) == expected, f"stage {stage}"


@pytest.mark.parametrize("stages,virtual,m", LAYOUTS, ids=[f"pp{p}-v{v}-m{m}" for p, v, m in LAYOUTS])
@pytest.mark.parametrize("backward_ticks", [1, 2], ids=["blocking-plans", "overlapped-plans"])
def test_plans_run_every_pass_once_and_never_deadlock(stages, virtual, m, backward_ticks):
    for forward_only in (False, True):
        plans = pipeline_plans(stages, virtual, m, forward_only, backward_ticks)
        for s, plan in enumerate(plans):
            passes = [step for step in plan if isinstance(step, Compute)]
            expected = {(b, (c, i)) for b in ((False,) if forward_only else (False, True))
                        for c in range(virtual) for i in range(m)}
            assert len(passes) == len(expected) and {(p.backward, p.unit) for p in passes} == expected
        execute_like_nccl(plans, stages, virtual)


@pytest.mark.parametrize("stages,virtual,m", LAYOUTS, ids=[f"pp{p}-v{v}-m{m}" for p, v, m in LAYOUTS])
def test_activations_held_per_stage(stages, virtual, m):
    """1F1B: rank r holds at most PP - r micro-batches; interleaved: 2(PP - r - 1) + (V - 1) PP + 1 chunks."""
    plans = pipeline_plans(stages, virtual, m, False)
    for r, plan in enumerate(plans):
        bound = stages - r if virtual == 1 else interleaved_warmup(stages, r, virtual) + 1
        assert max_in_flight(plan) == min(bound, m * virtual)


@pytest.mark.parametrize("stages,virtual,m", [(2, 1, 8), (4, 1, 8), (4, 1, 32), (4, 2, 8), (4, 2, 32), (8, 4, 16)])
@pytest.mark.parametrize("backward_ticks", [1, 2])
def test_bubble_is_the_textbook_one(stages, virtual, m, backward_ticks):
    """In lock-step the idle fraction is (PP - 1) / (V * M): interleaving divides it by V."""
    assert simulated_bubble(stages, virtual, m, backward_ticks) == pytest.approx((stages - 1) / (virtual * m))


def test_interleaving_rejects_micro_batch_counts_not_a_multiple_of_stages():
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        pipeline_plans(4, 2, 6, False)


def test_freed_output_still_backpropagates():
    """A stage output whose storage was released after sending still runs backward correctly."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    grad = torch.randn(4, 8)

    def stage(inp):
        h = torch.tanh(inp @ w)
        return inp + h @ w.t()  # residual add last, like a transformer layer

    expected = torch.autograd.grad(stage(x), (x, w), grad)
    out = stage(x)
    free_output(out)
    assert out.untyped_storage().size() == 0 and out.shape == (4, 8)
    torch.autograd.backward(out, grad)
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(w.grad, expected[1])


def test_free_output_leaves_inputs_and_views_alone():
    x = torch.randn(4, 8, requires_grad=True)
    free_output(x)  # a leaf (a stage without layers would return its input)
    view = (x * 2)[1:]
    free_output(view)
    assert x.untyped_storage().size() > 0 and view.untyped_storage().size() > 0


def test_plans_are_cached_and_deterministic():
    a = pipeline_plans(4, 2, 8, False)
    assert a is pipeline_plans(4, 2, 8, False)
    assert all(isinstance(s, (Compute, Exchange)) for s in itertools.chain.from_iterable(a))
