"""The collector's HTTP side: OTLP/HTTP receiver, health, bearer auth, and the app factory.

Receiver status codes follow the OTLP/HTTP spec: 200 (with partial success when spans were refused
or values truncated), 400 malformed, 413 too large, 415 unsupported media type or encoding, 503 +
Retry-After when the byte budget (collector/receiver/budget.py) or the write queue is full, or the store is
failing (all retryable). Error bodies are
``google.rpc.Status`` in the request's encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import json
import logging
import time
from contextlib import asynccontextmanager
from urllib.parse import parse_qsl, quote, urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from google.protobuf import json_format
from google.rpc import status_pb2
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tokentrace import __version__, wire
from tokentrace.collector.receiver.budget import EXPANSION, Arrivals, Budget, Hold
from tokentrace.collector.receiver.ingest import Counters, Pipeline
from tokentrace.collector.receiver.otlp import JSON, Encoding, decompress, encode_response, encoding_for
from tokentrace.collector.settings import CollectorConfig
from tokentrace.collector.stores.store import SpoolRecord
from tokentrace.collector.stores.writer import WriteQueue
from tokentrace.errors import (
    ConfigError,
    Overloaded,
    PayloadError,
    PayloadTooLarge,
    StoreError,
    TokentraceError,
    Unauthorized,
    retry_headers,
)
from tokentrace.wire import SPOOL_FILE_HEADER, SPOOL_FILE_NAME

log = logging.getLogger("tokentrace.collector")
_GRPC_CODE = {400: 3, 401: 16, 404: 5, 413: 8, 415: 3, 503: 14, 500: 13}  # HTTP -> google.rpc.Code
TOKEN_COOKIE = "tokentrace_token"
#: The OTLP/HTTP receiver's path (its POST goes to the receiver past FastAPI's routing: ReceiverFirst).
TRACES_PATH = "/v1/traces"
#: Seconds a failed write keeps /healthz unavailable by itself (issue 11: tell the truth, and recover).
RECENT_WRITE_ERROR_S = 10.0


class FiniteJSONResponse(JSONResponse):
    """The API's JSON answer: NaN and infinities become null instead of a 500 (tokentrace.wire)."""

    def render(self, content) -> bytes:
        return wire.dumps(content, ensure_ascii=False).encode("utf-8")


