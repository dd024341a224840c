"""meshtron's own count of the pipeline's point-to-point operations, for the hang report.

torch counts every collective of a group as it is issued (the count the hang report compares between ranks),
but on NCCL not the point-to-point sends and receives, and a pipeline stuck in send/recv is where large runs
hang most. :class:`P2PLedger` counts them per peer where meshtron posts them (:class:`meshtron.pipeline.p2p.
PipelineP2P`), the same way on every backend, and keeps what the last few of each were for (stage, chunk,
micro-batch). When a hang is declared, every rank posts its ledger (:func:`snapshot`), and
:func:`stuck_pairs` finds each pair whose counts disagree: a rank that posted more receives from a peer than
the peer posted sends to it waits for a message the peer never sent (and the reverse for sends, which NCCL
completes only when matched). Plain integer stores, no lock: the watchdog reads them racily, as it reads
:class:`meshtron.resilience.hang.Progress`.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

#: Entries kept per (operation, peer): enough to name the message a stuck pair disagrees on.
RECENT = 8


class P2PLedger:
    """Point-to-point operations this rank posted, per peer (global ranks)."""

    def __init__(self) -> None:
        self.posted: dict[str, dict[int, int]] = {"send": {}, "recv": {}}
        self._recent: dict[tuple[str, int], deque] = {}
        #: Called before each send is posted (the ``hang-send`` drill of ``--inject-fault``), or None.
        self.before_send: Optional[Callable[[], None]] = None

    def post(self, op: str, peer: int, stage: int, what: str, chunk: Optional[int] = None,
             micro_batch: Optional[int] = None) -> None:
        """Note one posted ``op`` ("send" or "recv") with ``peer``: this rank's ``stage``, ``what`` travels
        ("activation" or "gradient") and for which model chunk and micro-batch (None where unknown)."""
        counts = self.posted[op]
        index = counts.get(peer, 0)
        counts[peer] = index + 1
        recent = self._recent.get((op, peer))
        if recent is None:
            recent = self._recent[(op, peer)] = deque(maxlen=RECENT)
        recent.append({"index": index, "stage": stage, "what": what, "chunk": chunk, "micro_batch": micro_batch})

    def snapshot(self) -> dict:
        """What the hang report needs, as JSON-ready data: counts and recent entries per (op, peer)."""
        return {"posted": {op: {str(peer): n for peer, n in counts.items()} for op, counts in self.posted.items()},
                "recent": {f"{op}:{peer}": list(entries) for (op, peer), entries in list(self._recent.items())}}


def stuck_pairs(ledgers: dict[int, dict]) -> list[dict]:
    """Every pair of ranks whose point-to-point counts disagree, from the ranks' snapshots (``{rank: snap}``).

    A rank that posted n receives from a peer that posted m < n sends to it waits for message m (counting from
    0) of that peer, which the peer never sent: ``{"waiting": rank, "op": "recv", "peer": peer, "posted": n,
    "peer_posted": m, "message": <the waiting rank's entry for it, where kept>}``; the peer is behind. Sends
    likewise (a send NCCL has not matched). A peer that posted nothing at all is absent from its snapshot."""
    out = []
    for rank, snap in sorted(ledgers.items()):
        for op, partner_op in (("recv", "send"), ("send", "recv")):
            for peer_text, n in sorted(snap.get("posted", {}).get(op, {}).items(), key=lambda kv: int(kv[0])):
                peer = int(peer_text)
                if peer not in ledgers:
                    continue  # a rank that did not report: named as not reporting already
                m = int(ledgers[peer].get("posted", {}).get(partner_op, {}).get(str(rank), 0))
                if m >= n:
                    continue
                message = next((e for e in snap.get("recent", {}).get(f"{op}:{peer}", []) if e["index"] == m), None)
                out.append({"waiting": rank, "op": op, "peer": peer, "posted": n, "peer_posted": m,
                            "message": message})
    return out


def describe(pair: dict) -> str:
    """One pair of :func:`stuck_pairs` in words."""
    message = pair.get("message") or {}
    what = message.get("what") or "message"
    at = []
    if message.get("micro_batch") is not None:
        at.append(f"micro-batch {message['micro_batch']}")
    if message.get("chunk") is not None:
        at.append(f"chunk {message['chunk']}")
    stage = f" (stage {message['stage']})" if message.get("stage") is not None else ""
    direction = "to receive" if pair["op"] == "recv" else "to send"
    other = "sent" if pair["op"] == "recv" else "received"
    return (f"rank {pair['waiting']}{stage} waits {direction} {what} #{pair['peer_posted']}"
            + (f" ({', '.join(at)})" if at else "") + f" {'from' if pair['op'] == 'recv' else 'to'} rank "
            f"{pair['peer']}, which {other} {pair['peer_posted']} of {pair['posted']}")
