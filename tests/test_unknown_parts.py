"""Issue 13 item 7 (unknown is not zero) and issue 11 item 8 (outcomes), through a real collector:
requests sent by the real OpenTelemetry SDK from senders that measure less than our engine does.

Before: a request known only by its TTFT and decode time was called ``decode`` (missing phases
counted as 0 ms), one with no parts at all ``cold_start``, and failed or cancelled requests were
counted in the categories and percentiles like any other.
"""

from __future__ import annotations

import time

import golden
import httpx
import pytest
from harness_collector import CollectorProcess

from tokentrace import contract as c

MS = 1_000_000


def _request(request_id: str, start: int, end: int, **attributes) -> dict:
    return {"id": request_id, "name": c.SPAN_REQUEST, "kind": "SERVER", "start": start, "end": end,
            "attributes": {c.REQUEST_ID: request_id, c.INPUT_TOKENS: 100, c.OUTPUT_TOKENS: 10, **attributes}}


#: An outside observer that declares it measures TTFT, decode and TPOT only. Its translation also
#: filled queue_ms with 0.0, which its declaration says it cannot know.
OUTSIDE = {
    "resource": {c.SERVICE_NAME: "outside", c.SERVICE_INSTANCE_ID: "outside-1",
                 c.OBSERVER_MEASURES: ["ttft", "decode", "tpot"]},
    "spans": [
        _request("partial-1", 0, 800 * MS, **{c.TTFT_MS: 400.0, c.DECODE_MS: 300.0, c.TPOT_MS: 33.3,
                                               c.QUEUE_MS: 0.0, c.HTTP_STATUS: 200, c.CACHED_TOKENS: 50}),
    ],
}
#: A sender that declares nothing and reports no phases at all, plus a failed and a cancelled request.
BARE = {
    "resource": {c.SERVICE_NAME: "bare", c.SERVICE_INSTANCE_ID: "bare-1"},
    "spans": [
        _request("bare-1", 0, 500 * MS, **{c.HTTP_STATUS: 200}),
        _request("failed-1", 0, 9000 * MS, **{c.HTTP_STATUS: 500, c.ERROR_TYPE: "server_error",
                                               c.LOAD_WAIT_MS: 0.0, c.QUEUE_MS: 8000.0}),
        _request("cancelled-1", 0, 7000 * MS, **{c.HTTP_STATUS: 499, c.CLIENT_DISCONNECTED: True,
                                                  c.QUEUE_MS: 6000.0}),
    ],
}


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    collector = CollectorProcess(tmp_path_factory.mktemp("unknown")).start()
    try:
        base = time.time_ns() - 10_000_000_000
        for fixture in (OUTSIDE, BARE):
            golden.replay(fixture, collector.url + "/v1/traces", base)
        yield collector
    finally:
        collector.stop()


def _get(collector, path: str) -> dict:
    response = httpx.get(collector.url + path, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_known_by_ttft_and_decode_is_undecomposed(collector):
    slow = _get(collector, "/api/requests/partial-1/slow")
    assert (slow["outcome"], slow["category"], slow["ttft_category"]) == ("completed", "undecomposed", "undecomposed")
    parts = slow["breakdown_ms"]
    assert (parts["load_wait"], parts["queue"], parts["prefill"], parts["other"]) == (None, None, None, None)
    assert (parts["decode"], parts["ttft"]) == (300.0, 400.0)
    [item] = [e for e in slow["evidence"] if e["kind"] == "undecomposed"]
    assert item["known_ms"] == {"decode": 300.0}
    assert item["unmeasured"] == ["load_wait", "prefill", "queue"] and item["unreported"] == []
    assert slow["abnormal"] is None and slow["baseline"] == {}


def test_a_request_with_no_parts_is_not_cold_start(collector):
    slow = _get(collector, "/api/requests/bare-1/slow")
    assert (slow["category"], slow["outcome"]) == ("undecomposed", "completed")
    [item] = [e for e in slow["evidence"] if e["kind"] == "undecomposed"]
    assert item["unreported"] == ["decode", "load_wait", "prefill", "queue"] and item["measures"] is None
    assert not [e for e in slow["evidence"] if e["kind"] == "load"]


@pytest.mark.parametrize(("request_id", "outcome"), [("failed-1", "failed"), ("cancelled-1", "cancelled")])
def test_failed_and_cancelled_requests_get_their_outcome(collector, request_id, outcome):
    slow = _get(collector, f"/api/requests/{request_id}/slow")
    assert (slow["outcome"], slow["category"]) == (outcome, None)
    cache = _get(collector, f"/api/requests/{request_id}/cache")
    assert (cache["outcome"], cache["result"], cache["cause"]) == (outcome, None, None)


def test_report_and_pages_invent_no_category(collector):
    report = _get(collector, "/api/report?since=all")
    assert report["outcomes"] == {"cancelled": 1, "completed": 2, "failed": 1}
    assert report["categories"] == {"undecomposed": 2}
    # The failed and cancelled requests' 8-9 s stay out of the latency figures.
    e2e = {row["instance_id"]: row["e2e_ms"]["p99"] for row in report["instances"]}
    assert e2e == {"outside-1": 800.0, "bare-1": 500.0}
    # 50 of outside-1's 100 prompt tokens; bare-1 reports no cached count (unknown, not 0: not 50 of 200).
    assert report["cache"]["token_hit_rate"] == 0.5
    overview = _get(collector, "/.json?since=all")
    assert overview["categories"]["undecomposed"] == 2 and overview["categories"]["queueing"] == 0
    assert overview["latency"]["e2e_ms"]["p99"] == 800.0
    timeline = _get(collector, "/timeline.json?since=all")
    labels = {rid: timeline["categories"][code] for rid, code in zip(timeline["requests"]["id"],
                                                                      timeline["requests"]["category"], strict=True)}
    assert labels == {"partial-1": "undecomposed", "bare-1": "undecomposed", "failed-1": "failed",
                      "cancelled-1": "cancelled"}
    bare = timeline["requests"]["id"].index("bare-1")
    assert [timeline["requests"][part][bare] for part in ("load_wait", "queue", "prefill", "decode")] == [None] * 4
    partial = timeline["requests"]["id"].index("partial-1")
    assert timeline["requests"]["queue"][partial] is None  # sent as 0.0, but not measured by its observer
    page = httpx.get(collector.url + "/requests/failed-1", timeout=30)
    assert page.status_code == 200 and 'data-value="failed"' in page.text
