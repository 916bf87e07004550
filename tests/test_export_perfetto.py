"""``tokentrace export perfetto`` on the golden trace: from a running collector (--url) and from its
stopped store (--db), checked against the trace-event format and the golden numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import golden
import trace_event_format


def export(*args: str) -> subprocess.CompletedProcess:
    """Run the real CLI."""
    return subprocess.run([sys.executable, "-m", "tokentrace", "export", "perfetto", *args],
                          capture_output=True, text=True, timeout=120)


def tracks(trace: dict) -> dict[str, list[dict]]:
    """Events of each named thread, by time: {"request golden-req-1": [...], "engine steps": [...]}."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    found: dict[str, list[dict]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] != "M":
            found.setdefault(names[(event["pid"], event["tid"])], []).append(event)
    return {name: sorted(events, key=lambda e: e["ts"]) for name, events in found.items()}


def test_export_from_url_and_db_agree_and_follow_the_format(collector_factory, tmp_path):
    collector = collector_factory().start()
    base = time.time_ns() - 2_000_000_000
    golden.replay(golden.load("golden_engine_trace.json"), collector.url + "/v1/traces", base)
    by_url = export("--since", "1h", "--url", collector.url, "-o", str(tmp_path / "url.json"))
    assert by_url.returncode == 0, by_url.stderr
    one = export("--request-id", "golden-req-1", "--url", collector.url, "-o", str(tmp_path / "one.json"))
    assert one.returncode == 0, one.stderr
    assert collector.stop() == 0
    by_db = export("--since", "1h", "--db", str(collector.db), "-o", str(tmp_path / "db.json"))
    assert by_db.returncode == 0, by_db.stderr

    trace, from_db = (json.loads((tmp_path / name).read_text()) for name in ("url.json", "db.json"))
    assert trace["traceEvents"] == from_db["traceEvents"]  # only otherData.since_ns (now - 1h) differs
    assert trace_event_format.problems(trace) == []
    t0 = trace["otherData"]["t0_ns"]
    assert t0 == base  # the model load starts the trace

    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"instance golden-1"}
    by_track = tracks(trace)
    request = by_track["request golden-req-1"]
    assert [e["name"] for e in request] == ["load_wait", "queue", "prefill", "decode", "cache insert"]
    assert [(e["ts"], e["dur"]) for e in request[:2]] == [(100_000.0, 300_000.0), (400_000.0, 50_000.0)]
    assert request[0]["args"]["category"] == "cold_start" and request[0]["args"]["prompt_tokens"] == 40
    assert [c["tokens"] for c in request[2]["args"]["chunks"]] == [16, 8]
    steps = by_track["engine steps"]
    assert [(e["name"], e["dur"]) for e in steps] == [
        ("prefill+decode", 69_500.0), ("prefill+decode", 80_000.0), ("decode", 20_000.0)]
    assert steps[2]["args"]["decode_requests"] == ["golden-req-1", "other-req"]
    evictions = by_track["cache evictions"]
    assert [(e["ph"], e["args"]["reason"]) for e in evictions] == [("i", "max_entries"), ("i", "memory_pressure")]
    assert [e["name"] for e in by_track["model load"]] == [
        "model.load.resolve", "model.load.shard", "model.load.weights", "model.load.tokenizer", "model.load.warmup"]

    single = json.loads((tmp_path / "one.json").read_text())
    assert trace_event_format.problems(single) == []
    assert [name for name in tracks(single) if name.startswith("request")] == ["request golden-req-1"]


def test_unknown_request_exits_2_with_a_clear_message(collector_factory, tmp_path):
    collector = collector_factory().start()
    result = export("--request-id", "nope", "--url", collector.url, "-o", str(tmp_path / "x.json"))
    assert result.returncode == 2 and "nope" in result.stderr
    assert not (tmp_path / "x.json").exists()
    assert collector.stop() == 0
    result = export("--request-id", "nope", "--db", str(collector.db), "-o", str(tmp_path / "x.json"))
    assert result.returncode == 2 and "no request with id 'nope'" in result.stderr


def test_the_checker_catches_overlaps_and_missing_fields():
    good = {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10}
    assert trace_event_format.problems({"traceEvents": [good]}) == []
    overlap = {**good, "name": "b", "ts": 5}
    assert "starts before" in trace_event_format.problems({"traceEvents": [good, overlap]})[0]
    assert trace_event_format.problems({"traceEvents": [{**good, "dur": -1}]})
    assert trace_event_format.problems({"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "ts": 0, "dur": 1}]})
    assert trace_event_format.problems([good])
