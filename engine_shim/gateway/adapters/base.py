"""The adapter interface: everything one kind of upstream engine knows, in one class.

The gateway core (app, router, observer) sees only this interface (STYLE §20): a new engine is a
new module under ``adapters/`` plus one line in the registry (``adapters/__init__.py``).

Lifecycle of an adapter object (one per upstream):

1. ``detect()`` in the registry calls each class's ``probe(client, base_url)`` in the registry's
   order until one returns a ``Probe``; the operator may skip detection with ``--adapter NAME=KIND``
   (then ``probe`` is not called and ``Probe(kind=KIND)`` is used).
2. The gateway constructs ``cls(name, base_url, client, probe)``.
3. On the request path (cheap, no I/O): ``prepare(route, body)`` may rewrite the JSON body the
   gateway forwards. Nothing else of the adapter runs while bytes flow to the client.
4. Off the request path, on the observer thread, after the response ended: ``facts_from_headers``,
   then ``facts_from_payload`` once per JSON document of the response (each SSE ``data:`` event,
   each NDJSON line, or the one body of a non-streamed answer), in arrival order, then
   ``finish(facts)``. These must not do I/O.
5. On the gateway's event loop, between requests: ``tokenize(...)`` (I/O allowed, bounded by the
   client's timeout) and ``poll()`` every ``--poll-interval`` seconds.

Units: token counts are ints, times are milliseconds (float), never ``0`` for "not reported": a value
the engine did not report is ``None`` (DESIGN "unknown is not zero").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from tokentrace import contract as c

#: Request extension that marks a POST as safe to send twice (``/tokenize``, ``/apply-template``:
#: they change nothing), so that ``StaleConnectionRetry`` may repeat it. GET and HEAD always are.
REPEATABLE = "tokentrace.repeatable"
#: ``extensions=`` for such a POST.
REPEATABLE_POST = {REPEATABLE: True}


class StaleConnectionRetry(httpx.AsyncBaseTransport):
    """The gateway's transport to its upstreams: a request that is safe to repeat and failed before
    any response because the pooled keep-alive connection it went out on had just been closed by the
    upstream ("Server disconnected without sending a response": llama.cpp's server did it to about
    one ``/apply-template`` in twenty of the truth matrix's) is sent once more, on a fresh
    connection. Without it such a poll marks a healthy upstream down, and such a tokenization falls
    back to a byte-level fingerprint (segments in bytes, not tokens: a prefix change read as a new
    prompt). Generation requests are never repeated: they are not safe to send twice."""

    RETRIED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

    def __init__(self, inner: httpx.AsyncBaseTransport):
        self.inner = inner
        self.retried = 0  #: requests sent a second time

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except self.RETRIED:
            if request.method not in ("GET", "HEAD") and not request.extensions.get(REPEATABLE):
                raise
            self.retried += 1
            return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


#: Who observed a row (the ``observer`` column; docs/telemetry.md): a tokentrace engine measured it
#: inside, the vLLM plugin inside vLLM, the engine's own OpenTelemetry spans, or the gateway outside.
OBSERVER_ENGINE = c.OBSERVER_ENGINE
OBSERVER_PLUGIN = c.OBSERVER_PLUGIN
OBSERVER_NATIVE = c.OBSERVER_NATIVE
OBSERVER_GATEWAY = c.OBSERVER_GATEWAY

#: What an adapter can declare it measures (``Adapter.measures``). The gateway itself always measures
#: ``ttft``, ``e2e``, ``itl`` (streamed chunk times) and ``gateway_wait``.
MEASURES = (
    "prompt_tokens",  #: prompt token count (usage block or engine field)
    "completion_tokens",  #: completion token count
    "cached_tokens",  #: prompt tokens the engine reused from its cache
    "queue",  #: time the request waited inside the engine
    "load_wait",  #: time the request waited for a model load
    "prefill",  #: time the engine spent on the prompt
    "decode",  #: time the engine spent generating (engine clock, not chunk arrival)
    "slot",  #: which slot / cache entry served the request
    "cache_state",  #: instance-level cache used/capacity (poll)
    "queue_state",  #: instance-level running/waiting counts (poll)
    "lifecycle",  #: instance lifecycle events (loading, ready, unloaded) (poll)
    "tokenize",  #: the engine tokenizes prompts for the gateway (fingerprints in its own tokens)
    "fingerprint",  #: the engine sends its own prompt fingerprint (llm.cache.lookup): the gateway sends none
)

#: Framing of a response body the gateway must split into JSON documents.
FRAMING_SSE = "sse"  #: ``text/event-stream``; one document per ``data:`` line, ``[DONE]`` ignored
FRAMING_NDJSON = "ndjson"  #: one JSON document per line (Ollama's native streaming)
FRAMING_JSON = "json"  #: the whole body is one document


@dataclass(frozen=True)
class Route:
    """A POST route the gateway forwards and observes.

    The gateway always serves ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI; streamed when
    the body says ``"stream": true``, as SSE). Adapters add native routes through
    ``Adapter.extra_routes`` (e.g. Ollama's ``/api/chat``), which the gateway serves only when every
    upstream that may receive them declares them (requests go only to upstreams that declare the route).
    """

    path: str  #: path on the gateway and on the upstream, e.g. "/api/chat"
    kind: str  #: "chat" (body has ``messages``) or "completion" (body has ``prompt``)
    stream_framing: str = FRAMING_SSE  #: framing when the request streams
    stream_default: bool = False  #: whether a body without a ``stream`` field streams (Ollama: True)
    messages_field: str = "messages"  #: body field holding the chat messages (chat routes)
    prompt_field: str = "prompt"  #: body field holding the prompt text (completion routes)


CHAT = Route("/v1/chat/completions", "chat")
COMPLETIONS = Route("/v1/completions", "completion")


@dataclass(frozen=True)
class Probe:
    """What probing an upstream found. ``kind`` names the adapter class in the registry."""

    kind: str  #: registry key of the adapter that recognised the upstream
    version: str | None = None  #: the engine's version, when it tells
    models: tuple[str, ...] = ()  #: models it serves, when it lists them
    reports_itself: bool = False  #: it sends its own tokentrace telemetry (engine or plugin)
    observer: str = OBSERVER_GATEWAY  #: who observes its requests (OBSERVER_* above)
    instance_id: str | None = None  #: its own service.instance.id, when it reports itself
    cache_block_tokens: int = 1  #: the engine caches prompts in whole blocks of this many tokens
    details: dict[str, Any] = field(default_factory=dict)  #: anything else the probe learnt


@dataclass
class Facts:
    """Per-request facts the adapter extracted from the response (engine-reported, not measured by
    the gateway). Every field defaults to None: not reported. Adapters only fill; the gateway reads."""

    prompt_tokens: int | None = None  #: prompt tokens (usage.prompt_tokens or engine field)
    completion_tokens: int | None = None  #: generated tokens
    cached_tokens: int | None = None  #: prompt tokens reused from the engine's cache
    queue_ms: float | None = None  #: waited inside the engine before it started
    load_ms: float | None = None  #: waited for a model load
    prefill_ms: float | None = None  #: engine time on the prompt
    decode_ms: float | None = None  #: engine time generating
    finish_reasons: list[str] = field(default_factory=list)  #: one per choice, in choice order
    slot: str | None = None  #: slot / cache entry that served it (llama.cpp ``id_slot``)
    upstream_request_id: str | None = None  #: the engine's own id for the request (response ``id``)
    error: str | None = None  #: an error the engine reported inside a 200 response (stream error event)
    evidence: dict[str, str | int | float | bool] = field(default_factory=dict)
    """Engine-specific facts worth showing as evidence, flat and JSON-serialisable
    (e.g. ``{"timings.prompt_per_token_ms": 1.2}``); sent as one JSON attribute."""


@dataclass(frozen=True)
class LifecycleEvent:
    """Something that happened to an instance, seen by polling (a model loaded or unloaded)."""

    name: str  #: contract lifecycle event name (instance.ready, instance.stopped, ...) or engine-specific
    time_unix_ns: int  #: when the poll saw it (or when the engine says it happened)
    detail: str = ""  #: human text, e.g. "model qwen unloaded (keep-alive expired)"


@dataclass(frozen=True)
class InstanceState:
    """An upstream's state at one poll. None: the engine does not say."""

    reachable: bool  #: the poll got an answer at all
    ready: bool | None = None  #: it serves requests now
    loading: bool | None = None  #: a model is loading
    running: int | None = None  #: requests being generated
    waiting: int | None = None  #: requests queued inside the engine
    cache_used: float | None = None  #: cache occupancy, in ``cache_unit``
    cache_capacity: float | None = None  #: cache capacity, in ``cache_unit``
    cache_unit: str | None = None  #: "tokens" | "bytes" | "blocks" | "ratio" (capacity 1.0)
    models: tuple[str, ...] = ()  #: models loaded now
    events: tuple[LifecycleEvent, ...] = ()  #: new since the previous poll
    findings: tuple[str, ...] = ()  #: human-readable problems the poll found (e.g. "runner stuck")


class Adapter:
    """Base class: the generic OpenAI-compatible behaviour; subclasses override what differs.

    Class attributes are the adapter's declaration; instances hold one upstream's connection.
    """

    kind: ClassVar[str] = ""  #: registry key, e.g. "openai", "mlx_lm", "vllm", "llama.cpp"
    engine: ClassVar[str] = "openai-compatible"  #: value of the resource attribute tokentrace.engine
    measures: ClassVar[frozenset[str]] = frozenset()  #: subset of MEASURES the engine reports
    extra_routes: ClassVar[tuple[Route, ...]] = ()  #: native routes beyond CHAT and COMPLETIONS

    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient, probe: Probe):
        self.name = name  #: the operator's name for the upstream: the instance id of its rows
        self.base_url = base_url.rstrip("/")  #: e.g. "http://10.0.0.11:8080"
        self.client = client  #: shared client; use it for every call (timeouts are set on it)
        self.probe_result = probe  #: what probing found

    # --- detection ------------------------------------------------------------------------------
    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """Whether ``base_url`` is this kind of engine: a Probe if so, None if not.

        Must not raise for an upstream of another kind (catch ``httpx.HTTPError`` and bad JSON);
        may take at most a few small GETs; must not send a generation request. The registry calls
        the classes in its DETECT_ORDER, most specific first, and the generic OpenAI adapter last.
        """
        return None

    @classmethod
    def forced_probe(cls) -> Probe:
        """What to assume when the operator names this kind (``--adapter NAME=KIND``) and probing
        finds nothing (the upstream is down at start, or hides its markers)."""
        return Probe(kind=cls.kind)

    @property
    def reports_itself(self) -> bool:
        """The upstream sends its own tokentrace telemetry (a tokentrace engine, vLLM with the
        plugin): the gateway then emits only its own hop and never a second request row."""
        return self.probe_result.reports_itself

    @property
    def observer(self) -> str:
        """Who observes this upstream's requests (an OBSERVER_* value)."""
        return self.probe_result.observer

    # --- request path ---------------------------------------------------------------------------
    def prepare(self, route: Route, body: dict[str, Any], streamed: bool) -> dict[str, Any]:
        """The JSON body to forward (return ``body`` itself when nothing changes; never mutate a
        field the client set). Called on the request path: no I/O, microseconds.

        The base asks OpenAI-compatible streams for a final usage chunk
        (``stream_options.include_usage``) when the client did not set ``stream_options``; the
        gateway strips that usage-only chunk from what the client receives only if the client did
        not ask for it (``Facts`` still get it)."""
        if streamed and route.stream_framing == FRAMING_SSE and "stream_options" not in body:
            return {**body, "stream_options": {"include_usage": True}}
        return body

    # --- observer thread ------------------------------------------------------------------------
    def facts_from_headers(self, facts: Facts, status: int, headers: httpx.Headers) -> None:
        """Fill ``facts`` from the response status and headers (e.g. an engine timing header)."""

    def facts_from_payload(self, facts: Facts, payload: Any, route: Route) -> None:
        """Fill ``facts`` from one JSON document of the response (a streamed chunk or the whole
        body; ``payload`` is whatever ``json.loads`` returned). Later documents may overwrite
        earlier values (the last usage block wins). The base reads the OpenAI shape: ``id``,
        ``usage.{prompt,completion}_tokens``, ``usage.prompt_tokens_details.cached_tokens``,
        ``choices[].finish_reason`` and a top-level ``error``."""
        if not isinstance(payload, dict):
            return
        if isinstance(payload.get("id"), str) and facts.upstream_request_id is None:
            facts.upstream_request_id = payload["id"]
        usage = payload.get("usage")
        if isinstance(usage, dict):
            facts.prompt_tokens = _int(usage.get("prompt_tokens"), facts.prompt_tokens)
            facts.completion_tokens = _int(usage.get("completion_tokens"), facts.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                facts.cached_tokens = _int(details.get("cached_tokens"), facts.cached_tokens)
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                index = choice.get("index", 0) if isinstance(choice.get("index"), int) else 0
                while len(facts.finish_reasons) <= index:
                    facts.finish_reasons.append("")
                facts.finish_reasons[index] = str(choice["finish_reason"])
        error = payload.get("error")
        if error:
            facts.error = str(error.get("message") if isinstance(error, dict) else error)[:200]

    def finish(self, facts: Facts) -> None:
        """Last call for a request's facts, after every document (derive totals here)."""

    # --- between requests (event loop, I/O allowed) ----------------------------------------------
    async def tokenize(self, route: Route, body: dict[str, Any],
                       messages: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True) -> list[int] | None:
        """The engine's own token ids for a prompt, or None when it has no tokenize endpoint or the
        call failed (never raise for that).

        ``messages`` given: tokenize those chat messages through the engine's chat template (the
        gateway calls this with growing prefixes of the request's messages and
        ``add_generation_prompt=False`` to find each message's token span, then the whole list with
        ``add_generation_prompt=True``). ``messages`` None: tokenize ``body[route.prompt_field]``
        (completion routes). ``body`` is the client's request (for ``model`` and template options).
        """
        return None

    def cluster_view(self) -> list[dict[str, Any]] | None:
        """A multi-node upstream's instances as of the latest poll (model, nodes, layers, runner stage,
        readiness stages), sent as a ``cluster.state`` span when it changes; None (the default) for an
        engine that is one process."""
        return None

    async def poll(self) -> InstanceState:
        """The upstream's state now. The base GETs ``/health`` (then ``/v1/models``): reachable and
        ready when it answers 2xx. Must not raise for a down upstream: ``reachable=False``."""
        for path in ("/health", "/v1/models"):
            try:
                response = await self.client.get(self.base_url + path)
            except httpx.HTTPError:
                return InstanceState(reachable=False)
            if response.status_code != 404:
                return InstanceState(reachable=True, ready=response.is_success)
        return InstanceState(reachable=True, ready=None)


def _int(value: Any, default: int | None) -> int | None:
    """``value`` when it is a non-negative int (bool excluded), else ``default``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return default
