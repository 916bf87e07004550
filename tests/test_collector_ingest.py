"""Golden traces in, SQL on the DuckDB file out: every span, attribute and expanded columnar row."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import time
from pathlib import Path

import golden
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from tokentrace.collector.decoding.normalize import EXPANDED, TABLES
from tokentrace.collector.receiver.ingest import RECEIVER_BUCKETS, RECEIVER_STAGES
from tokentrace.collector.receiver.otlp import Encoding, decode


def _spec(fixture: dict, span_id: str) -> dict:
    return next(spec for spec in fixture["spans"] if spec["id"] == span_id)


def test_golden_trace_sent_by_the_sdk_lands_in_every_table(collector_factory):
    collector = collector_factory().start()
    fixture = golden.load("golden_engine_trace.json")
    base = time.time_ns() - 5_000_000_000
    ids = golden.replay(fixture, collector.url + "/v1/traces", base)
    assert collector.stop() == 0

    stored = {row[0]: row for row in collector.sql(
        "SELECT span_id, trace_id, parent_span_id, name, start_ns, end_ns, attributes, instance_id, "
        "request_id, resource FROM spans")}
    assert len(stored) == len(fixture["spans"])
    for spec in fixture["spans"]:
        _, trace_id, parent, name, start, end, attributes, instance, request_id, resource = stored[
            ids[spec["id"]][1]]
        assert (trace_id, name, start, end) == (ids[spec["id"]][0], spec["name"], base + spec["start"],
                                                base + spec["end"])
        assert parent == (ids[spec["parent"]][1] if "parent" in spec else None)
        expected = {k: v for k, v in spec["attributes"].items() if k not in EXPANDED}
        assert json.loads(attributes or "{}") == expected, spec["name"]
        assert instance == "golden-1"
        assert request_id == spec["attributes"].get("tokentrace.request.id")
        assert json.loads(resource)["host.name"] == "mac-mini-1"

    request = collector.sql(
        "SELECT request_id, instance_id, engine, model, session_id, endpoint, start_ns, end_ns, queue_ms, "
        "load_wait_ms, prefill_ms, decode_ms, ttft_ms, tpot_ms, prompt_tokens, cached_tokens, "
        "completion_tokens, max_tokens, finish_reason, streamed, client_disconnected, http_status FROM requests")
    assert request == [(
        "golden-req-1", "golden-1", "mlx-lm", "tiny-llama", "sess-<b>1</b>", "/v1/chat/completions",
        base + 100_000_000, base + 700_000_000, 50.0, 300.0, 150.0, 80.0, 500.0, 20.0, 40, 16, 5, 5, "length",
        True, False, 200,
    )]
    phases = collector.sql("SELECT name, start_ns - ?, queue_depth, queue_running, max_batch, load_id "
                           "FROM phases ORDER BY start_ns, name", [base])
    assert phases == [
        ("llm.load_wait", 100_000_000, None, None, None, "load-1"),
        ("llm.queue", 400_000_000, 2, 1, 1, None),
        ("llm.cache.lookup", 450_000_000, None, None, None, None),
        ("llm.prefill", 450_500_000, None, None, None, None),
        ("llm.decode", 600_000_000, None, None, None, None),
        ("llm.cache.insert", 680_000_000, None, None, None, None),
    ]
    assert collector.sql("SELECT chunk_offset, tokens, batch_size, end_ns - start_ns FROM prefill_chunks "
                         "ORDER BY start_ns") == [(16, 16, 1, 69_500_000), (32, 8, 2, 80_000_000)]
    assert collector.sql("SELECT step, t_ns - ? FROM decode_steps ORDER BY step", [base]) == [
        (i, 600_000_000 + i * 20_000_000) for i in range(5)]
    assert collector.sql(
        "SELECT start_ns - ?, duration_ns, prefill_seqs, decode_seqs, prefill_tokens, decode_tokens, "
        "prefill_request_ids, decode_request_ids FROM steps ORDER BY start_ns", [base]) == [
        (450_500_000, 69_500_000, 1, 1, 16, 1, ["golden-req-1"], ["other-req"]),
        (520_000_000, 80_000_000, 1, 1, 8, 1, ["golden-req-1"], ["other-req"]),
        (600_000_000, 20_000_000, 0, 2, 0, 2, [], ["golden-req-1", "other-req"]),
    ]
    lookup = _spec(fixture, "lookup")["attributes"]
    assert collector.sql("SELECT prompt_tokens, matched_tokens, match, matched_entry, cache_entries, "
                         "cache_bytes, block_size FROM cache_lookups") == [
        (40, 16, "prefix", lookup["tokentrace.cache.block_hashes"][0], 3, 123456, 16)]
    assert collector.sql("SELECT block_index, hash FROM prefix_blocks WHERE source = 'lookup' "
                         "ORDER BY block_index") == list(enumerate(lookup["tokentrace.cache.block_hashes"]))
    insert = _spec(fixture, "insert")["attributes"]
    fingerprint = insert["tokentrace.cache.entry.fingerprint"]
    assert collector.sql("SELECT block_index, hash, fingerprint FROM prefix_blocks WHERE source = 'insert' "
                         "ORDER BY block_index") == [
        (i, h, fingerprint) for i, h in enumerate(insert["tokentrace.cache.block_hashes"])]
    assert collector.sql("SELECT segment_index, role, token_start, token_end, hash FROM segments "
                         "ORDER BY segment_index") == [
        (0, "system", 0, 24, lookup["tokentrace.segments.hashes"][0]),
        (1, "user", 24, 40, lookup["tokentrace.segments.hashes"][1]),
    ]
    assert collector.sql("SELECT fingerprint, tokens, bytes, block_size, cache_entries, cache_bytes, "
                         "max_entries, max_bytes, limit_rank FROM cache_inserts") == [
        (fingerprint, 64, 65536, 16, 3, 189000, 3, 1_000_000, 1)]
    assert collector.sql(
        "SELECT t_ns - ?, fingerprint, tokens, bytes, reason, entry_request_id, evicted_by_request_id, "
        "cache_entries, cache_bytes FROM cache_evictions ORDER BY t_ns", [base]) == [
        (680_500_000, -1234567890123, 32, 32768, "max_entries", "older-req", "golden-req-1", 3, 189000),
        (695_050_000, 987654321, 48, 66000, "memory_pressure", "older-req-2", None, 2, 123000),
    ]
    assert collector.sql("SELECT event, t_ns - ?, load_id, span_name FROM instance_events ORDER BY t_ns",
                         [base]) == [
        ("instance.started", 0, "load-1", "model.load"),
        ("instance.ready", 400_000_000, "load-1", "model.load"),
        ("instance.first_response", 700_000_000, None, "llm.request"),
    ]
    assert collector.sql("SELECT load_id, lazy, model_path, end_ns - start_ns FROM model_loads") == [
        ("load-1", True, "/models/tiny", 400_000_000)]
    assert collector.sql("SELECT name, load_id, bytes FROM load_stages ORDER BY start_ns") == [
        ("model.load.resolve", "load-1", None), ("model.load.shard", "load-1", None),
        ("model.load.weights", "load-1", 95_000_000), ("model.load.tokenizer", "load-1", None),
        ("model.load.warmup", "load-1", None)]
    assert collector.sql("SELECT queue_depth, running, max_batch, cache_entries, cache_bytes, cache_max_entries, "
                         "cache_max_bytes, kv_bytes_per_token, memory_bytes, memory_free_bytes FROM heartbeats") == [
        (0, 1, 1, 3, 189000, 3, 1_000_000, 1024, 200_000_000, 7_000_000_000)]
    assert collector.sql("SELECT DISTINCT instance_id, host_name, engine, engine_version, model FROM resources") == [
        ("golden-1", "mac-mini-1", "mlx-lm", "0.32.2", "tiny-llama")]


def _nice_of_threads(pid: int) -> dict[int, int]:
    """Each thread of ``pid`` and its nice value, from /proc/PID/task/TID/stat."""
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            out[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[16])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread priorities are read from Linux's /proc")
@pytest.mark.parametrize("nice", [7, 0])
def test_payloads_are_decoded_on_threads_niced_by_decode_nice(collector_factory, nice):
    """The store's merge thread gets a core before the decoders (ingest.Pipeline): the threads that
    decode run ``--decode-nice`` above the collector's own priority. They start with the first
    payloads (a thread pool starts its threads as work is submitted)."""
    collector = collector_factory("--decode-nice", str(nice)).start()
    own = os.getpriority(os.PRIO_PROCESS, collector.proc.pid)
    before = _nice_of_threads(collector.proc.pid)
    assert set(before.values()) == {own}
    fixture = golden.load("golden_engine_trace.json")
    bodies = [golden.encode(fixture, time.time_ns() - 10**10 + i * 10**6)[0] for i in range(20)]
    for body in bodies:
        assert collector.post(body, "application/x-protobuf").status_code == 200
    lowered = {tid: niced for tid, niced in _nice_of_threads(collector.proc.pid).items() if niced != own}
    if nice:
        assert lowered and set(lowered.values()) == {own + nice}
        assert not lowered.keys() & before.keys()  # started for the payloads
    else:
        assert not lowered
    assert collector.health()["accepted_spans"] == 18 * len(bodies)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from Linux's /proc")
def test_the_collectors_threads_carry_their_names_in_the_system(collector_factory):
    """``top -H``, ``perf`` and /proc tell the merge thread from the writer and the decoders
    (core/threads.py): each thread carries its role, and the niced threads are the decoders."""
    collector = collector_factory("--decode-nice", "5").start()
    fixture = golden.load("golden_engine_trace.json")
    body = golden.encode(fixture, time.time_ns() - 10**10)[0]
    assert collector.post(body, "application/x-protobuf").status_code == 200
    names = {}
    for task in Path(f"/proc/{collector.proc.pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            names[int(task.name)] = (task / "comm").read_text().strip()
    assert {"tt-merge", "tt-writer", "tt-decode_0", "tt-metrics"} <= set(names.values()), names
    own = os.getpriority(os.PRIO_PROCESS, collector.proc.pid)
    niced = {names.get(tid) for tid, nice in _nice_of_threads(collector.proc.pid).items() if nice == own + 5}
    assert niced and all(name.startswith("tt-decode_") for name in niced), niced


def test_healthz_says_where_acknowledged_requests_spent_their_time(collector_factory):
    """/healthz's ``receiver``: how many requests were acknowledged, the seconds they spent being
    read, decoded and written (ingest.RECEIVER_STAGES; bench/ingest.py reports them) and how many
    took how long (ingest.RECEIVER_BUCKETS, /metrics' histograms); a refused request is not among
    them, and the stages lie inside each request's round trip."""
    collector = collector_factory().start()
    fixture = golden.load("golden_engine_trace.json")
    bodies = [golden.encode(fixture, time.time_ns() - 10**10 + i * 10**6)[0] for i in range(5)]
    round_trips = []
    for body in bodies:
        began = time.perf_counter()
        assert collector.post(body, "application/x-protobuf").status_code == 200
        round_trips.append(time.perf_counter() - began)
    assert collector.post(b"\xff not protobuf", "application/x-protobuf").status_code == 400
    receiver = collector.health()["receiver"]
    assert receiver["requests"] == len(bodies)
    assert set(receiver["seconds"]) == set(RECEIVER_STAGES)
    assert all(spent > 0 for spent in receiver["seconds"].values()), receiver
    assert sum(receiver["seconds"].values()) <= sum(round_trips), receiver
    assert receiver["le"] == list(RECEIVER_BUCKETS) and set(receiver["counts"]) == {"request", *RECEIVER_STAGES}
    for counts in receiver["counts"].values():
        assert len(counts) == len(RECEIVER_BUCKETS) + 1 and sum(counts) == len(bodies), receiver
    # A request took at least as long as each of its stages, and less than its round trip.
    slowest = {name: max(i for i, n in enumerate(counts) if n) for name, counts in receiver["counts"].items()}
    assert all(slowest["request"] >= slowest[stage] for stage in RECEIVER_STAGES), receiver
    assert slowest["request"] == 0 or RECEIVER_BUCKETS[slowest["request"] - 1] < max(round_trips), receiver


def test_handwritten_json_and_its_protobuf_twin_store_the_same_rows(collector_factory):
    collector = collector_factory().start()
    text = (golden.FIXTURES / "otlp_handwritten.json").read_bytes()
    response = collector.post(text, "application/json")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert json.loads(response.text) == {}  # nothing refused: no partial_success
    # The same request, re-encoded as protobuf and gzip-compressed, through the protobuf path of a
    # second collector (to the first it would be a resend, stored once: test_collector_once.py).
    twin = collector_factory(db=collector.db.with_name("twin.duckdb")).start()
    message = decode(text, Encoding("json", "application/json"))
    response = twin.post(gzip.compress(message.SerializeToString()), "application/x-protobuf",
                         **{"Content-Encoding": "gzip"})
    assert response.status_code == 200
    assert not ExportTraceServiceResponse.FromString(response.content).HasField("partial_success")
    assert collector.stop() == 0 and twin.stop() == 0
    for table in TABLES:
        assert twin.sql(f"SELECT * FROM {table} ORDER BY ALL") == collector.sql(f"SELECT * FROM {table} ORDER BY ALL")

    rows = collector.sql("SELECT name, kind, status_code, status_message, scope_name, instance_id, attributes, "
                         "events, links FROM spans WHERE span_id = 'eee19b7ec3c1b174'")
    assert len(rows) == 1
    name, kind, status, message_, scope, instance, attributes, events, links = rows[0]
    assert (name, kind, status, message_, scope, instance) == (
        "GET /cart", 2, 2, "upstream timeout", "io.opentelemetry.contrib", "foreign-1")
    assert json.loads(attributes) == {"http.request.method": "GET", "http.response.status_code": 200,
                                      "retry": False, "ratio": 0.25, "tags": ["a", "b"],
                                      "nested": {"k": 7}, "blob": "AQID"}
    assert json.loads(events) == [{"name": "cache miss", "time_ns": 1544712660500000000,
                                   "attributes": {"key": "cart:42"}}]
    assert json.loads(links) == [{"trace_id": "00000000000000000000000000000001", "span_id": "0000000000000002"}]
    assert collector.sql("SELECT count(*) FROM requests WHERE request_id = 'json-req-1' AND session_id = "
                         "'<script>alert(1)</script>' AND prompt_tokens = 20 AND completion_tokens = 3 "
                         "AND cached_tokens = 0 AND ttft_ms = 120.5") == [(1,)]
    assert collector.sql("SELECT DISTINCT block_index, hash FROM prefix_blocks ORDER BY 1") == [
        (0, -9223372036854775808), (1, 9223372036854775807)]
    assert collector.sql("SELECT count(*) FROM requests WHERE instance_id = 'foreign-1'") == [(0,)]


def test_schema_columns_match_the_normalizer(tmp_path):
    from tokentrace.collector.stores.store_duckdb import DuckDBStore

    store = DuckDBStore(tmp_path / "schema.duckdb")  # raises if a table's columns differ from TABLES
    assert set(store.counts()) == set(TABLES)
    store.close()
    DuckDBStore(tmp_path / "schema.duckdb").close()  # migrations are applied once, reopening is a no-op

