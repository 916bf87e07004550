"""A parsed payload as Arrow tables: what the parse stage hands to a store (issue 17).

The normalizer (collector/decoding/normalize.py) builds rows as Python tuples; the compiled decoder
(collector/decoding/fastpath.py) builds the same columns without them. Either way the store receives a
``Columns``: one Arrow table per non-empty table, in the column order and types of
``tables.TABLES``/``TYPES`` (the packed tables in their ``PACKED`` form), with the index of the span
each row came from, so that a store can leave out the rows of spans it holds already
(collector/stores/once.py), and each span's 64-bit key hash.

A ``Columns`` travels between processes and into the store's journal as bytes (``to_bytes``): a
short header and one Arrow IPC stream per table, read back without copying (``from_bytes``).
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from tokentrace.collector.decoding.tables import PACKED, PACKED_TYPES, TABLES, TYPES

_ARROW = {
    "VARCHAR": pa.string(), "BIGINT": pa.int64(), "INTEGER": pa.int32(), "DOUBLE": pa.float64(),
    "BOOLEAN": pa.bool_(), "VARCHAR[]": pa.list_(pa.string()), "DOUBLE[]": pa.list_(pa.float64()),
    "BIGINT[]": pa.list_(pa.int64()),
}


def _schema(columns: tuple[str, ...], types: tuple[str, ...]) -> pa.Schema:
    return pa.schema([(name, _ARROW[kind]) for name, kind in zip(columns, types, strict=True)])


#: The Arrow schema of every table as a batch carries it: ``TABLES`` order and types, the per-token
#: and per-block tables in their packed form.
SCHEMAS: dict[str, pa.Schema] = {
    name: _schema(PACKED[name], PACKED_TYPES[name]) if name in PACKED else _schema(columns, TYPES[name])
    for name, columns in TABLES.items()
}
_MAGIC = b"TTC1"


@dataclass
class Columns:
    """Rows of every table as Arrow, plus what the parse refused (the counters of ``Batch``)."""

    tables: dict[str, pa.Table] = field(default_factory=dict)  #: non-empty tables only (``SCHEMAS``)
    origin: dict[str, np.ndarray] = field(default_factory=dict)  #: per table: the span (0-based) of each row
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  #: key hash per span
    spans: int = 0  #: spans accepted
    rejected: int = 0  #: spans refused (invalid ids or times)
    truncated: int = 0  #: values cut to the length limit
    duplicates: int = 0  #: spans left out because the store held them (set by the store's write)
    problems: list[str] = field(default_factory=list)  #: first few reasons, for the response message
    rejected_by: Counter = field(default_factory=Counter)  #: refused spans by reason
    left_out: Counter = field(default_factory=Counter)  #: typed values left out (span kept), by reason
    #: What each part of this batch was parsed from, in span order: (kind, max_value_length, bytes,
    #: spans), kind "columns" (``to_bytes``) or an OTLP encoding ("protobuf", "json") of a payload
    #: that parses to exactly the rows of those ``spans`` spans; bytes None where a part has no such
    #: form (built in Python, or some of its spans left out): its rows are serialized when journaled
    #: (``journal_pieces``). The store journals these instead of the columns (collector/stores/journal.py):
    #: no second serialization, and a protobuf payload is half the bytes.
    sources: list[tuple[str, int, bytes | None, int]] | None = field(default=None, repr=False, compare=False)
    _nbytes: tuple | None = field(default=None, repr=False, compare=False)

    # --- reading ----------------------------------------------------------------------------------
    def table(self, name: str) -> pa.Table:
        """The rows of ``name`` (an empty table of its schema when there are none)."""
        found = self.tables.get(name)
        return found if found is not None else SCHEMAS[name].empty_table()

    def rows(self, name: str) -> list[tuple]:
        """The rows of ``name`` as tuples (``TABLES`` order; packed form for packed tables)."""
        found = self.tables.get(name)
        if found is None:
            return []
        return list(zip(*(column.to_pylist() for column in found.columns), strict=True))

    def count(self, name: str) -> int:
        """How many rows ``name`` has."""
        found = self.tables.get(name)
        return 0 if found is None else found.num_rows

    def expanded(self, name: str) -> list[tuple]:
        """Rows of ``name`` in ``TABLES`` order, packed tables expanded (normalize.Batch.expanded)."""
        if name not in PACKED:
            return self.rows(name)
        if name == "decode_steps":
            return [(rid, inst, step, start + offset)
                    for rid, inst, start, offsets in self.rows(name) for step, offset in enumerate(offsets)]
        return [(rid, inst, t_ns, source, index, value, fingerprint)
                for rid, inst, t_ns, source, fingerprint, hashes in self.rows(name)
                for index, value in enumerate(hashes)]

    def counted(self, nbytes: int) -> None:
        """Take ``nbytes`` as the tables' byte count (``nbytes``) while they stay as they are: a
        count their builder made (the compiled decoder's, collector/decoding/fastpath.py)."""
        self._nbytes = (self.tables, nbytes)

    @property
    def nbytes(self) -> int:
        """Memory the tables' buffers hold (their total size; Table.nbytes, which counts only the
        parts a slice references, took 0.36 ms for an engine batch), counted once per set of tables."""
        if self._nbytes is None or self._nbytes[0] is not self.tables:
            self._nbytes = (self.tables, sum(rows.get_total_buffer_size() for rows in self.tables.values()))
        return self._nbytes[1]

    def message(self) -> str:
        """The partial-success message: what was refused or changed, in one line."""
        from tokentrace.collector.decoding.normalize import partial_success_message

        return partial_success_message(self.problems, self.truncated)

    # --- changing ---------------------------------------------------------------------------------
    def select(self, keep: np.ndarray) -> Columns:
        """Only the spans of the mask ``keep`` and the rows they made; counters carried over."""
        if keep.all():
            return self
        renumber = np.cumsum(keep) - 1
        tables, origin = {}, {}
        for name, rows in self.tables.items():
            mask = keep[self.origin[name]]
            if mask.any():
                tables[name] = rows.filter(pa.array(mask))
                origin[name] = renumber[self.origin[name][mask]].astype(np.int32)
        return Columns(tables, origin, self.keys[keep], int(keep.sum()), self.rejected, self.truncated,
                       self.duplicates, self.problems, self.rejected_by, self.left_out,
                       _kept_sources(self.sources, keep))

    def journal_pieces(self) -> list[tuple[str, int, bytes]]:
        """(kind, max_value_length, bytes) of each part, as the journal holds them: a part's payload
        where it has one, and the rows of each run of parts without one as ``to_bytes`` (without
        span indexes and key hashes: the journal's reader makes them again). A batch of parts from
        several senders (the writer's groups) keeps the payloads of those that have one."""
        sources = self.sources
        if sources is None or sum(source[3] for source in sources) != self.spans:
            sources = [("columns", 0, None, self.spans)]
        pieces: list[tuple[str, int, bytes]] = []
        at, run = 0, None  # run: the first span of parts without a form, not yet serialized
        for kind, limit, data, spans in sources:
            if data is None:
                run = at if run is None else run
            else:
                if run is not None:
                    pieces.append(self._rows_of(run, at))
                    run = None
                pieces.append((kind, limit, data))
            at += spans
        if run is not None or not pieces:
            pieces.append(self._rows_of(run or 0, at))
        return pieces

    def _rows_of(self, start: int, stop: int) -> tuple[str, int, bytes]:
        """The rows of spans ``start`` to ``stop`` as a journal piece of kind "columns"."""
        part = self
        if (start, stop) != (0, self.spans):
            mask = np.zeros(self.spans, dtype=bool)
            mask[start:stop] = True
            part = self.select(mask)
        return ("columns", 0, part.to_bytes(with_origin=False))

    @classmethod
    def concat(cls, parts: list[Columns]) -> Columns:
        """Several batches as one (their spans numbered one after the other)."""
        if len(parts) == 1:
            return parts[0]
        out = cls(keys=np.concatenate([part.keys for part in parts]) if parts else np.zeros(0, np.uint64))
        if any(part.sources is not None for part in parts):
            out.sources = [source for part in parts for source in (part.sources or [("columns", 0, None, part.spans)])]
        offset = 0
        for name in TABLES:
            chosen = [(part, offset_of) for part, offset_of in zip(parts, _offsets(parts), strict=True)
                      if name in part.tables]
            if chosen:
                out.tables[name] = pa.concat_tables([part.tables[name] for part, _ in chosen])
                if all(name in part.origin for part, _ in chosen):  # read back from a journal: none
                    out.origin[name] = np.concatenate([part.origin[name] + at for part, at in chosen]).astype(np.int32)
        for part in parts:
            offset += part.spans
            out.rejected += part.rejected
            out.truncated += part.truncated
            out.duplicates += part.duplicates
            out.problems.extend(part.problems)
            out.rejected_by.update(part.rejected_by)
            out.left_out.update(part.left_out)
        out.spans = offset
        if all(part._nbytes is not None and part._nbytes[0] is part.tables for part in parts):
            # concat_tables keeps the parts' buffers: their counts add up (counting them again was
            # 5 % of the writer thread under load; py-spy, issue 17 tenth round)
            out._nbytes = (out.tables, sum(part._nbytes[1] for part in parts))
        return out

    # --- bytes ------------------------------------------------------------------------------------
    def to_bytes(self, with_origin: bool = True) -> bytes:
        """A header and one Arrow IPC stream per table; ``with_origin`` keeps the span index of each
        row and the key hashes (needed until the store has checked the spans, not after)."""
        streams, listed = [], []
        for name, rows in self.tables.items():
            if with_origin:
                rows = rows.append_column("__origin", pa.array(self.origin[name], pa.int32()))
            sink = pa.BufferOutputStream()
            with ipc.new_stream(sink, rows.schema) as writer:
                writer.write_table(rows)
            data = sink.getvalue()
            streams.append(data)
            listed.append([name, data.size])
        header = {"spans": self.spans, "rejected": self.rejected, "truncated": self.truncated,
                  "problems": self.problems, "rejected_by": dict(self.rejected_by),
                  "left_out": dict(self.left_out), "tables": listed,
                  "keys": self.keys.size if with_origin else None}
        text = json.dumps(header, separators=(",", ":")).encode()
        tail = self.keys.astype("<u8").tobytes() if with_origin else b""
        return b"".join([_MAGIC, struct.pack("<I", len(text)), text, *[s.to_pybytes() for s in streams], tail])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> Columns:
        """The inverse of ``to_bytes`` (buffers point into ``data``)."""
        view = memoryview(data)
        if bytes(view[:4]) != _MAGIC:
            raise ValueError("not a tokentrace column batch")
        (size,) = struct.unpack("<I", view[4:8])
        header = json.loads(bytes(view[8:8 + size]))
        at = 8 + size
        out = cls(spans=header["spans"], rejected=header["rejected"], truncated=header["truncated"],
                  problems=header["problems"], rejected_by=Counter(header["rejected_by"]),
                  left_out=Counter(header["left_out"]))
        out.sources = [("columns", 0, data, header["spans"])]
        buffer = pa.py_buffer(data)
        for name, length in header["tables"]:
            rows = ipc.open_stream(buffer.slice(at, length)).read_all()
            at += length
            if "__origin" in rows.column_names:
                out.origin[name] = rows.column("__origin").to_numpy()
                rows = rows.drop_columns(["__origin"])
            out.tables[name] = rows
        if header["keys"] is not None:
            out.keys = np.frombuffer(view[at:at + 8 * header["keys"]], dtype="<u8").astype(np.uint64)
        return out


def _offsets(parts: list[Columns]) -> list[int]:
    at, out = 0, []
    for part in parts:
        out.append(at)
        at += part.spans
    return out


def arrow_table(name: str, rows: list[tuple]) -> pa.Table:
    """Rows (tuples in ``SCHEMAS[name]`` order) as one Arrow table of that schema."""
    schema = SCHEMAS[name]
    columns = list(zip(*rows, strict=True))
    # From lists, not the tuples zip gives: pyarrow converts a list 1.1-2.7 times as fast (measured).
    arrays = [pa.array(list(column), type=f.type) for column, f in zip(columns, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)


def _kept_sources(sources: list | None, keep: np.ndarray) -> list | None:
    """``sources`` for the spans of the mask ``keep``: a part whose spans all stay keeps its form,
    one that lost some has none (its rows are serialized when journaled), one that lost all is gone."""
    if sources is None or sum(source[3] for source in sources) != len(keep):
        return None
    kept, at = [], 0
    for kind, limit, data, spans in sources:
        left = int(keep[at:at + spans].sum())
        if left == spans:
            kept.append((kind, limit, data, spans))
        elif left:
            kept.append(("columns", 0, None, left))
        at += spans
    return kept
