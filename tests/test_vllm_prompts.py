"""The vLLM plugin's prompt fingerprints (engine_shim/vllm/prompts.py) against the gateway's, for the
same chat and the same tokenizer: two observers of one prompt cut it into the same segments and hash
it the same way, so a verdict does not depend on which of them saw the request. The plugin in a real
vLLM is tested by tests/test_gateway_vllm.py and the truth matrix (tests/truth/test_truth_vllm.py).
"""

from __future__ import annotations

from transformers import AutoTokenizer

from tokentrace import contract as c
from tokentrace.engine_shim.gateway.adapters.base import CHAT
from tokentrace.engine_shim.gateway.prompt import LocalTokenizer, fingerprint_local
from tokentrace.engine_shim.vllm.prompts import Chat, PromptLog
from tokentrace.fingerprint import block_hashes

SYSTEM = {"role": "system", "content": "You are the vLLM prompt test. " * 12}
TURNS = [SYSTEM, {"role": "user", "content": "hello there " * 8}, {"role": "assistant", "content": "hi"},
         {"role": "developer", "content": "be brief " * 4}, {"role": "user", "content": "again " * 8}]


def _chat(tokenizer, messages) -> Chat:
    return Chat(messages, None, {}, True, False, tokenizer)


def test_the_plugin_cuts_a_chat_as_the_gateway_does_with_the_same_tokenizer(tiny_model):
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    gateway = fingerprint_local(CHAT, {"messages": TURNS}, 16, LocalTokenizer(str(tiny_model)), False)
    log = PromptLog()
    tokens = hf.apply_chat_template(TURNS, tokenize=True, add_generation_prompt=True)
    tokens = list(tokens["input_ids"] if hasattr(tokens, "keys") else tokens)
    log.chat("chatcmpl-r1", _chat(hf, TURNS))
    log.tokens("chatcmpl-r1", tokens)
    printed = log.take("chatcmpl-r1")
    assert printed is not None and printed.length == gateway.length == len(tokens)
    assert printed.hashes == gateway.hashes == block_hashes(tokens, 16)
    assert printed.segments == [(s.role, s.start, s.end, s.hash, s.tail) for s in gateway.segments]
    # One segment per message (the developer message as system) and the generation prompt.
    assert [s[0] for s in printed.segments] == ["system", "user", "assistant", "system", "user", "assistant"]
    assert printed.segments[-1][2] == len(tokens)
    assert log.take("chatcmpl-r1") is None  # taken once: the log keeps nothing of a finished request


def test_a_prompt_vllm_rendered_otherwise_keeps_its_fingerprint_and_no_segments(tiny_model):
    """A --chat-template (or per-request template) renders tokens the tokenizer's own template does
    not: segments cut by the wrong template would name the wrong message, so there are none."""
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    log = PromptLog()
    tokens = [7, 8, 9, *hf.encode("something rendered by another template " * 6)]
    log.chat("chatcmpl-r2", _chat(hf, TURNS))
    log.tokens("chatcmpl-r2", tokens)
    printed = log.take("chatcmpl-r2")
    assert printed is not None and printed.hashes == block_hashes(tokens, 16) and printed.segments == []


def test_a_completion_prompt_is_one_segment_and_a_request_without_tokens_has_no_print():
    log = PromptLog()
    log.tokens("cmpl-r3-0", list(range(40)))
    printed = log.take("cmpl-r3-0")
    assert printed is not None and [(s[0], s[1], s[2]) for s in printed.segments] == [(c.ROLE_PROMPT, 0, 40)]
    assert printed.segments[0][4] != 0  # 40 tokens: two blocks and more, so a tail hash
    log.chat("chatcmpl-r4", Chat(TURNS, None, {}, True, False, None))
    assert log.take("chatcmpl-r4") is None  # never reached the engine: nothing to fingerprint
    assert not log.reached("chatcmpl-r4")
    log.tokens("chatcmpl-r5", [1, 2, 3])
    assert log.reached("chatcmpl-r5") and log.reached("x", "chatcmpl-r5")
