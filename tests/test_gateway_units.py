"""The gateway's pure parts: settings validation, routing policies, stream splitting and timing,
usage-chunk stripping, the byte-level rendering, admission (rate limit, concurrency slots)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tokentrace import contract as c
from tokentrace.engine_shim.gateway.adapters.base import CHAT, COMPLETIONS, FRAMING_SSE, Adapter, Facts, Probe
from tokentrace.engine_shim.gateway.app import RateLimiter, _without_usage
from tokentrace.engine_shim.gateway.measure import documents, token_kinds, unfinished
from tokentrace.engine_shim.gateway.prompt import fingerprint_local, routing_blocks
from tokentrace.engine_shim.gateway.router import Router
from tokentrace.engine_shim.gateway.settings import add_setting_arguments, settings_from_args
from tokentrace.engine_shim.gateway.upstreams import Upstream
from tokentrace.errors import ConfigError


def parse(*argv: str, environ: dict | None = None):
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    return settings_from_args(parser.parse_args(list(argv)), environ or {})


def test_settings_parse_upstreams_and_refuse_an_open_bind_without_a_key():
    settings = parse("--upstream", "a=http://h:1/v1/", "--upstream", "b=http://h:2", "--route", "session")
    assert settings.upstream == (("a", "http://h:1"), ("b", "http://h:2"))
    assert parse(environ={"TOKENTRACE_GATEWAY_UPSTREAM": "a=http://h:1,b=http://h:2"}).upstream[1][0] == "b"
    for argv, message in [((), "--upstream is required"), (("--upstream", "a"), "NAME=VALUE"),
                          (("--upstream", "a=ftp://x"), "must be http"),
                          (("--upstream", "a=http://h:1", "--upstream", "a=http://h:2"), "unique"),
                          (("--upstream", "a=http://h:1", "--host", "0.0.0.0"), "--api-key"),
                          (("--upstream", "a=http://h:1", "--adapter", "a=nope"), "unknown kind")]:
        with pytest.raises(ConfigError, match=message):
            parse(*argv)
    assert parse("--upstream", "a=http://h:1", "--host", "0.0.0.0", "--api-key", "k").api_key == "k"
    assert parse("--upstream", "a=http://h:1", "--host", "0.0.0.0", "--insecure-no-api-key").host == "0.0.0.0"


def upstreams(*names: str, limit: int = 4) -> list[Upstream]:
    made = [Upstream(name, f"http://{name}", limit) for name in names]
    for upstream in made:
        upstream.adapter = Adapter(upstream.name, upstream.base_url, None, Probe("openai"))
    return made


def test_round_robin_skips_down_upstreams_and_records_its_candidates():
    a, b, c_ = upstreams("a", "b", "c")
    router = Router(c.POLICY_ROUND_ROBIN, [a, b, c_])
    assert [router.choose(None, None, set()).upstream.name for _ in range(4)] == ["a", "b", "c", "a"]
    b.down = True
    decision = router.choose(None, None, set())
    assert decision.upstream.name == "c" and "b" not in decision.candidates
    assert router.choose(None, None, {"a", "c"}) is None


def test_session_sticks_then_fails_over_when_saturated_or_down():
    a, b = upstreams("a", "b", limit=1)
    router = Router(c.POLICY_SESSION, [a, b])
    first = router.choose("s", None, set())
    router.served(first, "s", None)
    b.inflight = 1 if first.upstream is a else 0  # load the other one: stickiness must still win
    assert router.choose("s", None, set()).upstream is first.upstream
    a.inflight = b.inflight = 0
    first.upstream.inflight = 1  # saturated, the other one free
    moved = router.choose("s", None, set())
    assert moved.upstream is not first.upstream and "saturated" in moved.reason
    first.upstream.inflight, first.upstream.down = 0, True
    assert "down" in router.choose("s", None, set()).reason


def test_prefix_prefers_the_upstream_that_served_the_longest_prefix_within_the_load_bound():
    a, b = upstreams("a", "b")
    router = Router(c.POLICY_PREFIX, [a, b], load_bound=1.5)
    body = {"messages": [{"role": "system", "content": "x" * 400}, {"role": "user", "content": "hi"}]}
    blocks = routing_blocks(CHAT, body, 16)
    a.served = 1  # b is then the least loaded: the first decision goes there
    router.served(router.choose(None, blocks, set()), None, blocks)
    decision = router.choose(None, blocks, set())
    assert decision.upstream is b and decision.scores[0] == len(blocks)
    b.inflight = 4  # 4 > 1.5 * (0 + 1): over the bound
    assert router.choose(None, blocks, set()).upstream is a


def test_documents_are_timed_by_the_chunk_that_completes_them():
    chunks = [(1, b": keepalive 1/2\n\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\nda"),
              (2, b"ta: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n"),
              (3, b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n")]
    found = list(documents(chunks, FRAMING_SSE))
    assert [t for t, _ in found] == [1, 2, 3]
    assert [token_kinds(p) for _, p in found] == [(False, False), (True, True), (False, False)]
    facts = Facts()
    for _, payload in found:
        Adapter("a", "http://a", None, Probe("openai")).facts_from_payload(facts, payload, CHAT)
    assert facts.prompt_tokens == 3 and facts.cached_tokens is None


def test_a_stream_is_unfinished_only_without_done_a_finish_reason_or_an_error():
    part = (1, b'data: {"choices":[{"index":0,"delta":{"content":"the"},"finish_reason":null}]}\n\n')
    assert unfinished([part, part])  # the body ended mid-answer (a stock mlx_lm.server whose rank died)
    assert not unfinished([part, (2, b"data: [DONE]\n\n")])
    assert not unfinished([part, (2, b"data: [DONE]")])  # no trailing blank line: still done
    assert not unfinished([part, (2, b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n')])
    assert not unfinished([part, (2, b'data: {"error":{"message":"generation failed"}}\n\n')])  # it said why
    assert unfinished([])  # a 200 stream with no byte at all


def test_the_usage_chunk_the_gateway_asked_for_is_withheld_and_the_rest_passes_byte_for_byte():
    stream = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n')
    sent, rest = _without_usage(stream[:30])
    assert sent == b"" and rest == stream[:30]
    sent, rest = _without_usage(stream)
    assert sent == b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n' and rest == b""


def test_byte_level_rendering_gives_one_segment_per_message():
    body = {"messages": [{"role": "system", "content": "abc" * 20}, {"role": "user", "content": "hello"}]}
    printed = fingerprint_local(CHAT, body, 16, None, capture=False)
    assert printed.unit == "bytes" and [s.role for s in printed.segments] == ["system", "user"]
    assert printed.segments[0].end == len("<|system|>\n" + "abc" * 20 + "\n") == printed.segments[1].start
    edited = {"messages": [{"role": "system", "content": "abd" * 20}, {"role": "user", "content": "hello"}]}
    other = fingerprint_local(CHAT, edited, 16, None, capture=False)
    assert other.segments[1].hash == printed.segments[1].hash and other.hashes[0] != printed.hashes[0]
    assert fingerprint_local(COMPLETIONS, {"prompt": "hi"}, 16, None, False).segments[0].role == "prompt"


def test_rate_limit_answers_with_a_retry_after():
    limiter = RateLimiter(1.0)
    assert limiter.retry_after("k") == 0
    assert limiter.retry_after("k") >= 1
    assert limiter.retry_after("other") == 0
    assert RateLimiter(0).retry_after("k") == 0


def test_slots_beyond_the_limit_wait_in_order_and_the_wait_is_measured():
    async def scenario():
        upstream = Upstream("a", "http://a", 1)
        assert await upstream.acquire() == 0
        waiter = asyncio.create_task(upstream.acquire())
        await asyncio.sleep(0)
        assert upstream.waiting == 1 and not waiter.done()
        upstream.release()
        waited = await waiter
        assert waited > 0 and upstream.inflight == 1 and upstream.waiting == 0
        upstream.release()
        assert upstream.inflight == 0

    asyncio.run(scenario())


def test_every_registered_adapter_loads_and_a_forced_kind_says_whether_it_reports_itself():
    from tokentrace.engine_shim.gateway.adapters import adapter_class, kinds

    assumed = {kind: adapter_class(kind).forced_probe() for kind in kinds()}
    assert all(probe.kind == kind for kind, probe in assumed.items())
    assert {kind for kind, probe in assumed.items() if probe.reports_itself} == {"tokentrace", "vllm-plugin"}


class _DroppingPeer:
    """An HTTP/1.1 server on 127.0.0.1 that answers the first request on each connection with
    keep-alive and then closes that connection when the next request arrives on it, without a
    response: what llama.cpp's server did to the gateway's pooled connections."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.answered = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.answered += 1
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n"
                         b"Connection: keep-alive\r\n\r\n{\"ok\":true}")
            conn.recv(65536)  # the next request on this connection: dropped unanswered


