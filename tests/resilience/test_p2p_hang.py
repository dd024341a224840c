"""A pipeline stuck in send/recv is named by meshtron's own count of its point-to-point operations
(meshtron.resilience.p2p_ledger): the counts NCCL keeps leave them out, so the report must not rely on them.
The bookkeeping and the attribution from the ranks' posts (with NCCL-like counts, equal on every group), then a
real two-stage job on gloo where one stage stops before a send."""

from __future__ import annotations

import json
import time

from meshtron.resilience.hang import HANG_EXIT_CODE, attribute_hang, summary_line
from meshtron.resilience.p2p_ledger import P2PLedger, stuck_pairs
from tests.resilience.job_runs import hang_events, meshtron_train, tiny_job


def _ledger(ops) -> dict:
    ledger = P2PLedger()
    for op, peer, stage, what, chunk, micro_batch in ops:
        ledger.post(op, peer, stage, what, chunk, micro_batch)
    return json.loads(json.dumps(ledger.snapshot()))  # as posted through the store


def test_counts_per_peer_and_the_messages_they_are_for():
    ledger = P2PLedger()
    for mb in range(12):
        ledger.post("send", 1, 0, "activation", 0, mb)
    ledger.post("recv", 1, 0, "gradient", 0, 0)
    snap = ledger.snapshot()
    assert snap["posted"] == {"send": {"1": 12}, "recv": {"1": 1}}
    recent = snap["recent"]["send:1"]
    assert len(recent) == 8 and recent[-1] == {"index": 11, "stage": 0, "what": "activation", "chunk": 0,
                                                "micro_batch": 11}


def _entry(rank: int, p2p: dict, phase: str = "forward-backward") -> dict:
    # NCCL's counts: collectives only, equal on every rank of the pipeline group (nothing lags there).
    return {"rank": rank, "iteration": 3, "phase": phase, "waiting_in": {"collective": "wait", "caller": None},
            "stack": [], "counts": {"pp": {"ranks": [0, 1, 2], "count": 5}}, "p2p": p2p}


def test_the_stage_that_never_sent_is_behind_and_the_pair_is_named():
    # Stage 0 (rank 0) sent micro-batches 0-1 and stopped before 2; stage 1 waits for it, and stage 2 waits for
    # stage 1's micro-batch 2 in turn.
    entries = {
        0: _entry(0, _ledger([("send", 1, 0, "activation", 0, m) for m in range(2)])),
        1: _entry(1, _ledger([("recv", 0, 1, "activation", 0, m) for m in range(3)]
                             + [("send", 2, 1, "activation", 0, m) for m in range(2)])),
        2: _entry(2, _ledger([("recv", 1, 2, "activation", 0, m) for m in range(3)])),
    }
    report = attribute_hang(entries, 3, declared_by=2)
    assert report["ranks_behind"] == [0] and report["group"] == "pp" and report["collective"] == "recv"
    first = report["stuck_pairs"][0]
    assert (first["waiting"], first["peer"], first["posted"], first["peer_posted"]) == (1, 0, 3, 2)
    assert first["message"]["micro_batch"] == 2 and first["message"]["stage"] == 1
    line = summary_line(report)
    assert "rank 1 (stage 1) waits to receive activation #2 (micro-batch 2, chunk 0) from rank 0" in line, line


def test_agreeing_counts_name_no_pair():
    entries = {0: _entry(0, _ledger([("send", 1, 0, "activation", 0, 0)])),
               1: _entry(1, _ledger([("recv", 0, 1, "activation", 0, 0)]))}
    assert stuck_pairs({r: e["p2p"] for r, e in entries.items()}) == []
    assert "stuck_pairs" not in attribute_hang(entries, 2, declared_by=0)


def test_a_pipeline_stuck_before_a_send_names_the_pair(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    start = time.monotonic()
    result = meshtron_train(tiny_job("--pipeline-model-parallel-size", "2", "--inject-fault", "hang-send:0:3",
                                     "--hang-timeout-seconds", "3", "--metrics-file", str(metrics)), timeout=150)
    assert result.returncode == HANG_EXIT_CODE, result.stderr[-3000:]
    assert time.monotonic() - start < 120
    (event,) = hang_events(metrics)
    assert event["ranks_behind"] == [0] and event["not_reporting"] == []
    pair = event["stuck_pairs"][0]
    assert (pair["waiting"], pair["op"], pair["peer"]) == (1, "recv", 0)
    assert pair["message"]["stage"] == 1 and pair["message"]["micro_batch"] is not None
    assert event["iteration"] == 3
    assert "waits to receive activation" in result.stderr
