"""Issue 46: /metrics says which distributed instances hold requests open while their ring stands
still (``tokentrace_requests_stalled{state}``, ``tokentrace_stall_seconds``), from the heartbeats
their rank 0 sends, as the live answer of a request page does.

The heartbeats are the engine's own: its SpanBuilder's spans of ``HeartbeatRecord``s, written as
its exporter process writes them, POSTed to a real collector, and /metrics scraped over HTTP.
(tests/test_cluster_engine.py makes the stall for real: a rank stopped with SIGSTOP.)
"""

from __future__ import annotations

import time

import httpx
from harness_collector import wait_for
from harness_prometheus import parse_samples
from opentelemetry.sdk.resources import Resource

from tokentrace import contract as c
from tokentrace.analyzers.live import stall_of
from tokentrace.dashboards.instances import STALE_AFTER_S
from tokentrace.engine_shim.emit import otlp_wire
from tokentrace.engine_shim.mlx.records import Clock, HeartbeatRecord
from tokentrace.engine_shim.mlx.spans import SpanBuilder

STOPPED = ("RankStopped", "rank 1 (pid 4242) is alive but not stepping: its process is stopped (SIGSTOP or a "
           "debugger)", 5010)
CLOCK = Clock()


def _heartbeats(instance: str, beats: list[tuple[float, tuple | None]], rank: int | None = 0,
                watch_ms: int | None = 10_000) -> bytes:
    """An OTLP request of ``instance``'s heartbeats, each (seconds ago, stall or None); a stall is
    (state, reason, ms, open request ids[, the ranks named]): rank 1 unless given. ``rank`` None: a single-process
    engine (no stall watch declared). ``watch_ms``: the rank timeout its rank 0 declares watching
    with (the default's; 0: ``--rank-timeout 0``; None: an engine older than the declaration)."""
    spans: list[bytes] = []
    builder = SpanBuilder(otlp_wire.WireTracer(spans.append), CLOCK)
    for ago_s, stall in beats:
        builder.build(HeartbeatRecord(time.perf_counter_ns() - int(ago_s * 1e9), 0, 1, 8, 0, 0, 16, 1 << 30, 1000,
                                      10**8, stall=stall and (stall if len(stall) == 5 else (*stall, (1,))),
                                      stall_watch_ms=None if rank is None else watch_ms))
    resource = {c.SERVICE_NAME: "tokentrace-engine", c.SERVICE_INSTANCE_ID: instance, c.ENGINE: c.ENGINE_MLX,
                c.ENGINE_VERSION: "0.3.36", c.MODEL: "q2"}
    if rank is not None:
        resource.update({c.NODE_RANK: rank, c.NODE_RANKS: 2, c.NODE_OF: instance})
    return otlp_wire.export_request(otlp_wire.resource_attributes(Resource.create(resource).attributes),
                                    otlp_wire.scope("tokentrace.engine", "0.3.36"), spans)


def _stall_series(collector) -> dict[tuple, float]:
    text = httpx.get(collector.url + "/metrics", headers=collector.headers, timeout=30).text
    return {(name, labels["instance_id"], labels.get("state")): value for name, labels, value in parse_samples(text)
            if name in ("tokentrace_requests_stalled", "tokentrace_stall_seconds")}


def _expect(collector, expected: dict[tuple, float], what: str) -> dict[tuple, float]:
    seen: list = []

    def matches() -> bool:
        seen[:] = [_stall_series(collector)]
        return seen[0] == expected

    try:
        wait_for(matches, 30, what)
    except BaseException:
        print(f"last scrape: {seen}")
        raise
    return seen[0]


def _moving(instance: str) -> dict[tuple, float]:
    return {**{("tokentrace_requests_stalled", instance, state): 0 for state in
               ("RankStopped", "RankLost", "RankUnresponsive")}, ("tokentrace_stall_seconds", instance, None): 0}


def _post(collector, body: bytes) -> None:
    response = collector.post(body, "application/x-protobuf")
    assert response.status_code == 200, response.text


