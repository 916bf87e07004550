"""What a client of mlx_lm.server relies on, on a real engine process (issue 12 §2): routes without
/v1, models.retrieve, CORS, the API key, SSE keep-alive during a long prefill, log-probabilities."""

from __future__ import annotations

import json

import httpx
import pytest
from harness_engine import EngineProcess, streamed_text

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model):
    process = EngineProcess(tmp_path_factory.mktemp("dropin"), tiny_model, "--max-batch", "4",
                            "--allowed-origins", "http://app.example,http://other.example",
                            "--keepalive-interval", "0.05", "--prefill-step-size", "16").start()
    yield process
    assert process.stop() == 0


def test_routes_without_v1_and_models_retrieve(engine):
    request = {"max_tokens": 4, "ignore_eos": True}
    with_v1 = engine.post("/v1/chat/completions", {"messages": HELLO, **request}).json()
    without = engine.post("/chat/completions", {"messages": HELLO, **request}).json()
    assert without["choices"][0]["message"] == with_v1["choices"][0]["message"]
    assert engine.post("/completions", {"prompt": "Hi", **request}).json()["object"] == "text_completion"
    assert httpx.get(engine.url + "/v1/models/tiny").json() == {"id": "tiny", "object": "model", "created": 0,
                                                                 "owned_by": "tokentrace"}
    missing = httpx.get(engine.url + "/v1/models/gpt-17")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_cors_answers_preflights_and_names_allowed_origins_only(engine):
    preflight = httpx.options(engine.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "http://app.example"
    assert preflight.headers["vary"] == "Origin"
    assert httpx.options(engine.url + "/anything").status_code == 204
    answered = engine.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers={"Origin": "http://other.example"})
    assert answered.headers["access-control-allow-origin"] == "http://other.example"
    stranger = engine.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers={"Origin": "http://evil.example"})
    assert stranger.status_code == 200 and "access-control-allow-origin" not in stranger.headers


def test_keepalive_comments_flow_while_a_long_prompt_is_prefilled(engine):
    # ~1,400 prompt tokens in 16-token chunks: the first token takes many 50 ms keep-alive periods.
    prompt = list(range(3, 500)) * 3
    with httpx.stream("POST", engine.url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data > 0 and all(line == ": keepalive" for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"


def test_logprobs_in_openai_shape_streamed_and_not(engine):
    body = {"messages": HELLO, "max_tokens": 8, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    whole = engine.post("/v1/chat/completions", body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == 8
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and entry["bytes"] == list(entry["token"].encode())
    events, _ = engine.stream("/v1/chat/completions", body)
    streamed = [e for event in events for choice in event["choices"] if choice.get("logprobs")
                for e in choice["logprobs"]["content"]]
    assert [(e["token"], round(e["logprob"], 4)) for e in streamed] == \
        [(e["token"], round(e["logprob"], 4)) for e in content]
    assert streamed_text(events) == whole["message"]["content"]
    completion = engine.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True,
                                                 "logprobs": 3}).json()["choices"][0]
    logprobs = completion["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"])
    offsets = logprobs["text_offset"]  # each token's text starts where the previous one's ended
    assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(5)]
    plain = engine.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}).json()["choices"][0]
    assert plain["logprobs"] is None


def test_large_bodies_and_many_messages_are_refused_clearly(engine):
    too_many = engine.post("/v1/chat/completions", {"messages": HELLO * 3000, "max_tokens": 1})
    assert too_many.status_code == 400 and "--max-messages" in too_many.json()["error"]["message"]
    assert too_many.json()["error"]["param"] == "messages"
    huge = engine.post("/v1/completions", json.dumps({"prompt": "x" * (9 << 20)}).encode())
    assert huge.status_code == 413 and "--max-request-bytes" in huge.json()["error"]["message"]


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{{ suffix }}"


def test_an_api_key_guards_everything_but_health_and_the_chat_template_options_apply(tmp_path, tiny_model):
    engine = EngineProcess(tmp_path, tiny_model, "--api-key", "s3cret", "--chat-template", TEMPLATE,
                           "--chat-template-args", '{"suffix": "A:"}').start()
    try:
        assert httpx.get(engine.url + "/health").status_code == 200
        refused = engine.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(engine.url + "/v1/models").status_code == 401
        wrong = engine.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                            headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert engine.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers=key).status_code == 200

        def prompt_tokens(**extra) -> int:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
            return engine.post("/v1/chat/completions", body, headers=key).json()["usage"]["prompt_tokens"]

        custom = prompt_tokens()
        longer = prompt_tokens(chat_template_kwargs={"suffix": "Answer in a long and careful way:"})
        assert custom < longer  # the suffix only exists in --chat-template; the request's kwargs win
    finally:
        assert engine.stop() == 0


def _write_adapter(model_dir, out) -> None:
    """A LoRA adapter for the tiny model, as mlx_lm.lora saves one, with non-zero weights so that
    it changes the output."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    model.freeze()
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(3)
    weights = {k: mx.random.normal(v.shape) * 0.5 if k.endswith("lora_b") else v
               for k, v in tree_flatten(model.trainable_parameters())}
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2,
                                                         "lora_parameters": params}))


def test_adapter_path_applies_lora_adapters(engine, tmp_path, tiny_model):
    _write_adapter(tiny_model, tmp_path / "adapter")
    request = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "ignore_eos": True}
    base = engine.post("/v1/completions", request).json()["choices"][0]["text"]
    adapted = EngineProcess(tmp_path, tiny_model, "--adapter-path", str(tmp_path / "adapter")).start()
    try:
        assert adapted.post("/v1/completions", request).json()["choices"][0]["text"] != base
    finally:
        assert adapted.stop() == 0
