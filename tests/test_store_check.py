"""``tokentrace store check|repair`` (issue 45 item 2): a real collector writes a real store, it is
stopped, the store is damaged on disk the way a disk or an operator damages it, and then ``check``
names exactly what is damaged (and changes nothing), ``repair`` sets it aside in the collector's own
quarantine and says what is lost, ``check`` is then clean, and a collector started afterwards serves
everything intact.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_collector_errors import make_request
from test_store_damage import FILE_SPANS, SPANS, _damage, _merged_then_killed, _three_span_files

from tokentrace.collector.stores import journal
from tokentrace.collector.stores.journal import Log


def _store(action: str, db: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``tokentrace store ACTION --db DB`` as a user would."""
    return subprocess.run([sys.executable, "-m", "tokentrace", "store", action, "--db", str(db), *args],
                          capture_output=True, text=True, timeout=300)


def _check_json(db: Path) -> tuple[int, dict]:
    result = _store("check", db, "--json")
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def _snapshot(db: Path) -> dict[str, tuple[int, int, str]]:
    """Every file of the store (its file and the folders beside it): size, mtime, SHA-256."""
    found = {}
    for path in sorted(db.parent.iterdir()):
        if not path.name.startswith(db.name):
            continue
        for item in [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]:
            if item.is_file():
                found[str(item)] = (item.stat().st_size, item.stat().st_mtime_ns,
                                    hashlib.sha256(item.read_bytes()).hexdigest())
            else:
                found[str(item)] = (0, item.stat().st_mtime_ns, "dir")
    return found


def _damage_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("damage: ")]


def _checked_clean(db: Path) -> None:
    """``check`` exits 0 with nothing to say, not even a note."""
    result = _store("check", db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].startswith(f"store {db}: clean, 0 notes"), result.stdout
    assert len(result.stdout.splitlines()) == 1, result.stdout


def _losses(db: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(str(db) + ".quarantine") / "losses.jsonl").read_text().splitlines()]


def _served(collector_factory, db: Path) -> dict[str, int]:
    """Spans by name that a collector started on the store serves (counted once it stopped)."""
    collector = collector_factory(db=db).start()
    health = collector.health()
    assert health["status"] == "ok", health["problems"]
    assert collector.stop() == 0
    return dict(collector.sql("SELECT name, count(*) FROM spans GROUP BY name"))


# --- the journal ------------------------------------------------------------------------------------
def _journal(db: Path, seqs) -> Path:
    """Journal acknowledged protobuf batches ``batchSEQ`` in one file, as one collector run lays
    them out (store_duckdb._record); the file."""
    log_file = Log(Path(str(db) + ".journal"))
    for seq in seqs:
        body = make_request(SPANS, name=f"batch{seq}").SerializeToString()
        head = json.dumps({"spool": None, "parts": [["protobuf", 65536, len(body)]]}).encode()
        log_file.append(seq, [struct.pack("<I", len(head)), head, body])
    log_file.close(merged_all=False)
    return log_file.folder / f"{min(seqs):020d}.log"


def _records(path: Path) -> dict[int, tuple[int, int]]:
    """Byte range of each record of a journal file."""
    return {seq: (at, end) for kind, at, end, seq in journal._scan(path.read_bytes()) if kind == "record"}


def test_a_flipped_byte_in_a_journal_record_in_the_middle_is_named_quarantined_and_the_rest_appended(
        collector_factory):
    first, _ = _merged_then_killed(collector_factory)  # record 1 ("old") merged
    segment = _journal(first.db, range(2, 8))  # records 2-7: acknowledged, not merged
    start, end = _records(segment)[4]
    data = bytearray(segment.read_bytes())
    data[(start + end) // 2] ^= 0x10
    segment.write_bytes(bytes(data))
    before = _snapshot(first.db)

    result = _store("check", first.db)
    assert result.returncode == 1, result.stdout + result.stderr
    assert _damage_lines(result) == [f"damage: {segment} (bytes {start}-{end}, record 4): a record whose checksum "
                                     f"fails; acknowledged batches not in the tables are lost"]
    assert f"note: {segment.parent} (records 2-3, 5-7): acknowledged, not yet in the tables" in result.stdout
    assert "1 damaged" in result.stdout.splitlines()[-1]
    assert _snapshot(first.db) == before, "check changed the store"
    code, report = _check_json(first.db)
    [damage] = [finding for finding in report["findings"] if finding["damage"]]
    assert code == 1 and report["clean"] is False
    assert (damage["journal_file"], damage["byte_range"], damage["first_seq"], damage["last_seq"]) == \
        (str(segment), [start, end], 4, 4)

    repaired = _store("repair", first.db)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    [entry] = _losses(first.db)
    assert entry["kind"] == "damaged journal bytes" and (entry["first_seq"], entry["last_seq"]) == (4, 4)
    assert entry["acknowledged_batches_lost"] is True and entry["byte_range"] == [start, end]
    assert Path(entry["file"]).read_bytes() == bytes(data[start:end])
    assert "lost: acknowledged journal record 4 (never in the tables)" in repaired.stdout
    assert "appended: journal records 2-3, 5-7 (5 acknowledged batches) to the tables" in repaired.stdout
    assert repaired.stdout.splitlines()[-1].endswith("check now: clean")
    _checked_clean(first.db)
    assert _served(collector_factory, first.db) == {"old": 1000, **{f"batch{seq}": SPANS for seq in (2, 3, 5, 6, 7)}}


def test_a_journal_file_cut_at_a_record_boundary_is_named_with_the_records_lost(collector_factory):
    first, _ = _merged_then_killed(collector_factory)
    segment = _journal(first.db, range(2, 7))  # records 2-6 in one file ...
    later = _journal(first.db, [7])  # ... and 7 in the next (a later run)
    with open(segment, "r+b") as handle:  # cut after record 4: 5 and 6 are gone
        handle.truncate(_records(segment)[4][1])

    result = _store("check", first.db)
    assert result.returncode == 1, result.stdout + result.stderr
    assert _damage_lines(result) == [f"damage: {later} (records 5-6): journal records missing between {segment.name} "
                                     f"and this file (a file deleted or cut short); acknowledged batches not in the "
                                     f"tables are lost"]

    repaired = _store("repair", first.db)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    [entry] = _losses(first.db)
    assert entry["kind"] == "missing journal records" and (entry["first_seq"], entry["last_seq"]) == (5, 6)
    assert "lost: acknowledged journal records 5-6 (never in the tables)" in repaired.stdout
    assert "appended: journal records 2-4, 7 (4 acknowledged batches)" in repaired.stdout
    _checked_clean(first.db)
    assert _served(collector_factory, first.db) == {"old": 1000, **{f"batch{seq}": SPANS for seq in (2, 3, 4, 7)}}


# --- span files ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["flipped byte in a data page", "flipped byte in the footer",
                                 "flipped byte in the footer's statistics", "truncated", "deleted"])
