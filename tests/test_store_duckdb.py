"""DuckDB store internals that keep ingest and verdicts fast: list parameters, the first new block
of each packed block list (collector/stores/frontier.py) and the verdict query that relies on it, and the
plans of the hash lookups (an index scan, not a scan of every row; bench/analyze.py has the times).
"""

from __future__ import annotations

import json
import random
import re
import threading

import golden
import numpy as np
import pyarrow as pa
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.decoding.columns import arrow_table
from tokentrace.collector.decoding.normalize import Batch, normalize
from tokentrace.collector.stores.frontier import RecentKeys, fresh_frontiers
from tokentrace.collector.stores.store_duckdb import DuckDBStore, bind_lists
from tokentrace.fingerprint import block_hashes


def test_reads_run_together_each_on_a_cursor_of_its_own(tmp_path):
    """``together`` (what a cache verdict's branches use): the reads overlap (three wait at a barrier
    only all three can pass, which one after the other would time out), each queries the store from
    its own thread, and the results come back in the order of the reads."""
    store = DuckDBStore(tmp_path / "together.duckdb")
    try:
        meeting = threading.Barrier(3, timeout=30)

        def read(n: int):
            def run():
                meeting.wait()
                rows = store.rows("request", request_id=f"req-{n}")
                return n, rows, threading.current_thread().name
            return run

        results = store.together(read(1), read(2), read(3))
        assert [(n, rows) for n, rows, _ in results] == [(1, []), (2, []), (3, [])]
        assert len({name for _, _, name in results}) == 3
    finally:
        store.close()


def test_reads_together_raise_the_first_error_once_every_read_is_done(tmp_path):
    store = DuckDBStore(tmp_path / "together.duckdb")
    try:
        done: list[int] = []

        def fails():
            raise ValueError("this read failed")

        def slow():
            store.rows("request", request_id="r")
            done.append(1)  # list.append is atomic

        for reads in ((fails, slow, slow), (slow, fails, slow)):  # failing in this thread, or in a helper
            done.clear()
            with pytest.raises(ValueError, match="this read failed"):
                store.together(*reads)
            assert len(done) == 2
        # The pool is still serviceable after a failure, and a read's own ``together`` runs inside it.
        nested = store.together(*[lambda k=k: store.together(lambda: k, lambda: k * 10) for k in range(6)])
        assert nested == [[k, k * 10] for k in range(6)]
    finally:
        store.close()


def test_a_patient_reader_reads_one_after_the_other_on_its_own_thread(tmp_path):
    """The /metrics verdict thread reads patiently (``read_patiently``: it never starts a merge early)
    and yields to ingest by pausing in proportion to each verdict's wall time: reads run at once made
    its verdicts shorter but no cheaper, so that it took more of the CPU ingest needs. Its reads run
    one after the other, on its own thread, patiently."""
    store = DuckDBStore(tmp_path / "together.duckdb")
    try:
        def where():
            return threading.current_thread().name, getattr(store._local, "patient", False)

        def patient_reader():
            store.read_patiently()
            return store.together(where, where, where)

        answers = []
        thread = threading.Thread(target=lambda: answers.append(patient_reader()), name="patient-reader")
        thread.start()
        thread.join(60)
        assert answers == [[("patient-reader", True)] * 3]
        assert {name for name, _ in store.together(where, where)} != {threading.current_thread().name}
    finally:
        store.close()


def test_list_parameters_become_one_bound_value_each():
    sql, params = bind_lists("SELECT 1 WHERE h IN ($hashes[]) AND t < $t -- $hashes[] again", {"hashes": [5, 6],
                                                                                               "t": 9})
    assert sql == "SELECT 1 WHERE h IN ($hashes_0, $hashes_1) AND t < $t -- $hashes_0, $hashes_1 again"
    assert params == {"t": 9, "hashes_0": 5, "hashes_1": 6}
    sql, params = bind_lists("SELECT 1 WHERE h IN ($hashes[])", {"hashes": []})
    assert (sql, params) == ("SELECT 1 WHERE h IN (NULL)", {})
    sql, params = bind_lists("SELECT $hashes::BIGINT[] WHERE h IN ($hashes[])", {"hashes": [5]})  # the whole list too
    assert (sql, params) == ("SELECT $hashes::BIGINT[] WHERE h IN ($hashes_0)", {"hashes_0": 5, "hashes": [5]})


