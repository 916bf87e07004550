"""Issue 44 item 3: instance pages that contradicted their own data.

- An idle engine showed "process start to first answer: 39.28 s" as if that were a cold start,
  although its runner was ready after 576 ms: the first answer of an idle instance is not a cold
  start. The page now gives the cold start (process start -> runner ready) and says when the first
  request arrived and that the instance was idle until then.
- A stopped instance kept showing its last heartbeat's "running 3" as live figures: an instance that
  recorded a stop, or whose heartbeats stopped, shows as stopped or stale with the time of its last
  heartbeat, and no live figures.

Built for real: two of our engines on the tiny generated model, heartbeating every 0.2 s to a real
collector; one is killed (kill -9) while it generates for three clients, the other answers one
request after sitting idle and is stopped with SIGTERM. Read from /instances and / and their JSON twins.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import engine_factory, tiny_model  # noqa: F401 - fixtures

from tokentrace.dashboards.instances import STALE_AFTER_S
from tokentrace.dashboards.web import fmt_clock

pytestmark = pytest.mark.slow
IDLE_S = 1.5


def _instances(collector: CollectorProcess) -> dict[str, dict]:
    body = httpx.get(collector.url + "/instances.json", timeout=30).json()
    return {row["instance_id"]: row for row in body["instances"]}


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _generate(url: str, request_id: str) -> http.client.HTTPConnection:
    """A long streamed answer, left running (the response is never read)."""
    connection = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=120)
    body = {"messages": [{"role": "user", "content": f"story {request_id}"}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    return connection


def test_stopped_stale_and_idle_instances_show_what_they_are(tmp_path, engine_factory):  # noqa: F811
    collector = CollectorProcess(tmp_path).start()
    busy = idle = None
    leftovers: list[int] = []
    try:
        busy = engine_factory("--heartbeat-interval", "0.2", collector=collector, instance_id="busy").start()
        idle = engine_factory("--heartbeat-interval", "0.2", collector=collector, instance_id="idle").start()
        # busy: three clients generating; once the collector holds a heartbeat with all three
        # running, the engine is killed: its heartbeats stop there.
        connections = [_generate(busy.url, f"long-{i}") for i in range(3)]
        wait_for(lambda: ((_instances(collector).get("busy") or {}).get("heartbeat") or {}).get("running") == 3,
                 60, "a heartbeat of busy with 3 running")
        leftovers = _children(busy.proc.pid)
        os.kill(busy.proc.pid, signal.SIGKILL)
        busy.proc.wait(30)
        for connection in connections:
            connection.close()
        # idle: ready, then idle for IDLE_S before its one request (the idle time is the situation
        # built here, not a wait for something to happen).
        time.sleep(IDLE_S)
        assert httpx.post(idle.url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": "first"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).status_code == 200
        idle.stop()
        rows = wait_for(lambda: (r := _instances(collector))["idle"]["status"] == "stopped"
                        and r["idle"]["first_answer"] and r, 60, "idle's stop and first answer")

        stopped = rows["idle"]
        assert stopped["live"] is False and stopped["now"] is None and stopped["heartbeat"]["live"] is False
        assert stopped["stopped_ns"] >= stopped["heartbeat"]["t_ns"]
        ready_ms = stopped["cold_start_ms"]
        first = stopped["first_answer"]
        assert ready_ms == stopped["readiness"][2]["after_start_ms"] and ready_ms < first["after_start_ms"]
        assert first["idle"] is True and first["first_request_after_ready_ms"] >= IDLE_S * 1000
        assert first["after_start_ms"] == pytest.approx(
            ready_ms + first["first_request_after_ready_ms"] + first["answered_after_arrival_ms"], abs=0.01)

        rows = wait_for(lambda: (r := _instances(collector))["busy"]["status"] == "stale" and r,
                        STALE_AFTER_S + 60, "busy to go stale")
        stale = rows["busy"]
        assert stale["heartbeat"]["running"] == 3, "its last heartbeat had three running"
        assert stale["live"] is False and stale["now"] is None and stale["stopped_ns"] is None

        page = httpx.get(collector.url + "/instances", timeout=30).text
        sections = dict(re.findall(r'data-instance="([^"]+)">(.*?)</section>', page, re.S))
        assert "Stopped at" in sections["idle"] and fmt_clock(stopped["stopped_ns"]) in sections["idle"]
        assert "last heartbeat was at <b" in sections["idle"]
        assert "Gone stale" in sections["busy"] and fmt_clock(stale["heartbeat"]["t_ns"]) in sections["busy"]
        for name in ("idle", "busy"):
            assert "waiting / running" not in sections[name] and "Process start to first answer" not in sections[name]
        assert "Cold start (process start to runner ready)" in sections["idle"]
        assert "was not a cold start" in sections["idle"] and "Idle until its first request" in sections["idle"]

        overview = httpx.get(collector.url + "/.json?since=1h", timeout=30).json()
        shown = {row["instance_id"]: row for row in overview["instances"]}
        assert shown["busy"]["now"] is None and shown["busy"]["status"] == "stale"
        html = httpx.get(collector.url + "/?since=1h", timeout=30).text
        (busy_row,) = re.findall(r'<tr data-instance="busy">(.*?)</tr>', html, re.S)
        assert 'data-metric="running"' not in busy_row and ">3<" not in busy_row
        assert f"last at {fmt_clock(stale['heartbeat']['t_ns'])}" in busy_row and "stale" in busy_row
    finally:
        for pid in leftovers:  # the killed engine's exporter process, should it outlive its parent
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        collector.stop()
