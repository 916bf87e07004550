"""Request bodies as the engine accepts them: decoded, bounded and validated at the API boundary.

Every field a request can set is checked here — type, range, finite — so that nothing a client
sends can fail inside the generation loop, where one sequence's error would reach the whole batch
(issue 12: a ``top_k`` of 10⁹ failed three unrelated generations at token 139). A refusal is an
OpenAI-style 400 naming the parameter, what was expected and what arrived. Ranges follow what
mlx-lm's samplers and logits processors accept (sample_utils.py), so that every accepted value
also works there; checks that need the model (vocabulary size) are in ``check_for_model``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from tokentrace.engine_shim.mlx.jobs import Sampling
from tokentrace.engine_shim.mlx.protocol import BadRequest

#: JSON nesting allowed in a request body (chat messages with tool schemas need ~10).
MAX_JSON_DEPTH = 64
#: Most log-probability alternatives per token (OpenAI's limit for top_logprobs).
MAX_TOP_LOGPROBS = 20
#: Stop strings per request, and characters per stop string: each is searched for in the answer
#: on the event loop after every token.
MAX_STOPS, MAX_STOP_CHARS = 32, 1024


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ContentPart(_Strict):
    """One part of a message's content; only text parts are understood."""

    type: str  #: "text" (other kinds are refused)
    text: str | None = None  #: the text of a text part


class Message(_Strict):
    """A chat message."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # tool_calls reach the template
    role: str  #: system, user, assistant, tool (developer is read as system)
    content: str | list[ContentPart] | None = None  #: text, or text parts


class StreamOptions(_Strict):
    """OpenAI stream options."""

    include_usage: bool = False  #: send a final chunk with usage


class _Generation(_Strict):
    model: str | None = None  #: model id; must match the served one when given
    max_tokens: int | None = None  #: completion limit
    max_completion_tokens: int | None = None  #: newer name of max_tokens
    temperature: float | None = None  #: 0 = greedy (default --temp, as in mlx_lm.server)
    top_p: float | None = None  #: nucleus sampling in [0, 1]; 0 or 1 disable it (mlx-lm)
    top_k: int | None = None  #: top-k sampling; 0 disables it
    min_p: float | None = None  #: min-p sampling in [0, 1]; 0 disables it
    xtc_probability: float = 0.0  #: mlx-lm's XTC sampling: probability of applying it
    xtc_threshold: float = 0.1  #: XTC threshold in [0, 0.5]
    repetition_penalty: float = 0.0  #: mlx-lm's multiplicative penalty; 0 disables it
    repetition_context_size: int = 20  #: tokens the repetition penalty looks back on
    presence_penalty: float = 0.0  #: additive penalty for tokens present in the context
    presence_context_size: int = 20  #: tokens the presence penalty looks back on
    frequency_penalty: float = 0.0  #: additive penalty per occurrence in the context
    frequency_context_size: int = 20  #: tokens the frequency penalty looks back on
    logit_bias: dict[str, float] | None = None  #: token id (as a string) -> bias added to its logit
    seed: int | None = None  #: reproducible sampling for this request
    n: int = 1  #: only 1 is supported
    stream: bool = False  #: stream server-sent events
    stream_options: StreamOptions | None = None  #: include_usage
    stop: str | list[str] | None = None  #: stop strings
    user: str | None = None  #: end-user id; used as session id when X-Session-Id is absent
    ignore_eos: bool = False  #: vLLM extra: generate through EOS up to max_tokens
    min_tokens: int = 0  #: vLLM extra: suppress EOS before this many tokens
    chat_template_kwargs: dict[str, Any] | None = None  #: extra arguments for the chat template
    #: only {"type": "text"} (the default); JSON modes need constrained decoding, which this engine
    #: does not do: refused with a 400 rather than answered with text that may not be JSON
    response_format: dict[str, Any] | None = None


class ChatRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[Message]  #: the conversation
    tools: list[dict[str, Any]] | None = None  #: tool definitions, rendered by the chat template
    logprobs: bool = False  #: return the log-probability of each generated token
    top_logprobs: int | None = None  #: alternatives per token (needs logprobs)


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]  #: text, token ids, or a one-element list of text
    logprobs: int | bool | None = None  #: OpenAI: alternatives per token (0-5); mlx_lm.server: true
    top_logprobs: int | None = None  #: mlx_lm.server's name for the alternatives per token


@dataclass(frozen=True)
class Limits:
    """Bounds on one request, from the engine's settings."""

    max_bytes: int  #: request body size
    max_messages: int  #: chat messages


