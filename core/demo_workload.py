"""The demo's scripted workload: real requests against two engine instances that produce every
slowness category and every cache-miss cause. The analyzer acceptance tests drive the same script.

Instance A serves with ``--max-batch 2 --cache-max-entries 4``; instance B with ``--lazy-load
--max-batch 4 --prefill-step-size 64``. Each scenario returns the requests that show something,
with what the analyzers should say about them.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from tokentrace.errors import TokentraceError

#: Flags each instance needs for its scenarios.
INSTANCE_FLAGS = {
    "A": ["--max-batch", "2", "--cache-max-entries", "4", "--prefill-step-size", "256"],
    "B": ["--lazy-load", "--max-batch", "4", "--prefill-step-size", "64"],
}
LONG_GENERATION = 300  # tokens: long enough to hold a batch slot for a while on a tiny model


@dataclass(frozen=True)
class Shown:
    """A request the demo shows, and the verdict it should get."""

    label: str  #: what the scenario demonstrates
    request_id: str
    instance: str  #: "A" or "B"
    verdict: str  #: "slow", "cache" or "outcome": which verdict demonstrates it
    expect: str | None  #: the category, cause or outcome it should get (None: cache hit)


@dataclass
class Cluster:
    """Where the engines listen: {"A": url, "B": url}."""

    engines: dict[str, str]


def _words(seed: int, count: int) -> str:
    """Deterministic filler text; each seed gives a different text from its first word on."""
    vocabulary = ("cache", "prefix", "token", "decode", "prefill", "queue", "batch", "model", "layer", "mac",
                  "mini", "cluster", "request", "latency", "memory", "bandwidth", "kernel", "shard")
    state = seed * 7919 + 17
    words = []
    for _ in range(count):
        state = (state * 1103515245 + 12345) % (1 << 31)
        words.append(vocabulary[state % len(vocabulary)])
    return f"[{seed}] " + " ".join(words)


def _post(url: str, request_id: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise TokentraceError(f"{url} answered {exc.code} to request {request_id}: {exc.read()[:300]!r}") from None


def chat(url: str, request_id: str, messages: list[dict], max_tokens: int, session: str | None = None) -> dict:
    """One non-streamed chat request of exactly ``max_tokens`` output tokens."""
    body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
    if session:
        body["user"] = session
    return _post(url, request_id, body)


def refused(url: str, request_id: str, body: dict) -> int:
    """Send a request the engine must refuse; returns the HTTP status it answered."""
    try:
        _post(url, request_id, body)
    except TokentraceError as exc:
        return int(str(exc).split(" answered ", 1)[1].split(" ", 1)[0])
    raise TokentraceError(f"{url} accepted request {request_id}, which it should have refused")


def reply(answer: dict) -> dict:
    """The assistant message of a chat answer, to continue the conversation."""
    return answer["choices"][0]["message"]


def stream_in_background(url: str, request_id: str, messages: list[dict], max_tokens: int) -> tuple[
        threading.Thread, threading.Event]:
    """Start a streamed request on a thread; the event is set once its first token arrived."""
    first = threading.Event()

    def run() -> None:
        body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         method="POST", headers={"Content-Type": "application/json",
                                                                 "X-Request-Id": request_id})
        with urllib.request.urlopen(request, timeout=300) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    first.set()
        first.set()

    thread = threading.Thread(target=run, name=f"stream-{request_id}", daemon=True)
    thread.start()
    return thread, first


def _system(seed: int) -> dict:
    return {"role": "system", "content": _words(seed, 40)}


def _user(seed: int, count: int = 24) -> dict:
    return {"role": "user", "content": _words(seed, count)}


def cold_start(cluster: Cluster) -> list[Shown]:
    """B loads its model only when this first request arrives (--lazy-load)."""
    chat(cluster.engines["B"], "demo-cold-start", [_user(1, 4)], 2)
    return [Shown("cold start (lazy load)", "demo-cold-start", "B", "slow", "cold_start")]


def prefix_change(cluster: Cluster) -> list[Shown]:
    """The same conversation again, with its system prompt rewritten."""
    a = cluster.engines["A"]
    first = chat(a, "demo-sys-before", [_system(10), _user(11)], 4, "conv-sys")
    chat(a, "demo-sys-changed", [_system(12), _user(11), reply(first), _user(13)], 4, "conv-sys")
    return [Shown("changed system prompt", "demo-sys-changed", "A", "cache", "prefix_change")]


def instance_change(cluster: Cluster) -> list[Shown]:
    """A conversation whose second turn lands on the other instance."""
    first = chat(cluster.engines["A"], "demo-move-1", [_system(20), _user(21)], 4, "conv-move")
    chat(cluster.engines["B"], "demo-move-2", [_system(20), _user(21), reply(first), _user(22)], 4, "conv-move")
    return [Shown("conversation moved to B", "demo-move-2", "B", "cache", "instance_change")]


def clean_hit(cluster: Cluster) -> list[Shown]:
    """A second turn on the same instance reuses everything the first left."""
    b = cluster.engines["B"]
    first = chat(b, "demo-hit-1", [_system(30), _user(31)], 8, "conv-hit")
    chat(b, "demo-hit-2", [_system(30), _user(31), reply(first), _user(32)], 4, "conv-hit")
    return [Shown("follow-up turn, same instance", "demo-hit-2", "B", "cache", None)]


def queueing(cluster: Cluster) -> list[Shown]:
    """Two long generations fill A's two batch slots; a short request waits behind them."""
    a = cluster.engines["A"]
    streams = [stream_in_background(a, f"demo-long-gen-{i}", [_user(40 + i, 8)], LONG_GENERATION) for i in (1, 2)]
    for _, first_token in streams:
        first_token.wait(120)
    chat(a, "demo-queued", [_user(43, 4)], 4)
    for thread, _ in streams:
        thread.join(300)
    return [Shown("queued behind long generations", "demo-queued", "A", "slow", "queueing")]


