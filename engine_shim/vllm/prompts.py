"""What vLLM's OpenAI server was asked: each prompt's fingerprint and segments, the requests it
refused before they reached the engine, and those it aborted before the engine finished them
(docs/vllm.md, "Prompts and refusals").

vLLM's stat loggers see a finished request's counts and times, never its prompt, and a request the
frontend refuses (a prompt over the context, an unknown model, a bad parameter) never reaches the
engine, so they never see it at all. The plugin therefore wraps five methods in the API-server
process, each keeping references only (nothing is hashed or tokenized on the request path):

- ``OpenAIServingChat._create_chat_completion`` and ``OpenAIServingCompletion._create_completion``:
  the request's own id (``_base_request_id``, the X-Request-Id the client sent, as vLLM computes
  it), its chat messages, tools and template arguments, and the tokenizer; an ``ErrorResponse``
  returned or an exception raised becomes a refused request (its HTTP status as vLLM's
  ``create_error_response`` gives it);
- ``InputProcessor.assign_request_id``: the prompt token ids the engine will run, under the
  request's external id;
- ``OutputProcessor.add_request``: the request's ``RequestStateStats``, whose engine-core queued
  time tells how long it waited before vLLM's engine core took it in (``steps.engine_intake_s``);
- ``OutputProcessor.abort_requests``: a request aborted before it finished (the client went away, or
  the frontend gave up on it) never reaches the stat loggers, which see only requests the engine
  finished; what the output processor knew of it (arrival, tokens so far) becomes a request with
  vLLM's finish reason ``abort`` (tokentrace's ``cancelled``).

When the request finishes, the export thread computes tokentrace's chained block hashes of those
token ids (the same ones the KV-event tracker gives evicted blocks) and the chat's segments: message
k ends where the chat template's rendering of the first k messages stops sharing tokens with the
prompt, as the gateway cuts them (``tokentrace.fingerprint.message_spans``). Segments are kept only
when the template rendered here gives exactly the tokens vLLM ran (a ``--chat-template``, a
per-request template or multimodal content it renders otherwise: one fingerprint, no segments).
Chats of more than ``MAX_SEGMENTED_MESSAGES`` messages get no segments (each costs one rendering).
No prompt text is kept: segments carry hashes and no snippets.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokentrace import contract as c
from tokentrace.contract import DEFAULT_BLOCK_SIZE
from tokentrace.fingerprint import block_hashes, message_spans, segment_hash, segment_tail_hash

log = logging.getLogger("vllm.tokentrace")

#: Requests whose prompt is remembered until they finish; the oldest are forgotten past this.
MAX_PENDING = 20_000
#: Chats with more messages get one fingerprint and no segments.
MAX_SEGMENTED_MESSAGES = 64
#: vLLM's external request id = this prefix + the client's id (+ "-<prompt index>" for completions).
CHAT_PREFIX, COMPLETION_PREFIX = "chatcmpl-", "cmpl-"


@dataclass
class Chat:
    """A chat request as the client sent it (references, nothing copied)."""

    messages: list[Any]
    tools: Any
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    tokenizer: Any


@dataclass
class Refusal:
    """A request vLLM's frontend answered with an error before the engine saw it (a 4xx: refused;
    a 5xx: failed)."""

    request_id: str  #: the client's id
    start_ns: int
    end_ns: int
    status: int
    error_type: str
    model: str | None
    max_tokens: int | None


@dataclass
class Abort:
    """A request vLLM aborted before its engine finished it."""

    external_id: str  #: vLLM's external request id
    start_ns: int  #: its arrival (wall clock)
    end_ns: int
    prompt_tokens: int | None
    output_tokens: int
    max_tokens: int | None


@dataclass
class Printed:
    """One prompt's fingerprint, as the export thread computes it."""

    length: int
    hashes: list[int]
    segments: list[tuple[str, int, int, int, int]]  #: (role, start, end, content hash, tail hash)
    block_size: int  #: tokens per hashed block


