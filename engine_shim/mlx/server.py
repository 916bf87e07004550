"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the engine.

Routes: POST /v1/chat/completions and /v1/completions, also without /v1 (SSE streaming or not),
GET /v1/models and /v1/models/{id}, GET /health (503 until the model is loaded and warmed up), and
OPTIONS anywhere (CORS preflight, as mlx_lm.server answers it). ``X-Request-Id`` is honoured, echoed
and generated when absent; ``X-Session-Id`` (else the ``user`` field) is the session id. With
``--api-key``, everything but /health and preflights needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from tokentrace.engine_shim.mlx.cors import AccessMiddleware
from tokentrace.engine_shim.mlx.engine import Engine
from tokentrace.engine_shim.mlx.jobs import Job
from tokentrace.engine_shim.mlx.params import Limits, max_tokens_of, parse_request, stop_strings
from tokentrace.engine_shim.mlx.protocol import (
    BadRequest,
    LogprobFormatter,
    TextAssembler,
    chunk_body,
    response_body,
    usage,
    usage_chunk,
)
from tokentrace.engine_shim.mlx.records import RequestRecord
from tokentrace.engine_shim.mlx.scheduler import LOAD_READY


def create_app(engine: Engine) -> FastAPI:
    """The ASGI app; the engine starts and stops with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="tokentrace engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    settings = engine.settings
    app.add_middleware(AccessMiddleware, origins=settings.origins, api_key=settings.api_key)
    limits = Limits(settings.max_request_bytes, settings.max_messages)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = engine.state
        if engine.scheduler.unavailable is not None:
            return JSONResponse({"status": "degraded", "reason": engine.scheduler.unavailable}, status_code=503)
        ok = state == LOAD_READY
        return JSONResponse({"status": "ok" if ok else state}, status_code=200 if ok else 503)

    def model_card() -> dict[str, Any]:
        return {"id": settings.served_name, "object": "model", "created": 0, "owned_by": "tokentrace"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            engine.check_model(model_id)
        except BadRequest as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(model_card())

    async def chat(request: Request) -> Response:
        return await _handle(engine, request, "chat", limits)

    async def completions(request: Request) -> Response:
        return await _handle(engine, request, "completion", limits)

    # mlx_lm.server also answers /chat/completions; clients configured without /v1 work as well.
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])

    return app


#: Bodies larger than this are decoded and validated on the prompt threads, not the event loop.
LARGE_BODY = 64 << 10


class RequestStream:
    """A job's consumer on the event loop: tokens in, text out; finalizes the record once both
    the HTTP side and the generation are done (the scheduler may still be writing the record
    after a client has gone)."""

    def __init__(self, engine: Engine, job: Job, stops: list[str], kind: str):
        self.engine = engine
        self.job = job
        self.queue: asyncio.Queue = asyncio.Queue()
        runtime = engine.scheduler.runtime
        self.text = TextAssembler(runtime.tokenizer, runtime.eos_token_ids, stops)
        self.logprobs = LogprobFormatter(runtime.tokenizer, kind) if job.sampling.top_logprobs is not None else None
        self._logprobs_sent = 0  #: tokens whose log-probabilities went out already
        self.finish_reason: str | None = None
        self.generation_done = False
        self.http_done = False
        self.completed = False  #: the whole response was written (streaming)
        job.sink = self

    def push(self, token: int, reason: str | None) -> None:
        """From the generation thread (via the loop): one token, or the end."""
        if reason is not None:
            self.generation_done = True
        self.queue.put_nowait((token, reason))
        if self.generation_done and self.http_done:
            self._finalize()

    async def next_piece(self) -> tuple[str, str | None]:
        """Wait for the next token; returns (new text, finish reason or None)."""
        token, reason = await self.queue.get()
        if self.finish_reason is not None:
            return "", self.finish_reason
        text, stopped = self.text.add(token, final=reason is not None, reason=reason)
        if stopped and reason is None:
            self.engine.cancel(self.job, "stop")
            reason = "stop"
        if reason is not None:
            self.finish_reason = reason
        return text, reason

    def take_logprobs(self) -> dict[str, Any] | None:
        """Log-probabilities of the tokens not sent yet, in OpenAI's shape (None when not asked)."""
        if self.logprobs is None:
            return None
        tokens = self.job.logprobs[self._logprobs_sent:]
        self._logprobs_sent += len(tokens)
        return self.logprobs.format(tokens)

    def content_sent(self) -> None:
        """A chunk with answer text is leaving now (the first one is the time to first content)."""
        if not self.job.record.first_content_ns:
            self.job.record.first_content_ns = time.perf_counter_ns()

    def error(self) -> BadRequest:
        """The 500 of a generation that failed, saying why when its own sampling failed."""
        job = self.job
        why = job.fault or (job.sampler.error if job.sampler is not None else None) or self.engine.scheduler.unavailable
        return BadRequest(f"generation failed: {why}" if why else "generation failed", status=500,
                          error_type="server_error")

    def close(self, status: int, disconnected: bool = False) -> None:
        """The HTTP side is done (last byte sent, or the client left)."""
        record = self.job.record
        record.end_ns = time.perf_counter_ns()
        record.http_status = status
        if disconnected and not self.generation_done:
            record.client_disconnected = True
            self.engine.cancel(self.job)
        self.http_done = True
        if self.generation_done:
            self._finalize()

    def _finalize(self) -> None:
        if self.job.record.finish_reason == "error" and self.job.record.http_status == 200:
            self.job.record.error_type = self.job.record.error_type or "GenerationError"
        self.engine.finished(self.job.record)
        self.http_done = self.generation_done = False  # finalize once

    def usage_body(self) -> dict[str, Any]:
        """Usage as sent to the client (and recorded on the span)."""
        record = self.job.record
        return usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)