def test_recent_keys_drop_repeats_and_forget_after_two_generations():
    recent = RecentKeys(capacity=4)
    keys = np.array([1, 2, 3], dtype=np.uint64)
    assert recent.fresh(keys).tolist() == [True, True, True]
    assert recent.fresh(np.array([3, 4], dtype=np.uint64)).tolist() == [False, True]  # 5 keys: rotates
    assert recent.fresh(np.array([1, 9], dtype=np.uint64)).tolist() == [False, True]  # 1 is in the old one
    assert recent.fresh(np.array([7, 8, 10], dtype=np.uint64)).tolist() == [True, True, True]  # rotates
    assert recent.fresh(np.array([2, 1], dtype=np.uint64)).tolist() == [True, False]  # 2 was forgotten


def test_a_second_copy_of_a_trace_has_no_new_blocks(tmp_path):
    body, _ = golden.encode(golden.load("golden_engine_trace.json"), 1_790_000_000_000_000_000)
    batch = normalize(ExportTraceServiceRequest.FromString(body))
    store = DuckDBStore(tmp_path / "s.duckdb")
    store.write(batch)
    again, _ = golden.encode(golden.load("golden_engine_trace.json"), 1_790_000_000_000_000_000)
    store.write(normalize(ExportTraceServiceRequest.FromString(again)))  # other spans, the same blocks
    assert store.counts()["prefix_blocks"] == 2 * sum(len(row[-1]) for row in batch.packed["prefix_blocks"])
    rows = store._cursor().execute("SELECT source, fresh_from, fresh_hash = hashes[1] FROM prefix_block_lists "
                                   "ORDER BY source, fresh_from NULLS LAST").fetchall()
    assert rows == [("insert", 0, True), ("insert", None, None), ("lookup", 0, True), ("lookup", None, None)]
    store.close()


def test_first_new_blocks_match_a_row_by_row_reference():
    """fresh_frontiers takes rows by time (ties: staged order) and a block as new unless its (hash,
    instance, source) was in an earlier row or in memory: the same as a loop over the rows."""
    rng = np.random.default_rng(17)
    rows = []
    for n in range(400):
        hashes = [int(h) for h in rng.integers(-40, 40, size=int(rng.integers(1, 12)))]  # repeats within a row
        rows.append((f"r{n}", [None, "a", "b"][n % 3], int(rng.integers(0, 20)) * 1000, ["lookup", "insert"][n % 2],
                     int(rng.integers(0, 2**62)) if n % 2 else None, hashes))
    staged = arrow_table("prefix_blocks", rows)
    expected, known = [None] * len(rows), set()
    for at in sorted(range(len(rows)), key=lambda i: rows[i][2]):
        _, inst, _, source, _, hashes = rows[at]
        for index, value in enumerate(hashes):
            if (value, inst, source) not in known and expected[at] is None:
                expected[at] = index
            known.add((value, inst, source))
    recent = RecentKeys()
    fresh_from, fresh_hash = fresh_frontiers(staged, recent)
    assert fresh_from.to_pylist() == expected
    assert fresh_hash.to_pylist() == [None if i is None else row[-1][i] for row, i in zip(rows, expected, strict=True)]
    again, _ = fresh_frontiers(staged, recent)  # the same rows again: every key is known now
    assert again.to_pylist() == [None] * len(rows)


_REACH_REFERENCE = """
-- prefix_reach over every stored block (what ClickHouse's twin reads): the deepest block of the
-- prompt each instance and source had before the moment, and its first holder.
SELECT instance_id, source, block_index, t_ns, request_id, fingerprint
FROM (SELECT *, row_number() OVER (PARTITION BY instance_id, source
                                   ORDER BY block_index DESC, t_ns, coalesce(request_id, '')) AS place
      FROM prefix_blocks WHERE t_ns < $before AND list_extract($prompt::BIGINT[], block_index + 1) = hash)
WHERE place = 1
ORDER BY block_index DESC, instance_id, source
"""


