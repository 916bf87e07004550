"""Checking and repairing a stopped collector's DuckDB store (issue 45): ``tokentrace store check``
and ``tokentrace store repair``, this store's pg_amcheck.

``check`` reads everything and changes nothing (the store file is attached read-only, which also
keeps a collector from opening it meanwhile): every journal record (checksum, consecutive sequence
numbers, the batches acknowledged and not yet in the tables, each decoded as an open would), every
listed span file (present, its size, its whole-file checksum where ``span_files`` lists one, its
footer, its rows, every page's checksum, the time range its spans started in), the span files
against the store's lists (``span_files``, the view ``spans``), and every table read in full
(DuckDB verifies each block's checksum as it reads it). A finding is damage (the store is not what
was written) or a note (what the next open of a collector does by itself: append acknowledged
batches, cut a record torn by a crash, delete a file nothing lists).

``repair`` is the collector's own open (``DuckDBStore``: the quarantine of damaged journal bytes,
missing records and damaged span files, collector/stores/quarantine.py, with the same ``losses.jsonl``
lines; the intact records after a damaged one appended; unlisted files deleted) and close (every
acknowledged batch merged, the store checkpointed), with span files also checked against their
time range, then ``check`` again: it says what was set aside, what is lost and what could not be
repaired.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tokentrace.errors import ConfigError, PayloadError, StoreError

log = logging.getLogger("tokentrace.collector")


@dataclass
class Finding:
    """One thing ``check`` found: ``damage`` (else a note) of a ``kind`` in ``file`` (``part``: its
    byte range, records), ``what`` is wrong, and ``facts`` for ``--json``."""

    damage: bool
    kind: str  #: journal bytes, journal records, journal record, unmerged records, torn record, spill file,
    #: span file, span files, unlisted span file, view, table, store file, wal
    file: str
    what: str
    part: str | None = None
    facts: dict = field(default_factory=dict)

    def line(self) -> str:
        """The finding as one line of text."""
        where = self.file if self.part is None else f"{self.file} ({self.part})"
        return f"{'damage' if self.damage else 'note'}: {where}: {self.what}"

    def as_dict(self) -> dict:
        """The finding for ``--json``."""
        return {"damage": self.damage, "kind": self.kind, "file": self.file, "part": self.part, "what": self.what,
                **self.facts}


@dataclass
class Report:
    """What ``check`` found in one store, and what it read."""

    store: str
    findings: list[Finding] = field(default_factory=list)
    merged_seq: int = 0  #: the last journal record in the tables
    unmerged: list[int] = field(default_factory=list)  #: acknowledged records not in the tables yet
    span_files: int = 0  #: listed
    #: listed before 020_span_file_checksums.sql: no whole-file checksum, their pages are checked
    span_files_unsummed: int = 0
    tables: int = 0  #: read in full
    quarantined: int = 0  #: entries of losses.jsonl

    @property
    def clean(self) -> bool:
        """No damage (notes are what the next open does by itself)."""
        return not any(finding.damage for finding in self.findings)

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)

    def damage(self, kind: str, file: str | Path, what: str, part: str | None = None, **facts) -> None:
        """Record damage: the store is not what was written."""
        self.add(Finding(True, kind, str(file), _one_line(what), part, facts))

    def note(self, kind: str, file: str | Path, what: str, part: str | None = None, **facts) -> None:
        """Record a note: what the next open of a collector does by itself."""
        self.add(Finding(False, kind, str(file), _one_line(what), part, facts))

    def summary(self) -> str:
        """The last line of ``check``."""
        damaged = sum(finding.damage for finding in self.findings)
        notes = len(self.findings) - damaged
        state = "clean" if not damaged else f"{damaged} damaged"
        unsummed = f" ({self.span_files_unsummed} listed before whole-file checksums: their pages checked)" \
            if self.span_files_unsummed else ""
        return (f"store {self.store}: {state}, {notes} note{'s' * (notes != 1)} (journal merged through record "
                f"{self.merged_seq}, {len(self.unmerged)} acknowledged records to append; {self.span_files} span "
                f"files{unsummed}; {self.tables} tables read in full; {self.quarantined} entries in the quarantine)")

    def as_dict(self) -> dict:
        """The report for ``--json``."""
        return {"store": self.store, "clean": self.clean, "damaged": sum(f.damage for f in self.findings),
                "findings": [finding.as_dict() for finding in self.findings], "merged_seq": self.merged_seq,
                "unmerged_records": _ranges(self.unmerged), "span_files": self.span_files,
                "span_files_without_checksum": self.span_files_unsummed, "tables": self.tables,
                "quarantined": self.quarantined}


# --- check ------------------------------------------------------------------------------------------
def check(path: str) -> Report:
    """Check the store at ``path`` without changing anything (module docstring). ConfigError for a
    missing store, one a collector holds, or one of another version."""
    from tokentrace.collector.stores import store_duckdb

    if not Path(path).is_file():
        raise ConfigError(f"no store file at {path}")
    report = Report(path, quarantined=len(losses(path)))
    con = _attach(path, report)
    if con is None:
        return report
    try:  # held read-only to the end: no collector opens the store meanwhile
        try:  # the store's bookkeeping: without it nothing else can be checked
            _versions(con, path)
            store_duckdb.check_columns(con, path)
            [(merged, journaled)] = con.execute("SELECT merged_seq, journaled_seq FROM journal_state").fetchall()
            listed = store_duckdb.listed_span_files(con)
            viewed = store_duckdb.spans_view_paths(con)
        except store_duckdb.duckdb.Error as exc:
            report.damage("store file", path, f"its own bookkeeping does not read back: {exc}; this tool does not "
                                              f"write to a DuckDB file whose blocks fail their checksums")
            return report
        _check_tables(con, report)
        report.merged_seq = merged
        _check_journal(path, merged, journaled, report)
        _check_span_files(path, listed, viewed, report)
    finally:
        con.close()
    if Path(path + ".wal").exists():
        report.note("wal", path + ".wal", "DuckDB's write-ahead log of a collector that did not stop cleanly: the "
                                          "next open replays it")
    return report


def _attach(path: str, report: Report):
    """The store attached read-only; None, with the damage in ``report``, when the file does not
    open as a DuckDB file; ConfigError when a collector holds it."""
    from tokentrace.collector.stores import store_duckdb

    try:
        return store_duckdb._attach(path, read_only=True)
    except store_duckdb.duckdb.Error as exc:
        if "lock" in str(exc).lower():
            raise ConfigError(f"the store {path} is held open by a running collector (its file is locked): stop "
                              f"the collector first") from None
        report.damage("store file", path, f"it does not open as a DuckDB file: {exc}; this tool can neither read "
                                          f"nor repair it")
        return None


def _versions(con, path: str) -> None:
    """ConfigError unless the store has exactly this version's migrations (a collector's open
    applies the missing ones)."""
    from tokentrace.collector.stores import sqlfiles

    expected = {version for version, _, _ in sqlfiles.migrations("duckdb")}
    applied = {row[0] for row in con.execute("SELECT version FROM schema_migrations").fetchall()}
    if applied - expected:
        raise ConfigError(f"the store {path} was written by a newer version (migrations {sorted(applied - expected)})")
    if expected - applied:
        raise ConfigError(f"the store {path} was written by an earlier version: start a collector on it once (it "
                          f"applies migrations {sorted(expected - applied)}), then check it")


def _check_tables(con, report: Report) -> None:
    """Read every column of every table (DuckDB verifies each block's checksum as it loads it)."""
    columns: dict[str, list[str]] = {}
    for table, name in con.execute(
        "SELECT c.table_name, c.column_name FROM duckdb_columns() c JOIN duckdb_tables() t "
        "ON t.database_name = c.database_name AND t.schema_name = c.schema_name AND t.table_name = c.table_name "
        "WHERE c.database_name = current_database() AND c.schema_name = 'main' ORDER BY c.table_name, c.column_index"
    ).fetchall():
        columns.setdefault(table, []).append('"' + name.replace('"', '""') + '"')
    for table, names in columns.items():
        try:
            con.execute(f'SELECT count(*), bit_xor(hash({", ".join(names)})) FROM "{table}"').fetchall()
        except Exception as exc:  # whatever DuckDB says of a block that does not read back is the reason
            report.damage("table", report.store, f"it does not read back: {exc}; merged rows cannot be rebuilt from "
                                                 f"the journal", part=f"table {table}", table=table)
        report.tables += 1


def _check_journal(path: str, merged: int, journaled: int, report: Report) -> None:
    """Every journal record read back as a collector's open reads it (``Log.records_after``, then
    each acknowledged batch not in the tables decoded), changing nothing."""
    from tokentrace.collector.stores import store_duckdb
    from tokentrace.collector.stores.journal import Log

    store_duckdb._libraries()
    log_file = Log(Path(path + ".journal"), read_only=True)
    for seq, data in log_file.records_after(merged, lambda damage: report.add(_journal_damage(damage, merged)),
                                            expected=journaled):
        try:
            store_duckdb._read_record(data)
        except PayloadError as exc:
            report.damage("journal record", log_file.folder, f"an acknowledged batch the store cannot take: {exc}",
                          part=f"record {seq}", seq=seq, acknowledged_batches_lost=True)
            continue
        report.unmerged.append(seq)
    if report.unmerged:
        numbers = _ranges(report.unmerged)
        report.note("unmerged records", log_file.folder, "acknowledged, not yet in the tables: the next open "
                                                          "appends them", part=f"records {numbers}",
                    unmerged_records=numbers)
    for file, start, end in log_file.torn:
        report.note("torn record", file, "a record cut short by a crash while writing it (never acknowledged): "
                                          "the next open cuts it", part=f"bytes {start}-{end}", byte_range=[start, end])
    for spill in log_file.spills():
        report.note("spill file", spill, "columns a stopped collector spilled (its journal holds them): the next "
                                         "open deletes the file")


def _journal_damage(damage, merged: int) -> Finding:
    """A finding of bytes of the journal that do not read back, or records missing from it."""
    from tokentrace.collector.stores.store_duckdb import journal_loss

    lost = journal_loss(damage, merged)
    part = [f"bytes {damage.start}-{damage.end}"] if damage.end > damage.start >= 0 else []
    if damage.first_seq is not None:
        last = "?" if damage.last_seq is None else damage.last_seq
        part.append(f"record {last}" if damage.first_seq == last else f"records {damage.first_seq}-{last}")
    what = damage.why + ("; acknowledged batches not in the tables are lost" if lost
                         else "; these records were already in the tables: nothing is lost")
    facts = {"journal_file": str(damage.path), "first_seq": damage.first_seq, "last_seq": damage.last_seq,
             "acknowledged_batches_lost": lost}
    if damage.end > damage.start >= 0:
        facts["byte_range"] = [damage.start, damage.end]
    kind = "journal bytes" if damage.end > damage.start >= 0 else "journal records"
    return Finding(True, kind, str(damage.path), _one_line(what), ", ".join(part) or None, facts)


def _check_span_files(path: str, listed: list, viewed: set[str], report: Report) -> None:
    """Every span file the store lists (``listed``) read back in full, and the files in its folder
    and those the view ``spans`` reads (``viewed``) against them."""
    from tokentrace.collector.stores import store_duckdb
    from tokentrace.collector.stores.span_files import SpanFiles

    report.span_files = len(listed)
    report.span_files_unsummed = sum(f.crc32 is None for f in listed)
    files = SpanFiles(Path(path + ".spans"), listed, swap=None)
    try:
        files.check()
    except StoreError as exc:
        report.damage("span files", files.folder, f"{exc}; repair refuses such a store")
    for bad, why in files.damaged(full=True, ranges=True):
        started = [store_duckdb._utc(bad.min_start_ns), store_duckdb._utc(bad.max_start_ns)]
        held = f"it holds {bad.spans} spans that started from {started[0]} to {started[1]}"
        report.damage("span file", files.folder / bad.name, f"{_one_line(why)}; {held}",
                      span_file=bad.name, spans=bad.spans, min_start_ns=bad.min_start_ns,
                      max_start_ns=bad.max_start_ns, start_range_utc=started)
    for extra in files.unlisted():
        report.note("unlisted span file", extra, "not listed by the store, which does not read it (written by a "
                                                 "merge whose transaction did not commit, or a compaction's input): "
                                                 "the next open deletes it")
    names = {Path(p).name for p in viewed}
    unlisted, unread = names - {f.name for f in listed}, {f.name for f in listed} - names
    if unlisted or unread:
        report.damage("view", path, f"the view spans reads span files the store does not list ({sorted(unlisted)}) "
                                    f"or not those it lists ({sorted(unread)})", part="view spans")
    elif viewed != {str(files.folder / f.name) for f in listed}:
        report.note("view", path, f"the view spans reads the span files where the store was before it was moved, "
                                  f"not in {files.folder}: the next open points it there", part="view spans")


# --- repair -----------------------------------------------------------------------------------------
@dataclass
class Repair:
    """What ``repair`` found, set aside and appended, and what ``check`` finds after it."""

    before: Report
    quarantined: list[dict]  #: the lines it added to losses.jsonl
    after: Report
    opened: bool = True  #: the store was opened for writing (not when clean, nor when DuckDB's file is damaged)

    @property
    def clean(self) -> bool:
        return self.after.clean

    def lines(self) -> list[str]:
        """What was done, what is lost and what could not be repaired, one line each, then the summary."""
        out = [f"found: {finding.line()}" for finding in self.before.findings]
        if not self.opened:
            out += [f"not repaired: {finding.line()}" for finding in self.before.findings if finding.damage]
            state = "clean, nothing to repair" if self.before.clean else \
                "not repaired: DuckDB's own file does not read back, and repair writes nothing to such a file"
            return [*out, f"store {self.before.store}: {state}"]
        out += [f"quarantined: {_loss_line(entry)}" for entry in self.quarantined]
        appended = [seq for seq in self.before.unmerged if seq not in self.after.unmerged]
        if appended:
            out.append(f"appended: journal records {_ranges(appended)} ({len(appended)} acknowledged batches) to "
                       f"the tables")
        out += [f"deleted: {f.file}: not listed by the store" for f in self.before.findings
                if f.kind == "unlisted span file"]
        out.append(f"lost: {self.lost() or 'nothing'}")
        out += [f"not repaired: {finding.line()}" for finding in self.after.findings]
        state = "clean" if not self.after.findings else \
            f"{len(self.after.findings)} findings remain ({sum(f.damage for f in self.after.findings)} damaged)"
        out.append(f"store {self.before.store}: repaired, {len(self.quarantined)} quarantined, {len(appended)} "
                   f"journal records appended; check now: {state}")
        return out

    def lost(self) -> str:
        """What the quarantined entries lost, in one phrase (empty: nothing)."""
        spans = [entry for entry in self.quarantined if entry.get("acknowledged_spans_lost")]
        records = [entry for entry in self.quarantined if entry.get("acknowledged_batches_lost")]
        parts = [f"{entry['spans']} spans that started from {entry['start_range_utc'][0]} to "
                 f"{entry['start_range_utc'][1]} (span file {entry['span_file']})" for entry in spans]
        parts += [f"acknowledged journal record{_records(entry)} (never in the tables)" for entry in records]
        return "; ".join(parts)

    def as_dict(self) -> dict:
        """The repair for ``--json``."""
        return {"store": self.before.store, "before": self.before.as_dict(), "quarantined": self.quarantined,
                "appended_records": _ranges([s for s in self.before.unmerged if s not in self.after.unmerged]),
                "lost": self.lost() or None, "after": self.after.as_dict(), "clean": self.clean, "opened": self.opened}


def repair(path: str) -> Repair:
    """Check the store, open and close it as a collector does (with span files checked against their
    time range too), and check it again (module docstring). Nothing is changed when ``check`` finds
    nothing."""
    from tokentrace.collector.stores.store_duckdb import DuckDBStore

    before = check(path)
    if not before.findings or any(finding.kind in ("store file", "table") for finding in before.findings):
        return Repair(before, [], before, opened=False)  # nothing to do, or DuckDB's own file is damaged
    if any(finding.kind == "span files" for finding in before.findings):
        raise ConfigError(f"every span file the store {path} lists is missing from {path}.spans: copy the folder "
                          f"back (a store is its file and the folders beside it); repair would delist them all")
    known = len(losses(path))
    store = DuckDBStore(path, thorough=True)  # the collector's open: what does not read back is quarantined
    store.close()  # every acknowledged batch merged, the journal deleted, the store checkpointed
    return Repair(before, losses(path)[known:], check(path))


def losses(path: str) -> list[dict]:
    """The entries of the store's ``losses.jsonl`` (collector/stores/quarantine.py), oldest first."""
    from tokentrace.collector.stores.quarantine import Quarantine

    return Quarantine(Path(path + ".quarantine")).entries()


def _loss_line(entry: dict) -> str:
    """One quarantine entry as a line: what, where it is now, why, what it held."""
    what = entry.get("span_file") or entry.get("journal_file") or ""
    if "byte_range" in entry:
        what += f" bytes {entry['byte_range'][0]}-{entry['byte_range'][1]}"
    if entry.get("first_seq") is not None or entry.get("seq") is not None:
        what += f" (record{_records(entry)})"
    kept = f", kept as {entry['file']}" if entry.get("file") else ""
    if entry.get("acknowledged_spans_lost"):
        held = f"{entry['spans']} spans lost"
    elif entry.get("acknowledged_batches_lost"):
        held = "acknowledged batches lost"
    else:
        held = "nothing lost (already in the tables)"
    return f"{entry['kind']} {what.strip()}{kept}: {_one_line(str(entry.get('why')))}; {held}"


def _records(entry: dict) -> str:
    """' N' or 's N-M' for the journal records a quarantine entry names."""
    if entry.get("seq") is not None:
        return f" {entry['seq']}"
    first, last = entry.get("first_seq"), entry.get("last_seq")
    return f" {first}" if first == last else f"s {first}-{'?' if last is None else last}"


def _one_line(text: str) -> str:
    """``text`` with its runs of white space (a library's multi-line message) as one space."""
    return " ".join(text.split())


def _ranges(numbers: list[int]) -> str:
    """Sequence numbers as ranges: ``2-3, 5-7``."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def dumps(result: Report | Repair) -> str:
    """``--json``: one object."""
    return json.dumps(result.as_dict(), indent=2, sort_keys=True)
