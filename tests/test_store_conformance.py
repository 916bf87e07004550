"""One conformance suite for every store backend (STYLE §17): golden OTLP payloads in through the
writer role, then a table of (caption, query through the reader role, expected) run on DuckDB and on
chdb, every named query compared frame for frame between the two, and the stored rows of every
table compared value for value. A server (TOKENTRACE_CLICKHOUSE_URL) joins as a third backend."""

from __future__ import annotations

import json
import re

import golden
import polars as pl
import pytest
from harness_store import BACKENDS, store_url
from polars.testing import assert_frame_equal

from tokentrace.collector import stores
from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.decoding.normalize import TABLES
from tokentrace.collector.receiver.ingest import Counters, Pipeline
from tokentrace.collector.receiver.otlp import JSON, PROTOBUF, Encoding
from tokentrace.collector.stores import sqlfiles
from tokentrace.collector.stores.store import SpoolRecord

BASE = 1_790_000_000_000_000_000  # a fixed instant (2026-09-21): the same rows in every backend
SPOOL = SpoolRecord("ab" * 32, "golden.pb")


@pytest.fixture(scope="module")
def payloads():
    """The golden engine trace as the SDK exports it, the hand-written OTLP JSON and the spans vLLM
    itself exported (captured); made once so that every backend receives the very same bytes."""
    body, ids = golden.encode(golden.load("golden_engine_trace.json"), BASE)
    return {"golden": body, "json": (golden.FIXTURES / "otlp_handwritten.json").read_bytes(),
            "vllm": (golden.FIXTURES / "vllm_native_spans.json").read_bytes(), "ids": ids}


def _batches(payloads: dict) -> list[tuple[Columns, SpoolRecord | None]]:
    """What the conformance store receives: the JSON twice (a plain resend, then as a spool file)."""
    pipeline = Pipeline(Counters(), 16 * 1024 * 1024, 65536)
    golden_batch = pipeline.batch(payloads["golden"], Encoding("protobuf", PROTOBUF))
    json_batch = pipeline.batch(payloads["json"], Encoding("json", JSON))
    vllm_batch = pipeline.batch(payloads["vllm"], Encoding("json", JSON))
    return [(golden_batch, None), (json_batch, None), (vllm_batch, None), (json_batch, SPOOL)]


def _load(url: stores.StoreURL, payloads: dict):
    store = stores.open_store(url)
    for batch, spool in _batches(payloads):
        assert store.write(batch, spool)
    return store


def _expected_counts(payloads: dict) -> dict[str, int]:
    """Every row the normalizer made of each distinct payload, packed tables expanded: what a store
    must hold (the JSON resent, and then as a spool file, is stored once)."""
    return {table: sum(len(batch.expanded(table)) for batch, _ in _batches(payloads)[:3]) for table in TABLES}


@pytest.fixture(scope="module")
def loaded(payloads, tmp_path_factory, request):
    """Both backends, loaded with the same payloads (chdb's engine is shared by the process, so
    each backend's store is module-scoped and closed at the end)."""
    chdb_dir = request.getfixturevalue("chdb_dir")
    tmp = tmp_path_factory.mktemp("conformance")
    made = {backend: _load(store_url(backend, tmp, chdb_dir), payloads) for backend in BACKENDS}
    yield made
    for store in made.values():
        store.close()


def _golden_trace(payloads) -> str:
    return payloads["ids"]["req"][0]


def _trace_shape(spans: pl.DataFrame) -> tuple[bool, str, list[str]]:
    # Spans with equal starts and non-null parents (llm.prefill and its first chunk) come in the
    # order of their random parent ids, so only the time order and the root's place are fixed.
    starts = spans["start_ns"].to_list()
    return starts == sorted(starts), spans["name"][0], sorted(spans["name"].to_list())


