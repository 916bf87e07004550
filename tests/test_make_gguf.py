"""make-model --gguf: llama.cpp's llama-server loads the tiny model and tokenizes exactly as the Hugging
Face tokenizer the MLX engine uses (same ids for the same text, same chat rendering), so a prompt's
fingerprint is the same whichever engine served it."""

from __future__ import annotations

import httpx
import pytest
from harness_llama import llama_factory, tiny_gguf  # noqa: F401

pytestmark = pytest.mark.slow

TEXTS = [
    "Why was this request slow?",
    "  leading spaces,\ttabs\n\nand  double  spaces   ",
    "Numbers 1234567 and 3.14159, dates 2026-12-01; code: def f(x):\n    return x ** 2\n",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🚀🔥",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "it's they're we've I'm you'll she'd 'quoted' \"double\"",
]


def test_llama_server_tokenizes_and_renders_like_the_hf_tokenizer(tiny_gguf, llama_factory):  # noqa: F811
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_gguf))
    server = llama_factory(tiny_gguf / "model.gguf", "-c", "512")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for text in TEXTS:
            got = client.post("/tokenize", json={"content": text, "add_special": True, "parse_special": True})
            assert got.json()["tokens"] == hf.encode(text, add_special_tokens=True), text
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
        rendered = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
        assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        answer = client.post("/completion", json={"prompt": rendered, "n_predict": 4, "cache_prompt": True}).json()
        assert answer["timings"]["prompt_n"] == len(hf.encode(rendered)) and answer["tokens_predicted"] >= 1