def test_a_request_safe_to_repeat_is_sent_again_when_its_kept_alive_connection_was_dropped():
    import httpx

    from tokentrace.engine_shim.gateway.adapters.base import REPEATABLE_POST, StaleConnectionRetry

    peer = _DroppingPeer()
    url = f"http://127.0.0.1:{peer.port}"

    async def scenario():
        transport = StaleConnectionRetry(httpx.AsyncHTTPTransport())
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            assert (await client.get(url + "/health")).json() == {"ok": True}
            # The pooled connection is reused and dropped: a poll and a tokenization go out again.
            assert (await client.get(url + "/health")).json() == {"ok": True}
            assert (await client.post(url + "/tokenize", json={}, extensions=REPEATABLE_POST)).status_code == 200
            assert transport.retried == 2
            # A generation request is never sent twice.
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await client.post(url + "/v1/chat/completions", json={"messages": []})
            assert transport.retried == 2
        async with httpx.AsyncClient(timeout=10) as plain:  # the failure itself, without the retry
            await plain.get(url + "/health")
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await plain.get(url + "/health")

    asyncio.run(scenario())
    assert (peer.answered, peer.connections) == (4, 4)


def test_the_generation_prompt_is_a_segment_of_its_own_so_a_last_message_hashes_as_it_will_next_turn(tiny_model):
    """With the model's tokenizer (--tokenizer), as with the engine's: the user message that ends
    turn 1 has the same segment hash as the same message inside turn 2 (issue 44: it took the
    generation prompt in, and a changed system prompt behind mlx_lm.server was called a hit)."""
    from tokentrace.engine_shim.gateway.prompt import LocalTokenizer

    tokenizer = LocalTokenizer(str(tiny_model))
    first = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hello there " * 8}]
    turn1 = fingerprint_local(CHAT, {"messages": first}, 16, tokenizer, False)
    second = [*first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again " * 8}]
    turn2 = fingerprint_local(CHAT, {"messages": second}, 16, tokenizer, False)
    assert [s.role for s in turn1.segments] == ["system", "user", "assistant"]
    assert [s.role for s in turn2.segments] == ["system", "user", "assistant", "user", "assistant"]
    assert turn1.segments[1].hash == turn2.segments[1].hash
    assert turn1.segments[-1].end == turn1.length and turn2.segments[-1].end == turn2.length