def _conversations(seed: int, turns: int) -> list[tuple]:
    """Packed prefix_blocks rows of chat sessions on three instances: shared system prompts, growing
    histories, sessions that move between instances, edited turns (a branch inside a history)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 1000) for _ in range(rng.choice((16, 48, 80)))] for _ in range(3)]
    sessions = [list(rng.choice(systems)) for _ in range(12)]
    rows, t = [], 1_000_000_000
    for turn in range(turns):
        at = rng.randrange(len(sessions))
        history = sessions[at]
        if rng.random() < 0.15 and len(history) > 40:  # an edited earlier message: the prompt branches
            history[rng.randrange(16, len(history)):] = []
        prompt = history + [rng.randrange(1, 1000) for _ in range(rng.randrange(4, 40))]
        instance = f"i{rng.randrange(3)}"
        t += rng.randrange(1, 3) * 1_000_000  # some rows share a moment
        rows.append((f"t{turn}", instance, t, "lookup", None, block_hashes(prompt, 16)))
        stored = prompt + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 30))]
        inserted = block_hashes(stored, 16)
        if inserted and rng.random() < 0.8:
            rows.append((f"t{turn}", instance, t + 500_000, "insert", inserted[-1], inserted))
        sessions[at] = stored
    return rows


@pytest.mark.parametrize("capacity", [1_000_000, 40], ids=["memory holds every key", "memory forgets"])
def test_prefix_reach_equals_a_scan_of_every_block(tmp_path, capacity):
    """The verdict's query reads only the rows whose first new block is one of the prompt's; it must
    answer as a scan of every stored block does, for every prompt, also when the memory of recent
    keys is too small and blocks count as new again."""
    store = DuckDBStore(tmp_path / "s.duckdb")
    store._recent = RecentKeys(capacity=capacity)
    rows = _conversations(seed=capacity, turns=400)
    for at in range(0, len(rows), 64):  # several merges, as a collector receives them
        batch = Batch()
        batch.packed["prefix_blocks"].extend(rows[at:at + 64])
        store.write(batch)
    cursor = store._cursor()
    compared = 0
    for rid, _, t_ns, source, _, hashes in rows:
        if source != "lookup":
            continue
        got = store.rows("prefix_reach", hashes=hashes, before_ns=t_ns)
        expected = cursor.execute(_REACH_REFERENCE, {"before": t_ns, "prompt": hashes}).fetchall()
        assert [tuple(row.values()) for row in got] == expected, rid
        compared += bool(expected)
    assert compared > 100  # most prompts met an earlier one
    store.close()


def _scans(cursor, sql: str, params: dict) -> list[str]:
    """The scan type of every table scan in the executed plan (EXPLAIN ANALYZE, JSON)."""
    plan = json.loads(cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchall()[0][1])
    found, pending = [], list(plan["operator"])
    while pending:
        node = pending.pop()
        pending.extend(node.get("children", []))
        if node.get("name") == "SEQ_SCAN":
            found.append(node["extra_info"].get("Type"))
    return found


@pytest.mark.parametrize("name", ["prefix_reach", "segment_matches"])
def test_hash_lookups_take_the_art_index(tmp_path, name):
    """A second filter in the same scan (t_ns < before) turns DuckDB's index scan into a scan of the
    whole table: 180 ms instead of 7 ms per cache verdict at 53M rows. Several hashes, as a verdict
    asks (one value would be an equality, which keeps the index either way)."""
    store = DuckDBStore(tmp_path / "s.duckdb")
    for base in (1_790_000_000_000_000_000, 1_790_000_010_000_000_000):  # the same trace 10 s later
        body, _ = golden.encode(golden.load("golden_engine_trace.json"), base)
        store.write(normalize(ExportTraceServiceRequest.FromString(body)))
    cursor = store._cursor()
    table, column = ("prefix_blocks", "hash") if name == "prefix_reach" else ("segments", "hash")
    hashes = [row[0] for row in cursor.execute(f"SELECT DISTINCT {column} FROM {table} ORDER BY 1").fetchall()]
    assert len(hashes) >= 2
    # A moment inside the table's time range, so that its statistics cannot drop the time filter.
    [(before,)] = cursor.execute(f"SELECT max(t_ns) FROM {table}").fetchall()
    text = store._queries.text(name)
    params = {k: v for k, v in {"hashes": hashes, "before_ns": before, "request_id": "another"}.items()
              if f"${k}" in text}
    sql, bound = bind_lists(text, params)
    assert "Index Scan" in _scans(cursor, sql, bound)
    assert "Sequential Scan" not in _scans(cursor, sql, bound)
    store.close()


# slot_holders before it bounded the queue spans it reads: a join with every llm.queue span stored.
_HOLDERS_REFERENCE = """
SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, start_ns, end_ns, admitted_ns
FROM (
    SELECT r.request_id, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.start_ns, r.end_ns,
           coalesce(q.end_ns, r.start_ns + CAST(coalesce(r.queue_ms, 0) * 1e6 AS BIGINT)) AS admitted_ns
    FROM requests r
    LEFT JOIN phases q ON q.request_id = r.request_id AND q.name = 'llm.queue'
    WHERE r.instance_id = $instance_id AND r.request_id <> $request_id
      AND r.end_ns > $t0_ns AND r.start_ns < $t1_ns
)
WHERE admitted_ns < $t1_ns
ORDER BY admitted_ns
"""


def _row_groups(cursor, sql: str, params: dict, table: str) -> tuple[int, int]:
    """(scanned, total) row groups of ``table``'s scan in the executed plan (EXPLAIN ANALYZE)."""
    plan = cursor.execute("EXPLAIN ANALYZE " + sql, params).fetchall()[0][1]
    found = []
    for block in plan.split("Table Scan")[1:]:
        if f".{table}" in block.split("Row Groups Scanned")[0]:
            scanned, total = re.search(r"Row Groups Scanned: ([\d,]+) / ([\d,]+)", block).groups()
            found.append((int(scanned.replace(",", "")), int(total.replace(",", ""))))
    assert len(found) == 1, plan
    return found[0]


