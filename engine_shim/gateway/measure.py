"""From an Exchange's raw chunks to measurements and engine facts (off the request path).

Definitions (docs/gateway.md "What the gateway measures"):
- a *token event* is a streamed document carrying generated output: a choice with a non-empty
  ``delta.content`` / ``delta.reasoning_content`` / ``delta.reasoning`` / ``delta.tool_calls`` or
  ``text`` (OpenAI), or a non-empty ``message.content`` / ``response`` (Ollama's native routes).
  A role-only first chunk, keep-alive comments and the usage-only chunk are not token events;
- a *content event* is a token event with visible text (``delta.content``, ``text``, Ollama's);
- TTFT = arrival at the gateway -> first token event received from the upstream; time to first
  content likewise; decode = first -> last token event; ITL = gaps between token events;
  e2e = arrival -> last byte sent to the client;
- a non-streamed answer is one document: its arrival gives only e2e; TTFT, decode and ITL are
  unknown (None), never zero.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from tokentrace.engine_shim.gateway.adapters.base import (
    FRAMING_JSON,
    FRAMING_NDJSON,
    FRAMING_SSE,
    Adapter,
    Facts,
)
from tokentrace.engine_shim.gateway.records import Exchange


@dataclass
class Measured:
    """What the gateway measured for one request, in perf_counter nanoseconds (None: unknown)."""

    facts: Facts  #: engine-reported facts (adapter)
    first_token_ns: int | None = None  #: first token event
    first_content_ns: int | None = None  #: first content event
    token_ns: list[int] = field(default_factory=list)  #: every token event's arrival
    documents: int = 0  #: JSON documents parsed
    response_id: str | None = None  #: the upstream's own id of the answer (the first document's ``id``)


def measure(exchange: Exchange, adapter: Adapter | None) -> Measured:
    """Split the response into documents, time the token events, and let the adapter read facts."""
    facts = Facts()
    measured = Measured(facts)
    if adapter is not None and exchange.upstream_headers is not None and exchange.status is not None:
        adapter.facts_from_headers(facts, exchange.status, exchange.upstream_headers)
    framing = exchange.route.stream_framing if exchange.streamed else FRAMING_JSON
    for t_ns, payload in documents(exchange.chunks, framing):
        measured.documents += 1
        if measured.response_id is None and isinstance(payload, dict) and isinstance(payload.get("id"), str):
            measured.response_id = payload["id"][:256]
        if adapter is not None:
            adapter.facts_from_payload(facts, payload, exchange.route)
        if not exchange.streamed:
            continue
        token, content = token_kinds(payload)
        if token:
            measured.token_ns.append(t_ns)
            if measured.first_token_ns is None:
                measured.first_token_ns = t_ns
        if content and measured.first_content_ns is None:
            measured.first_content_ns = t_ns
    if adapter is not None:
        adapter.finish(facts)
    return measured


def documents(chunks: list[tuple[int, bytes]], framing: str):
    """(arrival ns, parsed JSON) per document; a document's time is that of the chunk completing it.
    Undecodable documents are skipped."""
    if framing == FRAMING_JSON:
        if chunks:
            payload = _loads(b"".join(data for _, data in chunks))
            if payload is not None:
                yield chunks[-1][0], payload
        return
    separator = b"\n" if framing == FRAMING_NDJSON else b"\n\n"
    buffer = b""
    for t_ns, data in chunks:
        buffer += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        while True:
            end = buffer.find(separator)
            if end < 0:
                break
            block, buffer = buffer[:end], buffer[end + len(separator):]
            payload = _loads(block) if framing == FRAMING_NDJSON else _sse_data(block)
            if payload is not None:
                yield t_ns, payload
    if buffer.strip() and chunks:
        payload = _loads(buffer) if framing == FRAMING_NDJSON else _sse_data(buffer)
        if payload is not None:
            yield chunks[-1][0], payload


def unfinished(chunks: list[tuple[int, bytes]]) -> bool:
    """Whether a streamed SSE answer ended before it finished: its connection closed with no
    ``data: [DONE]``, no choice with a ``finish_reason`` and no error document. An upstream whose
    process died mid-generation ends so: a stock ``mlx_lm.server`` (HTTP/1.0: the body ends when the
    connection closes) under ``mlx.launch``, whose other rank was killed, looks like a normal end
    of body to HTTP. Read once, at the end of a stream, and only past a tail without ``[DONE]``."""
    if b"[DONE]" in b"".join(data for _, data in chunks[-3:])[-64:]:
        return False
    for _, payload in documents(chunks, FRAMING_SSE):
        if not isinstance(payload, dict):
            continue
        if payload.get("error"):
            return False
        if any(isinstance(choice, dict) and choice.get("finish_reason") for choice in payload.get("choices") or ()):
            return False
    return True


def _sse_data(block: bytes) -> Any:
    lines = [line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None  # a comment (": keepalive") or an event without data
    data = b"\n".join(lines)
    if data.strip() == b"[DONE]":
        return None
    return _loads(data)


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def token_kinds(payload: Any) -> tuple[bool, bool]:
    """(carries generated output, carries visible content) for one document (module docstring)."""
    if not isinstance(payload, dict):
        return False, False
    token = content = False
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        text = choice.get("text")
        if delta.get("content") or text:
            token = content = True
        elif delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
            token = True
    message = payload.get("message")
    if (isinstance(message, dict) and message.get("content")) or payload.get("response"):
        token = content = True
    return token, content


def gaps_ms(times_ns: list[int]) -> list[float]:
    """Gaps between consecutive times, in ms."""
    return [(b - a) / 1e6 for a, b in itertools.pairwise(times_ns)]


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile, None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