CASES = [
    ("request(id) carries the phase summary",
     lambda r, p: {k: v for k, v in r.request("golden-req-1").items() if k in (
         "instance_id", "engine", "model", "session_id", "queue_ms", "load_wait_ms", "prefill_ms", "decode_ms",
         "ttft_ms", "tpot_ms", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
         "streamed", "client_disconnected", "http_status", "error_type")},
     {"instance_id": "golden-1", "engine": "mlx-lm", "model": "tiny-llama", "session_id": "sess-<b>1</b>",
      "queue_ms": 50.0, "load_wait_ms": 300.0, "prefill_ms": 150.0, "decode_ms": 80.0, "ttft_ms": 500.0,
      "tpot_ms": 20.0, "prompt_tokens": 40, "cached_tokens": 16, "completion_tokens": 5,
      "finish_reason": "length", "streamed": True, "client_disconnected": False, "http_status": 200,
      "error_type": None}),
    ("request(id) times are integer nanoseconds",
     lambda r, p: (r.request("golden-req-1")["start_ns"] - BASE, r.request("golden-req-1")["end_ns"] - BASE),
     (100_000_000, 700_000_000)),
    ("request(id) keeps the columns of the requests table, in order",
     lambda r, p: tuple(r.request("golden-req-1")), TABLES["requests"]),
    ("request of an unknown id is None", lambda r, p: r.request("no-such-request"), None),
    ("a request sent twice: request(id) gives one row", lambda r, p: r.request("json-req-1")["ttft_ms"], 120.5),
    ("requests() without bounds: every request once, oldest first",
     lambda r, p: (r.requests().height, r.requests()["request_id"].to_list()[:2]),
     (4, ["json-req-1", "golden-req-1"])),
    ("requests() in [since, until)",
     lambda r, p: r.requests(since_ns=BASE, until_ns=BASE + 100_000_001)["request_id"].to_list(),
     ["golden-req-1"]),
    ("requests() until is exclusive",
     lambda r, p: r.requests(since_ns=BASE, until_ns=BASE + 100_000_000).height, 0),
    ("requests() of one instance", lambda r, p: r.requests(instance_id="golden-1")["request_id"].to_list(),
     ["golden-req-1"]),
    ("requests() limit keeps the newest",
     lambda r, p: r.requests(until_ns=BASE + 10**9, limit=1)["request_id"].to_list(), ["golden-req-1"]),
    ("requests() of an empty window keeps its columns",
     lambda r, p: (r.requests(since_ns=1, until_ns=2).height, tuple(r.requests(since_ns=1, until_ns=2).columns)),
     (0, TABLES["requests"])),
    ("trace(id): every span of the trace by start time, the root first",
     lambda r, p: _trace_shape(r.trace(_golden_trace(p))),
     (True, "llm.request", sorted(["llm.request", "llm.load_wait", "llm.queue", "llm.cache.lookup", "llm.prefill",
                                   "llm.prefill.chunk", "llm.prefill.chunk", "llm.decode", "llm.cache.insert"]))),
    ("trace(id) of an unknown id is empty with the span columns",
     lambda r, p: (r.trace("0" * 32).height, tuple(r.trace("0" * 32).columns)), (0, TABLES["spans"])),
    ("trace(id) spans keep kind, status and ids",
     lambda r, p: r.trace(_golden_trace(p)).select("kind", "status_code", "parent_span_id").row(0),
     (2, 0, None)),
    ("counts(): every row the normalizer made, per table", lambda r, p: r.counts() == _expected_counts(p), True),
    ("spool_seen(): an ingested spool file", lambda r, p: r.spool_seen(SPOOL.sha256), True),
    ("spool_seen(): an unknown hash", lambda r, p: r.spool_seen("cd" * 32), False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("caption", "query", "expected"), CASES, ids=[c[0] for c in CASES])
def test_reader_role(loaded, payloads, backend, caption, query, expected):
    assert query(loaded[backend], payloads) == expected, caption


# --- every named query, on every backend ---------------------------------------------------------
_GOLDEN = golden.load("golden_engine_trace.json")
_LOOKUP_HASHES = next(s for s in _GOLDEN["spans"] if s["id"] == "lookup")["attributes"]["tokentrace.cache.block_hashes"]
_INSERT_HASHES = next(s for s in _GOLDEN["spans"] if s["id"] == "insert")["attributes"]["tokentrace.cache.block_hashes"]
_SEGMENT_HASHES = next(s for s in _GOLDEN["spans"] if s["id"] == "lookup")["attributes"]["tokentrace.segments.hashes"]
#: Values for named-query parameters, by name: the golden request's, the hand-written JSON request's
#: (so that queries excluding the asking request still find the golden rows), and values that find
#: nothing (None where DuckDB takes NULL).
PARAMS = {
    "request_id": ("golden-req-1", "json-req-1", "no-such-request"),
    "trace_id": (None, "0" * 32, "f" * 32),  # None: the golden trace, known once the payload is built
    "instance_id": ("golden-1", "json-engine", None),
    "since_ns": (BASE, 0, None),
    "until_ns": (BASE + 10**9, BASE, None),
    "before_ns": (BASE + 10**9, BASE + 10**9, None),
    "t0_ns": (BASE, BASE, None),
    "t1_ns": (BASE + 10**9, BASE + 10**9, None),
    "limit": (100, 1, 0),
    "sha256": (SPOOL.sha256, SPOOL.sha256, "cd" * 32),
    "hashes": (_LOOKUP_HASHES + _INSERT_HASHES, _INSERT_HASHES + _SEGMENT_HASHES + [-(2**63)], []),
    # The golden segments are under two blocks (tail hash 0, stored as null): no tail finds them.
    "tails": ([0], _SEGMENT_HASHES, []),
    "fingerprints": ([-1234567890123, 987654321], [987654321], []),
    "request_ids": (["golden-req-1", "json-req-1"], ["golden-req-1"], []),
    "load_id": ("load-1", "load-1", None),
    "min_tokens": (0, 32, 10**9),
    "reasons": (["max_entries", "max_bytes", "memory_pressure", "trim"], ["max_entries"], []),
    "block_indices": ([0, 1, 2, 3], [0], []),
    "inserted_ns": (BASE + 680_000_000, BASE, None),  # the golden insert span's start
    "evicted_ns": (BASE + 680_500_000, BASE, None),  # the golden insert span's eviction
    "starts": ([BASE + 100_000_000, BASE + 110_000_000], [BASE], []),
    "traces": (["0" * 32], ["0" * 32, "f" * 32], []),
    "t_ns": (BASE, 0, None),
    "session_id": ("sess-<b>1</b>", "<script>alert(1)</script>", None),
    "model": ("tiny-llama", "o'brien", None),
    "request_prefix": ("golden-", "%_", None),
}
_DUCKDB_PARAM = re.compile(r"\$([a-z_][a-z0-9_]*)")
_CLICKHOUSE_PARAM = re.compile(r"\{([a-z_][a-z0-9_]*):")


def _params(backend: str, name: str) -> set[str]:
    sql = "\n".join(sqlfiles.statements(sqlfiles.read(backend, f"queries/{name}.sql")))
    return set((_DUCKDB_PARAM if backend == "duckdb" else _CLICKHOUSE_PARAM).findall(sql))


def test_every_named_query_exists_for_every_backend():
    duckdb, clickhouse = sqlfiles.query_names("duckdb"), sqlfiles.query_names("clickhouse")
    assert duckdb - clickhouse == set(), "DuckDB queries without a ClickHouse twin (sql/clickhouse/queries/)"
    assert clickhouse - duckdb == set(), "ClickHouse queries without a DuckDB twin (sql/duckdb/queries/)"


@pytest.mark.parametrize("name", sorted(sqlfiles.query_names("duckdb")))
def test_named_query_twins_bind_the_same_parameters(name):
    assert _params("duckdb", name) == _params("clickhouse", name)
    unknown = _params("duckdb", name) - set(PARAMS)
    assert not unknown, f"add values for {unknown} to PARAMS in tests/test_store_conformance.py"


def _query_params(payloads, name: str, which: int) -> dict:
    """Parameter set ``which`` of PARAMS for a named query (the golden trace's id where it needs one)."""
    params = {p: PARAMS[p][which] for p in _params("duckdb", name)}
    if "trace_id" in params and params["trace_id"] is None:
        params["trace_id"] = _golden_trace(payloads)
    return params


@pytest.mark.parametrize("which", [0, 1, 2], ids=["golden", "json", "nothing"])
@pytest.mark.parametrize("name", sorted(sqlfiles.query_names("duckdb")))
def test_named_query_gives_the_same_frame_on_every_backend(loaded, payloads, name, which):
    params = _query_params(payloads, name, which)
    frames = {backend: store.frame(name, **params) for backend, store in loaded.items()}
    reference = frames.pop("duckdb")
    for frame in frames.values():
        assert_frame_equal(frame, reference, check_exact=False, rel_tol=1e-9)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["golden", "json", "nothing"])