def test_slot_holders_read_the_queue_spans_of_their_window_only(tmp_path):
    """A slow verdict asks who held the batch slots while a request queued; the query joined every
    llm.queue span ever stored (1.25M requests: 52-92 ms of a 140 ms verdict), so verdicts slowed as
    the store grew. It must read the phases row groups of its window, and answer as that join does:
    with queue spans that end before or after their request's span (clock skew) and requests with no
    queue span (arrival + queue_ms)."""
    store = DuckDBStore(tmp_path / "s.duckdb")
    cursor = store._cursor()
    n, step = 600_000, 1_000_000  # one request a millisecond on two instances, 33 row groups of phases
    cursor.execute(
        "INSERT INTO requests (request_id, trace_id, span_id, instance_id, start_ns, end_ns, queue_ms, "
        "prompt_tokens, cached_tokens, completion_tokens) "
        "SELECT 'r' || i, 't' || i, 's' || i, 'i' || (i % 2), i * $step, i * $step + 40 * $step + (i % 7) * $step, "
        "(i % 5) * 0.5, 100 + i % 13, i % 3, 8 FROM range($n) t(i)", {"n": n, "step": step})
    # Every request but each 10th has a queue span; some end up to 20 s off their request (skew).
    cursor.execute(
        "INSERT INTO phases (request_id, instance_id, name, start_ns, end_ns) "
        "SELECT 'r' || i, 'i' || (i % 2), 'llm.queue', i * $step + skew, "
        "i * $step + skew + (i % 4) * $step FROM "
        "(SELECT i, CASE WHEN i % 97 = 0 THEN -20_000::BIGINT * $step "
        "                WHEN i % 89 = 0 THEN 20_000::BIGINT * $step ELSE 0 END "
        " AS skew FROM range($n) t(i)) WHERE i % 10 <> 0", {"n": n, "step": step})
    sql = store._queries.text("slot_holders")
    compared = 0
    for at in (50, 1_234, 97 * 1_000, 300_001, 599_990):
        t0 = at * step
        params = {"instance_id": f"i{at % 2}", "request_id": f"r{at}", "t0_ns": t0, "t1_ns": t0 + 3 * step}
        got = store.rows("slot_holders", **params)
        expected = cursor.execute(_HOLDERS_REFERENCE, params).fetchall()
        assert [tuple(row.values()) for row in got] == expected, at
        compared += len(expected)
        scanned, total = _row_groups(cursor, sql, params, "phases")
        # Its window and the skewed spans' row groups, not the table: at most 2 of 5 row groups of
        # DuckDB's default size, and as small a share of the smaller ones the store writes.
        assert total >= 4 and scanned * 5 <= total * 2, (at, scanned, total)
    assert compared > 100
    # No request held a slot (no such instance): no phases row group read either.
    params = {"instance_id": "elsewhere", "request_id": "r5", "t0_ns": 5 * step, "t1_ns": 8 * step}
    assert store.rows("slot_holders", **params) == []
    assert _row_groups(cursor, sql, params, "phases")[0] == 0
    store.close()


