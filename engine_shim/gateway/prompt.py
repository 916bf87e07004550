"""Prompt segments and prefix fingerprints, computed by the gateway without the engine's help.

Three sources of token ids, best first (docs/gateway.md "Fingerprints"):

1. the upstream's own tokenizer endpoint (adapters that measure ``tokenize``: vLLM, llama.cpp,
   SGLang): the fingerprint is the one the engine itself would compute;
2. ``--tokenizer DIR``: the model's Hugging Face tokenizer and chat template, run by the gateway;
3. otherwise a **byte-level rendering**: each chat message becomes the UTF-8 bytes of
   ``"<|" + role + "|>\\n" + text + "\\n"`` (``text``: a string content as is; a list of parts as its
   text parts joined by ``"\\n"``; anything else as compact JSON), a completion prompt its own UTF-8
   bytes, and each byte is one "token" (ids 0-255). Fingerprints then say which *messages* are
   shared, not how many model tokens; token counts on the lookup are bytes and the matched count
   is the engine's cached-token share of them (inferred).

Segments: one per chat message (role, token span, content hash of its tokens), then one of role
``assistant`` for the generation prompt that opens the answer's turn, as ``tokentrace engine`` cuts
them; a completion prompt is one ``prompt`` segment. Chat segment spans come from rendering growing
prefixes of the message list (``messages[:k]`` without a generation prompt, k = 1..n); the span of
message k ends where the rendering of ``messages[:k]`` stops sharing tokens with the whole prompt.
The last message's segment must not take the generation prompt in: as the last message it would
hash differently from the same message one turn later, and no later turn would be seen to share it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from tokentrace import contract as c
from tokentrace.engine_shim.gateway.adapters.base import Adapter, Route
from tokentrace.fingerprint import block_hashes, message_spans, segment_hash, segment_tail_hash

UNIT_TOKENS = "tokens"
UNIT_BYTES = "bytes"
#: Characters of a segment kept as its snippet (only with --capture-content).
SNIPPET_CHARS = 160
#: Chat prompts with more messages than this get one fingerprint and no per-message segments
#: (each segment costs one tokenization of a growing prefix).
MAX_SEGMENTED_MESSAGES = 64


@dataclass
class Segment:
    """One message of the prompt."""

    role: str  #: contract segment role
    start: int  #: first token (or byte) index
    end: int  #: end index, exclusive
    hash: int  #: content hash of its tokens
    snippet: str | None = None  #: bounded text, only with --capture-content
    tail: int = 0  #: content hash of its last block (0: under two blocks)


@dataclass
class PromptPrint:
    """A prompt's fingerprint."""

    unit: str  #: "tokens" or "bytes"
    length: int  #: prompt length in ``unit``
    hashes: list[int]  #: chained block hashes
    block_size: int  #: tokens (or bytes) per block
    segments: list[Segment] = field(default_factory=list)  #: per message
    source: str = ""  #: "upstream", "tokenizer" or "bytes"


def messages_of(route: Route, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages of a chat route's body, or None."""
    messages = body.get(route.messages_field) if route.kind == "chat" else None
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else None


def message_text(message: dict[str, Any]) -> str:
    """A message's content as text (the byte-level rendering's rule, module docstring)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        if texts and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    return json.dumps(content, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def render_bytes(message: dict[str, Any]) -> bytes:
    """One message's byte-level rendering."""
    return f"<|{message.get('role', '')}|>\n{message_text(message)}\n".encode()


def routing_blocks(route: Route, body: dict[str, Any], block_size: int) -> list[int]:
    """Byte-level block hashes of the prompt, for the prefix routing policy (on the request path:
    hashing a few kilobytes costs microseconds)."""
    messages = messages_of(route, body)
    if messages is not None:
        data = b"".join(render_bytes(m) for m in messages)
    else:
        prompt = body.get(route.prompt_field)
        data = prompt.encode() if isinstance(prompt, str) else b""
    return block_hashes(data, block_size * 4) if data else []


class LocalTokenizer:
    """``--tokenizer DIR``: the model's Hugging Face tokenizer and chat template, in the gateway."""

    def __init__(self, directory: str):
        # transformers warns at import that PyTorch is missing and "Models won't be available": true,
        # and nothing a gateway that only tokenizes needs to hear (an advisory warning it lets us mute).
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        from transformers import AutoTokenizer  # heavy: only when --tokenizer is given

        self.tokenizer = AutoTokenizer.from_pretrained(directory)

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
             body: dict[str, Any]) -> list[int]:
        """Token ids of the chat template applied to ``messages``."""
        ids = self.tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=True,
                                                 add_generation_prompt=add_generation_prompt)
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def text(self, prompt: str) -> list[int]:
        """Token ids of a completion prompt."""
        return [int(t) for t in self.tokenizer.encode(prompt, add_special_tokens=False)]