class PromptLog:
    """Prompts of requests not finished yet, by vLLM's external request id (bounded)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._chats: OrderedDict[str, Chat] = OrderedDict()
        self._tokens: OrderedDict[str, Any] = OrderedDict()
        #: external ids that reached the engine (an error answer after that is the engine's to report)
        self._reached: OrderedDict[str, None] = OrderedDict()
        #: each request's RequestStateStats, as the output processor keeps it (a reference, read when
        #: it finished: the engine core's queued time, which no FinishedRequestStats carries)
        self._times: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.on_refusal: Callable[[Refusal], None] | None = None
        self.on_abort: Callable[[Abort], None] | None = None

    def chat(self, external_id: str, chat: Chat) -> None:
        self._put(self._chats, external_id, chat)

    def tokens(self, external_id: str, token_ids: Any) -> None:
        self._put(self._tokens, external_id, token_ids)
        self._put(self._reached, external_id, None)

    def times(self, external_id: str, stats: Any) -> None:
        self._put(self._times, external_id, stats)

    def take_times(self, external_id: str) -> Any:
        """The finished request's ``RequestStateStats`` (None if the output processor's was not seen)."""
        with self._lock:
            return self._times.pop(external_id, None)

    def reached(self, *external_ids: str) -> bool:
        """Whether any of these requests reached the engine; forgets the chat of one that did not."""
        with self._lock:
            if any(key in self._reached for key in external_ids):
                return True
            for key in external_ids:
                self._chats.pop(key, None)
            return False

    def _put(self, table: OrderedDict, key: str, value: Any) -> None:
        with self._lock:
            table[key] = value
            if len(table) > MAX_PENDING:
                table.popitem(last=False)

    def forget(self, external_id: str) -> None:
        with self._lock:
            self._tokens.pop(external_id, None)
            self._chats.pop(external_id, None)
            self._times.pop(external_id, None)

    def take(self, external_id: str) -> Printed | None:
        """The finished request's fingerprint (computed here, off the request path), or None."""
        with self._lock:
            tokens = self._tokens.pop(external_id, None)
            chat = self._chats.pop(external_id, None)
        if not tokens:
            return None
        tokens = [int(t) for t in tokens]
        return Printed(len(tokens), block_hashes(tokens, self.block_size), self._segments(tokens, chat),
                       self.block_size)

    def _segments(self, tokens: list[int], chat: Chat | None) -> list[tuple[str, int, int, int, int]]:
        if chat is None:  # a completion prompt: one segment
            return [self._segment(c.ROLE_PROMPT, tokens, 0, len(tokens))]
        messages = chat.messages
        if not messages or len(messages) > MAX_SEGMENTED_MESSAGES:
            return []
        try:
            if _render(chat, messages, chat.add_generation_prompt, chat.continue_final_message) != tokens:
                return []  # vLLM rendered it otherwise: its segments are not these
            prefixes = [_render(chat, messages[:k], False, False) for k in range(1, len(messages) + 1)]
        except Exception:  # a template that refuses a partial chat: no segments, never a failure
            return []
        segments = [self._segment(c.segment_role(_role(message)), tokens, start, end)
                    for message, (start, end) in zip(messages, message_spans(tokens, prefixes), strict=True)]
        end = segments[-1][2]
        if end < len(tokens):  # the generation prompt that opens the answer's turn
            segments.append((c.ROLE_ASSISTANT, end, len(tokens), segment_hash(tokens[end:]), 0))
        return segments

    def _segment(self, role: str, tokens: list[int], start: int, end: int) -> tuple[str, int, int, int, int]:
        piece = tokens[start:end]
        return role, start, end, segment_hash(piece), segment_tail_hash(piece, self.block_size)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _render(chat: Chat, messages: list[Any], generation: bool, continued: bool) -> list[int]:
    ids = chat.tokenizer.apply_chat_template(messages, tools=chat.tools, tokenize=True,
                                             add_generation_prompt=generation, continue_final_message=continued,
                                             **chat.template_kwargs)
    if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


_LOG: PromptLog | None = None


def install(prompt_log: PromptLog) -> bool:
    """Wrap vLLM's chat and completion handlers, ``assign_request_id``, ``add_request`` and
    ``abort_requests`` (once per process) so that ``prompt_log`` hears of every prompt, request
    stats, refusal and abort; False where this vLLM lacks the pieces."""
    global _LOG
    if _LOG is not None:
        _LOG = prompt_log
        return True
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        log.info("tokentrace: this vLLM's frontend has moved; no prompt fingerprints or refusals")
        return False
    try:
        from vllm.v1.engine.output_processor import OutputProcessor
    except ImportError:
        OutputProcessor = None  # aborted requests then stay unrecorded
    if not all(callable(getattr(cls, name, None)) for cls, name in (
            (OpenAIServingChat, "_create_chat_completion"), (OpenAIServingCompletion, "_create_completion"),
            (OpenAIServingChat, "_base_request_id"), (InputProcessor, "assign_request_id"))):
        log.info("tokentrace: this vLLM's frontend has moved; no prompt fingerprints or refusals")
        return False
    _LOG = prompt_log
    OpenAIServingChat._create_chat_completion = _handler(OpenAIServingChat._create_chat_completion, CHAT_PREFIX)
    OpenAIServingCompletion._create_completion = _handler(OpenAIServingCompletion._create_completion,
                                                          COMPLETION_PREFIX)
    original = InputProcessor.assign_request_id

    @functools.wraps(original)
    def assign_request_id(request: Any) -> None:
        original(request)
        try:
            if _LOG is not None and request.prompt_token_ids is not None:
                _LOG.tokens(request.external_req_id or request.request_id, request.prompt_token_ids)
        except Exception:  # never fail a request for tokentrace's sake
            log.debug("tokentrace: could not keep a prompt's token ids", exc_info=True)

    InputProcessor.assign_request_id = staticmethod(assign_request_id)  # type: ignore[method-assign]
    if OutputProcessor is not None and callable(getattr(OutputProcessor, "abort_requests", None)):
        OutputProcessor.abort_requests = _aborting(OutputProcessor.abort_requests)
    if OutputProcessor is not None and callable(getattr(OutputProcessor, "add_request", None)):
        OutputProcessor.add_request = _adding(OutputProcessor.add_request)
    return True