def parse_request(kind: Literal["chat", "completion"], body: bytes, limits: Limits) -> ChatRequest | CompletionRequest:
    """Decode, bound and validate a request body; raises BadRequest with a precise message."""
    if len(body) > limits.max_bytes:
        raise BadRequest(f"Request body is {len(body)} bytes; this engine accepts at most {limits.max_bytes} "
                         f"(--max-request-bytes)", status=413)
    data = _decode(body)
    if kind == "chat" and isinstance(data.get("messages"), list) and len(data["messages"]) > limits.max_messages:
        raise BadRequest(f"'messages' has {len(data['messages'])} messages; this engine accepts at most "
                         f"{limits.max_messages} (--max-messages)", param="messages")
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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _decode(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    except RecursionError:
        raise BadRequest(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise BadRequest(f"Request body must be a JSON object, got {type(data).__name__}")
    if _depth(data) > MAX_JSON_DEPTH:
        raise BadRequest(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion (a deep body must not raise RecursionError
    in whatever walks it next: pydantic, the chat template)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _fail(param: str, expected: str, got: Any) -> BadRequest:
    return BadRequest(f"'{param}' must be {expected}, got {got!r:.80}", param=param)


def _check_range(request: Any, param: str, low: float | None, high: float | None, expected: str) -> None:
    value = getattr(request, param)
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(param, expected, value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise _fail(param, expected, value)


#: (field, lowest, highest, what the message says): every numeric field of a generation request.
_RANGES = (
    ("temperature", 0, None, "a finite number >= 0"),
    ("top_p", 0, 1, "a number in [0, 1]"),
    ("top_k", 0, None, "an integer >= 0"),
    ("min_p", 0, 1, "a number in [0, 1]"),
    ("xtc_probability", 0, 1, "a number in [0, 1]"),
    ("xtc_threshold", 0, 0.5, "a number in [0, 0.5]"),
    ("repetition_penalty", 0, None, "a finite number >= 0"),
    ("repetition_context_size", 1, None, "an integer >= 1"),
    ("presence_penalty", None, None, "a finite number"),
    ("presence_context_size", 1, None, "an integer >= 1"),
    ("frequency_penalty", None, None, "a finite number"),
    ("frequency_context_size", 1, None, "an integer >= 1"),
    ("min_tokens", 0, None, "an integer >= 0"),
    ("top_logprobs", 0, MAX_TOP_LOGPROBS, f"an integer in [0, {MAX_TOP_LOGPROBS}]"),
)


def _check_format(request: ChatRequest | CompletionRequest) -> None:
    kind = (request.response_format or {}).get("type", "text")
    if kind != "text":
        raise BadRequest(f"'response_format': type {kind!r:.40} is not supported: this engine does not constrain "
                         "its output to JSON (no guided decoding); only {\"type\": \"text\"} is accepted",
                         param="response_format")


def _check_values(request: ChatRequest | CompletionRequest) -> None:
    _check_format(request)
    limit = max_tokens_of(request)
    if limit is not None and limit <= 0:
        raise BadRequest(f"'max_tokens' must be at least 1, got {limit}", param="max_tokens")
    if request.n != 1:
        raise BadRequest(f"'n' must be 1 (one choice per request), got {request.n}", param="n")
    for param, low, high, expected in _RANGES:
        _check_range(request, param, low, high, expected)
    if limit is not None and request.min_tokens > limit:
        raise BadRequest(f"'min_tokens' ({request.min_tokens}) must not exceed max_tokens ({limit})",
                         param="min_tokens")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > MAX_STOPS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise _fail("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                    f"{len(stops)} strings, the longest {max(map(len, stops))} characters")
    for key, bias in (request.logit_bias or {}).items():
        if not key.strip().lstrip("-").isdigit():
            raise _fail("logit_bias", "a map from token ids to numbers", key)
        if not -100 <= bias <= 100:
            raise _fail("logit_bias", "a map to numbers in [-100, 100]", bias)
    if isinstance(request, CompletionRequest):
        _check_completion(request)
    else:
        _check_chat(request)


def _check_completion(request: CompletionRequest) -> None:
    logprobs = request.logprobs
    if not isinstance(logprobs, bool) and logprobs is not None and not 0 <= logprobs <= 5:
        raise _fail("logprobs", "true, false or an integer in [0, 5]", logprobs)
    if isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], str) \
            and len(request.prompt) != 1:
        raise BadRequest(f"'prompt': one prompt per request, got {len(request.prompt)}", param="prompt")


def _check_chat(request: ChatRequest) -> None:
    if request.top_logprobs and not request.logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not request.messages:
        raise BadRequest("'messages' must contain at least one message", param="messages")

    for i, message in enumerate(request.messages):
        for part in message.content if isinstance(message.content, list) else ():
            if part.type != "text":
                raise BadRequest(f"'messages.{i}.content': only text parts are supported, got {part.type!r}",
                                 param="messages")


def check_for_model(sampling: Sampling, vocab_size: int) -> None:
    """The checks that need the model: top_k and logit_bias token ids within the vocabulary."""
    if sampling.top_k >= vocab_size:
        # mlx-lm's apply_top_k accepts (0, vocab) only, and raises at sampling time.
        raise _fail("top_k", f"an integer in [0, {vocab_size}) for this model", sampling.top_k)
    for token, _ in sampling.logit_bias:
        if not 0 <= token < vocab_size:
            raise _fail("logit_bias", f"a map from token ids in [0, {vocab_size})", token)


def max_tokens_of(request: ChatRequest | CompletionRequest) -> int | None:
    """The completion limit the request asked for, if any."""
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


def top_logprobs_of(request: ChatRequest | CompletionRequest) -> int | None:
    """Alternatives per token the answer carries; None when no log-probabilities are asked for.

    Chat: ``logprobs: true`` (+ ``top_logprobs``). Completions: OpenAI's integer ``logprobs``, or
    mlx_lm.server's ``logprobs: true`` with ``top_logprobs``.
    """
    if isinstance(request, ChatRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    if request.logprobs is None or request.logprobs is False:
        return request.top_logprobs if request.top_logprobs else None
    if request.logprobs is True:
        return request.top_logprobs or 0
    return int(request.logprobs)


@dataclass(frozen=True)
class SamplingDefaults:
    """The server's defaults for what a request leaves out (mlx_lm.server's --temp, --top-p ...)."""

    temperature: float = 0.0  #: --temp
    top_p: float = 1.0  #: --top-p
    top_k: int = 0  #: --top-k
    min_p: float = 0.0  #: --min-p


def sampling_of(request: ChatRequest | CompletionRequest, defaults: SamplingDefaults = SamplingDefaults()) -> Sampling:
    """The decoding settings of a request, the server's defaults filling what it leaves out."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return Sampling(
        temperature=float(pick(request.temperature, defaults.temperature)),
        top_p=float(pick(request.top_p, defaults.top_p)),
        top_k=int(pick(request.top_k, defaults.top_k)),
        min_p=float(pick(request.min_p, defaults.min_p)),
        xtc_probability=request.xtc_probability,
        xtc_threshold=request.xtc_threshold,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        repetition_penalty=request.repetition_penalty,
        repetition_context_size=request.repetition_context_size,
        presence_penalty=request.presence_penalty,
        presence_context_size=request.presence_context_size,
        frequency_penalty=request.frequency_penalty,
        frequency_context_size=request.frequency_context_size,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in (request.logit_bias or {}).items())),
        seed=request.seed,
        top_logprobs=top_logprobs_of(request),
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