@pytest.mark.parametrize("name", sorted(sqlfiles.query_names("duckdb")))
def test_named_query_rows_are_the_frame_rows(loaded, payloads, name, which):
    """``rows()`` (what the verdicts read; DuckDB fetches Python tuples, no frame) equals the frame's rows."""
    params = _query_params(payloads, name, which)
    for store in loaded.values():
        assert store.rows(name, **params) == store.frame(name, **params).to_dicts()


# --- the stored rows themselves -------------------------------------------------------------------
def _table(store, table: str) -> pl.DataFrame:
    """Every row of ``table`` (backend internals: the reader role has no raw-table query)."""
    if hasattr(store, "_cursor"):
        return store._cursor().sql(f"SELECT * FROM {table}").pl()
    return pl.from_arrow(store._reader().query_arrow("SELECT * FROM {t:Identifier}", parameters={"t": table}))


@pytest.mark.parametrize("table", list(TABLES))
def test_every_table_stores_the_same_rows_and_types(loaded, table):
    frames = {backend: _table(store, table) for backend, store in loaded.items()}
    reference = frames.pop("duckdb")
    assert reference.height > 0, f"the golden payloads put no row in {table}: extend them"
    for backend, frame in frames.items():
        assert frame.schema == reference.schema, backend
        assert sorted(map(repr, frame.rows())) == sorted(map(repr, reference.rows())), backend


