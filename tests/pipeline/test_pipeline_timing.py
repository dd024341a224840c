"""The pipeline timing model: where blocking exchanges stall ranks, and that posting them without
waiting (--overlap-p2p-comm) brings every schedule to its theoretical bubble."""

from __future__ import annotations

import pytest

from meshtron.pipeline.timing import plan_bubble

SHAPES = [(2, 1, 8), (2, 2, 8), (2, 2, 32), (4, 1, 8), (4, 2, 8), (4, 2, 16), (8, 2, 16)]


@pytest.mark.parametrize("stages,virtual,m", SHAPES)
@pytest.mark.parametrize("backward_cost", [1.0, 1.65, 2.0])
def test_overlapped_transfers_reach_the_theoretical_bubble(stages, virtual, m, backward_cost):
    theory = (stages - 1) / (virtual * m)
    assert plan_bubble(stages, virtual, m, backward_cost, blocking=False) == pytest.approx(theory, abs=1e-9)


@pytest.mark.parametrize("stages,m", [(2, 8), (4, 8), (8, 16)])
def test_blocking_1f1b_is_at_its_bubble(stages, m):
    assert plan_bubble(stages, 1, m, 2.0, blocking=True) == pytest.approx((stages - 1) / m, abs=1e-9)


def test_blocking_exchanges_stall_the_interleaved_schedule_on_two_stages():
    # Each rank waits for whole exchanges whose other side is busy in a longer backward.
    assert plan_bubble(2, 2, 32, 2.0, blocking=True) > 10 * (1 / 64)