def _adding(original: Callable) -> Callable:
    """``OutputProcessor.add_request``, keeping a reference to the new request's stats (its
    ``RequestStateStats``) under its external id: its arrival and its engine core's queued time."""

    @functools.wraps(original)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        try:
            state = self.request_states.get(request.request_id)
            if _LOG is not None and state is not None and getattr(state, "stats", None) is not None:
                _LOG.times(str(state.external_req_id), state.stats)
        except Exception:  # never fail a request for tokentrace's sake
            log.debug("tokentrace: could not keep a request's stats", exc_info=True)
        return result

    return add_request


def _aborting(original: Callable) -> Callable:
    """``OutputProcessor.abort_requests``, telling the prompt log of each request it aborts that its
    engine had not finished (those it still holds state for)."""

    @functools.wraps(original)
    def abort_requests(self: Any, request_ids: Any, internal: bool, *args: Any, **kwargs: Any) -> Any:
        aborted = []
        try:
            request_ids = list(request_ids)
            for rid in request_ids:
                for internal_id in ([rid] if internal else list(self.external_req_ids.get(rid, ()))):
                    state = self.request_states.get(internal_id)
                    if state is not None and getattr(state, "stats", None) is not None:
                        aborted.append(state)
        except Exception:
            log.debug("tokentrace: could not read an aborted request", exc_info=True)
        result = original(self, request_ids, internal, *args, **kwargs)
        now = time.time_ns()
        for state in aborted:
            try:
                if _LOG is not None and _LOG.on_abort is not None:
                    prompt = getattr(state, "prompt_token_ids", None)
                    _LOG.on_abort(Abort(str(state.external_req_id), int(state.stats.arrival_time * 1e9), now,
                                        len(prompt) if prompt is not None else None,
                                        int(state.stats.num_generation_tokens),
                                        getattr(state, "max_tokens_param", None)))
                    _LOG.forget(str(state.external_req_id))  # never finished: its prompt is not kept
            except Exception:
                log.debug("tokentrace: could not report an aborted request", exc_info=True)
        return result

    return abort_requests


def _handler(original: Callable, prefix: str) -> Callable:
    """``original`` (an OpenAI handler method), telling the prompt log what it was asked and refused."""

    @functools.wraps(original)
    async def handler(self: Any, request: Any, raw_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        start_ns = time.time_ns()
        client_id = None
        try:
            client_id = self._base_request_id(raw_request, request.request_id)
            if prefix == CHAT_PREFIX and _LOG is not None:
                _LOG.chat(prefix + client_id, _chat_of(self, request))
        except Exception:
            log.debug("tokentrace: could not read a request's prompt", exc_info=True)
        try:
            result = await original(self, request, raw_request, *args, **kwargs)
        except Exception as exc:
            _refused(prefix, client_id, request, start_ns, _status_of(exc))
            raise
        if type(result).__name__ == "ErrorResponse":
            error = getattr(result, "error", None)
            _refused(prefix, client_id, request, start_ns,
                     (getattr(error, "code", None), getattr(error, "type", None)))
        return result

    return handler


def _chat_of(serving: Any, request: Any) -> Chat:
    effective = getattr(serving, "_effective_chat_template_kwargs", None)
    kwargs = dict((effective(request) if callable(effective) else request.chat_template_kwargs) or {})
    for name in ("add_generation_prompt", "continue_final_message", "tokenize", "tools"):
        kwargs.pop(name, None)
    tools = [t.model_dump() if hasattr(t, "model_dump") else t for t in request.tools] if request.tools else None
    return Chat(list(request.messages), tools, kwargs, bool(getattr(request, "add_generation_prompt", True)),
                bool(getattr(request, "continue_final_message", False)), serving.renderer.tokenizer)


def _status_of(exc: Exception) -> tuple[int | None, str | None]:
    """The status vLLM answers ``exc`` with (its own mapping), or (500, the exception's name)."""
    try:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        error = create_error_response(exc).error
        return int(error.code), str(error.type)
    except Exception:
        return 500, type(exc).__name__


def _refused(prefix: str, client_id: str | None, request: Any, start_ns: int,
             status: tuple[int | None, str | None]) -> None:
    code, error_type = status
    if _LOG is None or _LOG.on_refusal is None or client_id is None or code is None:
        return
    # A request that reached the engine is reported when it finishes there (vllm/steps.py), once.
    if _LOG.reached(prefix + client_id, f"{prefix}{client_id}-0", f"{prefix}{client_id}_0"):
        return
    max_tokens = getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)
    try:
        _LOG.on_refusal(Refusal(client_id, start_ns, time.time_ns(), int(code), str(error_type or "error"),
                                getattr(request, "model", None), max_tokens))
    except Exception:
        log.debug("tokentrace: could not report a refused request", exc_info=True)
