"""Parquet files joined by copying their row groups (collector/stores/parquet_concat.py): pyarrow writes
real files (the span files' options, and others: dictionaries, nested lists, NULLs, many row
groups), the join is read back by pyarrow and by DuckDB, statistics and Bloom filters included, and
what it cannot join is refused before anything is written."""

from __future__ import annotations

import os
import random

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokentrace.collector.stores.parquet_concat import Unjoinable, join
from tokentrace.collector.stores.span_files import ROW_GROUP_ROWS, WRITE_OPTIONS

SCHEMA = pa.schema([("trace_id", pa.binary()), ("name", pa.string()), ("start_ns", pa.int64()),
                    ("attributes", pa.string()), ("offsets", pa.list_(pa.int64())), ("ratio", pa.float64()),
                    ("flag", pa.bool_())])


def _table(rng: random.Random, rows: int, start: int) -> pa.Table:
    return pa.table({
        "trace_id": [rng.randbytes(16) for _ in range(rows)],
        "name": [rng.choice(["llm.request", "llm.decode", None]) for _ in range(rows)],
        "start_ns": range(start, start + rows),
        "attributes": [None if i % 7 == 0 else f'{{"k": {i}, "s": "{"x" * (i % 50)}"}}' for i in range(rows)],
        "offsets": [None if i % 3 == 0 else list(range(i % 5)) for i in range(rows)],
        "ratio": [None if i % 11 == 0 else i / 3 for i in range(rows)],
        "flag": [i % 2 == 0 for i in range(rows)],
    }, schema=SCHEMA)


def _write(tmp_path, tables: list[pa.Table], **options) -> list:
    paths = []
    for k, table in enumerate(tables):
        path = tmp_path / f"in{k}.parquet"
        pq.write_table(table, str(path), **options)
        paths.append(path)
    return paths


@pytest.mark.parametrize("options", [
    {"row_group_size": ROW_GROUP_ROWS, **WRITE_OPTIONS},  # the span files'
    {"row_group_size": 1000},  # pyarrow's defaults: dictionaries (their page offsets move too), snappy
    {"row_group_size": 5000, "compression": "none", "write_statistics": False},
], ids=["span-files", "dictionaries", "plain"])
def test_the_joined_file_reads_as_its_inputs_one_after_another(tmp_path, options):
    rng = random.Random(7)
    tables = [_table(rng, rows, k * 1_000_000) for k, rows in enumerate((40_000, 1, 17_000, 33_333))]
    paths = _write(tmp_path, tables, **options)
    out = tmp_path / "joined.parquet"
    assert join(paths, out)
    whole = pa.concat_tables(tables)
    assert pq.read_table(out).equals(whole)
    joined = pq.ParquetFile(out).metadata
    inputs = [pq.ParquetFile(p).metadata for p in paths]
    assert joined.num_rows == whole.num_rows
    assert joined.num_row_groups == sum(m.num_row_groups for m in inputs)
    groups = [m.row_group(i) for m in inputs for i in range(m.num_row_groups)]
    for index, group in enumerate(groups):  # every row group's statistics as its input had them
        mine = joined.row_group(index)
        assert mine.num_rows == group.num_rows
        for column in range(group.num_columns):
            assert mine.column(column).statistics == group.column(column).statistics
            assert mine.column(column).total_compressed_size == group.column(column).total_compressed_size
    # DuckDB reads it as a whole, and row group by row group through its statistics.
    con = duckdb.connect()
    read = con.sql(f"SELECT * FROM read_parquet('{out}') ORDER BY start_ns").to_arrow_table()
    assert read.equals(whole.sort_by("start_ns"))
    [(count,)] = con.execute(f"SELECT count(*) FROM read_parquet('{out}') WHERE start_ns BETWEEN 2000000 AND 2016999"
                             ).fetchall()
    assert count == 17_000


def test_the_bloom_filters_are_found_where_they_moved(tmp_path):
    """DuckDB probes each row group's Bloom filter of trace ids at its (moved) offset: the row group
    holding an id may hold it, almost every other one excludes it."""
    rng = random.Random(11)
    tables = [_table(rng, 50_000, k * 1_000_000) for k in range(3)]
    paths = _write(tmp_path, tables, row_group_size=ROW_GROUP_ROWS, **WRITE_OPTIONS)
    out = tmp_path / "joined.parquet"
    assert join(paths, out)
    con = duckdb.connect()
    wanted = tables[2].column("trace_id")[40_000].as_py()  # the third input's third row group
    probes = con.execute(f"SELECT row_group_id, bloom_filter_excludes FROM parquet_bloom_probe('{out}', 'trace_id', ?) "
                         "ORDER BY row_group_id", [wanted]).fetchall()
    groups = pq.ParquetFile(out).metadata.num_row_groups
    assert len(probes) == groups
    holder = pq.ParquetFile(paths[0]).metadata.num_row_groups * 2 + 2
    assert probes[holder] == (holder, False)
    assert sum(excluded for _, excluded in probes) >= groups - 2  # fpp 0.01 a row group
    [(start,)] = con.execute(f"SELECT start_ns FROM read_parquet('{out}') WHERE trace_id = ?", [wanted]).fetchall()
    assert start == 2_040_000


def test_a_single_input_joins_to_the_same_rows(tmp_path):
    paths = _write(tmp_path, [_table(random.Random(3), 20_000, 0)], row_group_size=ROW_GROUP_ROWS, **WRITE_OPTIONS)
    assert join(paths, tmp_path / "one.parquet")
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(paths[0]))


@pytest.mark.parametrize("case", ["page index", "other schema", "other metadata", "not parquet", "truncated",
                                  "garbled footer"])
def test_what_cannot_be_joined_by_copying_is_refused_and_nothing_is_written(tmp_path, case):
    rng = random.Random(5)
    first = _table(rng, 2_000, 0)
    second = _table(rng, 2_000, 10_000)
    options = {"row_group_size": 1000}
    if case == "page index":  # its offset index holds absolute page offsets among the copied bytes
        paths = _write(tmp_path, [first, second], write_page_index=True, **options)
    elif case == "other schema":
        paths = _write(tmp_path, [first, second.drop_columns(["ratio"])], **options)
    elif case == "other metadata":
        paths = _write(tmp_path, [first, second.replace_schema_metadata({"who": "else"})], **options)
    else:
        paths = _write(tmp_path, [first, second], **options)
        data = paths[1].read_bytes()
        if case == "garbled footer":  # its length and magic intact, its Thrift cut short inside a value
            length = int.from_bytes(data[-8:-4], "little")
            start = len(data) - 8 - length
            data = data[:start] + b"\x19\xfc" + b"\xff" * (length - 2) + data[-8:]
        paths[1].write_bytes({"not parquet": b"not a parquet file at all", "truncated": data[:-100]}.get(case, data))
    out = tmp_path / "joined.parquet"
    with pytest.raises(Unjoinable, match="is not Parquet's" if case == "garbled footer" else None):
        join(paths, out)
    assert not out.exists()


def test_a_join_given_up_leaves_no_output(tmp_path):
    paths = _write(tmp_path, [_table(random.Random(9), 3_000, k * 10_000) for k in range(3)], row_group_size=1000)
    out = tmp_path / "joined.parquet"
    asked = []

    def stopping() -> bool:
        asked.append(1)
        return len(asked) == 2  # after the first input's bytes

    assert join(paths, out, stopping) is False
    assert not out.exists()
    assert set(os.listdir(tmp_path)) == {p.name for p in paths}
