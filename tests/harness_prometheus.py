"""A real Prometheus (Debian's package, 2.42) for tests: its own config, data directory and free
port, no service manager. ``tests/run`` installs it; tests that need it skip only when it is absent
and the run is not CI."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from harness_collector import free_port, terminate, wait_for

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def require_prometheus() -> None:
    """Fail (not skip) when Debian's prometheus is missing: tests/run installs it."""
    if not Path(PROMETHEUS).exists() or not Path(PROMTOOL).exists():
        pytest.fail("prometheus and promtool are not installed: apt-get install prometheus (tests/run does)")


class PrometheusProcess:
    """``prometheus`` scraping one target every second, with a bearer token."""

    def __init__(self, workdir: Path, target: str, token: str | None, path: str = "/metrics"):
        self.workdir = Path(workdir) / "prometheus"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        auth = f"    authorization:\n      credentials: {token}\n" if token else ""
        (self.workdir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: tokentrace\n"
            f"    metrics_path: {path}\n{auth}"
            f"    static_configs:\n      - targets: ['{target}']\n")
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        """Base URL of its HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> PrometheusProcess:
        """Start and wait until /-/ready answers 200."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child process owns it
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        wait_for(self._ready, timeout, f"prometheus on port {self.port} (log {self.log_path})", interval=0.2)
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}: {self.log_path.read_text()}")
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM and wait."""
        terminate(self.proc)

    def target(self) -> dict | None:
        """The one active target's state (health, lastScrape, lastError)."""
        active = httpx.get(self.url + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return active[0] if active else None

    def scraped_after(self, when: float, timeout: float = 60) -> dict:
        """Wait until a successful scrape started after ``when`` (epoch seconds); its target state."""
        def done():
            target = self.target()
            if not target or target["health"] != "up":
                return None
            started = _epoch(target["lastScrape"])
            return target if started > when else None

        return wait_for(done, timeout, "a prometheus scrape after the traffic", interval=0.2)

    def query(self, promql: str) -> list[dict]:
        """An instant query's result vector (fails the test on a query error)."""
        body = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=30).json()
        assert body["status"] == "success", (promql, body)
        return body["data"]["result"]


def _epoch(rfc3339: str) -> float:
    """Prometheus's lastScrape (RFC 3339 with nanoseconds) as epoch seconds."""
    from datetime import datetime

    head, _, rest = rfc3339.partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())[:6]
    zone = rest[len("".join(ch for ch in rest if ch.isdigit())):] or "Z"
    stamp = datetime.fromisoformat(f"{head}.{fraction or '0'}{'+00:00' if zone == 'Z' else zone}")
    return stamp.timestamp()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of an exposition (text format 0.0.4): (name, labels, value), comments left out."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def sum_by(samples: list[tuple[str, dict[str, str], float]], name: str, *labels: str,
           **where: str) -> dict[tuple[str, ...], float]:
    """PromQL's ``sum by (labels) (name{where})`` over parsed samples; zero sums kept (a counter
    present at 0 is present)."""
    sums: dict[tuple[str, ...], float] = {}
    for sample, values, value in samples:
        if sample == name and all(values.get(k) == v for k, v in where.items()):
            key = tuple(values.get(label, "") for label in labels)
            sums[key] = sums.get(key, 0.0) + value
    return sums


def now() -> float:
    """Epoch seconds (the clock Prometheus stamps scrapes with)."""
    return time.time()
