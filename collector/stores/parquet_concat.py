"""Parquet files joined into one by copying their bytes: no page decoded, none encoded (issue 17).

Why: compacting span files (collector/stores/span_files.py) by reading every row group and writing it
again cost 0.8-1.4 us of CPU a span, as much as the files had saved the merge thread; under
sustained load it ran beside ingest (docs/benchmarks.md, Issue 17, twenty-second round). A Parquet
file is its row groups' bytes followed by a footer (Thrift's compact protocol) that says where each
column chunk starts: the joined file is every input's bytes between its magic and its footer, copied
by the kernel (``os.copy_file_range``), and one footer that lists every input's row groups, each
absolute offset moved by where its input's bytes now start.

What moves: a row group's ``file_offset`` (RowGroup field 5) and its ``ordinal`` (7, renumbered,
where the writer set one: pyarrow 26 sets none);
a column chunk's ``file_offset`` (ColumnChunk 2); its data, index and dictionary page offsets and
its Bloom filter's (ColumnMetaData 9, 10, 11, 14). The Bloom filters lie among the copied bytes.
Not handled, so refused (``Unjoinable``; the caller rewrites instead): a page index (its offset
index holds absolute page offsets inside the copied bytes), encryption, column chunks in other
files, more row groups than an ordinal (i16) numbers, and inputs whose footers differ in anything
but their rows and row groups (schema, key-value metadata, version, writer, column orders: their
bytes are compared).

The Thrift compact protocol, as much as a footer needs: a struct is a list of fields ending with a
zero byte; a field's header byte holds the delta of its id from the previous field's (high nibble;
0: a zigzag varint id follows) and its type (low nibble); integers are zigzag varints, binaries a
varint length and the bytes, lists a header byte (size in the high nibble, 15: a varint size
follows) and their elements, booleans in a field's type and a byte in a list.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

MAGIC = b"PAR1"

# Compact protocol types.
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)

# Field ids (parquet.thrift).
_META_NUM_ROWS, _META_ROW_GROUPS = 3, 4
_META_SAME = (1, 2, 5, 6, 7)  #: version, schema, key-value metadata, created_by, column orders
_GROUP_COLUMNS, _GROUP_FILE_OFFSET, _GROUP_ORDINAL = 1, 5, 7
_CHUNK_FILE_PATH, _CHUNK_FILE_OFFSET, _CHUNK_META = 1, 2, 3
_CHUNK_REFUSED = {4: "a page index (offset index)", 6: "a page index (column index)",
                  8: "encryption", 9: "encryption"}
_COLUMN_OFFSETS = (9, 10, 11, 14)  #: data page, index page, dictionary page, Bloom filter
_MAX_ORDINAL = 32_767


class Unjoinable(ValueError):
    """The inputs cannot be joined by copying (module docstring); rewrite them instead."""


# --- reading ------------------------------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _skip(buf: bytes, pos: int, kind: int, in_list: bool = False) -> int:
    """The position after a value of type ``kind`` at ``pos``."""
    if kind in (_TRUE, _FALSE):
        return pos + 1 if in_list else pos
    if kind == _BYTE:
        return pos + 1
    if kind in (_I16, _I32, _I64):
        return _varint(buf, pos)[1]
    if kind == _DOUBLE:
        return pos + 8
    if kind == _BINARY:
        size, pos = _varint(buf, pos)
        return pos + size
    if kind in (_LIST, _SET):
        size, element, pos = _list_header(buf, pos)
        for _ in range(size):
            pos = _skip(buf, pos, element, in_list=True)
        return pos
    if kind == _MAP:
        size, pos = _varint(buf, pos)
        if size:
            types, pos = buf[pos], pos + 1
            for _ in range(size):
                pos = _skip(buf, _skip(buf, pos, types >> 4, True), types & 0x0F, True)
        return pos
    if kind == _STRUCT:
        return _skip_struct(buf, pos)
    raise Unjoinable(f"not a Parquet footer: Thrift type {kind} at byte {pos}")


def _list_header(buf: bytes, pos: int) -> tuple[int, int, int]:
    header, pos = buf[pos], pos + 1
    size = header >> 4
    if size == 15:
        size, pos = _varint(buf, pos)
    return size, header & 0x0F, pos


def _skip_struct(buf: bytes, pos: int) -> int:
    """The position after the struct at ``pos`` (after its stop byte)."""
    while True:
        _, kind, pos = _field_header(buf, pos, 0)
        if kind == _STOP:
            return pos
        pos = _skip(buf, pos, kind)


def _field_header(buf: bytes, pos: int, previous: int) -> tuple[int, int, int]:
    """A field's id (``previous``: the id of the field before it in its struct), its type
    (``_STOP`` at the struct's end) and the position of its value."""
    header, pos = buf[pos], pos + 1
    delta, kind = header >> 4, header & 0x0F
    if delta or not header:
        return previous + delta, kind, pos
    raw, pos = _varint(buf, pos)
    return _unzigzag(raw), kind, pos


def _int(buf: bytes, start: int) -> int:
    return _unzigzag(_varint(buf, start)[0])


# --- writing ------------------------------------------------------------------------------------
def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_int(out: bytearray, value: int) -> None:
    _put_varint(out, (value << 1) ^ (value >> 63))


def _put_field(out: bytearray, previous: int, field: int, kind: int) -> int:
    delta = field - previous
    if 0 < delta <= 15:
        out.append(delta << 4 | kind)
    else:
        out.append(kind)
        _put_int(out, field)
    return field


def _put_list(out: bytearray, size: int, element: int) -> None:
    if size < 15:
        out.append(size << 4 | element)
    else:
        out.append(0xF0 | element)
        _put_varint(out, size)


# The structs whose fields move, and what moves in each: (struct, field) -> how.
_ROW_GROUP, _COLUMN_CHUNK, _COLUMN_META = range(3)
_MOVED, _ORDINAL, _CHUNKS, _META, _REFUSED = range(5)
_HOW = {(_ROW_GROUP, _GROUP_COLUMNS): _CHUNKS, (_ROW_GROUP, _GROUP_FILE_OFFSET): _MOVED,
        (_ROW_GROUP, _GROUP_ORDINAL): _ORDINAL,
        (_COLUMN_CHUNK, _CHUNK_FILE_OFFSET): _MOVED, (_COLUMN_CHUNK, _CHUNK_META): _META,
        (_COLUMN_CHUNK, _CHUNK_FILE_PATH): _REFUSED,
        **{(_COLUMN_CHUNK, field): _REFUSED for field in _CHUNK_REFUSED},
        **{(_COLUMN_META, field): _MOVED for field in _COLUMN_OFFSETS}}


def _copy_struct(buf: bytes, pos: int, out: bytearray, struct_: int, shift: int, ordinal: int = 0) -> int:
    """Copy the struct ``struct_`` (a row group, a column chunk or its metadata) at ``pos`` to
    ``out`` in one pass, its offsets moved by ``shift`` and a row group's ordinal set; returns the
    position after it. Field ids and types do not change, so their headers are copied as they are."""
    field = 0
    while True:
        begin = pos
        field, kind, pos = _field_header(buf, pos, field)
        if kind == _STOP:
            out.append(0)
            return pos
        out += buf[begin:pos]
        how = _HOW.get((struct_, field))
        if how is None:
            end = _skip(buf, pos, kind)
            out += buf[pos:end]
            pos = end
        elif how == _REFUSED:
            raise Unjoinable("a column chunk has " + _CHUNK_REFUSED.get(field, "its data in another file"))
        elif how in (_MOVED, _ORDINAL) and kind in (_I16, _I32, _I64):
            if how == _ORDINAL and ordinal > _MAX_ORDINAL:
                raise Unjoinable(f"more than {_MAX_ORDINAL + 1} row groups: a row group's ordinal is an i16")
            raw, pos = _varint(buf, pos)
            _put_int(out, _unzigzag(raw) + shift if how == _MOVED else ordinal)
        elif how == _META and kind == _STRUCT:
            pos = _copy_struct(buf, pos, out, _COLUMN_META, shift)
        elif how == _CHUNKS and kind == _LIST:
            size, element, end = _list_header(buf, pos)
            if element != _STRUCT:
                raise Unjoinable("not a Parquet footer: a row group's columns are not structs")
            out += buf[pos:end]
            pos = end
            for _ in range(size):
                pos = _copy_struct(buf, pos, out, _COLUMN_CHUNK, shift)
        else:
            raise Unjoinable(f"not a Parquet footer: field {field} of Thrift type {kind}")


# --- files --------------------------------------------------------------------------------------
def footer(path: Path) -> tuple[bytes, int]:
    """The footer of the Parquet file at ``path`` and where it starts."""
    with open(path, "rb") as file:
        size = file.seek(0, os.SEEK_END)
        if size < 12:
            raise Unjoinable(f"{path} is too short to be a Parquet file")
        file.seek(size - 8)
        tail = file.read(8)
        length = struct.unpack("<I", tail[:4])[0]
        if tail[4:] != MAGIC or length > size - 12:
            raise Unjoinable(f"{path} does not end as a Parquet file")
        file.seek(size - 8 - length)
        return file.read(length), size - 8 - length


def join(inputs: list[Path], output: Path, stopping: Callable[[], bool] = lambda: False) -> bool:
    """Write ``output``: the row groups of ``inputs`` in order, their bytes copied. False (and no
    output) when ``stopping()`` turned true between inputs; ``Unjoinable`` (and no output) when they
    cannot be joined this way."""
    footers = [footer(path) for path in inputs]
    try:
        meta = _joined_footer(inputs, footers)
    except (IndexError, RecursionError) as exc:  # a value past the footer's end, or nesting without end
        raise Unjoinable(f"a footer of {', '.join(map(str, inputs))} is not Parquet's ({exc!r})") from exc
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write(out, MAGIC)
        for path, (_, end_of_data) in zip(inputs, footers, strict=True):
            if stopping():
                raise _Stopped
            source = os.open(path, os.O_RDONLY)
            try:
                _copy(source, out, len(MAGIC), end_of_data - len(MAGIC))
            finally:
                os.close(source)
        _write(out, meta + struct.pack("<I", len(meta)) + MAGIC)
    except BaseException as exc:
        os.close(out)
        output.unlink(missing_ok=True)
        if isinstance(exc, _Stopped):
            return False
        raise
    os.close(out)
    return True


def _joined_footer(inputs: list[Path], footers: list[tuple[bytes, int]]) -> bytes:
    """The footer of ``inputs`` joined: the first one's fields, the rows of all, and every row group
    with its offsets moved by where its file's bytes start in the joined file."""
    first: dict[int, tuple[int, bytes]] = {}
    rows, count, groups, at = 0, 0, bytearray(), len(MAGIC)
    for index, (buf, end_of_data) in enumerate(footers):
        shift = at - len(MAGIC)
        field, pos, kept = 0, 0, {}
        while True:  # FileMetaData's own fields, in one pass
            field, kind, pos = _field_header(buf, pos, field)
            if kind == _STOP:
                break
            if field == _META_ROW_GROUPS and kind == _LIST:
                size, element, pos = _list_header(buf, pos)
                if element != _STRUCT:
                    raise Unjoinable("not a Parquet footer: row groups are not structs")
                for _ in range(size):
                    pos = _copy_struct(buf, pos, groups, _ROW_GROUP, shift, count)
                    count += 1
                continue
            end = _skip(buf, pos, kind)
            if field == _META_NUM_ROWS:
                rows += _int(buf, pos)
            kept[field] = (kind, buf[pos:end])
            pos = end
        if index == 0:
            first = kept
        elif any(kept.get(field) != first.get(field) for field in _META_SAME):
            raise Unjoinable(f"{inputs[index]} differs from {inputs[0]} in its footer (schema, metadata or writer)")
        at += end_of_data - len(MAGIC)
    meta, previous = bytearray(), 0
    for field in sorted({*first, _META_ROW_GROUPS}):
        kind = first[field][0] if field in first else _LIST
        previous = _put_field(meta, previous, field, kind)
        if field == _META_NUM_ROWS:
            _put_int(meta, rows)
        elif field == _META_ROW_GROUPS:
            _put_list(meta, count, _STRUCT)
            meta += groups
        else:
            meta += first[field][1]
    meta.append(0)
    return bytes(meta)


def _write(target: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(target, view):]


def _copy(source: int, target: int, offset: int, count: int) -> None:
    """``count`` bytes of ``source`` from ``offset`` appended to ``target``, in the kernel where it can."""
    while count:
        try:
            done = os.copy_file_range(source, target, count, offset)
        except OSError:  # a filesystem or kernel without it: through user space
            data = os.pread(source, min(count, 1 << 24), offset)
            _write(target, data)
            done = len(data)
        if not done:
            raise OSError(f"copying a span file: {count} bytes short of its length")
        offset, count = offset + done, count - done


class _Stopped(Exception):
    pass
