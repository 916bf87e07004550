"""Issue 11 item 7: safe defaults on the network, and a collector that tells the truth about its disk.

The full-disk cases use a real full file system: a small tmpfs mounted for the test (needs root, as
in CI's container; skipped with the reason otherwise)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, free_port, wait_for
from test_collector_errors import make_request

PB = "application/x-protobuf"


def _start_bare(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``tokentrace collector`` expected to refuse to start (bounded)."""
    cmd = [sys.executable, "-m", "tokentrace", "collector", "--db", str(tmp_path / "s.duckdb"),
           "--port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("args", "env"), [
    (("--host", "0.0.0.0"), {}),
    (("--host", "::"), {}),
    (("--host", "collector.example"), {}),
    ((), {"TOKENTRACE_HOST": "0.0.0.0"}),
], ids=["0.0.0.0", "::", "a host name", "from the environment"])
def test_a_non_loopback_bind_without_a_token_is_refused(tmp_path, args, env):
    result = _start_bare(tmp_path, *args, env=env)
    assert result.returncode == 2
    assert "is reachable from other machines: give --token" in result.stderr
    assert "--insecure-no-token" in result.stderr
    assert not (tmp_path / "s.duckdb").exists()


def test_an_explicit_insecure_flag_or_a_token_lets_it_bind_everywhere(collector_factory):
    for collector in (collector_factory("--host", "0.0.0.0", "--insecure-no-token"),
                      collector_factory("--host", "0.0.0.0", token="tok-net")):
        collector.start()  # the harness reaches it on 127.0.0.1
        assert collector.post(make_request(1).SerializeToString(), PB).status_code == 200
        assert collector.stop() == 0


def test_the_token_never_reaches_page_links_and_redirects_stay_on_this_host(collector_factory):
    collector = collector_factory(token="tok-links").start()
    with httpx.Client(base_url=collector.url, timeout=30) as browser:
        entry = browser.get("/timeline?since=5m&token=tok-links")
        assert entry.status_code == 303 and entry.headers["location"] == "/timeline?since=5m"
        # A cookie is set now; a link that still carries the token must not be rendered with it.
        again = browser.get("/timeline?since=5m&token=tok-links")
        assert again.status_code == 303 and again.headers["location"] == "/timeline?since=5m"
        page = browser.get("/timeline?since=5m")
        assert page.status_code == 200 and "tok-links" not in page.text
        # Even a wrong token in the query of an authenticated browser is dropped, not rendered.
        wrong = browser.get("/?token=not-it")
        assert wrong.status_code == 303 and wrong.headers["location"] == "/"
    for path, expected in (("//evil.example/?token=tok-links", "/evil.example/"),
                           ("/\\evil.example/?token=tok-links", "/evil.example/"),
                           ("///evil.example/x?token=tok-links&a=1", "/evil.example/x?a=1")):
        response = httpx.get(collector.url + path, timeout=30)
        assert response.status_code == 303, path
        assert response.headers["location"] == expected, path
    assert collector.stop() == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs, mounted for the test and unmounted after."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True,
                            text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()
    return filler


def test_a_full_disk_is_reported_passes_and_a_failed_checkpoint_exits_non_zero(small_disk, tmp_path):
    collector = CollectorProcess(tmp_path, db=small_disk / "store.duckdb").start()
    try:
        for _ in range(10):
            assert collector.post(make_request(200, name="before").SerializeToString(), PB).status_code == 200
        filler = _fill(small_disk)
        health = httpx.get(collector.url + "/healthz", timeout=30)
        assert health.status_code == 503 and health.json()["store"]["writable"] is False
        assert "bytes free" in health.json()["problems"][0]
        full = collector.post(make_request(200, name="while-full").SerializeToString(), PB)
        assert full.status_code == 503 and "retry-after" in full.headers  # a full disk passes
        filler.unlink()
        # A sender's next batch succeeds at once; /healthz recovers once the failure is over 10 s old
        # (or as soon as a write succeeds) and the merge thread has appended what it holds: a merge
        # that failed while the disk was full is retried as soon as a write passes again (at the
        # latest after its pause of at most 5 s, journal._RETRY_S), and /healthz says so meanwhile.
        assert collector.post(make_request(3, name="after").SerializeToString(), PB).status_code == 200
        wait_for(lambda: httpx.get(collector.url + "/healthz", timeout=30).status_code == 200, 30,
                 "/healthz to recover once the disk has room")
        _fill(small_disk)
        assert collector.stop(signal.SIGTERM) == 1
        log = collector.log_path.read_text()
        assert "tokentrace collector: error: stopping failed" in log and "No space left on device" in log

        # Restarted on the full disk: /healthz must not claim the store is writable.
        restarted = CollectorProcess(tmp_path, db=small_disk / "store.duckdb")
        cmd = [sys.executable, "-m", "tokentrace", "collector", "--db", str(restarted.db), "--port",
               str(restarted.port), "--log-level", "warning"]
        restarted.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answer():
            if restarted.proc.poll() is not None:
                return restarted.proc.returncode
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(restarted.url + "/healthz", timeout=5)

        health = wait_for(answer, 60, "the restarted collector's /healthz")
        assert isinstance(health, httpx.Response), f"exited {health}"
        assert health.status_code == 503 and health.json()["store"]["writable"] is False
        restarted.stop()
    finally:
        collector.kill()
