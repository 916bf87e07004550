"""The collector's HTTP side: OTLP/HTTP receiver, health, bearer auth, and the app factory.

Receiver status codes follow the OTLP/HTTP spec: 200 (with partial success when spans were refused
or values truncated), 400 malformed, 413 too large, 415 unsupported media type or encoding, 503 +
Retry-After when the byte budget (collector/budget.py) or the write queue is full, or the store is
failing (all retryable). Error bodies are
``google.rpc.Status`` in the request's encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from contextlib import asynccontextmanager
from urllib.parse import parse_qsl, urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format
from google.rpc import status_pb2
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tokentrace import __version__
from tokentrace.collector.budget import EXPANSION, Budget, Hold
from tokentrace.collector.ingest import Counters, Pipeline
from tokentrace.collector.otlp import JSON, Encoding, decompress, encode_response, encoding_for
from tokentrace.collector.settings import CollectorConfig
from tokentrace.collector.store import SpoolRecord
from tokentrace.collector.writer import WriteQueue
from tokentrace.errors import (
    ConfigError,
    NotFound,
    Overloaded,
    PayloadError,
    PayloadTooLarge,
    StoreError,
    UnsupportedMediaType,
)
from tokentrace.wire import SPOOL_FILE_HEADER, SPOOL_FILE_NAME

log = logging.getLogger("tokentrace.collector")
_GRPC_CODE = {400: 3, 413: 8, 415: 3, 503: 14, 500: 13}
TOKEN_COOKIE = "tokentrace_token"


def error_envelope(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    """The one JSON error shape of the query API and auth: {"error": {status, code, message}}."""
    body = {"error": {"status": status, "code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _otlp_error(status: int, message: str, encoding: Encoding | None, headers: dict | None = None) -> Response:
    payload = status_pb2.Status(code=_GRPC_CODE.get(status, 2), message=message)
    if encoding is not None and encoding.name == "protobuf":
        return Response(payload.SerializeToString(), status, headers, media_type=encoding.media_type)
    return Response(json_format.MessageToJson(payload, indent=None), status, headers, media_type=JSON)


class BearerAuth:
    """ASGI middleware: every path needs ``Authorization: Bearer TOKEN`` or the token cookie.

    Browsers cannot send a bearer header by themselves, so ``?token=TOKEN`` on a GET sets the
    cookie (HttpOnly, SameSite=Strict) and redirects to the same URL without the token.
    """

    def __init__(self, app, token: str):
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._bearer_ok(headers.get(b"authorization", b"")) or self._cookie_ok(headers.get(b"cookie", b"")):
            return await self.app(scope, receive, send)
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = dict(query).get("token", "").encode()
        if scope["method"] == "GET" and given and hmac.compare_digest(given, self.token):
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            location = scope["path"] + (f"?{rest}" if rest else "")
            cookie = f"{TOKEN_COOKIE}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict"
            response = Response(status_code=303, headers={"Location": location, "Set-Cookie": cookie})
        else:
            response = error_envelope(
                401, "unauthorized", "this collector requires a bearer token (Authorization: Bearer TOKEN)",
                headers={"WWW-Authenticate": 'Bearer realm="tokentrace"'},
            )
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


async def _read_body(request: Request, limit: int, hold: Hold) -> bytes:
    """The body, held against the byte budget (collector/budget.py): refused before reading when
    Content-Length says it does not fit, or as soon as the chunks received pass the budget."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is over the limit of {limit} bytes")
    if declared.isdigit() and not hold.take(EXPANSION * int(declared)):
        raise Overloaded(_FULL.format(hold.budget.limit), retry_after=1)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
        if not declared.isdigit() and not hold.take(EXPANSION * len(chunk)):
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


