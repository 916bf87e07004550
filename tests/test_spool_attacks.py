"""A spool directory no file can jam (issue 11 item 4). Each case of the attack table stopped spool
ingest for good on the old code; here each is followed by a valid canary file that must be ingested,
and the collector's peak RSS (VmHWM) must stay far below what reading the attack would cost. Links
and sub-folders must make the collector neither read nor write outside the spool directory."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from harness_collector import free_port, proc_status, wait_for
from test_collector_errors import make_request
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

GIB = 1 << 30
#: Peak RSS a collector may reach in these tests: reading a 1 GiB attack file would pass it.
PEAK_RSS_BYTES = 700 << 20


def _valid(name: str) -> bytes:
    return make_request(2, name=name).SerializeToString()


def _drop(directory: Path, name: str | bytes, data: bytes) -> None:
    """Write under a temporary name, then rename into place."""
    tmp = os.path.join(os.fsencode(directory), b".drop.tmp")
    Path(os.fsdecode(tmp)).write_bytes(data)
    os.replace(tmp, os.path.join(os.fsencode(directory), os.fsencode(name)))


class _Accesses(FileSystemEventHandler):
    """Every open of a file in a directory outside the spool (inotify), to prove none is read."""

    def __init__(self):
        self.events: list[str] = []

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write", "closed", "modified", "created", "moved", "deleted"):
            self.events.append(f"{event.event_type} {event.src_path}")


# --- the attack table: (id, what to put in the spool directory before start, check afterwards) --------
def _long_name(spool: Path, outside: Path) -> Callable:
    name = "x" * 248 + ".pb"  # 252 bytes: "NAME.reason.txt" would be 263, over NAME_MAX
    _drop(spool, name, b"\x0a\xff\xff not protobuf")

    def check() -> None:
        reasons = [p for p in (spool / "rejected").iterdir() if p.name.endswith(".reason.txt")]
        assert len(reasons) == 1 and "not a valid OTLP" in reasons[0].read_text()
        assert len(reasons[0].name.encode()) <= 255
    return check


def _not_utf8(spool: Path, outside: Path) -> Callable:
    _drop(spool, b"latin1-\xe9t\xe9.pb", _valid("latin1"))
    return lambda: None  # ingested: checked by the span names below


def _fifo(spool: Path, outside: Path) -> Callable:
    os.mkfifo(spool / "pipe.pb")
    return lambda: None


def _dev_zero(spool: Path, outside: Path) -> Callable:
    os.symlink("/dev/zero", spool / "zero.pb")
    return lambda: None


def _sparse(spool: Path, outside: Path) -> Callable:
    with open(spool / ".sparse.tmp", "wb") as handle:
        handle.truncate(GIB)
    os.replace(spool / ".sparse.tmp", spool / "sparse.pb")

    def check() -> None:
        reason = next((spool / "rejected").glob("sparse.pb.reason.txt")).read_text()
        assert "over the limit" in reason
    return check


def _link_outside(spool: Path, outside: Path) -> Callable:
    target, data = outside / "secret.pb", _valid("outside")
    target.write_bytes(data)
    os.symlink(target, spool / "secret.pb")

    def check() -> None:
        assert target.read_bytes() == data  # still there, unchanged
        assert (spool / "rejected" / "secret.pb").is_symlink()
    return check


ATTACKS = [
    ("name of 252 bytes", _long_name),
    ("name not UTF-8", _not_utf8),
    ("FIFO named .pb", _fifo),
    ("link to /dev/zero", _dev_zero),
    ("sparse file of 1 GiB", _sparse),
    ("link to a file outside", _link_outside),
]


@pytest.mark.parametrize("make", [make for _, make in ATTACKS], ids=[caption for caption, _ in ATTACKS])
def test_an_attack_file_never_stops_spool_ingest(collector_factory, tmp_path, make):
    spool, outside = tmp_path / "spool", tmp_path / "outside"
    spool.mkdir()
    outside.mkdir()
    check = make(spool, outside)
    accesses, observer = _Accesses(), Observer()
    observer.schedule(accesses, str(outside), recursive=True)
    observer.start()
    try:
        collector = collector_factory("--spool-dir", str(spool)).start()
        _drop(spool, "canary.pb", _valid("canary"))
        wait_for(lambda: (spool / "ingested" / "canary.pb").exists(), 60, "the canary file to be ingested")
        peak = proc_status(collector.proc.pid, "VmHWM")
        assert collector.stop() == 0
    finally:
        observer.stop()
        observer.join(5)
    assert peak < PEAK_RSS_BYTES, f"peak RSS {peak >> 20} MiB: the attack file was read"
    names = dict(collector.sql("SELECT name, count(*) FROM spans GROUP BY name"))
    assert names.pop("canary") == 2
    assert names == ({"latin1": 2} if make is _not_utf8 else {})  # nothing from outside
    assert accesses.events == [], "the collector touched a file outside the spool directory"
    check()


def test_a_file_still_being_written_at_start_waits_until_it_is_complete(collector_factory, tmp_path):
    """docs/collector.md: a file written in place is picked up when it is closed; the old code read
    it at start, rejected it as truncated and never looked again."""
    spool = tmp_path / "spool"
    spool.mkdir()
    data = _valid("slow-writer")
    writer = open(spool / "growing.pb", "wb")  # noqa: SIM115 - held open across the start
    writer.write(data[: len(data) // 2])
    writer.flush()
    done = threading.Event()
    # The writer keeps writing (its file keeps changing) until a canary dropped after start is in.
    keep_touching = threading.Thread(target=lambda: [os.utime(spool / "growing.pb") for _ in iter(
        lambda: done.wait(0.1), True)])
    keep_touching.start()
    try:
        collector = collector_factory("--spool-dir", str(spool)).start()
        _drop(spool, "canary.pb", _valid("canary"))
        wait_for(lambda: (spool / "ingested" / "canary.pb").exists(), 60, "the canary file to be ingested")
        done.set()
        keep_touching.join(10)
        assert not list((spool / "rejected").iterdir()), "a file still being written was rejected"
        writer.write(data[len(data) // 2:])
    finally:
        done.set()
        writer.close()
    wait_for(lambda: (spool / "ingested" / "growing.pb").exists(), 60, "the completed file to be ingested")
    assert collector.stop() == 0
    assert dict(collector.sql("SELECT name, count(*) FROM spans GROUP BY name")) == {"canary": 2, "slow-writer": 2}


@pytest.mark.parametrize("folder", ["rejected", "ingested"])
@pytest.mark.parametrize("kind", ["link to a directory outside", "regular file"])
def test_sub_folders_must_be_real_directories_inside_the_spool(tmp_path, folder, kind):
    """A linked rejected/ or ingested/ made the collector write outside the spool directory: it
    refuses to start, in one line, and writes nothing anywhere."""
    spool, outside = tmp_path / "spool", tmp_path / "outside"
    spool.mkdir()
    outside.mkdir()
    if kind == "regular file":
        (spool / folder).write_text("not a folder")
    else:
        os.symlink(outside, spool / folder)
    _drop(spool, "corrupt.pb", b"\x0a\xff\xff not protobuf")
    _drop(spool, "good.pb", _valid("good"))
    db = tmp_path / "store.duckdb"
    result = subprocess.run(
        [sys.executable, "-m", "tokentrace", "collector", "--db", str(db), "--port", str(free_port()),
         "--spool-dir", str(spool)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{folder} must be a directory inside the spool directory" in lines[0], result.stderr
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in spool.iterdir()) == sorted(["corrupt.pb", "good.pb", folder])
    assert not db.exists()