def test_spool_file_is_stored_once_and_a_second_write_stores_nothing(loaded, payloads):
    spooled, _ = _batches(payloads)[-1]
    for backend, store in loaded.items():
        assert store.write(spooled, SPOOL) is False, backend
        assert store.counts()["requests"] == 4, backend  # golden, 2 vLLM, the JSON (plain, then as spool)


# --- exactly once, whatever the sender retries (issue 11 item 2) ----------------------------------
def _deliveries(payloads: dict) -> list[tuple[str, list[tuple[Columns, SpoolRecord | None]]]]:
    """Ways a sender delivers the same three payloads more than once, each after one clean delivery
    (a batch object per delivery: a write leaves the stored spans out of the batch it is given)."""
    def golden():
        return _batches(payloads)[0][0]

    def json_():
        return _batches(payloads)[1][0]

    def vllm():
        return _batches(payloads)[2][0]

    merged = Columns.concat([vllm(), golden()])  # a group of the writer: other spans, other order
    return [
        ("the same batches three times", [(make(), None) for make in (golden, json_, vllm) * 2]),
        ("as spool files after plain sends", [(golden(), SpoolRecord("01" * 32, "a.pb")),
                                              (json_(), SpoolRecord("02" * 32, "b.json"))]),
        ("regrouped with each other", [(merged, None), (json_(), None)]),
    ]