async def fingerprint(adapter: Adapter | None, route: Route, body: dict[str, Any], block_size: int,
                      tokenizer: LocalTokenizer | None, capture: bool) -> PromptPrint:
    """The prompt's fingerprint from the best source at hand (module docstring)."""
    messages = messages_of(route, body)
    if adapter is not None and "tokenize" in adapter.measures:
        printed = await _with_upstream(adapter, route, body, messages, block_size, capture)
        if printed is not None:
            return printed
    return fingerprint_local(route, body, block_size, tokenizer, capture)


def fingerprint_local(route: Route, body: dict[str, Any], block_size: int, tokenizer: LocalTokenizer | None,
                      capture: bool) -> PromptPrint:
    """The fingerprint from ``--tokenizer`` or the byte-level rendering (no I/O)."""
    messages = messages_of(route, body)
    if tokenizer is not None:
        try:
            return _with_tokenizer(tokenizer, route, body, messages, block_size, capture)
        except Exception:  # a template the tokenizer cannot apply: fall back to bytes, never fail
            pass
    return _with_bytes(route, body, messages, block_size, capture)


async def _with_upstream(adapter: Adapter, route: Route, body: dict[str, Any],
                         messages: list[dict[str, Any]] | None, block_size: int,
                         capture: bool) -> PromptPrint | None:
    whole = await adapter.tokenize(route, body, messages, add_generation_prompt=True)
    if whole is None:
        return None
    prefixes: list[list[int] | None] = []
    if messages is not None and len(messages) <= MAX_SEGMENTED_MESSAGES:
        for k in range(1, len(messages) + 1):
            prefixes.append(await adapter.tokenize(route, body, messages[:k], add_generation_prompt=False))
    return _printed(whole, prefixes, messages, route, body, block_size, capture, UNIT_TOKENS, "upstream")


def _with_tokenizer(tokenizer: LocalTokenizer, route: Route, body: dict[str, Any],
                    messages: list[dict[str, Any]] | None, block_size: int, capture: bool) -> PromptPrint:
    if messages is None:
        prompt = body.get(route.prompt_field)
        whole = tokenizer.text(prompt) if isinstance(prompt, str) else []
        return _printed(whole, [], None, route, body, block_size, capture, UNIT_TOKENS, "tokenizer")
    whole = tokenizer.chat(messages, True, body)
    prefixes: list[list[int] | None] = []
    if len(messages) <= MAX_SEGMENTED_MESSAGES:
        prefixes = [tokenizer.chat(messages[:k], False, body) for k in range(1, len(messages) + 1)]
    return _printed(whole, prefixes, messages, route, body, block_size, capture, UNIT_TOKENS, "tokenizer")


def _with_bytes(route: Route, body: dict[str, Any], messages: list[dict[str, Any]] | None, block_size: int,
                capture: bool) -> PromptPrint:
    if messages is None:
        prompt = body.get(route.prompt_field)
        whole = list(prompt.encode()) if isinstance(prompt, str) else []
        return _printed(whole, [], None, route, body, block_size, capture, UNIT_BYTES, "bytes")
    parts = [render_bytes(m) for m in messages]
    whole = list(b"".join(parts))
    prefixes, end = [], 0
    for part in parts:
        end += len(part)
        prefixes.append(whole[:end])
    return _printed(whole, prefixes, messages, route, body, block_size, capture, UNIT_BYTES, "bytes")


def _printed(whole: list[int], prefixes: list[list[int] | None], messages: list[dict[str, Any]] | None,
             route: Route, body: dict[str, Any], block_size: int, capture: bool, unit: str,
             source: str) -> PromptPrint:
    printed = PromptPrint(unit, len(whole), block_hashes(whole, block_size) if whole else [], block_size,
                          source=source)
    if messages is None:
        prompt = body.get(route.prompt_field)
        snippet = prompt[:SNIPPET_CHARS] if capture and isinstance(prompt, str) else None
        if whole:
            printed.segments.append(Segment(c.ROLE_PROMPT, 0, len(whole), segment_hash(whole), snippet,
                                            segment_tail_hash(whole, block_size)))
        return printed
    if len(prefixes) != len(messages) or any(p is None for p in prefixes):
        return printed  # segments unknown: one fingerprint only
    start = 0
    for message, (start, end) in zip(messages, message_spans(whole, prefixes), strict=True):  # type: ignore[arg-type]
        snippet = message_text(message)[:SNIPPET_CHARS] if capture else None
        printed.segments.append(Segment(c.segment_role(message.get("role")), start, end,
                                        segment_hash(whole[start:end]), snippet,
                                        segment_tail_hash(whole[start:end], block_size)))
        start = end
    if start < len(whole):  # the generation prompt (e.g. "<|im_start|>assistant\n")
        printed.segments.append(Segment(c.ROLE_ASSISTANT, start, len(whole), segment_hash(whole[start:]), None))
    return printed

