"""A timing model of the pipeline plans, with the waiting rules of real point-to-point transfers.

The lock-step simulation that places the exchanges (``schedules._simulate``) assumes every
exchange completes at once. On GPUs it does not: an exchange's transfers start when every rank
involved has reached it (NCCL runs one rank's exchanges in the order they were posted, each after
the computation posted before it), and with blocking exchanges a rank's next pass waits for the
whole exchange. :func:`plan_bubble` replays the plans under those rules, with a backward
``backward_cost`` times as long as a forward and free transfers, and returns the idle fraction
(each mode with the plans it runs):

* blocking (``--no-overlap-p2p-comm``): each pass waits for the exchange before it;
* overlapped (``--overlap-p2p-comm``): a pass waits only for the transfer of its own input.

It explains measurements and guides the choice of the flag; it does not measure anything.
"""

from __future__ import annotations

from collections import defaultdict

from meshtron.pipeline.plan import Compute, Exchange
from meshtron.pipeline.schedules import OVERLAPPED_BACKWARD_TICKS, _orders, build_plans


def _peers(stage: int, stages: int, exchange: Exchange) -> list[int]:
    peers = []
    if exchange.send_next is not None or exchange.recv_next is not None:
        peers.append((stage + 1) % stages)
    if exchange.send_prev is not None or exchange.recv_prev is not None:
        peers.append((stage - 1) % stages)
    return list(dict.fromkeys(peers))


def plan_bubble(stages: int, virtual: int, num_micro_batches: int, backward_cost: float = 2.0,
                blocking: bool = True) -> float:
    """Idle time over busy time of every rank's plan under the model in the module docstring."""
    plans = build_plans(_orders(stages, virtual, num_micro_batches, False), virtual,
                        1 if blocking else OVERLAPPED_BACKWARD_TICKS)
    # The j-th exchange of rank s with peer p matches the j-th exchange of p with s (same ticks).
    keys: list[list] = []
    for s, plan in enumerate(plans):
        count: dict[int, int] = defaultdict(int)
        row = []
        for step in plan:
            key = {}
            if isinstance(step, Exchange):
                for p in _peers(s, stages, step):
                    key[p] = count[p]
                    count[p] += 1
            row.append(key)
        keys.append(row)
    posted: dict[tuple[int, int, int], float] = {}  # (rank, peer, j) -> time its side of the transfer starts
    compute = [0.0] * stages  # each rank's compute stream
    queue = [0.0] * stages  # each rank's communication stream (exchanges run in posting order)
    ready: list[dict] = [dict() for _ in range(stages)]  # (kind, unit) -> time a received tensor is there
    index = [0] * stages
    while any(index[s] < len(plans[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while index[s] < len(plans[s]):
                step = plans[s][index[s]]
                if isinstance(step, Compute):
                    need = ready[s].get(("grad" if step.backward else "input", step.unit), 0.0)
                    cost = (backward_cost if step.backward else 1.0) / virtual
                    compute[s] = max(compute[s], need) + cost
                    index[s] += 1
                    moved = True
                    continue
                key = keys[s][index[s]]
                start = max(compute[s], queue[s])
                for p, j in key.items():
                    posted.setdefault((s, p, j), start)
                if not all((p, s, j) in posted for p, j in key.items()):
                    break  # a peer has not reached this exchange yet
                done = max([posted[(s, p, j)] for p, j in key.items()] + [posted[(p, s, j)] for p, j in key.items()])
                queue[s] = done
                if step.recv_prev is not None:
                    ready[s][("input", step.recv_prev)] = done
                if step.recv_next is not None:
                    ready[s][("grad", step.recv_next)] = done
                if blocking:
                    compute[s] = max(compute[s], done)
                index[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("pipeline plans deadlock in the timing model")
    busy = num_micro_batches * (1.0 + backward_cost)
    return max(compute) / busy - 1.0