def error_envelope(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    """The one JSON error shape of the query API and auth: {"error": {status, code, message}}."""
    body = {"error": {"status": status, "code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _otlp_error(status: int, message: str, encoding: Encoding | None, headers: dict | None = None) -> Response:
    payload = status_pb2.Status(code=_GRPC_CODE.get(status, 2), message=message)
    if encoding is not None and encoding.name == "protobuf":
        return Response(payload.SerializeToString(), status, headers, media_type=encoding.media_type)
    return Response(json_format.MessageToJson(payload, indent=None), status, headers, media_type=JSON)


#: 401 messages: a token that was not given, and one that was given but does not match.
MISSING_TOKEN = ("this collector requires a token: send 'Authorization: Bearer TOKEN', or in a browser add "
                 "?token=TOKEN to the address once")
WRONG_TOKEN = "the token given does not match this collector's --token (TOKENTRACE_TOKEN)"
_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">
<title>tokentrace: token required</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto">
<h1>{title}</h1>
<p>{message}.</p>
<p>Open this page again with the collector's token in the address, once:
<code>http://HOST:PORT/?token=TOKEN</code>. The browser keeps it in a cookie for this collector, and the
token leaves the address bar.</p>
</body></html>
"""


def _has_cookie(header: bytes) -> bool:
    return any(part.strip().startswith(TOKEN_COOKIE.encode() + b"=") for part in header.split(b";"))


def unauthorized(presented: bool, browser: bool) -> Response:
    """The 401: an HTML page for a browser (it mentions ?token=), the JSON envelope otherwise; a wrong
    token and a missing one get different messages."""
    message = WRONG_TOKEN if presented else MISSING_TOKEN
    headers = {"WWW-Authenticate": 'Bearer realm="tokentrace"' + (', error="invalid_token"' if presented else "")}
    if browser:
        title = "Wrong token" if presented else "This collector needs a token"
        return HTMLResponse(_LOGIN_PAGE.format(title=title, message=html.escape(message)), Unauthorized.http_status,
                            headers)
    return error_envelope(Unauthorized.http_status, Unauthorized.code, message, headers=headers)


class BearerAuth:
    """ASGI middleware: every path needs ``Authorization: Bearer TOKEN`` or the token cookie.

    Browsers cannot send a bearer header by themselves, so ``?token=TOKEN`` on a GET sets the
    cookie (HttpOnly, SameSite=Strict) and redirects to the same path without the token. A token in
    the query is always taken out by that redirect, even when a cookie already authenticates the
    request, so that no page renders it into its links; the redirect never leaves this host.
    """

    def __init__(self, app, token: str):
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        authenticated = (self._bearer_ok(headers.get(b"authorization", b""))
                         or self._cookie_ok(headers.get(b"cookie", b"")))
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = dict(query).get("token", "").encode()
        valid = bool(given) and hmac.compare_digest(given, self.token)
        if scope["method"] == "GET" and any(key == "token" for key, _ in query) and (valid or authenticated):
            response = Response(status_code=303, headers={"Location": _same_host(scope["path"], query)})
            if valid:
                response.set_cookie(TOKEN_COOKIE, self.token.decode(), path="/", httponly=True, samesite="strict")
        elif authenticated:
            return await self.app(scope, receive, send)
        else:
            presented = bool(given or headers.get(b"authorization") or _has_cookie(headers.get(b"cookie", b"")))
            response = unauthorized(presented, b"text/html" in headers.get(b"accept", b""))
        await response(scope, receive, send)

    def _bearer_ok(self, header: bytes) -> bool:
        scheme, _, value = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), self.token)

    def _cookie_ok(self, header: bytes) -> bool:
        for part in header.split(b";"):
            name, _, value = part.strip().partition(b"=")
            if name == TOKEN_COOKIE.encode() and hmac.compare_digest(value, self.token):
                return True
        return False


class ReceiverFirst:
    """ASGI middleware: ``POST /v1/traces`` goes straight to the receiver, past FastAPI's router,
    its exception and exit-stack layers and its endpoint wrappers: 137 against 53 us a
    request on the event loop's one thread (a 250 kB body in four chunks; docs/benchmarks.md, Issue
    17, sixteenth round). The receiver answers every error it knows itself; anything else still
    reaches ServerErrorMiddleware (a 500), and other methods and paths go to the app as before."""

    def __init__(self, app, receiver):
        self.app = app
        self.receiver = receiver

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == TRACES_PATH:
            response = await self.receiver(Request(scope, receive, send))
            await response(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _same_host(path: str, query: list[tuple[str, str]]) -> str:
    """A Location on this host: ``path`` (with leading slashes and backslashes folded into one
    slash, so that ``//evil.example/`` cannot become another host) and ``query`` without the token."""
    location = quote("/" + path.lstrip("/\\"), safe="/:@!$&'()*+,;=-._~")
    rest = urlencode([(key, value) for key, value in query if key != "token"])
    return location + (f"?{rest}" if rest else "")


async def _read_body(request: Request, limit: int, hold: Hold, arrivals: Arrivals | None = None) -> bytes:
    """The body, held against the byte budget (collector/receiver/budget.py): refused before reading when
    Content-Length says it does not fit (once ``arrivals`` found no body arriving too slowly to give
    up its reservation), or as soon as the chunks received pass the budget. The rest
    of a refused body is read and dropped, never held, so that a sender still writing it reads the
    503 (closing the connection instead resets it, and most clients then see no answer at all)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is over the limit of {limit} bytes")
    arrival = request.scope.get("state", {}).get("arrival")  # BodyDeadline's record of this body
    if arrival is not None:
        arrival.hold = hold
    if declared.isdigit() and not hold.take(EXPANSION * int(declared)) \
            and not (arrivals is not None and arrivals.make_room(EXPANSION * int(declared), hold)):
        await _discard(request, limit)
        raise Overloaded(_FULL.format(hold.budget.limit), retry_after=1)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
        if not declared.isdigit() and not hold.take(EXPANSION * len(chunk)):
            chunks.clear()
            await _discard(request, limit - size)
            raise Overloaded(_FULL.format(hold.budget.limit), retry_after=1)
        chunks.append(chunk)
    return b"".join(chunks)


async def _discard(request: Request, limit: int) -> None:
    """Read and drop the rest of a refused body (at most ``limit`` bytes; past that the connection
    closes after the answer)."""
    size = 0
    with contextlib.suppress(ClientDisconnect):
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return


_FULL = "the collector holds as many request bytes as --max-pending-bytes allows ({}); retry later"


async def _inflate(body: bytes, content_encoding: str | None, limit: int, hold: Hold) -> bytes:
    """A compressed body inflated here, held against the budget first: a guess of 32 times its size
    (1 MiB at least), then the whole --max-body-bytes when it inflates past that. What it did not
    need is given back."""
    if (content_encoding or "identity").strip().lower() in ("", "identity"):
        return body
    guess = min(limit, max(1 << 20, 32 * len(body)))
    for size in dict.fromkeys((guess, limit)):
        if not hold.take(EXPANSION * size):
            raise Overloaded(_FULL.format(hold.budget.limit), retry_after=1)
        try:
            data = await run_in_threadpool(decompress, body, content_encoding, size)
        except PayloadTooLarge:
            hold.give(EXPANSION * size)
            if size == limit:
                raise
            continue
        hold.give(EXPANSION * (size - len(data)))
        return data
    raise AssertionError("unreachable: the last size is the limit")


def _spool_record(request: Request, body: bytes) -> SpoolRecord | None:
    """The spool record of a body resent by an engine from its spool (wire.SPOOL_FILE_HEADER)."""
    spool_name = request.headers.get(SPOOL_FILE_HEADER)
    if spool_name is None:
        return None
    if not SPOOL_FILE_NAME.fullmatch(spool_name):
        raise PayloadError(f"{SPOOL_FILE_HEADER} must be a plain file name (letters, digits, '.', '_', '-'; "
                           f"at most 200), got {spool_name[:80]!r}")
    # Stored once per SHA-256 of the bytes, as a file of --spool-dir.
    return SpoolRecord.of(body, spool_name)


class Collector:
    """What one collector process holds: config, store, write queue, counters, spool."""

    def __init__(self, config: CollectorConfig, store):
        self.config = config
        self.store = store
        self.counters = Counters()
        self.pipeline = Pipeline(self.counters, config.max_body_bytes, config.max_attribute_length,
                                 config.parse_workers, config.decode_nice)
        self.queue: WriteQueue | None = None
        self.spool = None
        #: Read-side parts told of every committed batch (``observe(batch)``, ``close()``): /metrics.
        self.listeners: list = []
        self.stop_error: str | None = None  #: why stopping failed (a checkpoint on a full disk)
        self.budget = Budget(config.max_pending_bytes)
        #: The bodies arriving (budget.BodyDeadline keeps it): one too slow gives its reservation up.
        self.arrivals = Arrivals(config.body_min_rate)

    def start(self) -> None:
        """Start the parse workers, the writer thread and, when configured, the spool watcher."""
        self.pipeline.start()
        self.queue = WriteQueue(self.store, self._written, self.config.max_queue)
        if self.config.spool_dir:
            from tokentrace.collector.receiver.spool import SpoolIngester

            self.spool = SpoolIngester(self.config.spool_dir, self.pipeline, self.queue, self.counters)
            self.spool.start()

    def _written(self, batch) -> None:
        self.counters.accept(batch.spans, batch.duplicates)  # the store left the duplicates out of it
        for listener in self.listeners:
            listener.observe(batch)

    def stop(self) -> None:
        """Stop the spool, write what was submitted, checkpoint and close the store; a failure is
        kept in ``stop_error`` (the process then exits non-zero, collector/cli.py)."""
        if self.spool is not None:
            self.spool.stop()
        self.pipeline.stop()
        if self.queue is not None:
            self.queue.close()
        for listener in self.listeners:
            listener.close()
        try:
            self.store.close()
        except StoreError as exc:
            log.error("the store was not closed cleanly: %s", exc)
            self.stop_error = str(exc)

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /healthz."""
        problems = []
        if self.queue is None or not self.queue.alive():
            problems.append("the writer thread is not running")
        elif self.queue.last_error and time.monotonic() - self.queue.last_error_at < RECENT_WRITE_ERROR_S:
            # After that, the probe below (the store answers, its disk has room) says whether the
            # condition passed: a sender must not be kept away by a failure that is over.
            problems.append(f"the last write failed: {self.queue.last_error}")
        try:
            self.store.probe()
        except StoreError as exc:
            problems.append(str(exc))
        body = {
            "status": "unavailable" if problems else "ok",
            "problems": problems,
            "version": __version__,
            "store": {"path": getattr(self.store, "path", None), "writable": not problems,
                      "last_write_error": self.queue.last_error if self.queue else None},
            "queue": {"depth": self.queue.depth() if self.queue else 0,
                      "capacity": self.config.max_queue},
            "pending": {**self.budget.snapshot(), "slow_bodies_evicted": self.arrivals.evicted},
            **self.counters.snapshot(),
            "spool": self.spool.snapshot() if self.spool else None,
            "journal": self.store.journal_state() if hasattr(self.store, "journal_state") else None,
        }
        return (503 if problems else 200), body


def _install_error_handlers(app: FastAPI) -> None:
    """Every query-API error answers with the one JSON envelope, its status read from the error's
    class (core/errors.py)."""

    @app.exception_handler(TokentraceError)
    async def known(_request: Request, exc: TokentraceError) -> JSONResponse:
        return error_envelope(exc.http_status, exc.code, str(exc), headers=retry_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid value')}"
        return error_envelope(ConfigError.http_status, ConfigError.code, message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_envelope(exc.status_code, code, str(exc.detail))


def create_app(collector: Collector) -> FastAPI:
    """The ASGI app: receiver and health; other parts add their routers to it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        collector.start()
        try:
            yield
        finally:
            await run_in_threadpool(collector.stop)

    app = FastAPI(title="tokentrace collector", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None, default_response_class=FiniteJSONResponse)
    app.state.collector = collector
    app.state.reader = collector.store
    _install_error_handlers(app)

    @app.post(TRACES_PATH)
    async def receive_traces(request: Request) -> Response:
        encoding, hold, limit = None, Hold(collector.budget), collector.config.max_body_bytes
        began = time.perf_counter()
        try:
            encoding = encoding_for(request.headers.get("content-type"))
            body = await _read_body(request, limit, hold, collector.arrivals)
            read = time.perf_counter()
            spool = _spool_record(request, body)
            payload = await _inflate(body, request.headers.get("content-encoding"), limit, hold)
            # Decoding and normalizing count their own rejects (tokentrace.collector.receiver.ingest).
            batch = await collector.pipeline.batch_async(payload, encoding, hold=hold)
            decoded = time.perf_counter()
            # Once the store holds none of the batch in memory (merged, or spilled to disk), it releases
            # what the request still holds (collector/receiver/budget.py).
            await asyncio.wrap_future(collector.queue.submit(batch, spool, on_released=hold.release))
        except TokentraceError as exc:
            hold.release()
            # Status and retryability come from the error's class (core/errors.py): 503 + Retry-After
            # only for conditions that pass; input that can never succeed is 4xx.
            if not getattr(exc, "counted", False):
                collector.counters.reject(exc.code)
            return _otlp_error(exc.http_status, str(exc), encoding, retry_headers(exc))
        except BaseException:
            hold.release()
            raise
        hold.keep(batch.nbytes)
        collector.counters.time_request(read - began, decoded - read, time.perf_counter() - decoded)
        return Response(encode_response(encoding, batch.rejected, batch.message()),
                        media_type=encoding.media_type)

    @app.get("/healthz")
    async def healthz() -> Response:
        status, body = await run_in_threadpool(collector.health)
        return Response(json.dumps(body), status, media_type=JSON)

    app.add_middleware(ReceiverFirst, receiver=receive_traces)
    if collector.config.token:  # added last: the outermost, so it guards the receiver too
        app.add_middleware(BearerAuth, token=collector.config.token)
    return app