async def _handle(engine: Engine, request: Request, kind: str, limits: Limits) -> Response:
    record = RequestRecord(request_id="", endpoint=request.url.path, arrival_ns=time.perf_counter_ns())
    record.request_id = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": record.request_id}
    try:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_bytes:
            raise BadRequest(f"Request body is {declared} bytes; this engine accepts at most {limits.max_bytes} "
                             f"(--max-request-bytes)", status=413)
        body = await request.body()
        if len(body) > LARGE_BODY:
            parsed = await engine.off_loop(parse_request, kind, body, limits)
        else:
            parsed = parse_request(kind, body, limits)
        record.session_id = request.headers.get("x-session-id") or parsed.user
        record.model, record.max_tokens, record.streamed = parsed.model, max_tokens_of(parsed), parsed.stream
        engine.check_model(parsed.model)
        await engine.wait_ready(record)
        job = await engine.new_job(kind, parsed, record)
    except BadRequest as exc:
        record.end_ns = time.perf_counter_ns()
        record.http_status, record.error_type = exc.status, exc.code or exc.error_type
        engine.finished(record)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
    stream = RequestStream(engine, job, stop_strings(parsed), kind)
    engine.submit(job)
    model = engine.settings.served_name
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        events = _events(stream, kind, model, include_usage, engine.settings.keepalive_interval)
        return EventStream(events, stream, headers=headers)
    return await _complete(stream, request, kind, model, headers)


async def _complete(stream: RequestStream, request: Request, kind: str, model: str,
                    headers: dict[str, str]) -> Response:
    watcher = asyncio.ensure_future(_disconnected(request))
    pieces: list[str] = []
    try:
        while True:
            getter = asyncio.ensure_future(stream.next_piece())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                stream.close(499, disconnected=True)
                return Response(status_code=499)
            text, reason = getter.result()
            pieces.append(text)
            if reason is not None:
                break
    finally:
        watcher.cancel()
    record = stream.job.record
    status = 500 if stream.finish_reason == "error" else 200
    if status == 500:
        body = stream.error().body()
    else:
        text = "".join(pieces)
        body = response_body(kind, record.request_id, model, text, stream.finish_reason, stream.usage_body(),
                             stream.take_logprobs())
        if text:
            stream.content_sent()
    stream.close(status)
    return JSONResponse(body, status_code=status, headers=headers)


async def _disconnected(request: Request) -> None:
    # After the body is read, the next ASGI message is http.disconnect when the client leaves.
    while (await request.receive())["type"] != "http.disconnect":
        pass


#: An SSE comment line: clients ignore it, proxies see the stream is alive (mlx_lm.server sends
#: ": keepalive N/M" per prefill chunk).
KEEPALIVE = ": keepalive\n\n"


async def _events(stream: RequestStream, kind: str, model: str, include_usage: bool,
                  keepalive: float) -> AsyncIterator[str]:
    rid = stream.job.record.request_id
    first = True
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None and not stream.queue.empty():
                text, reason = await stream.next_piece()  # the common case while tokens flow
            else:
                # While nothing comes (queued, or a long prefill), a comment now and then keeps the
                # connection from looking idle.
                pending = pending or asyncio.ensure_future(stream.next_piece())
                done, _ = await asyncio.wait({pending}, timeout=keepalive)
                if not done:
                    yield KEEPALIVE
                    continue
                text, reason = pending.result()
                pending = None
            if reason == "error":
                yield _sse(stream.error().body())
                break
            if text or first or reason is not None:
                if text:
                    stream.content_sent()
                yield _sse(chunk_body(kind, rid, model, text, reason, first, stream.take_logprobs()))
                first = False
            if reason is not None:
                break
    finally:
        if pending is not None:
            pending.cancel()
    if include_usage:
        yield _sse(usage_chunk(kind, rid, model, stream.usage_body()))
    yield "data: [DONE]\n\n"
    stream.completed = True


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """SSE response that always tells the stream how it ended: completed, or the client left
    (Starlette cancels a stream on disconnect without closing its generator)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream, headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass  # the client went away while we were writing
        finally:
            await self.body_iterator.aclose()
            self.stream.close(200, disconnected=not self.stream.completed)
