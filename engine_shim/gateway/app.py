"""The gateway's ASGI app: OpenAI-compatible routes forwarded to one upstream each, streamed through.

The request path does the least it can: parse the JSON body, choose an upstream, wait for a slot
(measured), forward, and copy the answer's bytes to the client as they arrive while appending
``(perf_counter_ns, bytes)`` to the exchange. Everything else happens after the last byte
(``observe.py``).

Responses pass through unchanged (engine-specific fields included) with ``X-Request-Id`` added;
the one change: when the gateway itself asked an OpenAI stream for usage
(``stream_options.include_usage``), the usage-only chunk the client did not ask for is not sent.
Failures (docs/gateway.md "Failure and admission"): an upstream that refuses the connection, times
out connecting or answers 5xx before any byte reached the client is marked (down after
``--down-after`` failures) and the request goes to another; once bytes were sent, a broken stream
ends with an SSE ``error`` event. Every accepted request ends with an answer or an error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any

import httpx

from tokentrace import contract as c
from tokentrace.collector.receiver.budget import Budget
from tokentrace.engine_shim.gateway.adapters import adapter_class, detect
from tokentrace.engine_shim.gateway.adapters.base import (
    CHAT,
    COMPLETIONS,
    FRAMING_SSE,
    Route,
    StaleConnectionRetry,
)
from tokentrace.engine_shim.gateway.measure import unfinished
from tokentrace.engine_shim.gateway.observe import Observer
from tokentrace.engine_shim.gateway.prompt import routing_blocks
from tokentrace.engine_shim.gateway.records import Exchange
from tokentrace.engine_shim.gateway.router import Router
from tokentrace.engine_shim.gateway.settings import GatewaySettings
from tokentrace.engine_shim.gateway.upstreams import Upstream

log = logging.getLogger(__name__)

#: Request headers forwarded upstream (others, e.g. the gateway's own Authorization, are not).
FORWARD_HEADERS = ("content-type", "accept", "x-session-id", "user-agent", "traceparent", "tracestate")
#: Response headers never copied from the upstream (hop-by-hop, or recomputed by the server).
DROP_RESPONSE_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date",
                                   "server", "x-request-id"})


class RateLimiter:
    """A token bucket per client: ``rate`` requests per second, bursts of ``max(1, rate)``."""

    def __init__(self, rate: float):
        self.rate = rate
        self.burst = max(1.0, rate)
        self._buckets: dict[str, tuple[float, float]] = {}

    def retry_after(self, client: str) -> int:
        """0 when the request may pass (a token is taken), else seconds to wait."""
        if self.rate <= 0:
            return 0
        now = time.monotonic()
        tokens, then = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self._buckets[client] = (tokens - 1.0, now)
            return 0
        self._buckets[client] = (tokens, now)
        return max(1, math.ceil((1.0 - tokens) / self.rate))


#: Bytes a request body holds per byte while its request lasts: the body and its parsed JSON (mostly
#: the strings of its messages, about the body's own size). The bodies in flight are charged as they
#: arrive against ``--max-pending-bytes`` (the collector's ``Budget``: a request alone is admitted)
#: and held until their answers end: each body was bounded by ``--max-request-bytes``, but not their
#: sum (bench/attacks.py saw 4.4 x that limit with 4 senders, 7.5 x with 8).
BODY_COPIES = 2


class Gateway:
    """The ASGI application and the state it routes with."""

    def __init__(self, settings: GatewaySettings, observer: Observer):
        self.settings = settings
        self.observer = observer
        self.upstreams = [Upstream(name, url, settings.max_concurrency) for name, url in settings.upstream]
        self.forced = dict(settings.adapter)
        self.router = Router(settings.route, self.upstreams, settings.prefix_load_bound)
        self.limiter = RateLimiter(settings.rate_limit)
        self.bodies = Budget(settings.max_pending_bytes)
        self.bodies_refused = 0  #: requests answered 503 for --max-pending-bytes
        self.client: httpx.AsyncClient | None = None
        self.routes: dict[str, Route] = {CHAT.path: CHAT, COMPLETIONS.path: COMPLETIONS}
        self._poller: asyncio.Task | None = None

    # --- lifespan ----------------------------------------------------------------------------------
    async def startup(self) -> None:
        """Open the client, detect every upstream, start polling."""
        timeout = httpx.Timeout(self.settings.request_timeout, connect=self.settings.connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        keys = {u.base_url: key for u in self.upstreams for name, key in self.settings.upstream_key
                if u.name == name}
        transport = StaleConnectionRetry(httpx.AsyncHTTPTransport(limits=limits, trust_env=False))
        self.client = httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False,
                                        auth=UpstreamKeys(keys) if keys else None)
        await asyncio.gather(*(self._detect(u) for u in self.upstreams))
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def shutdown(self) -> None:
        """Stop polling, export what is left, close the client."""
        if self._poller is not None:
            self._poller.cancel()
        await self.observer.drain()
        if self.client is not None:
            await self.client.aclose()

    async def _detect(self, upstream: Upstream) -> None:
        forced = self.forced.get(upstream.name)
        if forced is not None:
            cls = adapter_class(forced)
            probe = await cls.probe(self.client, upstream.base_url) or cls.forced_probe()
        else:
            probe = await detect(self.client, upstream.base_url)
            if probe is None:
                upstream.down, upstream.down_reason = True, "not reachable at start"
                return
            cls = adapter_class(probe.kind)
        upstream.adapter = cls(upstream.name, upstream.base_url, self.client, probe)
        for route in cls.extra_routes:
            self.routes.setdefault(route.path, route)
        log.info("upstream %s at %s: %s", upstream.name, upstream.base_url, probe.kind)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval)
            await asyncio.gather(*(self._poll(u) for u in self.upstreams), return_exceptions=True)

    async def _poll(self, upstream: Upstream) -> None:
        if upstream.adapter is None:
            await self._detect(upstream)
            if upstream.adapter is None:
                return
        state = await upstream.adapter.poll()
        view = upstream.adapter.cluster_view()
        if view is not None:
            self.observer.cluster(upstream.name, upstream.adapter, view, state.findings)
        if state.reachable and state.ready is not False:
            if upstream.succeed():
                self.observer.lifecycle(upstream.name, upstream.adapter, c.EVENT_READY, "healthy again")
        elif not upstream.down:
            self._fail(upstream, "unreachable" if not state.reachable else "not ready", force=True)

    def _fail(self, upstream: Upstream, reason: str, force: bool = False) -> None:
        down_after = 1 if force else self.settings.down_after
        if upstream.fail(reason, down_after):
            log.warning("upstream %s marked down: %s", upstream.name, reason)
            self.observer.lifecycle(upstream.name, upstream.adapter, c.EVENT_DOWN, reason)

    # --- ASGI -----------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not self._authorized(headers):
            await _json(send, 401, {"error": {"message": "missing or wrong API key", "type": "unauthorized"}},
                        {"WWW-Authenticate": "Bearer"})
            return
        if method == "GET" and path in ("/health", "/healthz"):
            await _json(send, 200, self.health())
            return
        if method == "GET" and path in ("/v1/models", "/models"):
            await _json(send, 200, self.models())
            return
        if method == "GET" and path.startswith(("/v1/models/", "/models/")):
            # One model, as the engines behind the gateway serve it (ids may hold "/": org/name).
            wanted = path.split("/models/", 1)[1]
            found = next((m for m in self.models()["data"] if m["id"] == wanted), None)
            if found is None:
                await _json(send, 404, {"error": {"message": f"The model '{wanted}' does not exist: no upstream "
                                                             "serves it (GET /v1/models lists what they serve)",
                                                  "type": "invalid_request_error", "param": "model",
                                                  "code": "model_not_found"}})
            else:
                await _json(send, 200, found)
            return
        route = self.routes.get(path) or self.routes.get("/v1" + path)
        if method != "POST" or route is None:
            await _json(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})
            return
        await self.proxy(route, scope, headers, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _authorized(self, headers: dict[str, str]) -> bool:
        key = self.settings.api_key
        if not key:
            return True
        scheme, _, given = headers.get("authorization", "").partition(" ")
        # Constant time: how long the comparison takes says nothing about how much of the key matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())

    def health(self) -> dict[str, Any]:
        """The gateway's view of its upstreams (also what `/health` answers)."""
        return {"status": "ok" if any(u.usable for u in self.upstreams) else "no_upstream",
                "route": self.router.policy,
                "upstreams": [{"name": u.name, "url": u.base_url, "kind": u.adapter.kind if u.adapter else None,
                               "down": u.down, "reason": u.down_reason or None, "inflight": u.inflight,
                               "waiting": u.waiting, "served": u.served} for u in self.upstreams],
                "pending": {**self.bodies.snapshot(), "refused": self.bodies_refused}}

    def models(self) -> dict[str, Any]:
        """Models the usable upstreams said they serve (their probe), once each."""
        seen: dict[str, dict] = {}
        for u in self.upstreams:
            for model in (u.adapter.probe_result.models if u.adapter else ()):
                seen.setdefault(model, {"id": model, "object": "model", "created": 0, "owned_by": u.name})
        return {"object": "list", "data": list(seen.values())}

    # --- the request path -------------------------------------------------------------------------
    async def proxy(self, route: Route, scope: dict, headers: dict[str, str], receive, send) -> None:
        """Forward one request and stream the answer back (module docstring), its body held against
        ``--max-pending-bytes`` until the answer ends."""
        held = [0]
        try:
            await self._proxy(route, scope, headers, receive, send, held)
        finally:
            self.bodies.give(held[0])

    async def _proxy(self, route: Route, scope: dict, headers: dict[str, str], receive, send,
                     held: list[int]) -> None:
        arrival = time.perf_counter_ns()
        request_id = headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
        reply = {"X-Request-Id": request_id}
        try:
            raw = await self._read_body(headers, receive, held)
        except _BodyRefused as refused:
            retry = {"Retry-After": "1"} if refused.status == 503 else {}
            await _json(send, refused.status, _error(str(refused), refused.kind),
                        {**reply, **retry, "Connection": "close"})
            return
        client = headers.get("authorization") or (scope.get("client") or ("?",))[0]
        wait = self.limiter.retry_after(client)
        if wait:
            await _json(send, 429, _error("rate limit exceeded", "rate_limited"),
                        {**reply, "Retry-After": str(wait)})
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            await _json(send, 400, _error("the body must be a JSON object", "invalid_request_error"), reply)
            return
        session = headers.get("x-session-id") or (body.get("user") if isinstance(body.get("user"), str) else None)
        streamed = bool(body.get("stream", route.stream_default))
        exchange = Exchange(request_id, session, route, body, streamed, arrival, policy=self.router.policy)
        try:
            await self._forward(exchange, headers, reply, send, receive)
        finally:
            if exchange.end_ns is None:
                exchange.end_ns = time.perf_counter_ns()
            upstream = exchange.decision.upstream if exchange.decision else None
            self.observer.submit(exchange, upstream.adapter if upstream else None)

    async def _read_body(self, headers: dict[str, str], receive, held: list[int]) -> bytes:
        """The request body, read as it arrives and never past ``--max-request-bytes`` (413, as the
        engine answers), within ``--body-timeout`` seconds plus one second per ``--body-min-rate``
        bytes received (408: as the collector's ``BodyDeadline``), so that neither a huge body nor an
        idle connection holds the gateway's memory. Each chunk is charged to ``held`` against
        ``--max-pending-bytes``; past it the rest of the body is read and dropped (so that the client
        reads the answer) and the request gets 503 + Retry-After."""
        limit, timeout, rate = (self.settings.max_request_bytes, self.settings.body_timeout,
                                self.settings.body_min_rate)
        too_large = f"this gateway accepts at most {limit} (--max-request-bytes)"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _BodyRefused(413, "request_too_large", f"Request body is {declared} bytes; {too_large}")
        chunks, received, began, full = [], 0, time.monotonic(), False
        while True:
            left = began + timeout + received / rate - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except TimeoutError:
                raise _BodyRefused(408, "request_timeout", (
                    f"the request body did not arrive in time: {received} bytes in {timeout:g} s + 1 s per "
                    f"{rate} bytes received (--body-timeout, --body-min-rate)")) from None
            if message["type"] != "http.request":
                break
            body = message.get("body", b"")
            received += len(body)
            if received > limit:
                raise _BodyRefused(413, "request_too_large", f"Request body is over {limit} bytes; {too_large}")
            if not full and self.bodies.take(BODY_COPIES * len(body), held[0]):
                held[0] += BODY_COPIES * len(body)
                chunks.append(body)
            elif not full:  # dropped from here on; what was held goes back at once
                full = True
                chunks.clear()
                self.bodies.give(held[0])
                held[0] = 0
                self.bodies_refused += 1
            if not message.get("more_body"):
                break
        if full:
            raise _BodyRefused(503, "overloaded", (
                f"the gateway holds as many request body bytes as --max-pending-bytes allows "
                f"({self.bodies.limit}, each body counted {BODY_COPIES} x); retry later"))
        return b"".join(chunks)

    async def _forward(self, exchange: Exchange, headers: dict[str, str], reply: dict[str, str], send,
                       receive) -> None:
        blocks = (routing_blocks(exchange.route, exchange.body, self.settings.block_size)
                  if self.router.policy == c.POLICY_PREFIX else None)
        # A native route (an adapter's extra route) goes only to upstreams whose adapter declares it.
        tried: set[str] = set() if exchange.route in (CHAT, COMPLETIONS) else {
            u.name for u in self.upstreams if u.adapter is None or exchange.route not in u.adapter.extra_routes}
        while True:
            decision = self.router.choose(exchange.session_id, blocks, tried)
            if decision is None:
                exchange.status, exchange.error_type = 503, "no_upstream"
                await _json(send, 503, _error("no upstream is available", "no_upstream"),
                            {**reply, "Retry-After": "1"})
                return
            upstream = decision.upstream
            exchange.decision, exchange.attempts = decision, exchange.attempts + 1
            tried.add(upstream.name)
            exchange.queue_depth, exchange.queue_running = upstream.waiting, upstream.inflight
            exchange.wait_ns += await upstream.acquire()
            exchange.admitted_ns = time.perf_counter_ns()
            try:
                response = await self._send(exchange, upstream, headers)
            except httpx.HTTPError as exc:
                upstream.release()
                self._fail(upstream, _describe(exc))
                exchange.skipped.append(f"{upstream.name}:{_describe(exc)}")
                continue
            if response.status_code >= 500 and self._others(tried):
                await response.aclose()
                upstream.release()
                self._fail(upstream, f"HTTP {response.status_code}")
                exchange.skipped.append(f"{upstream.name}:HTTP {response.status_code}")
                continue
            upstream.succeed()
            upstream.served += 1
            self.router.served(decision, exchange.session_id, blocks)
            try:
                await self._relay(exchange, response, reply, send, receive)
            finally:
                upstream.release()
            return

    def _others(self, tried: set[str]) -> bool:
        return any(u.usable and u.name not in tried for u in self.upstreams)

    async def _send(self, exchange: Exchange, upstream: Upstream, headers: dict[str, str]) -> httpx.Response:
        forward = upstream.adapter.prepare(exchange.route, exchange.body, exchange.streamed)
        exchange.injected_usage = forward is not exchange.body and "stream_options" not in exchange.body
        out = {k: v for k, v in headers.items() if k in FORWARD_HEADERS}
        if headers.get("authorization") and not self.settings.api_key:
            out["authorization"] = headers["authorization"]  # the upstream's own key, passed through
        out.update({"x-request-id": exchange.request_id, "accept-encoding": "identity",
                    "content-type": "application/json"})
        if exchange.session_id:
            out["x-session-id"] = exchange.session_id
        request = self.client.build_request("POST", upstream.base_url + exchange.route.path,
                                            content=json.dumps(forward).encode(), headers=out)
        exchange.sent_ns = time.perf_counter_ns()
        response = await self.client.send(request, stream=True)
        exchange.headers_ns = time.perf_counter_ns()
        return response

    async def _relay(self, exchange: Exchange, response: httpx.Response, reply: dict[str, str], send,
                     receive) -> None:
        exchange.status, exchange.upstream_headers = response.status_code, response.headers
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.multi_items()
               if k.lower() not in DROP_RESPONSE_HEADERS]
        out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.items()]
        strip = exchange.injected_usage and exchange.streamed and exchange.route.stream_framing == FRAMING_SSE
        gone = asyncio.get_running_loop().create_task(_disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            pending = b""
            async for data in response.aiter_raw():
                exchange.chunks.append((time.perf_counter_ns(), data))
                if strip:
                    data, pending = _without_usage(pending + data)
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                if gone.done():
                    raise _ClientGone
            if (exchange.streamed and response.status_code == 200
                    and response.headers.get("content-type", "").startswith("text/event-stream")
                    and unfinished(exchange.chunks)):
                raise _Unfinished
            await send({"type": "http.response.body", "body": pending, "more_body": False})
        except (_ClientGone, OSError):
            exchange.client_disconnected = True
        except (httpx.HTTPError, _Unfinished) as exc:
            reason = UNFINISHED if isinstance(exc, _Unfinished) else _describe(exc)
            exchange.error_type = f"upstream_broke: {reason}"
            self._fail(exchange.decision.upstream, reason)
            if exchange.streamed and not gone.done():
                event = json.dumps(_error(f"upstream {exchange.decision.upstream.name} failed mid-stream: {reason}",
                                          "upstream_error"))
                try:
                    await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(),
                                "more_body": False})
                except OSError:
                    exchange.client_disconnected = True
        finally:
            exchange.end_ns = time.perf_counter_ns()
            gone.cancel()
            await response.aclose()