class Collector:
    """What one collector process holds: config, store, write queue, counters, spool."""

    def __init__(self, config: CollectorConfig, store):
        self.config = config
        self.store = store
        self.counters = Counters()
        self.pipeline = Pipeline(self.counters, config.max_body_bytes, config.max_attribute_length,
                                 config.parse_workers)
        self.queue: WriteQueue | None = None
        self.spool = None
        self.budget = Budget(config.max_pending_bytes)

    def start(self) -> None:
        """Start the parse workers, the writer thread and, when configured, the spool watcher."""
        self.pipeline.start()
        self.queue = WriteQueue(self.store, lambda batch: self.counters.accept(batch.spans - batch.duplicates,
                                                                      batch.duplicates), self.config.max_queue)
        if self.config.spool_dir:
            from tokentrace.collector.spool import SpoolIngester

            self.spool = SpoolIngester(self.config.spool_dir, self.pipeline, self.queue, self.counters)
            self.spool.start()

    def stop(self) -> None:
        """Stop the spool, write what was submitted, checkpoint and close the store."""
        if self.spool is not None:
            self.spool.stop()
        self.pipeline.stop()
        if self.queue is not None:
            self.queue.close()
        self.store.close()

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /healthz."""
        problems = []
        if self.queue is None or not self.queue.alive():
            problems.append("the writer thread is not running")
        elif self.queue.last_error:
            problems.append(f"the last write failed: {self.queue.last_error}")
        try:
            self.store.probe()
        except StoreError as exc:
            problems.append(str(exc))
        body = {
            "status": "unavailable" if problems else "ok",
            "problems": problems,
            "version": __version__,
            "store": {"path": getattr(self.store, "path", None), "writable": not problems},
            "queue": {"depth": self.queue.depth() if self.queue else 0,
                      "capacity": self.config.max_queue},
            "pending": self.budget.snapshot(),
            **self.counters.snapshot(),
            "spool": self.spool.snapshot() if self.spool else None,
        }
        return (503 if problems else 200), body


def _install_error_handlers(app: FastAPI) -> None:
    """Every query-API error answers with the one JSON envelope."""

    @app.exception_handler(NotFound)
    async def not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return error_envelope(404, "not_found", str(exc))

    @app.exception_handler(ConfigError)
    async def bad_parameter(_request: Request, exc: ConfigError) -> JSONResponse:
        return error_envelope(400, "bad_parameter", str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()))
        return error_envelope(400, "bad_parameter", f"{where}: {first.get('msg', 'invalid value')}")

    @app.exception_handler(StoreError)
    async def store_failed(_request: Request, exc: StoreError) -> JSONResponse:
        return error_envelope(503, "store_unavailable", str(exc), headers={"Retry-After": "5"})

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
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.collector = collector
    app.state.reader = collector.store
    _install_error_handlers(app)

    @app.post("/v1/traces")
    async def receive_traces(request: Request) -> Response:
        try:
            encoding = encoding_for(request.headers.get("content-type"))
        except UnsupportedMediaType as exc:
            collector.counters.reject("unsupported_media_type")
            return _otlp_error(415, str(exc), None)
        hold = Hold(collector.budget)
        try:
            return await _receive(request, encoding, hold)
        finally:
            hold.release()

    async def _receive(request: Request, encoding: Encoding, hold: Hold) -> Response:
        limit = collector.config.max_body_bytes
        try:
            body = await _read_body(request, limit, hold)
            content_encoding = request.headers.get("content-encoding")
            payload = await _inflate(body, content_encoding, limit, hold)
        except PayloadTooLarge as exc:
            collector.counters.reject("too_large")
            return _otlp_error(413, str(exc), encoding)
        except Overloaded as exc:
            # Refused before the rest of the body is held; it is read and dropped so that the sender,
            # still writing it, reads the answer (closing now would reset its connection instead).
            collector.counters.reject("overloaded")
            await _discard(request, limit)
            return _otlp_error(503, str(exc), encoding, {"Retry-After": str(exc.retry_after)})
        except PayloadError as exc:
            collector.counters.reject("malformed")
            return _otlp_error(400, str(exc), encoding)
        except UnsupportedMediaType as exc:
            collector.counters.reject("unsupported_media_type")
            return _otlp_error(415, str(exc), encoding)
        spool = None
        spool_name = request.headers.get(SPOOL_FILE_HEADER)
        if spool_name is not None:
            if not SPOOL_FILE_NAME.fullmatch(spool_name):
                collector.counters.reject("malformed")
                return _otlp_error(400, f"{SPOOL_FILE_HEADER} must be a plain file name (letters, digits, '.', "
                                        f"'_', '-'; at most 200), got {spool_name[:80]!r}", encoding)
            # Stored once per SHA-256 of the bytes, as a file of --spool-dir (wire.SPOOL_FILE_HEADER).
            spool = SpoolRecord.of(body, spool_name)
        try:
            # Decoding and normalizing count their own rejects (tokentrace.collector.ingest).
            batch = await collector.pipeline.batch_async(payload, encoding)
            await asyncio.wrap_future(collector.queue.submit(batch, spool))
        except PayloadTooLarge as exc:
            return _otlp_error(413, str(exc), encoding)
        except UnsupportedMediaType as exc:
            return _otlp_error(415, str(exc), encoding)
        except PayloadError as exc:
            return _otlp_error(400, str(exc), encoding)
        except Overloaded as exc:
            collector.counters.reject("overloaded")
            return _otlp_error(503, str(exc), encoding, {"Retry-After": str(exc.retry_after)})
        except StoreError as exc:
            collector.counters.reject("store_error")
            return _otlp_error(503, f"the store could not write the batch: {exc}", encoding, {"Retry-After": "5"})
        return Response(encode_response(encoding, batch.rejected, batch.message()),
                         media_type=encoding.media_type)

    @app.get("/healthz")
    async def healthz() -> Response:
        status, body = await run_in_threadpool(collector.health)
        return Response(json.dumps(body), status, media_type=JSON)

    if collector.config.token:
        app.add_middleware(BearerAuth, token=collector.config.token)
    return app
