"""The OpenAI-compatible wire format: errors, answer text, log-probabilities and response bodies.

Requests are decoded and validated in params.py; every refusal is a ``BadRequest`` here, which
becomes an OpenAI-style error body. Answer text leaves out special tokens (vLLM's
``skip_special_tokens`` default) and ends before a stop string.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from tokentrace.errors import RequestRefused


class BadRequest(RequestRefused):
    """A request the engine refuses, with the HTTP status and OpenAI error fields (core/errors.py)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message, status)
        self.message, self.param, self.status, self.error_type, self.code = message, param, status, error_type, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error envelope."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI usage with prompt_tokens_details.cached_tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_body(kind: str, request_id: str, model: str, text: str, finish_reason: str | None,
                  usage_body: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A complete (non-streamed) response."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage_body}


def chunk_body(kind: str, request_id: str, model: str, text: str | None, finish_reason: str | None,
               first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk (a delta, or the final one carrying finish_reason)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


class LogprobFormatter:
    """Log-probabilities in OpenAI's shapes, for the tokens of one answer (or one streamed chunk).

    Each token is ``(token id, logprob, [(alternative id, logprob), ...])`` as the generation
    thread recorded it (mlx-lm's log-softmax after logits processors: mlx_lm.server's numbers).
    A token's text is its own decoding; ``bytes`` are that text's UTF-8 bytes.
    """

    def __init__(self, tokenizer: Any, kind: str):
        self._tokenizer = tokenizer
        self._kind = kind
        self._offset = 0  #: characters of token text before the next token (completions' text_offset)

    def _text(self, token: int) -> str:
        return self._tokenizer.decode([token])

    def format(self, tokens: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any]:
        """The ``logprobs`` object of a choice for these tokens."""
        if self._kind == "chat":
            return {"content": [self._chat_entry(token, logprob, top) for token, logprob, top in tokens],
                    "refusal": None}
        texts = [self._text(token) for token, _, _ in tokens]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [logprob for _, logprob, _ in tokens],
            "top_logprobs": [{self._text(alt): value for alt, value in top} for _, _, top in tokens],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (alt_text := self._text(alt)), "logprob": value,
                                  "bytes": list(alt_text.encode())} for alt, value in top]}


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