def test_the_store_writes_row_groups_of_its_own_size_and_spills_beside_its_file(tmp_path):
    """The store attaches its file with ROW_GROUP_SIZE (store_duckdb.ROW_GROUP_SIZE; with DuckDB's
    own 122,880 the merge took half as much CPU again) on every cursor it reads and writes with, and DuckDB's
    spill files go to FILE.tmp, as they did for a connected file, not to the working directory."""
    from tokentrace.collector.stores.store_duckdb import ROW_GROUP_SIZE

    path = tmp_path / "s.duckdb"
    store = DuckDBStore(path)
    rows = 5 * ROW_GROUP_SIZE + 7
    store._merger.execute("INSERT INTO heartbeats (instance_id, t_ns) SELECT 'i', range FROM range($n)",
                          {"n": rows})
    store._merger.execute("CHECKPOINT")
    [(groups,)] = store._cursor().execute(
        "SELECT count(DISTINCT row_group_id) FROM pragma_storage_info('heartbeats')").fetchall()
    assert groups == 6
    [(temp,)] = store._cursor().execute("SELECT current_setting('temp_directory')").fetchall()
    assert temp == f"{path}.tmp"
    assert store.counts()["heartbeats"] == rows
    store.close()


def test_a_loaded_merge_writes_its_typed_rows_to_the_file_not_the_wal(tmp_path):
    """A merge of a loaded collector (70-90k engine spans) gives ``requests`` and three other
    tables ~10k rows each. DuckDB writes a table's rows of one transaction straight to the file,
    compressed, only when they fill a row group; fewer went to its WAL, held uncompressed until a
    checkpoint compressed them: 0.92 x the collector's CPU a span with row groups of 8,192 instead of
    16,384 (issue 17, twenty-third round). 10,000 request rows through the journal and one merge
    leave the WAL with no more than the merge's bookkeeping."""
    from tokentrace.collector.decoding.columns import SCHEMAS, Columns

    path = tmp_path / "s.duckdb"
    store = DuckDBStore(path)
    n = 10_000
    given = {"request_id": [f"req-{i:08d}" for i in range(n)], "trace_id": [f"{i:032x}" for i in range(n)],
             "span_id": [f"{i:016x}" for i in range(n)], "instance_id": [f"i{i % 4}" for i in range(n)],
             "model": ["tiny"] * n, "start_ns": list(range(0, n * 1_000_000, 1_000_000)),
             "end_ns": list(range(500_000, n * 1_000_000, 1_000_000)), "prompt_tokens": [i % 900 for i in range(n)]}
    schema = SCHEMAS["requests"]
    requests = pa.Table.from_arrays([pa.array(given[f.name], f.type) if f.name in given else pa.nulls(n, f.type)
                                     for f in schema], schema=schema)
    store.write(Columns(tables={"requests": requests}))
    store.settle()  # merged: its rows in the tables, in one transaction
    wal = path.with_name(path.name + ".wal")
    assert store.counts()["requests"] == n
    # At 16,384 rows a row group they went to the WAL: 2.4 MB here.
    logged = wal.stat().st_size if wal.exists() else 0
    assert logged < 32_768, logged
    [(prompt,)] = store._cursor().execute("SELECT sum(prompt_tokens) FROM requests").fetchall()
    assert prompt == sum(given["prompt_tokens"])
    store.close()
    reopened = DuckDBStore(path, read_only=True)
    assert reopened.counts()["requests"] == n
    reopened.close()
