"""The stalled verdict of a request a distributed engine failed because its ring stopped, read while
the ring still stands still: rank 0 exports the window of steps the stall holds only once the ring
moves again (or the engine stops), so the last stored step can be older than the stopped rank's last
heartbeat, and the heartbeats alone single no rank out. Rank 0's stall report (its heartbeat's
``tokentrace.stall.*``) says when the ring stopped and which rank its diagnosis found stopped.
The real engines build this in tests/test_cluster_engine.py (SIGSTOP of a rank, one host and
mlx.launch); here the facts are the ones that such a run stores, to check each rule of the reading.
"""

from __future__ import annotations

import pytest

from tokentrace.analyzers.live import Stall
from tokentrace.analyzers.slowness import SlowFacts, classify_slowness

S = 1_000_000_000
STOP = 100 * S  #: when rank 1 was stopped
END = STOP + 8 * S  #: the request failed at the 8 s deadline
REASON = "rank 1 (pid 4242 on host a) is connected but silent (nothing for 4.0 s): stopped (SIGSTOP, a debugger)"


def _facts(stall: tuple[int, Stall] | None, error: str = "RankStopped") -> SlowFacts:
    row = {"request_id": "held", "instance_id": "ring", "engine": "mlx", "start_ns": STOP - 2 * S, "end_ns": END,
           "http_status": 200, "error_type": error, "finish_reason": None, "client_disconnected": False,
           "load_wait_ms": 0.0, "queue_ms": 0.1, "prefill_ms": 5.0, "decode_ms": None, "ttft_ms": 6.0}
    # What is stored while the ring stands still: each rank's steps up to the window before the stop
    # (the last one ended 0.3 s before it), rank 0's heartbeats on, and rank 1's last one 0.1 s
    # before the stop: after the last stored step.
    liveness = [{"instance_id": "ring", "last_heartbeat_ns": END - S // 5, "last_step_end_ns": STOP - 3 * S // 10},
                {"instance_id": "ring/rank1", "last_heartbeat_ns": STOP - S // 10,
                 "last_step_end_ns": STOP - 3 * S // 10}]
    return SlowFacts(row, [], [], [], [], [], None, liveness=liveness, stall=stall)


def _stalled(facts: SlowFacts) -> dict:
    verdict = classify_slowness(facts)
    assert verdict.outcome == "failed"
    (item,) = [e for e in verdict.evidence if e.kind == "stalled"]
    return {"text": item.text, **item.data}


def test_without_a_stall_report_the_heartbeats_single_no_rank_out():
    """Before tokentrace.stall.ranks (and where no report was stored): unknown, not wrong."""
    item = _stalled(_facts(None))
    assert item["rank"] is None and item["named_by"] is None and item["silent_ranks"] == [], item
    assert "do not single one out" in item["text"] and round(item["stalled_ms"]) == 8300, item


def test_rank_0s_stall_report_names_the_stopped_rank_and_when_the_ring_stopped():
    """Reported 4 s into the stall (half the deadline): the ring operation began 4 s before the report,
    just after the stop; rank 1's last heartbeat is older than that, rank 0's newer."""
    report = Stall("RankStopped", REASON, 4000, ("other", "held"), (1,))
    item = _stalled(_facts((STOP + 4 * S + S // 100, report)))
    assert (item["rank"], item["named_by"], item["diagnosis"]) == (1, "diagnosis", REASON), item
    assert item["silent_ranks"] == [1] and item["reporting_ranks"] == [0], item
    assert item["stalled_ms"] == pytest.approx(7990, abs=1), item
    assert item["text"].startswith("Stalled: no rank of ring completed a step in the 7.99 s before this request "
                                   "failed; rank 1 is alive but not stepping"), item["text"]
    assert f"while rank 0 went on reporting (rank 0's diagnosis, 4.00 s into the stall: {REASON})" in item["text"]


@pytest.mark.parametrize("report, why", [
    (Stall("RankStopped", REASON, 4000, ("other",), (1,)), "it did not hold this request"),
    (Stall("RankUnresponsive", "every rank alive", 4000, ("held",), ()), "another state: another stall"),
])
def test_a_report_of_another_stall_is_not_read(report, why):
    item = _stalled(_facts((STOP + 4 * S, report)))
    assert item["rank"] is None and item["diagnosis"] is None and round(item["stalled_ms"]) == 8300, why


def test_a_report_that_names_no_single_rank_leaves_the_heartbeats_to_tell():
    """Two ranks named (both silent): the report still dates the stall, and names none alone."""
    report = Stall("RankStopped", "ranks 1 and 2 are connected but silent", 4000, ("held",), (1, 2))
    item = _stalled(_facts((STOP + 4 * S, report)))
    # Dated by the report, rank 1's last heartbeat (0.1 s before the stop) is older than the stall:
    # the heartbeats single it out themselves.
    assert (item["rank"], item["named_by"]) == (1, "heartbeats") and round(item["stalled_ms"]) == 8000, item
