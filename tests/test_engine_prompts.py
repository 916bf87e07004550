"""Segmented prompts: exact token ranges per message and tools block, on the real tokenizer."""

from __future__ import annotations

import pytest

from tokentrace.engine_shim.mlx.prompts import build_chat_prompt, build_text_prompt, snippet

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_model)


def test_segments_tile_the_prompt_and_match_the_template(tokenizer):
    prompt = build_chat_prompt(tokenizer, MESSAGES, TOOLS, capture_content=False)
    expected = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    assert prompt.tokens == expected
    assert prompt.roles == ["tools", "system", "user", "assistant", "user", "assistant"]
    assert prompt.starts[0] == 0 and prompt.ends[-1] == len(prompt.tokens)
    assert prompt.starts[1:] == prompt.ends[:-1]
    assert prompt.snippets is None


def test_each_segment_is_exactly_its_message(tokenizer):
    prompt = build_chat_prompt(tokenizer, MESSAGES, None, capture_content=False)
    for message, start, end in zip(MESSAGES, prompt.starts, prompt.ends, strict=False):
        text = tokenizer.decode(prompt.tokens[start:end])
        assert text == f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
    assert tokenizer.decode(prompt.tokens[prompt.starts[-1]:]) == "<|im_start|>assistant\n"


def test_a_changed_system_prompt_changes_only_the_first_segment(tokenizer):
    a = build_chat_prompt(tokenizer, MESSAGES, None, capture_content=False)
    changed = [{"role": "system", "content": "You are terse."}, *MESSAGES[1:]]
    b = build_chat_prompt(tokenizer, changed, None, capture_content=False)
    pieces_a = [a.tokens[s:e] for s, e in zip(a.starts, a.ends, strict=True)]
    pieces_b = [b.tokens[s:e] for s, e in zip(b.starts, b.ends, strict=True)]
    assert pieces_a[0] != pieces_b[0]
    assert pieces_a[1:] == pieces_b[1:]


def test_developer_role_counts_as_system_and_snippets_are_bounded(tokenizer):
    messages = [{"role": "developer", "content": "x" * 500}, {"role": "user", "content": "hi"}]
    prompt = build_chat_prompt(tokenizer, messages, None, capture_content=True)
    assert prompt.roles[0] == "system"
    assert all(len(s) <= 96 for s in prompt.snippets)
    assert "…" in prompt.snippets[0]


def test_a_completion_prompt_is_one_segment(tokenizer):
    prompt = build_text_prompt(tokenizer, "Hello there", capture_content=False)
    assert prompt.roles == ["prompt"] and prompt.starts == [0] and prompt.ends == [len(prompt.tokens)]
    ids = build_text_prompt(tokenizer, [5, 6, 7], capture_content=True)
    assert ids.tokens == [5, 6, 7] and ids.snippets is not None


def test_snippet_keeps_head_and_tail():
    assert snippet("short") == "short"
    cut = snippet("a" * 50 + "b" * 50, limit=21)
    assert cut == "a" * 10 + "…" + "b" * 10