def test_a_damaged_span_file_is_named_quarantined_with_its_spans_and_time_range(collector_factory, how):
    first, files = _three_span_files(collector_factory)
    _damage(files[1], how)
    before = _snapshot(first.db)

    result = _store("check", first.db)
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = _damage_lines(result)
    assert line.startswith(f"damage: {files[1]}: ") and f"it holds {FILE_SPANS} spans that started from 20" in line
    assert _snapshot(first.db) == before, "check changed the store"

    repaired = _store("repair", first.db)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    [entry] = _losses(first.db)
    assert entry["kind"] == "damaged span file" and entry["span_file"] == files[1].name
    assert entry["acknowledged_spans_lost"] == FILE_SPANS
    assert f"lost: {FILE_SPANS} spans that started from {entry['start_range_utc'][0]} to " \
           f"{entry['start_range_utc'][1]} (span file {files[1].name})" in repaired.stdout
    if how != "deleted":
        assert Path(entry["file"]).exists() and not files[1].exists(), "the file is kept in the quarantine"
    _checked_clean(first.db)
    assert _served(collector_factory, first.db) == {"b1": FILE_SPANS, "b3": FILE_SPANS}


def test_a_span_file_nothing_lists_is_a_note_and_repair_deletes_it(collector_factory):
    first, files = _three_span_files(collector_factory)
    extra = files[0].with_name("999999999999.parquet")
    shutil.copyfile(files[0], extra)

    result = _store("check", first.db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[:-1] == [f"note: {extra}: not listed by the store, which does not read it "
                                               f"(written by a merge whose transaction did not commit, or a "
                                               f"compaction's input): the next open deletes it"]
    repaired = _store("repair", first.db)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert f"deleted: {extra}: not listed by the store" in repaired.stdout and "lost: nothing" in repaired.stdout
    assert not extra.exists()
    _checked_clean(first.db)
    assert _served(collector_factory, first.db) == {f"b{n}": FILE_SPANS for n in (1, 2, 3)}


# --- a clean store, a held store, no store ------------------------------------------------------------
def test_check_of_a_clean_store_exits_0_and_changes_nothing(collector_factory):
    first, _ = _three_span_files(collector_factory)
    before = _snapshot(first.db)
    _checked_clean(first.db)
    code, report = _check_json(first.db)
    assert code == 0 and report["clean"] is True and report["findings"] == []
    assert report["span_files"] == 3 and report["tables"] > 10
    repaired = _store("repair", first.db)
    assert repaired.returncode == 0 and repaired.stdout.endswith(f"store {first.db}: clean, nothing to repair\n")
    assert _snapshot(first.db) == before, "check or a repair with nothing to do changed the store"


def test_a_store_held_by_a_running_collector_is_refused_in_one_line(collector_factory):
    collector = collector_factory().start()
    assert collector.post(make_request(10).SerializeToString(), "application/x-protobuf").status_code == 200
    for action in ("check", "repair"):
        result = _store(action, collector.db)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr == (f"tokentrace store: error: the store {collector.db} is held open by a running "
                                 f"collector (its file is locked): stop the collector first\n")
    assert collector.health()["status"] == "ok"


def test_a_missing_store_is_refused_in_one_line(tmp_path):
    result = _store("check", tmp_path / "none.duckdb")
    assert result.returncode == 2
    assert result.stderr == f"tokentrace store: error: no store file at {tmp_path / 'none.duckdb'}\n"
    assert not (tmp_path / "none.duckdb").exists()
