"""What the gateway accepts from a client and sends to an upstream (issue 45), against a real
``tokentrace engine`` that requires a key, behind the real ``tokentrace gateway``:

- an upstream started with ``--api-key`` is served with its key (``--upstream-key NAME=KEY``), not
  marked down;
- request bodies are read as they arrive and never past ``--max-request-bytes`` (413 with a message
  that says why; the gateway's memory does not grow with a huge body), and a body must arrive in time
  (408), so idle connections cannot hold the gateway;
- the gateway's own key is checked (constant time: hmac.compare_digest).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from harness_collector import proc_status, wait_for
from harness_engine import EngineProcess, tiny_model  # noqa: F401 - fixture
from harness_gateway import GatewayProcess

pytestmark = pytest.mark.slow

ENGINE_KEY = "engine-secret-1"
GATEWAY_KEY = "gateway-secret-2"
CHAT = {"model": "default_model", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model):  # noqa: F811
    process = EngineProcess(tmp_path_factory.mktemp("gateway-limits-engine"), tiny_model, "--api-key", ENGINE_KEY,
                            instance_id="keyed").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, engine):
    process = GatewayProcess(tmp_path_factory.mktemp("gateway-limits"), {"keyed": engine.url}, "--api-key",
                             GATEWAY_KEY, "--upstream-key", f"keyed={ENGINE_KEY}", "--body-timeout", "1",
                             "--body-min-rate", "1000000").start()
    yield process
    process.stop()


def test_an_upstream_that_requires_a_key_is_served_with_its_key(gateway):
    upstream = gateway.health()["upstreams"][0]
    assert (upstream["kind"], upstream["down"]) == ("tokentrace", False), upstream
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=gateway.headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] is not None


def test_the_gateways_own_key_is_required(gateway):
    for headers in ({}, {"Authorization": "Bearer " + GATEWAY_KEY[:-1]}, {"Authorization": "Bearer " + ENGINE_KEY}):
        refused = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
        assert refused.status_code == 401, headers
    allowed = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                         headers={"Authorization": "bearer  " + GATEWAY_KEY}, timeout=60)
    assert allowed.status_code == 200, allowed.text


def test_a_body_over_the_limit_is_refused_by_the_gateway_with_413(gateway):
    big = b'{"messages": "' + b"x" * (9 << 20) + b'"}'
    declared = httpx.post(gateway.url + "/v1/chat/completions", content=big, timeout=60,
                          headers={**gateway.headers, "Content-Type": "application/json"})
    assert declared.status_code == 413
    assert "this gateway accepts at most 8388608 (--max-request-bytes)" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the body is counted as it arrives
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]

    chunked = httpx.post(gateway.url + "/v1/chat/completions", content=chunks(), timeout=60,
                         headers={**gateway.headers, "Content-Type": "application/json"})
    assert chunked.status_code == 413
    assert "over 8388608 bytes" in chunked.json()["error"]["message"]


def test_a_huge_body_does_not_grow_the_gateways_memory(gateway):
    before = proc_status(gateway.proc.pid, "VmRSS")
    piece = b"x" * (1 << 20)

    def chunks():
        yield b'{"messages": "'
        for _ in range(256):
            yield piece

    try:
        answer = httpx.post(gateway.url + "/v1/chat/completions", content=chunks(), timeout=120,
                            headers={**gateway.headers, "Content-Type": "application/json"})
        assert answer.status_code == 413
    except httpx.HTTPError:
        pass  # the gateway answered and closed while the rest was still being written: as wanted
    grown = proc_status(gateway.proc.pid, "VmRSS") - before
    assert grown < 64 << 20, f"the gateway grew by {grown >> 20} MiB reading a 256 MiB body"
    assert gateway.health()["status"] == "ok"


def test_a_body_that_does_not_arrive_in_time_is_cut_off_with_408(gateway):
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as idle:
        idle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + GATEWAY_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
        began = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = idle.recv(65536)
            if not data:
                break
            answer += data
        waited = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert waited < 10, waited
    # Served as before once the idle connection is gone.
    assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=gateway.headers,
                      timeout=60).status_code == 200


def test_the_bodies_held_at_once_are_bounded_by_max_pending_bytes(tmp_path, engine):
    """Each body is bounded by --max-request-bytes, but nothing bounded them together:
    bench/attacks.py saw the gateway grow 4.4 x --max-request-bytes under 4 senders of oversize
    bodies, 7.5 x under 8. Now bodies are charged as they arrive (twice: the body and its parsed
    JSON) until their answers end; a request alone is admitted, another past the bound gets 503 +
    Retry-After, and passes once the first is done."""
    limit = 4 << 20
    gateway = GatewayProcess(tmp_path, {"keyed": engine.url}, "--upstream-key", f"keyed={ENGINE_KEY}",
                             "--max-pending-bytes", str(limit), "--body-timeout", "60").start()
    head = b'{"model": "default_model", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}], "pad": "'
    pad, tail = b"x" * (3 << 20), b'"}'
    try:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as first:
            first.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (len(head) + len(pad) + len(tail)) + head + pad)
            wait_for(lambda: gateway.health().get("pending", {}).get("used_bytes", 0) >= 2 * len(pad), 30,
                     "the first body held (twice its 3 MiB: past the bound, admitted alone)")
            refused = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"] == "1"
            assert f"--max-pending-bytes allows ({limit}" in refused.json()["error"]["message"]
            first.sendall(tail)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += first.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        wait_for(lambda: gateway.health()["pending"]["used_bytes"] == 0, 30, "the first body given back")
        assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
        pending = gateway.health()["pending"]
        assert pending["refused"] == 1 and pending["peak_bytes"] >= 2 * len(pad), pending
    finally:
        gateway.stop()
