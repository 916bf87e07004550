"""The OpenAI-compatible wire format: request validation, answer text and response bodies.

Requests are validated strictly (a string where a number belongs is an error, not a coercion) and
every failure becomes an OpenAI-style 400 whose message names the field, what was expected and
what arrived. Unknown fields are ignored, as OpenAI-compatible servers do. Answer text leaves out
special tokens (vLLM's ``skip_special_tokens`` default) and ends before a stop string.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from tokentrace.engine_shim.mlx.jobs import Sampling


class BadRequest(Exception):
    """A request the engine refuses, with the HTTP status and OpenAI error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.error_type, self.code = message, param, status, error_type, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error envelope."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Strict):
    """One part of a message's content; only text parts are understood."""

    type: str  #: "text" (other kinds are refused)
    text: str | None = None  #: the text of a text part


class Message(_Strict):
    """A chat message."""

    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls etc. reach the chat template
    role: str  #: system, user, assistant, tool (developer is read as system)
    content: str | list[ContentPart] | None = None  #: text, or text parts


class StreamOptions(_Strict):
    """OpenAI stream options."""

    include_usage: bool = False  #: send a final chunk with usage


class _Generation(_Strict):
    model: str | None = None  #: model id; must match the served one when given
    max_tokens: int | None = None  #: completion limit
    max_completion_tokens: int | None = None  #: newer name of max_tokens
    temperature: float | None = None  #: 0 = greedy (default, as in mlx_lm.server)
    top_p: float | None = None  #: nucleus sampling
    top_k: int | None = None  #: top-k sampling (extra)
    min_p: float | None = None  #: min-p sampling (extra)
    n: int = 1  #: only 1 is supported
    stream: bool = False  #: stream server-sent events
    stream_options: StreamOptions | None = None  #: include_usage
    stop: str | list[str] | None = None  #: stop strings
    user: str | None = None  #: end-user id; used as session id when X-Session-Id is absent
    seed: int | None = None  #: accepted for compatibility; batched sampling shares one generator
    ignore_eos: bool = False  #: vLLM extra: generate through EOS up to max_tokens
    min_tokens: int = 0  #: vLLM extra: suppress EOS before this many tokens


class ChatRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[Message]  #: the conversation
    tools: list[dict[str, Any]] | None = None  #: tool definitions, rendered by the chat template


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]  #: text, token ids, or a one-element list of text


def parse_request(kind: Literal["chat", "completion"], body: bytes) -> ChatRequest | CompletionRequest:
    """Decode and validate a request body; raises BadRequest with a precise message."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"Request body must be a JSON object, got {type(data).__name__}")
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        got = error.get("input")
        detail = "is required" if error["type"] == "missing" else f"{error['msg'].lower()}, got {got!r:.80}"
        raise BadRequest(f"'{where}': {detail}", param=str(error["loc"][0])) from None
    _check_values(request)
    return request


def _check_values(request: ChatRequest | CompletionRequest) -> None:
    limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if limit is not None and limit <= 0:
        raise BadRequest(f"'max_tokens' must be at least 1, got {limit}", param="max_tokens")
    if request.n != 1:
        raise BadRequest(f"'n' must be 1 (one choice per request), got {request.n}", param="n")
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise BadRequest(f"'temperature' must be between 0 and 2, got {request.temperature}", param="temperature")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {request.top_p}", param="top_p")
    if request.min_tokens < 0:
        raise BadRequest(f"'min_tokens' must be >= 0, got {request.min_tokens}", param="min_tokens")
    if limit is not None and request.min_tokens > limit:
        raise BadRequest(f"'min_tokens' ({request.min_tokens}) must not exceed max_tokens ({limit})",
                         param="min_tokens")
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise BadRequest("'messages' must contain at least one message", param="messages")
        for i, message in enumerate(request.messages):
            for part in message.content if isinstance(message.content, list) else ():
                if part.type != "text":
                    raise BadRequest(f"'messages.{i}.content': only text parts are supported, got {part.type!r}",
                                     param="messages")
    elif isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], str) \
            and len(request.prompt) != 1:
        raise BadRequest(f"'prompt': one prompt per request, got {len(request.prompt)}", param="prompt")


def max_tokens_of(request: ChatRequest | CompletionRequest) -> int | None:
    """The completion limit the request asked for, if any."""
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


def sampling_of(request: ChatRequest | CompletionRequest) -> Sampling:
    """The decoding settings of a request."""
    return Sampling(
        temperature=request.temperature or 0.0,
        top_p=request.top_p if request.top_p is not None else 1.0,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
    )


def stop_strings(request: ChatRequest | CompletionRequest) -> list[str]:
    """The request's stop strings (empty ones dropped)."""
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return [s for s in stops if s]


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (text parts joined)."""
    messages = []
    for message in request.messages:
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            data["content"] = "".join(part.text or "" for part in message.content)
        data.setdefault("content", "")
        messages.append(data)
    return messages


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI usage with prompt_tokens_details.cached_tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_body(kind: str, request_id: str, model: str, text: str, finish_reason: str | None,
                  usage_body: dict[str, Any]) -> dict[str, Any]:
    """A complete (non-streamed) response."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage_body}


def chunk_body(kind: str, request_id: str, model: str, text: str | None, finish_reason: str | None,
               first: bool = False) -> dict[str, Any]:
    """One streamed chunk (a delta, or the final one carrying finish_reason)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: str, request_id: str, model: str, usage_body: dict[str, Any]) -> dict[str, Any]:
    """The final streamed chunk with usage (stream_options.include_usage)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage_body}


class TextAssembler:
    """Accumulates one answer's text; ``add`` returns the text that may be sent now.

    With stop strings, the last ``len(longest stop) - 1`` characters are held back until it is
    clear they do not begin a stop string, so no stop text ever reaches the client.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], stops: list[str]):
        self._detokenizer = tokenizer.detokenizer  # a fresh copy per call (mlx-lm TokenizerWrapper)
        self._skip = set(eos_token_ids) | set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._sent = 0
        self.stopped = False  #: a stop string matched

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._detokenizer.text[: self._sent]

    def add(self, token: int, final: bool = False, reason: str | None = None) -> tuple[str, bool]:
        """Feed one token (negative: none); returns (text to send now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if token >= 0 and token not in self._skip:
            self._detokenizer.add_token(token)
        if final:
            self._detokenizer.finalize()
        full = self._detokenizer.text
        if self._stops:
            found = self._find_stop(full)
            if found is not None:
                self.stopped = True
                return self._take(full, found), True
            limit = len(full) if final else max(self._sent, len(full) - self._hold)
        else:
            limit = len(full)
        return self._take(full, limit), False

    def _find_stop(self, full: str) -> int | None:
        start = max(0, self._sent - self._hold)
        hits = [pos for pos in (full.find(stop, start) for stop in self._stops) if pos >= 0]
        return min(hits) if hits else None

    def _take(self, full: str, limit: int) -> str:
        piece = full[self._sent : limit]
        self._sent = max(self._sent, limit)
        return piece