def _snapshot(store) -> dict:
    """Every table's rows (sorted) and the window report: what must not change on a resend."""
    from tokentrace.analyzers.report import summarize

    tables = {table: sorted(map(repr, _table(store, table).rows())) for table in [*TABLES, "prefix_block_lists"]
              if table != "prefix_block_lists" or hasattr(store, "_cursor")}  # DuckDB's first new blocks too
    return {"tables": tables, "report": summarize(store, None).as_dict()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_resent_spans_are_stored_once(payloads, backend, tmp_path, chdb_dir):
    """A store given each payload once, then every kind of resend, and again after a restart (the
    memory of stored keys starts from the store): every table and the report stay as one delivery."""
    url = store_url(backend, tmp_path, chdb_dir)
    store = stores.open_store(url)
    for batch, _ in _batches(payloads)[:3]:
        assert store.write(batch)
    once = _snapshot(store)
    assert once["report"]["requests"] == 4
    for caption, deliveries in _deliveries(payloads):
        for batch, spool in deliveries:
            spans = batch.spans
            assert store.write(batch, spool)
            assert batch.duplicates == spans, caption
        assert _snapshot(store) == once, caption
    store.close()
    store = stores.open_store(url)  # a restart: a resend of acknowledged-but-unanswered batches
    try:
        for batch, _ in _batches(payloads)[:3]:
            spans = batch.spans
            assert store.write(batch)
            assert (batch.duplicates, batch.spans) == (spans, 0)  # write leaves them out of the batch
        assert _snapshot(store) == once
    finally:
        store.close()


def test_spans_older_than_the_memory_are_checked_in_the_store(payloads, tmp_path, chdb_dir):
    """Spans that started before the horizon of the in-memory keys (late data) are looked up."""
    for backend in BACKENDS:
        store = stores.open_store(store_url(backend, tmp_path, chdb_dir))
        try:
            first, again = _batches(payloads)[0][0], _batches(payloads)[0][0]
            assert store.write(first)
            once = _snapshot(store)
            store._keys = type(store._keys)()  # memory empty, as for spans older than it
            store._keys.horizon = 2**40
            spans = again.spans
            assert store.write(again)
            assert again.duplicates == spans, backend
            assert _snapshot(store) == once, backend
        finally:
            store.close()


# --- the analyzers' verdicts --------------------------------------------------------------------
def _others(stores: dict) -> list[tuple[str, object]]:
    """(backend, store) of every backend but the reference, DuckDB."""
    return [(backend, store) for backend, store in stores.items() if backend != "duckdb"]


def _assert_same_verdicts(backend: str, store, reference, request_ids: list[str]) -> None:
    """The store holds the reference's requests, and each gets the reference's two verdicts."""
    from tokentrace.analyzers.cache import analyze_cache
    from tokentrace.analyzers.slowness import analyze_slowness

    assert _request_ids(store) == request_ids, backend
    for request_id in request_ids:
        assert analyze_slowness(store, request_id).as_dict() == analyze_slowness(reference, request_id).as_dict(), \
            backend
        assert analyze_cache(store, request_id).as_dict() == analyze_cache(reference, request_id).as_dict(), backend


def _request_ids(store) -> list[str]:
    return sorted(set(store.requests(limit=10_000)["request_id"].to_list()))


def test_every_verdict_is_identical_on_every_backend(loaded):
    """Slowness and cache verdicts of every stored request (golden engine trace, hand-written OTLP,
    real vLLM spans) and the window report, computed through each backend's reader role."""
    from tokentrace.analyzers.report import summarize

    reference = loaded["duckdb"]
    request_ids = _request_ids(reference)
    assert len(request_ids) == 4
    for backend, store in _others(loaded):
        _assert_same_verdicts(backend, store, reference, request_ids)
        assert summarize(store, None).as_dict() == summarize(reference, None).as_dict(), backend


# --- verdicts of a real workload, replayed ---------------------------------------------------------
@pytest.fixture(scope="module")
def demo_loaded(tmp_path_factory, request):
    """Both backends, loaded with what two real engines exported during the demo's workload
    (tests/fixtures/demo_trace.jsonl, made by tests/capture_demo_trace.py)."""
    chdb_dir = request.getfixturevalue("chdb_dir")
    tmp = tmp_path_factory.mktemp("demo")
    pipeline = Pipeline(Counters(), 1 << 26, 65536)
    lines = (golden.FIXTURES / "demo_trace.jsonl").read_bytes().splitlines()
    batches = [pipeline.batch(line, Encoding("json", JSON)) for line in lines if line.strip()]
    made = {}
    for backend in BACKENDS:
        made[backend] = stores.open_store(store_url(backend, tmp, chdb_dir))
        for batch in batches:
            assert made[backend].write(batch)
    yield made
    for store in made.values():
        store.close()


def test_a_real_workload_gets_the_same_verdicts_on_every_backend(demo_loaded):
    """Every category and cause, produced by real engines: each shown request gets the verdict the
    demo expects on every backend, and every request's verdicts are identical across backends."""
    from tokentrace.analyzers.cache import analyze_cache
    from tokentrace.analyzers.slowness import analyze_slowness

    shown = json.loads((golden.FIXTURES / "demo_trace.shown.json").read_text(encoding="utf-8"))
    reference = demo_loaded["duckdb"]
    request_ids = _request_ids(reference)
    assert len(request_ids) >= 20
    for backend, store in demo_loaded.items():
        for item in shown:
            if item["expect"] is None:
                continue  # "fast" / "hit": asserted by identity below, not by a category
            verdict = (analyze_slowness(store, item["request_id"]).category if item["verdict"] == "slow"
                       else analyze_cache(store, item["request_id"]).cause)
            assert verdict == item["expect"], (backend, item["label"])
    for backend, store in _others(demo_loaded):
        _assert_same_verdicts(backend, store, reference, request_ids)


def test_a_cache_verdict_looks_up_only_the_segments_it_can_explain_by(demo_loaded, monkeypatch):
    """The earlier copies of a segment the request reused (above all a system prompt, which every
    request of an application may share) explain nothing, and looking them up reads every earlier
    request that had them: the verdict leaves them out of segment_matches. Every cache verdict of
    the real workload is what looking up all of the prompt's segments gives."""
    from tokentrace.analyzers import cache

    store = demo_loaded["duckdb"]
    asked: dict[str, tuple[int, int]] = {}
    rows = store.rows

    def recording(name, **params):
        if name == "segment_matches":
            mine = {row["hash"] for row in rows("segments_of", request_id=params["request_id"], t0_ns=0,
                                                  t1_ns=2**62)}
            asked[params["request_id"]] = (len(set(params["hashes"])), len(mine))
        return rows(name, **params)

    everything = {}
    with monkeypatch.context() as patched:
        patched.setattr(cache, "_match_hashes", lambda segments, cached, block: [
            row["hash"] for row in segments if row["hash"] is not None])
        for request_id in _request_ids(store):
            everything[request_id] = cache.analyze_cache(store, request_id).as_dict()
    monkeypatch.setattr(store, "rows", recording)
    for request_id, expected in everything.items():
        assert cache.analyze_cache(store, request_id).as_dict() == expected, request_id
    assert any(count < total for count, total in asked.values()), asked  # some reused segments left out
    assert all(count <= total for count, total in asked.values())


#: The parameters of a slice (core/window.py Slice) beside the instance: a query that takes only
#: these (session_requests: one session's) is not a window query.
_SLICE = {"model", "session_id", "request_prefix"}
#: Values for the named queries that take only a window, a slice and a limit: everything.
_UNBOUNDED = {"since_ns": None, "until_ns": None, "instance_id": None, "limit": 100_000, "model": None,
              "session_id": None, "request_prefix": None}
#: Window queries over tables (or spans) the demo (two engines of one process each, no gateway) does not
#: fill; the golden payloads cover them in test_named_query_gives_the_same_frame_on_every_backend.
_NOT_IN_DEMO = {"routing_by_policy", "cluster_states", "nodes"}
_WINDOW_QUERIES = sorted(n for n in sqlfiles.query_names("duckdb")
                         if _params("duckdb", n) <= set(_UNBOUNDED) and n not in _NOT_IN_DEMO
                         and not (_params("duckdb", n) and _params("duckdb", n) <= _SLICE))
#: The named queries that take only what a request row gives (its id, instance and time span).
_PER_REQUEST = {"request_id", "instance_id", "t0_ns", "t1_ns"}
#: request_alias looks a request up by the id its upstream gave the answer, which only a gateway in front
#: of an engine records: the demo's trace has no such id, and tests/test_gateway_merge.py compares the
#: query on both backends (test_the_upstreams_own_id_finds_the_request).
#: node_steps reads the timed steps of a distributed engine's ranks, which the demo (one process per
#: instance) has none of: the golden trace's engine.steps carries them (a rank's compute and ring wait,
#: one step untimed), and test_named_query_gives_the_same_frame_on_every_backend compares them.
_PER_REQUEST_QUERIES = sorted(n for n in sqlfiles.query_names("duckdb")
                              if "request_id" in _params("duckdb", n) and _params("duckdb", n) <= _PER_REQUEST
                              and n not in ("request_alias", "node_steps"))


@pytest.mark.parametrize("name", _WINDOW_QUERIES)
def test_window_queries_give_the_same_frame_on_a_real_workload(demo_loaded, name):
    """Real engines start spans at equal times (a prefill and its cache lookup, the chunks of one
    batched prefill step), which the golden trace does not: every ORDER BY must break those ties."""
    params = {p: _UNBOUNDED[p] for p in _params("duckdb", name)}
    frames = {backend: store.frame(name, **params) for backend, store in demo_loaded.items()}
    reference = frames.pop("duckdb")
    assert reference.height > 0, f"the demo workload gives {name} no row"
    for frame in frames.values():
        assert_frame_equal(frame, reference, check_exact=False, rel_tol=1e-9)
    for store in demo_loaded.values():  # the columnar path for large windows gives the same frame
        assert_frame_equal(store.bulk(name, **params), reference, check_exact=False, rel_tol=1e-9)


@pytest.mark.parametrize("name", _PER_REQUEST_QUERIES)
def test_per_request_queries_give_the_same_frame_on_a_real_workload(demo_loaded, name):
    """Each query that a request row parametrizes, for every request of the real workload."""
    reference, found = demo_loaded["duckdb"], 0
    for row in reference.requests(limit=10_000).iter_rows(named=True):
        values = {"request_id": row["request_id"], "instance_id": row["instance_id"], "t0_ns": row["start_ns"],
                  "t1_ns": row["end_ns"]}
        params = {p: values[p] for p in _params("duckdb", name)}
        expected = reference.frame(name, **params)
        found += expected.height
        for _, store in _others(demo_loaded):
            assert_frame_equal(store.frame(name, **params), expected, check_exact=False, rel_tol=1e-9)
    assert found, f"the demo workload gives {name} no row"
