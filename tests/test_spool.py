"""Spool directory: files dropped before and during a run are ingested exactly once; bad files are
moved to rejected/ with their reason, never retried, never blocking the others."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
from google.protobuf import json_format
from harness_collector import wait_for
from test_collector_errors import make_request

from tokentrace.wire import SPOOL_FILE_HEADER


def _drop(directory: Path, name: str, data: bytes) -> None:
    """Write under a temporary name, then rename into place (how writers should drop files)."""
    tmp = directory / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, directory / name)


def _jsonl(*requests) -> bytes:
    return b"\n".join(json.dumps(_hex_ids(json_format.MessageToDict(r))).encode() for r in requests) + b"\n"


def _hex_ids(document: dict) -> dict:
    """OTLP JSON carries ids in hex, where protobuf's JSON mapping writes base64."""
    import base64

    for resource in document["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId"):
                    span[key] = base64.b64decode(span[key]).hex()
    return document


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_spool_ingests_exactly_once_and_rejects_bad_files(collector_factory, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    _drop(spool, "before.pb", make_request(3, name="before").SerializeToString())
    _drop(spool, "before.jsonl", _jsonl(make_request(2, name="lines"), make_request(1, name="lines")))
    collector = collector_factory("--spool-dir", str(spool)).start()
    wait_for(lambda: len(_files(spool / "ingested")) == 2, 60, "the files present at start")

    _drop(spool, "during.pb", make_request(4, name="during").SerializeToString())
    _drop(spool, "corrupt.pb", b"\x0a\xff\xff\xff this is not protobuf")
    _drop(spool, "empty.json", b'{"resourceSpans": []}')
    (spool / "ignored.txt").write_text("not an OTLP file")
    wait_for(lambda: len(_files(spool / "ingested")) == 3 and len(_files(spool / "rejected")) == 4, 60,
             "the files dropped while running")
    assert _files(spool) == ["ignored.txt", "ingested", "rejected"]
    reason = (spool / "rejected" / "corrupt.pb.reason.txt").read_text()
    assert "not a valid OTLP ExportTraceServiceRequest protobuf" in reason
    assert "holds no span" in (spool / "rejected" / "empty.json.reason.txt").read_text()
    stats = collector.health()["spool"]
    assert (stats["ingested"], stats["rejected"], stats["duplicates"]) == (3, 2, 0)

    # The same bytes again (as after a crash between commit and move): recognised, not re-stored.
    shutil.copy(spool / "ingested" / "during.pb", spool / "during-again.pb")
    wait_for(lambda: collector.health()["spool"]["duplicates"] == 1, 60, "the duplicate to be recognised")
    assert collector.stop() == 0
    assert collector.sql("SELECT name, count(*) FROM spans GROUP BY name ORDER BY name") == [
        ("before", 3), ("during", 4), ("lines", 3)]

    # A restart does not ingest anything twice, and picks up what arrived while it was down.
    _drop(spool, "while-down.pb", make_request(5, name="down").SerializeToString())
    restarted = collector_factory("--spool-dir", str(spool), db=collector.db).start()
    wait_for(lambda: restarted.health()["spool"]["ingested"] == 1, 60, "the file dropped while down")
    assert restarted.stop() == 0
    assert restarted.sql("SELECT count(*) FROM spans") == [(15,)]
    assert restarted.sql("SELECT count(*) FROM spool_files") == [(4,)]


def test_a_spool_file_resent_over_http_is_stored_once(collector_factory, tmp_path):
    """The engine shim resends spool files with their name (wire.SPOOL_FILE_HEADER): the same
    bytes posted again (an acknowledgement lost on the way back) or also dropped into the watched
    directory are stored once. Without the header a body sent twice is stored once too (its spans
    are known: collector/stores/once.py)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    collector = collector_factory("--spool-dir", str(spool)).start()
    url, protobuf = collector.url + "/v1/traces", {"Content-Type": "application/x-protobuf"}
    data = make_request(3, name="resent").SerializeToString()
    headers = {**protobuf, SPOOL_FILE_HEADER: "0001-engine-1-000001.pb"}
    for _ in range(2):
        assert httpx.post(url, content=data, headers=headers, timeout=30).status_code == 200
    _drop(spool, "0001-engine-1-000001.pb", data)  # the collector watching that directory finds it too
    wait_for(lambda: collector.health()["spool"]["duplicates"] == 1, 60, "the dropped copy to be recognised")

    plain = make_request(2, name="plain").SerializeToString()
    for _ in range(2):
        assert httpx.post(url, content=plain, headers=protobuf, timeout=30).status_code == 200
    refused = httpx.post(url, content=plain, headers={**protobuf, SPOOL_FILE_HEADER: "../etc/passwd"}, timeout=30)
    assert refused.status_code == 400 and SPOOL_FILE_HEADER in refused.text
    assert collector.health()["rejected"]["malformed"] == 1
    assert collector.stop() == 0
    assert collector.sql("SELECT name, count(*) FROM spans GROUP BY name ORDER BY name") == [
        ("plain", 2), ("resent", 3)]
    assert collector.sql("SELECT name, spans FROM spool_files") == [("0001-engine-1-000001.pb", 3)]