def test_requests_held_in_a_stall_are_gauged_per_instance_and_state_until_the_ring_moves(collector_factory):
    collector = collector_factory().start()
    # A ring that moves: its rank 0's series are present at 0. A single-process engine has no ring
    # to stall and no series; a cluster whose rank 0 last reported a stall a minute ago is not known
    # to be stalled now (past the liveness window): no series either.
    _post(collector, _heartbeats("ring", [(1.0, None)]))
    _post(collector, _heartbeats("solo", [(0.5, None)], rank=None))
    _post(collector, _heartbeats("old-ring", [(STALE_AFTER_S + 30, (*STOPPED, ["old-1"]))]))
    _expect(collector, _moving("ring"), "the moving ring's series at 0")

    # Its rank 0 reports a stall holding two requests: counted under the state it names. (An earlier
    # heartbeat after it in the same request changes nothing: the newest one is the state now.)
    _post(collector, _heartbeats("ring", [(0.5, (*STOPPED, ["held-1", "held-2"])), (0.9, None)]))
    stalled = {**_moving("ring"), ("tokentrace_requests_stalled", "ring", "RankStopped"): 2,
               ("tokentrace_stall_seconds", "ring", None): 5.01}
    _expect(collector, stalled, "the two held requests")
    # The same answer a lookup of one of them gives (analyzers/live.py): open, stalled.
    answer = httpx.get(f"{collector.url}/api/requests/held-1/slow", headers=collector.headers, timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "still_open", answer.text
    assert "RankStopped" in answer.text and "1 other request held open with it" in answer.text, answer.text

    # Nor does one that arrives late, in a request of its own (a second ring's first heartbeat after
    # it shows it was folded: one writer, in order).
    _post(collector, _heartbeats("ring", [(0.8, None)]))
    _post(collector, _heartbeats("ring-2", [(0.4, None)]))
    _expect(collector, {**stalled, **_moving("ring-2")}, "the late heartbeat folded")
    # The deadline failed them (the ring still stands still, nothing held), then the ring moved.
    _post(collector, _heartbeats("ring", [(0.3, ("RankStopped", STOPPED[1], 8020, []))]))
    _expect(collector, {**_moving("ring"), **_moving("ring-2"), ("tokentrace_stall_seconds", "ring", None): 8.02},
            "the failed requests no longer held")
    _post(collector, _heartbeats("ring", [(0.1, None)]))
    _expect(collector, {**_moving("ring"), **_moving("ring-2")}, "the ring moving again")


def test_an_instance_whose_stall_watch_is_off_or_undeclared_has_no_stall_series_until_it_reports_one(
        collector_factory):
    """A rank 0 run with ``--rank-timeout 0`` runs no watch and never reports a stall: its "no stall"
    says nothing of its ring, so it has no stall series (absent, not 0). Nor has one whose heartbeats
    do not declare their watch (an engine older than ``tokentrace.stall.rank_timeout_ms``): it may be
    run so. A stall it does report (only a running watch sends one) is served."""
    collector = collector_factory().start()
    _post(collector, _heartbeats("unwatched", [(0.5, None)], watch_ms=0))
    _post(collector, _heartbeats("older", [(0.5, None)], watch_ms=None))
    _post(collector, _heartbeats("ring", [(0.5, None)]))  # after them: they were folded (one writer, in order)
    _expect(collector, _moving("ring"), "no stall series for the unwatched rings")

    _post(collector, _heartbeats("older", [(0.2, (*STOPPED, ["held-1"]))], watch_ms=None))
    _expect(collector, {**_moving("ring"), **_moving("older"),
                        ("tokentrace_requests_stalled", "older", "RankStopped"): 1,
                        ("tokentrace_stall_seconds", "older", None): 5.01}, "the older engine's stall report")
    # Its ring moves again: what it says of the ring is unknown again, not 0.
    _post(collector, _heartbeats("older", [(0.1, None)], watch_ms=None))
    _post(collector, _heartbeats("ring", [(0.1, None)]))
    _expect(collector, _moving("ring"), "the older engine's series gone with its stall")


def test_the_ranks_a_stall_report_names_are_stored_as_the_engine_sent_them(collector_factory):
    """``tokentrace.stall.ranks`` through the engine's own wire encoding, the collector's decoding and
    the store, read back as the verdicts read it (analyzers/live.py ``stall_of``): one rank, two,
    and none (a diagnosis that singles no rank out sends an empty list)."""
    collector = collector_factory().start()
    reports = {"one": ("RankStopped", STOPPED[1], 5010, ["h1"], (1,)),
               "two": ("RankStopped", "ranks 1 and 2 are connected but silent", 5010, ["h2"], (1, 2)),
               "none": ("RankUnresponsive", "every rank alive", 5010, ["h3"], ())}
    for instance, stall in reports.items():
        _post(collector, _heartbeats(instance, [(0.2, stall)]))
    collector.stop()  # acknowledged is kept: stopped, all three are in the store file
    rows = collector.sql("SELECT instance_id, attributes FROM spans WHERE name = 'instance.heartbeat'")
    read = {instance: stall_of(attributes) for instance, attributes in rows}
    assert {instance: stall.ranks for instance, stall in read.items()} == {"one": (1,), "two": (1, 2), "none": ()}
    assert read["none"].state == "RankUnresponsive" and read["none"].held == ("h3",), read

