"""Span export that survives a collector outage: OTLP/HTTP first, a bounded on-disk spool otherwise.

Each undeliverable batch is written as one OTLP ``ExportTraceServiceRequest`` protobuf file
(``*.pb``, tmp + rename, so readers never see half a file) in the spool directory — the format the
collector's ``--spool-dir`` ingests. A background thread re-sends spooled files oldest first once
the collector answers again. Files are *claimed* by renaming them to ``*.pb.sending`` first, so the
collector (which only reads ``*.pb``) and other engines sharing the directory never send the same
file twice. When the spool is full, batches are dropped and counted, never raised.

A collector that answers 401 or 403 is up but refuses our token: that is said as such (not
"unreachable"), and the batches stay in the spool as ``*.pb`` until a sender with the right token —
this process later, or the next one after a restart — delivers them (issue 12).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tokentrace.threads import os_named
from tokentrace.wire import SPOOL_FILE_HEADER

log = logging.getLogger(__name__)

#: A claimed file older than this is assumed orphaned by a crashed sender and put back.
STALE_CLAIM_S = 60.0

#: Seconds a stopping exporter spends resending what it spooled.
SHUTDOWN_RESEND_S = 5.0

#: Outcomes of one POST: delivered; try again later (down, busy); refused for our credentials
#: (kept for a sender with the right token); refused for good (malformed, too large).
SENT, RETRY, UNAUTHORIZED, REJECTED = "sent", "retry", "unauthorized", "rejected"


class Spool:
    """A directory of OTLP protobuf files with a size limit."""

    def __init__(self, directory: str | Path, max_bytes: int, name: str):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] + f"-{os.getpid()}"
        self._sequence = 0
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._reclaim_stale()

    def files(self) -> list[Path]:
        """Spooled batches, oldest first (names start with a zero-padded timestamp)."""
        return sorted(p for p in self.directory.glob("*.pb") if p.is_file())

    def size(self) -> int:
        """Bytes held in ``*.pb`` files."""
        total = 0
        for path in self.files():
            with contextlib.suppress(FileNotFoundError):  # claimed or ingested meanwhile
                total += path.stat().st_size
        return total

    def write(self, data: bytes) -> bool:
        """Store one batch atomically; False (nothing written) when it would exceed the limit."""
        with self._lock:
            if self.size() + len(data) > self.max_bytes:
                return False
            self._sequence += 1
            name = f"{time.time_ns():020d}-{self._prefix}-{self._sequence:06d}.pb"
            tmp = self.directory / (name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self.directory / name)
            return True

    def claim(self) -> Path | None:
        """Take the oldest batch for sending, or None; the claim is an atomic rename."""
        for path in self.files():
            claimed = path.with_name(path.name + ".sending")
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                continue  # someone else took it
            return claimed
        return None

    def release(self, claimed: Path) -> None:
        """Give a claimed batch back (sending failed)."""
        os.replace(claimed, claimed.with_name(claimed.name.removesuffix(".sending")))

    def _reclaim_stale(self) -> None:
        now = time.time()
        for path in self.directory.glob("*.pb.sending"):
            try:
                if now - path.stat().st_mtime > STALE_CLAIM_S:
                    self.release(path)
            except FileNotFoundError:
                pass


class SpoolingSpanExporter(SpanExporter):
    """OTLP/HTTP protobuf export with a spool behind it.

    After a failed export the collector is considered down for ``retry_interval`` seconds: batches
    go straight to the spool instead of each waiting out a timeout, and the resend thread probes
    the collector with the oldest spooled file. ``token_hint`` is how the operator sets the token
    (the engine's ``--otlp-token``; the vLLM plugin names its environment variable).
    """

    def __init__(self, endpoint: str | None, spool: Spool | None, token: str | None = None,
                 timeout: float = 2.0, retry_interval: float = 1.0, token_hint: str = "--otlp-token"):
        self.url = endpoint.rstrip("/") + "/v1/traces" if endpoint else None
        parts = urllib.parse.urlsplit(self.url or "")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname or "", parts.port
        self._path = parts.path or "/"
        self._proxied = bool(self.url) and parts.scheme in urllib.request.getproxies() and not (
            urllib.request.proxy_bypass(parts.hostname or ""))
        self._local = threading.local()  #: each sending thread's kept connection
        self._connections: list[http.client.HTTPConnection] = []
        self._connections_lock = threading.Lock()
        self.spool = spool
        self.retry_interval = retry_interval
        self.token_hint = token_hint
        self._headers = {"Content-Type": "application/x-protobuf"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = timeout
        self._down_until = 0.0
        self._warned: str | None = None  #: the outcome last warned about (one warning per outage)
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._spooled = threading.Event()  #: the spool may hold batches: look at it every retry_interval
        self._spooled.set()
        self.exported_spans = 0  #: spans the collector acknowledged directly
        self.spooled_batches = 0  #: batches written to the spool
        self.resent_batches = 0  #: spooled batches delivered later
        self.dropped_spans = 0  #: spans lost because the spool was full or absent
        self.rejected_batches = 0  #: spooled batches the collector refused for good (kept as *.rejected)
        self.unauthorized = 0  #: answers 401/403: the token is missing or wrong
        self._thread = None
        if self.url and spool is not None:
            self._thread = threading.Thread(target=os_named(self._resend_loop), name="tokentrace-spool", daemon=True)
            self._thread.start()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Send ``spans``; spool them if that fails; count them as dropped if that fails too."""
        data = encode_spans(spans).SerializeToString() if self.url is not None else b""
        return SpanExportResult.SUCCESS if self.export_encoded(data, len(spans)) else SpanExportResult.FAILURE

    def export_encoded(self, data: bytes, spans: int) -> bool:
        """``export`` for a batch already encoded (an ``ExportTraceServiceRequest`` of ``spans``
        spans): True once it was sent or spooled."""
        if self.url is not None and time.monotonic() >= self._down_until:
            outcome = self._post(data)
            if outcome == SENT:
                self.exported_spans += spans
                self._recovered()
                if self.spool is not None and self.spooled_batches > self.resent_batches:
                    self._kick.set()
                return True
            self._mark_down(outcome)
        if self.spool is not None and self.url is not None:
            try:
                if self.spool.write(data):
                    self.spooled_batches += 1
                    self._spooled.set()
                    self._kick.set()
                    return True
            except OSError as exc:
                self._warn(f"cannot write the spool {self.spool.directory}: {exc}", "spool")
        self.dropped_spans += spans
        self._warn(f"span batches are being dropped (spool full or unavailable); {self.dropped_spans} so far",
                   "dropped")
        return False

    def shutdown(self) -> None:
        """Stop the resend thread; batches this exporter spooled get one last, bounded try (a
        collector that was only slow for a moment must not lose the end of a run)."""
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self.spooled_batches > self.resent_batches:
                try:
                    self._resend_all(deadline=time.monotonic() + SHUTDOWN_RESEND_S)
                except Exception:  # shutting down: what stays spooled is resent by the next sender
                    log.exception("resending spooled spans at shutdown failed")
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here beyond the spool, which is durable."""
        return True

    def _mark_down(self, outcome: str) -> None:
        self._down_until = time.monotonic() + self.retry_interval
        where = self.spool and self.spool.directory
        if outcome == UNAUTHORIZED:
            self.unauthorized += 1
            self._warn(f"collector at {self.url} refused the spans: token missing or wrong (set {self.token_hint}); "
                       f"spooling them to {where} until it accepts them", outcome)
        elif outcome == REJECTED:
            self._warn(f"collector at {self.url} refused a batch as malformed or too large; spooling it to {where}",
                       outcome)
        else:
            self._warn(f"collector at {self.url} unreachable; spooling spans to {where}", outcome)

    def _recovered(self) -> None:
        if self._warned is not None:
            log.info("collector at %s accepts spans again", self.url)
        self._warned = None

    def _warn(self, message: str, outcome: str) -> None:
        """Log once per kind of trouble (a new kind, e.g. unreachable then unauthorized, logs again)."""
        if self._warned != outcome:
            self._warned = outcome
            log.warning(message)

    def _resend_loop(self) -> None:
        # The spool is looked at every retry_interval only while it may hold something: at start
        # (files of an earlier run) and after a batch went there, until it was found empty. Else
        # the thread sleeps until kicked (listing the directory every second cost 0.3 ms of CPU).
        while not self._stop.is_set():
            self._kick.wait(self.retry_interval if self._spooled.is_set() else None)
            self._kick.clear()
            try:
                self._resend_all()
            except Exception:  # the resend thread must survive anything the disk or network does
                log.exception("resending spooled spans failed")

    def _resend_all(self, deadline: float | None = None) -> None:
        if not self.spool.files():
            self._spooled.clear()  # a batch spooled after this sets it again, and kicks
            return
        self._spooled.set()  # until they are gone, whoever wrote them
        if self._collector_ingests_spool() is not False:
            return
        while time.monotonic() < deadline if deadline is not None else not self._stop.is_set():
            claimed = self.spool.claim()
            if claimed is None:
                return
            outcome = self._post(claimed.read_bytes(), claimed.name.removesuffix(".sending"))
            if outcome in (RETRY, UNAUTHORIZED):
                # Unauthorized: the batch is fine, our token is not; it waits for the right one.
                self.spool.release(claimed)
                self._mark_down(outcome)
                return
            if outcome == REJECTED:
                # The collector will never take it (malformed, too large): keep it for inspection
                # under a name nobody ingests instead of retrying it forever.
                os.replace(claimed, claimed.with_name(claimed.name.removesuffix(".sending") + ".rejected"))
                self.rejected_batches += 1
                continue
            claimed.unlink(missing_ok=True)
            self.resent_batches += 1
            self._down_until = 0.0
            self._recovered()

    def _collector_ingests_spool(self) -> bool | None:
        """Whether the collector watches this very spool directory (its /healthz says so); None
        when nothing answers (still down: nothing to send to).

        A collector that watches the directory ingests the files itself, exactly once (it records
        each file's SHA-256); sending them as well would store them twice. A receiver without
        tokentrace's /healthz (an OpenTelemetry Collector, say) answers with an error: send.
        """
        base = self.url.removesuffix("/v1/traces")
        headers = {k: v for k, v in self._headers.items() if k == "Authorization"}
        try:
            with urllib.request.urlopen(urllib.request.Request(base + "/healthz", headers=headers),
                                        timeout=self._timeout) as response:
                spool = json.loads(response.read()).get("spool") or {}
        except urllib.error.HTTPError:
            return False
        except (urllib.error.URLError, OSError):
            return None
        except (ValueError, AttributeError):
            return False
        directory = spool.get("directory") if isinstance(spool, dict) else None
        return bool(directory) and Path(directory).resolve() == self.spool.directory.resolve()

    def _post(self, data: bytes, name: str | None = None) -> str:
        """POST one batch: SENT, RETRY (collector down or busy), UNAUTHORIZED (401/403) or REJECTED.

        A spooled file's name goes along (wire.SPOOL_FILE_HEADER): a tokentrace collector stores the
        bytes once however often they arrive, so a resend whose acknowledgement was lost, or a file
        that a collector watching the directory ingests as well, is not stored twice. Other OTLP
        receivers ignore the header.

        Each sending thread keeps its connection open between batches: a new connection through
        urllib cost an engine's exporter process about 1 ms of CPU a batch, half of what it spent
        per request. A kept connection the collector closed meanwhile fails before any answer;
        that batch goes once more on a new connection. Where a proxy applies to the URL (the
        environment's *_proxy variables), urllib sends it, as before."""
        headers = {**self._headers, SPOOL_FILE_HEADER: name} if name else self._headers
        if self._proxied:
            return self._post_via_urllib(data, headers)
        for attempt in (1, 2):
            connection, reused = self._connection()
            try:
                connection.request("POST", self._path, body=data, headers=headers)
                response = connection.getresponse()
                response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._close_connection()
                if reused and attempt == 1:
                    continue  # the collector had closed the idle connection; nothing was answered
                return RETRY
            except (OSError, http.client.HTTPException):
                self._close_connection()
                return RETRY
            if response.will_close:
                self._close_connection()
            return _outcome(response.status)
        return RETRY  # pragma: no cover - the loop returns

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the collector, and whether it was used before."""
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            return connection, True
        kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        self._local.connection = connection = kind(self._host, self._port, timeout=self._timeout)
        with self._connections_lock:
            self._connections.append(connection)  # shutdown closes them, whichever thread made them
        return connection, False

    def _close_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is not None:
            connection.close()
            with self._connections_lock, contextlib.suppress(ValueError):
                self._connections.remove(connection)

    def _post_via_urllib(self, data: bytes, headers: dict[str, str]) -> str:
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return _outcome(response.status)
        except urllib.error.HTTPError as exc:
            return _outcome(exc.code)
        except (urllib.error.URLError, OSError):
            return RETRY


def _outcome(status: int) -> str:
    if 200 <= status < 300:
        return SENT
    if status in (401, 403):
        return UNAUTHORIZED
    return RETRY if status in (408, 429) or status >= 500 else REJECTED