class _ClientGone(Exception):
    """The client disconnected while the answer streamed."""


#: A stream the upstream closed before it finished (measure.unfinished): its process died mid-answer.
UNFINISHED = "stream ended unfinished (no finish_reason, no [DONE])"


class _Unfinished(Exception):
    """The upstream closed a streamed answer before it finished."""


async def _disconnected(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _without_usage(data: bytes) -> tuple[bytes, bytes]:
    """Complete SSE events of ``data`` minus usage-only chunks, and the incomplete rest."""
    end = data.rfind(b"\n\n")
    if end < 0:
        return b"", data
    complete, rest = data[: end + 2], data[end + 2:]
    if b'"usage"' not in complete:
        return complete, rest
    kept = [event for event in complete.split(b"\n\n")
            if not (b'"usage"' in event and (b'"choices":[]' in event or b'"choices": []' in event))]
    return b"\n\n".join(kept), rest


class _BodyRefused(Exception):
    """A request body the gateway does not read to its end: too large (413) or too slow (408)."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


class UpstreamKeys(httpx.Auth):
    """``Authorization: Bearer KEY`` on every request to an upstream that requires a key
    (``--upstream-key NAME=KEY``): forwarded requests, detection, polls, ``/tokenize``. The key
    replaces whatever the client sent."""

    def __init__(self, keys: dict[str, str]):
        self.keys = keys  #: upstream base URL -> key

    def auth_flow(self, request: httpx.Request):
        url = str(request.url)
        for base, key in self.keys.items():
            if url == base or url.startswith(base + "/"):
                request.headers["Authorization"] = f"Bearer {key}"
                break
        yield request


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


def _describe(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    if isinstance(exc, httpx.ReadTimeout):
        return "read timeout"
    return type(exc).__name__


async def _json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    out = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": data})
