"""Prompts as token ids with known segments: one per chat message, one for the tools block, one for
the generation prompt (docs/telemetry.md, "Prefix fingerprint").

The cache analyzer finds a *changed system prompt* by comparing segment content hashes between
requests, so the boundaries must be exact. They are exact by construction here: the rendered chat
is cut where the rendering of ``messages[:k]`` ends (chat templates render earlier messages
independently of later ones), and each piece is tokenized on its own. For templates whose pieces
all start at special tokens (ChatML, Llama 3, Mistral …) that equals tokenizing the whole text; in
any case it keeps a conversation's earlier turns token-identical across requests, which is what
prefix caching needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokentrace.contract import ROLE_ASSISTANT, ROLE_PROMPT, ROLE_TOOLS, ROLE_USER, segment_role

#: Characters kept per segment snippet with --capture-content (head and tail halves).
SNIPPET_CHARS = 96
#: Messages that get a segment of their own, counted from the front of a long chat; the last
#: ``TAIL_SEGMENTS`` messages always get theirs. Finding a cut means rendering the chat up to it, so
#: cutting at every message of an n-message chat costs O(n²) (a 3,000-message chat: 18-20 s, issue
#: 12); this bounds it to about three renders of the whole chat. The messages in between share one
#: segment (role: its last message's).
HEAD_SEGMENTS = 64
TAIL_SEGMENTS = 2



@dataclass
class Prompt:
    """A tokenized prompt and its segments; segment ``i`` is ``tokens[starts[i]:ends[i]]``."""

    tokens: list[int]  #: token ids fed to the model
    roles: list[str] = field(default_factory=list)  #: contract role of each segment
    starts: list[int] = field(default_factory=list)  #: first token index of each segment
    ends: list[int] = field(default_factory=list)  #: end token index (exclusive) of each segment
    snippets: list[str] | None = None  #: bounded text per segment; only with --capture-content
    unknown_prefix: int = 0
    """Tokens before ``tokens`` whose ids are unknown (a caller's own KV cache holds them); when
    non-zero no fingerprint or segments can be computed."""

    @property
    def length(self) -> int:
        """Prompt tokens in all, including an unknown prefix."""
        return self.unknown_prefix + len(self.tokens)


def snippet(text: str, limit: int = SNIPPET_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters: head and tail around an ellipsis."""
    if len(text) <= limit:
        return text
    half = (limit - 1) // 2
    return text[:half] + "…" + text[len(text) - half :]


def build_text_prompt(tokenizer: Any, prompt: str | Sequence[int], capture_content: bool) -> Prompt:
    """A completion prompt (text or token ids): one segment of role ``prompt``."""
    if isinstance(prompt, str):
        tokens = list(tokenizer.encode(prompt))
        text = prompt
    else:
        tokens = list(prompt)
        text = None
    result = Prompt(tokens, [ROLE_PROMPT], [0], [len(tokens)])
    if capture_content:
        result.snippets = [snippet(text if text is not None else tokenizer.decode(tokens))]
    return result


def build_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[Any] | None,
    capture_content: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> Prompt:
    """Render ``messages`` (and ``tools``) with the model's chat template, ready for generation."""
    pieces = _render_pieces(tokenizer, messages, tools, template_kwargs or {})
    prompt = Prompt([])
    snippets: list[str] = []
    for role, text in pieces:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            continue
        prompt.roles.append(role)
        prompt.starts.append(len(prompt.tokens))
        prompt.tokens.extend(ids)
        prompt.ends.append(len(prompt.tokens))
        snippets.append(snippet(text))
    if capture_content:
        prompt.snippets = snippets
    return prompt


def _render_pieces(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]
) -> list[tuple[str, str]]:
    """(role, text) pieces whose concatenation is the full rendered prompt."""

    def render(upto: int, generation: bool, with_tools: bool = True) -> str | None:
        try:
            return tokenizer.apply_chat_template(
                messages[:upto], tools=tools if with_tools else None, tokenize=False,
                add_generation_prompt=generation, **kwargs,
            )
        except Exception:  # templates may refuse partial conversations (e.g. "must start with user")
            return None

    full = render(len(messages), True)
    if full is None:
        # Let the template's own error surface to the client as a bad request.
        return [(ROLE_USER, tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs))]
    cuts: list[tuple[int, str]] = []
    if tools and messages:
        # transformers refuses to render zero messages, so the tools block is what rendering the
        # first message with tools adds in front of rendering it without (templates that put the
        # tools inside a message leave them in that message's segment).
        with_tools, without = render(1, False), render(1, False, with_tools=False)
        if with_tools and without and with_tools.endswith(without) and len(with_tools) > len(without):
            cuts.append((len(with_tools) - len(without), ROLE_TOOLS))
    for k in _cut_points(len(messages)):
        text = render(k, False)
        if text is not None and full.startswith(text):
            cuts.append((len(text), segment_role(messages[k - 1].get("role"))))
    pieces: list[tuple[str, str]] = []
    done = 0
    for position, role in cuts:
        if position > done:
            pieces.append((role, full[done:position]))
            done = position
    if done < len(full):
        # The generation prompt (e.g. "<|im_start|>assistant\n") opens the answer's turn.
        pieces.append((ROLE_ASSISTANT if pieces else ROLE_USER, full[done:]))
    return pieces


def _cut_points(n: int) -> list[int]:
    """Message counts to cut the rendered chat after: every one for short chats, else the first
    ``HEAD_SEGMENTS`` and the last ``TAIL_SEGMENTS``."""
    if n <= HEAD_SEGMENTS + TAIL_SEGMENTS:
        return list(range(1, n + 1))
    return [*range(1, HEAD_SEGMENTS + 1), *range(n - TAIL_SEGMENTS + 1, n + 1)]