def capacity(cluster: Cluster) -> list[Shown]:
    """A conversation's cache entry is pushed out of A's 4-entry cache before its next turn."""
    a = cluster.engines["A"]
    first = chat(a, "demo-evicted-1", [_system(50), _user(51)], 8, "conv-cap")
    for i in range(4):
        chat(a, f"demo-filler-{i}", [_system(60 + i), _user(70 + i)], 2)
    chat(a, "demo-evicted-2", [_system(50), _user(51), reply(first), _user(52)], 4, "conv-cap")
    return [Shown("entry evicted before the next turn", "demo-evicted-2", "A", "cache", "capacity")]


def long_prompt(cluster: Cluster) -> list[Shown]:
    """A long prompt nobody sent before: all of it is prefilled."""
    chat(cluster.engines["B"], "demo-long-prompt", [_user(80, 450)], 1)  # ~1,400 tokens
    return [Shown("long uncached prompt", "demo-long-prompt", "B", "slow", "prefill"),
            Shown("first-time prompt", "demo-long-prompt", "B", "cache", "new_prefix")]


def contended_decode(cluster: Cluster) -> list[Shown]:
    """Three long generations share B's batch while a long prompt's prefill chunks interleave."""
    b = cluster.engines["B"]
    streams = [stream_in_background(b, f"demo-contended-{i}", [_user(90 + i, 8)], LONG_GENERATION)
               for i in (1, 2, 3)]
    for _, first_token in streams:
        first_token.wait(120)
    chat(b, "demo-interloper", [_user(95, 300)], 1)  # ~950 tokens, 15 chunks of 64
    for thread, _ in streams:
        thread.join(300)
    return [Shown("decode shared with a prefill", "demo-contended-1", "B", "slow", "decode")]


def steady(cluster: Cluster) -> list[Shown]:
    """Identical small requests on warm B: the last one is fast by B's own baseline."""
    b = cluster.engines["B"]
    # 32 tokens: decode dominates and TPOT averages 31 intervals, steady against a stray millisecond.
    for i in range(5):
        chat(b, f"demo-steady-{i}", [_user(100, 6)], 32)
    chat(b, "demo-fast", [_user(100, 6)], 32)
    return [Shown("a request that is fast everywhere", "demo-fast", "B", "slow", None)]


def edited_assistant(cluster: Cluster) -> list[Shown]:
    """The same conversation again, with an earlier assistant answer edited."""
    b = cluster.engines["B"]
    history = [_system(110), _user(111)]
    first = chat(b, "demo-edit-1", history, 8, "conv-edit")
    history += [reply(first), _user(112)]
    chat(b, "demo-edit-2", history, 4, "conv-edit")
    edited = {"role": "assistant", "content": "(edited) " + reply(first)["content"]}
    chat(b, "demo-edit-3", [history[0], history[1], edited, history[3], _user(113)], 4, "conv-edit")
    return [Shown("earlier assistant answer edited", "demo-edit-3", "B", "cache", "prefix_change")]


def tools_added(cluster: Cluster) -> list[Shown]:
    """The same messages again, now with a tools block: only what lies between messages changed."""
    b = cluster.engines["B"]
    messages = [_system(120), _user(121)]
    chat(b, "demo-tools-before", messages, 4, "conv-tools")
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                               "parameters": {"type": "object", "properties": {}}}}]
    _post(b, "demo-tools-after", {"messages": messages, "tools": tools, "max_tokens": 4, "ignore_eos": True,
                                  "user": "conv-tools"})
    return [Shown("tools block added, messages unchanged", "demo-tools-after", "B", "cache", "prefix_change")]


def too_short(cluster: Cluster) -> list[Shown]:
    """Two prompts that share only a system prompt shorter than one cache block."""
    b = cluster.engines["B"]
    # The user messages differ from their first character, so the prompts share the system message
    # and the user turn's opening markup: 15 tokens with the tiny model's tokenizer, under one block.
    system = {"role": "system", "content": "ok"}
    chat(b, "demo-short-1", [system, {"role": "user", "content": "Q" + _words(130, 24)}], 2)
    chat(b, "demo-short-2", [system, {"role": "user", "content": "Z" + _words(131, 24)}], 2)
    return [Shown("shared part under one block", "demo-short-2", "B", "cache", "too_short")]


def refused_requests(cluster: Cluster) -> list[Shown]:
    """A prompt over the model's context and an unknown model: the engine refuses both."""
    b = cluster.engines["B"]
    refused(b, "demo-too-long", {"messages": [_user(140, 900)], "max_tokens": 4})  # ~2,800 tokens > 2,048
    refused(b, "demo-unknown-model", {"model": "no-such-model", "messages": [_user(141)], "max_tokens": 4})
    return [Shown("prompt over the context limit", "demo-too-long", "B", "outcome", "rejected"),
            Shown("unknown model", "demo-unknown-model", "B", "outcome", "rejected")]


#: The scenarios in the order the demo runs them (B's cold start must come first).
SCENARIOS: tuple[Callable[[Cluster], list[Shown]], ...] = (
    cold_start, prefix_change, instance_change, clean_hit, queueing, capacity, long_prompt, contended_decode,
    steady, edited_assistant, tools_added, too_short, refused_requests,
)


def run_workload(cluster: Cluster, progress: Callable[[str], None] = lambda _: None) -> list[Shown]:
    """Run every scenario; returns the requests to show with their expected verdicts."""
    shown: list[Shown] = []
    for scenario in SCENARIOS:
        progress(scenario.__doc__.splitlines()[0])
        shown.extend(scenario(cluster))
    return shown
