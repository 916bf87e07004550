"""The truth matrix (docs/truth.md): built situations with known causes, run on every way in, and the
answer each surface gives for them.

``declarations()`` parses docs/truth.md's table (one row per situation, one column per path), so a
test expects exactly what the docs declare. ``run_cells`` builds every situation on one path, through
a ``Topology`` (where each role's requests go, how an engine restarts); ``gather`` then reads every
surface: the collector's API, the dashboard's JSON twin, the CLI through ``--url`` and (after the
collector stopped) ``--db``, ``analyze report`` and ``/metrics``. ``check_answer`` and
``check_surfaces`` are the two tests of a cell.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for

from tokentrace.cli import main as cli_main
from tokentrace.dashboards.prometheus import HISTOGRAMS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "truth.md"

PATHS = ("engine", "gateway-engine", "gateway-mlx", "gateway-llama", "gateway-vllm", "vllm", "engine-ring")


# --- the table in docs/truth.md ---------------------------------------------------------------------

@dataclass(frozen=True)
class Declaration:
    """One cell of the table: ``yes``, ``yes, without X [ref]``, ``not observable [ref]``, ``n/a [ref]``."""

    kind: str  #: "yes", "without", "not_observable" or "n/a"
    without: str | None = None  #: the detail left out ("evicting request", "blockers")
    reason: str | None = None  #: the reason's text


_CELL = re.compile(r"^(yes)$|^yes, without ([a-z ]+) \[([a-z-]+)\]$|^(not observable|n/a) \[([a-z-]+)\]$")


def _table(lines: list[str], header: str) -> list[list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def declarations() -> tuple[list[str], dict[tuple[str, str], Declaration]]:
    """The situations (in order) and every cell's declaration, as docs/truth.md states them."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    reasons = dict(re.findall(r"^- \[([a-z-]+)\]: (.+)$", "\n".join(lines), re.M))
    header = next(line for line in lines if line.startswith("| situation | `engine`"))
    paths = [cell.strip().strip("`") for cell in header.strip().strip("|").split("|")][1:]
    assert tuple(paths) == PATHS, paths
    situations, cells = [], {}
    for row in _table(lines, header):
        situation = row[0].strip("`")
        situations.append(situation)
        for path, text in zip(paths, row[1:], strict=True):
            match = _CELL.match(text)
            assert match, f"docs/truth.md: cell ({situation}, {path}) reads {text!r}"
            if match.group(1):
                cells[(path, situation)] = Declaration("yes")
            elif match.group(2):
                cells[(path, situation)] = Declaration("without", match.group(2), reasons[match.group(3)])
            else:
                kind = "n/a" if match.group(4) == "n/a" else "not_observable"
                cells[(path, situation)] = Declaration(kind, None, reasons[match.group(5)])
    return situations, cells


def described_situations() -> list[str]:
    """The situations of the 'Situations and the right answer' table."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    return [row[0].strip("`") for row in _table(lines, "| situation | built as | right answer |")]


SITUATIONS, CELLS = declarations()


def cases(*paths: str) -> list:
    """pytest params (path, situation) for every cell of ``paths``."""
    return [pytest.param(path, situation, id=f"{path}-{situation}") for path in paths for situation in SITUATIONS]


def marked(cases: list, wrong: dict[tuple[str, str], str],
           unreliable: dict[tuple[str, str], str] | None = None) -> list:
    """``cases`` with a strict xfail on each (path, situation) listed in ``wrong`` (its answer is
    wrong every time), and a non-strict one on each listed in ``unreliable``: a situation this
    machine does not build the same way every run (the reason says why), whose answer is then
    right or wrong by the run, and which must not decide CI either way."""
    out = []
    for case in cases:
        path, situation = case.values
        reason = wrong.get((path, situation))
        marks = [pytest.mark.xfail(strict=True, reason=f"issue 44: wrong today: {reason}")] if reason else []
        if (path, situation) in (unreliable or {}):
            marks.append(pytest.mark.xfail(strict=False, reason=f"not built reliably here: "
                                                                 f"{unreliable[(path, situation)]}"))
        out.append(pytest.param(path, situation, id=case.id, marks=marks))
    return out


# --- prompts -------------------------------------------------------------------------------------------

_VOCABULARY = ("harbour", "tide", "lantern", "rope", "gull", "anchor", "sail", "net", "pier", "storm", "salt",
               "keel", "mast", "dock", "wave", "reef", "shore", "buoy")


def words(seed: int, count: int) -> str:
    """Deterministic text; each seed gives a different text from its first word on."""
    state = seed * 7919 + 17
    out = []
    for _ in range(count):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(_VOCABULARY[state % len(_VOCABULARY)])
    return " ".join(out)


def _clock(seed: int) -> str:
    return f"[{seed % 24:02d}:{seed * 7 % 60:02d}:{seed * 13 % 60:02d}]"


def system_prompt(seed: int, where: str | None = None, size: int = 48) -> dict:
    """A long system message that starts with a time of its own (so that two cells' system messages
    differ from their first characters: what precedes them is less than a cache block); ``where``
    ("start", "middle", "end") changes it at that place: the time, a version in the middle, the last
    sentence."""
    head, middle, tail = _clock(seed), "policy v1", "Today is Monday."
    if where == "start":
        head = _clock(seed + 1)
    elif where == "middle":
        middle = "policy v2"
    elif where == "end":
        tail = "Today is Friday."
    half = size // 2
    return {"role": "system", "content": f"{head} {words(seed, half)} {middle} {words(seed + 1, half)} {tail}"}


def user(seed: int, count: int = 12) -> dict:
    """A user message that differs from every other seed's from its first characters on."""
    return {"role": "user", "content": f"#{seed} {words(seed, count)}"}


# --- a path's processes ----------------------------------------------------------------------------

#: Output tokens of the decode-bound request (decode must outweigh a short prompt's prefill many times
#: over).
DECODE = 64


@dataclass
class Topology:
    """Where one path's requests go, and what its engines can do.

    ``urls`` maps a role to a base URL: ``main`` (most situations), ``narrow`` (a gateway with
    --max-concurrency 1; gateway paths only), ``cold`` (an engine whose model is not loaded yet),
    ``template`` (an instance restarted with another chat template), ``move`` (the instance-change
    conversation's two turns: a pair of URLs)."""

    path: str
    collector: CollectorProcess
    urls: dict[str, object]
    model: str | None = None  #: the "model" field of every body (None: left out)
    slots: int = 2  #: long generations that fill the main engine's batch
    fillers: int = 4  #: prompts that push a conversation out of the main engine's cache
    filler_words: int = 40
    long_words: int = 450  #: a long prompt (prefill); must fit the context
    too_long_words: int = 900  #: a prompt over the context (refused)
    refuse: Callable[[str], dict] | None = None  #: sends a refused request itself (mlx_lm.server)
    warm: Callable[[], None] | None = None  #: after the cold start: makes sure the cold engine is loaded
    #: The queueing situations' requests are written back to back on connections opened beforehand
    #: (the long generations first), instead of the short one being sent once the long ones hold their
    #: slots: vLLM CPU starves its own API server, which then streams nothing (and reports nothing)
    #: until a generation ends, so no signal from it says the slots are taken in time.
    burst: bool = False
    long_tokens: int = 120  #: output tokens of a generation that holds a slot while another waits
    decode_tokens: int = DECODE  #: output tokens of the decode-bound request
    #: output tokens asked by the request the client hangs up on (it must still be generating then,
    #: and its prompt plus these must fit the context, or it is refused rather than cancelled)
    cancel_tokens: int = 2000
    prefix: str = ""  #: request and session ids start with it
    sent: list[str] = field(default_factory=list)  #: every request id sent
    cells: dict[str, dict] = field(default_factory=dict)  #: situation -> {rid, ...}
    laps: list[tuple[str, float]] = field(default_factory=list)  #: (what, seconds) in order
    _clock: float = field(default_factory=time.monotonic)

    def lap(self, what: str) -> None:
        """Record how long the situations since the previous lap took (printed by ``gather``)."""
        now = time.monotonic()
        self.laps.append((what, round(now - self._clock, 1)))
        self._clock = now

    seed: int = 0  #: added to every prompt's seed: paths that share engines send different prompts

    def system(self, seed: int, where: str | None = None) -> dict:
        return system_prompt(seed + self.seed, where)

    def user(self, seed: int, count: int = 12) -> dict:
        return user(seed + self.seed, count)

    def words(self, seed: int, count: int) -> str:
        return words(seed + self.seed, count)

    def url(self, role: str) -> str:
        return self.urls[role]  # type: ignore[return-value]

    def rid(self, name: str) -> str:
        rid = f"{self.prefix}{name}"
        self.sent.append(rid)
        return rid

    def body(self, messages: list[dict], max_tokens: int, session: str | None, **fields) -> dict:
        body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **fields}
        if self.model is not None:
            body["model"] = self.model
        if session:
            body["user"] = session
        return body

    def headers(self, rid: str, session: str | None) -> dict:
        return {"X-Request-Id": rid, **({"X-Session-Id": session} if session else {})}

    def chat(self, role: str, name: str, messages: list[dict], max_tokens: int = 4, session: str | None = None,
             url: str | None = None, answered: dict | None = None) -> str:
        """One streamed chat request, read to its end; returns the assistant's text. A request not
        answered with 200 fails the path's run, unless ``answered`` is given: then its status and
        body are put there, for the cell to fail on."""
        rid = self.rid(name)
        session = f"{self.prefix}{session}" if session else None
        text = []
        with httpx.stream("POST", (url or self.url(role)) + "/v1/chat/completions", timeout=300,
                          json=self.body(messages, max_tokens, session, stream=True),
                          headers=self.headers(rid, session)) as response:
            if answered is not None:
                answered.update(status=response.status_code, body=response.read().decode(errors="replace")[:300]
                                if response.status_code != 200 else None)
                if response.status_code != 200:
                    return ""
            assert response.status_code == 200, (rid, response.read())
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or ():
                        text.append((choice.get("delta") or {}).get("content") or "")
        return "".join(text)

    def background(self, role: str, name: str, messages: list[dict], max_tokens: int,
                   hang_up: bool = False) -> tuple[threading.Thread, threading.Event]:
        """A streamed request on a thread; the event is set at its first content. ``hang_up``: the
        client closes the connection there."""
        rid = self.rid(name)
        first = threading.Event()

        def run() -> None:
            try:
                with httpx.stream("POST", self.url(role) + "/v1/chat/completions", timeout=300,
                                  json=self.body(messages, max_tokens, None, stream=True),
                                  headers=self.headers(rid, None)) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            first.set()
                            if hang_up:
                                return
            finally:
                first.set()

        thread = threading.Thread(target=run, name=f"truth-{rid}", daemon=True)
        thread.start()
        return thread, first

    def refused(self, role: str, name: str) -> int:
        """A request the engine must refuse (4xx); returns its status."""
        rid = self.rid(name)
        if self.refuse is not None:
            response = self.refuse(rid)
        else:
            body = self.body([user(900, self.too_long_words)], 4, None)
            response = httpx.post(self.url(role) + "/v1/chat/completions", json=body,
                                  headers=self.headers(rid, None), timeout=120)
        assert 400 <= response.status_code < 500, (rid, response.status_code, response.text[:300])
        return response.status_code


def _while_running(threads: list[threading.Thread], ready: Callable[[], bool], what: str) -> None:
    """Wait until ``ready()``; the situation is not built (a clear failure, not a wrong verdict) when
    the background requests end first."""
    def check() -> bool:
        if ready():
            return True
        assert all(thread.is_alive() for thread in threads), f"not built: the requests ended before {what}"
        return False

    wait_for(check, 120, what, interval=0.05)


def _gateway_inflight(url: str) -> int:
    """Requests holding a slot of a gateway's upstreams (its /health)."""
    return sum(u["inflight"] for u in httpx.get(url + "/health", timeout=10).json()["upstreams"])


def _burst(t: Topology, role: str, chats: list[tuple[str, list[dict], int]]) -> None:
    """Streamed chats (name, messages, max tokens) written whole, one after the other, in one loop of
    this thread, on connections opened beforehand, so that they arrive in this order and together;
    then each answer is read to its end (every one must be 200)."""
    where = urllib.parse.urlsplit(t.url(role))
    ready = []
    for name, messages, max_tokens in chats:
        rid = t.rid(name)
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
        connection.connect()
        body = json.dumps(t.body(messages, max_tokens, None, stream=True)).encode()
        ready.append((rid, connection, body, {**t.headers(rid, None), "Content-Type": "application/json"}))
    for _, connection, body, headers in ready:
        connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
    for rid, connection, _, _ in ready:
        response = connection.getresponse()
        text = response.read()
        connection.close()
        assert response.status == 200, (rid, response.status, text[:300])


def settled(gateways: list) -> None:
    """Wait until every gateway sees every upstream up (after an upstream restarted)."""
    for gateway in gateways:
        wait_for(lambda g=gateway: all(not u["down"] for u in g.health()["upstreams"]), 60,
                 f"gateway {gateway.port}'s upstreams up")


def once(run: Callable[[str], Gathered]) -> Callable[[str], Gathered]:
    """``run(path)`` at most once per path; a failed run fails every cell of its path at once."""
    ran: dict[str, object] = {}

    def get(path: str) -> Gathered:
        if path not in ran:
            try:
                ran[path] = run(path)
            except BaseException as exc:
                ran[path] = exc
                raise
        if isinstance(ran[path], BaseException):
            pytest.fail(f"the {path} path's run failed: {ran[path]!r}")
        return ran[path]  # type: ignore[return-value]

    return get


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text or "ok"}


# --- the situations ------------------------------------------------------------------------------------

def before_restart(t: Topology, shared: bool = False) -> None:
    """Every situation up to the restarts (cold start first: nothing may load the cold engine before);
    with ``shared`` (another path's situations follow on the same engine), all but the restart's
    first turn (``restart_first_turn``)."""
    declared = {s for s in SITUATIONS if CELLS[(t.path, s)].kind != "n/a"}
    if "cold_start" in declared:
        t.cells["cold_start"] = {"rid": t.prefix + "cold", "answered": {}}
        t.chat("cold", "cold", [t.user(1, 4)], 2, answered=t.cells["cold_start"]["answered"])
        if t.warm is not None:
            t.warm()
    if "template_change" in declared and "template" in t.urls:  # elsewhere not observable: not built
        first = [t.system(5), t.user(6)]
        t.cells["template_change"] = {"first": first, "answer": t.chat("template", "tmpl-1", first, 8, "s-tmpl")}

    # A short request behind long generations that fill every batch slot.
    t.lap("cold start, first turns")
    t.cells["queueing_engine"] = {"rid": t.prefix + "queued", "blockers": {f"{t.prefix}long-{i}" for i in
                                                                           range(t.slots)}, "slots": t.slots}
    longs = [(f"long-{i}", [t.user(40 + i, 8)], t.long_tokens) for i in range(t.slots)]
    if t.burst:
        _burst(t, "main", [*longs, ("queued", [t.user(43, 4)], 4)])
    else:
        streams = [t.background("main", *long) for long in longs]
        for _, first in streams:
            first.wait(120)
        t.chat("main", "queued", [t.user(43, 4)], 4)
        for thread, _ in streams:
            thread.join(300)

    if "queueing_gateway" in declared:
        t.cells["queueing_gateway"] = {"rid": t.prefix + "gw-queued", "blockers": {t.prefix + "gw-long"}, "slots": 1}
        if t.burst:
            _burst(t, "narrow", [("gw-long", [t.user(44, 8)], t.long_tokens), ("gw-queued", [t.user(45, 4)], 4)])
        else:
            thread, _ = t.background("narrow", "gw-long", [t.user(44, 8)], t.long_tokens)
            # The gateway's own count of the slot held (its /health), not the long generation's
            # first content: its slot must be taken when the short request arrives.
            _while_running([thread], lambda: _gateway_inflight(str(t.urls["narrow"])) >= 1,
                           f"{t.path}: the narrow gateway's slot held by the long generation")
            t.chat("narrow", "gw-queued", [t.user(45, 4)], 4)
            thread.join(300)

    t.lap("queueing")
    t.cells["prefill"] = {"rid": t.prefix + "prefill"}
    t.chat("main", "prefill", [t.user(80, t.long_words)], 1)
    t.cells["decode"] = {"rid": t.prefix + "decode"}
    t.chat("main", "decode", [t.user(81, 6)], t.decode_tokens)
    t.lap("prefill, decode")

    first = [t.system(30), t.user(31)]
    answer = t.chat("main", "hit-1", first, 8, "s-hit")
    t.cells["hit"] = {"rid": t.prefix + "hit-2"}
    t.chat("main", "hit-2", [*first, reply(answer), t.user(32)], 4, "s-hit")

    for n, where in enumerate(("start", "middle", "end")):
        seed = 200 + 10 * n
        first = [t.system(seed), t.user(seed + 2)]
        answer = t.chat("main", f"multi-{where}-1", first, 8, f"s-multi-{where}")
        t.cells[f"prefix_multi_{where}"] = {"rid": f"{t.prefix}multi-{where}-2"}
        second = [t.system(seed, where), t.user(seed + 2), reply(answer), t.user(seed + 3)]
        t.chat("main", f"multi-{where}-2", second, 4, f"s-multi-{where}")
    for n, where in enumerate(("start", "middle", "end")):
        seed = 300 + 10 * n
        t.chat("main", f"oneshot-{where}-1", [t.system(seed), t.user(seed + 2)], 4)
        t.cells[f"prefix_oneshot_{where}"] = {"rid": f"{t.prefix}oneshot-{where}-2"}
        t.chat("main", f"oneshot-{where}-2", [t.system(seed, where), t.user(seed + 5)], 4)

    t.lap("hit, prefix changes")
    first = [t.system(20), t.user(21)]
    a, b = t.urls["move"]  # type: ignore[misc]
    answer = t.chat("main", "move-1", first, 4, "s-move", url=a)
    t.cells["instance_change"] = {"rid": t.prefix + "move-2", "first": t.prefix + "move-1"}
    t.chat("main", "move-2", [*first, reply(answer), t.user(22)], 4, "s-move", url=b)

    short = {"role": "system", "content": "ok"}
    t.chat("main", "short-1", [short, {"role": "user", "content": "Q" + t.words(130, 24)}], 2)
    t.cells["too_short"] = {"rid": t.prefix + "short-2"}
    t.chat("main", "short-2", [short, {"role": "user", "content": "Z" + t.words(131, 24)}], 2)

    t.cells["refused"] = {"rid": t.prefix + "refused"}
    t.refused("main", "refused")

    t.lap("instance change, too short, refused")
    # Capacity last but one: its fillers push everything else out of the main engine's cache.
    first = [t.system(50), t.user(51)]
    answer = t.chat("main", "cap-1", first, 8, "s-cap")
    fillers = [t.prefix + f"filler-{i}" for i in range(t.fillers)]
    for i in range(t.fillers):
        filler = [{"role": "system", "content": t.words(60 + i, t.filler_words)}, t.user(70 + i)]
        t.chat("main", f"filler-{i}", filler, 2)
    t.cells["capacity"] = {"rid": t.prefix + "cap-2", "evictors": set(fillers)}
    t.chat("main", "cap-2", [*first, reply(answer), t.user(52)], 4, "s-cap")

    thread, first_token = t.background("main", "cancelled", [t.user(90, 6)], t.cancel_tokens, hang_up=True)
    first_token.wait(120)
    thread.join(60)
    t.cells["cancelled"] = {"rid": t.prefix + "cancelled"}
    t.lap("capacity, cancelled")
    if not shared:
        restart_first_turn(t)


def restart_first_turn(t: Topology) -> None:
    """The restart's first turn, last before the restart, once every filler is gone by: nothing evicts
    it before the restart. Paths that share an engine call it for each path after every path's
    ``before_restart(t, shared=True)`` (another path's fillers would evict it: capacity, rightly)."""
    if CELLS[(t.path, "restart")].kind != "n/a":
        first = [t.system(7), t.user(8)]
        t.cells["restart"] = {"first": first, "answer": t.chat("main", "restart-1", first, 8, "s-restart")}


def around_restart(paths: list[Topology], restart: Callable[[], None], gateways: dict, what: str) -> None:
    """Every path's situations up to the restart (on an engine the paths share, each restart's first
    turn after all of them: ``restart_first_turn``), ``restart()``, every gateway settled, then the
    turns after it."""
    shared = len(paths) > 1
    for t in paths:
        before_restart(t, shared=shared)
    if shared:
        for t in paths:
            restart_first_turn(t)
    restart()
    settled(list(gateways.values()))
    for t in paths:
        t.lap(what)
        after_restart(t)


@contextlib.contextmanager
def stopping(collector: CollectorProcess, *groups) -> Iterator[None]:
    """A path's run: at its end every process of ``groups`` is stopped (dicts or lists, read then, so
    they may be filled during the run; in the order given: gateways before their engines), and the
    collector too when the run failed (a run that passed is read after it)."""
    try:
        yield
    except BaseException:
        collector.stop()
        raise
    finally:
        for group in groups:
            for process in group.values() if isinstance(group, dict) else group:
                process.stop()


def after_restart(t: Topology) -> None:
    """The second turns of the conversations whose engine restarted (``restart``, ``template_change``)."""
    for situation, role, name, session in (("restart", "main", "restart", "s-restart"),
                                           ("template_change", "template", "tmpl", "s-tmpl")):
        cell = t.cells.get(situation)
        if cell is None:
            continue
        t.chat(role, f"{name}-2", [*cell["first"], reply(cell["answer"]), t.user(9)], 4, session)
        t.cells[situation] = {"rid": f"{t.prefix}{name}-2"}
    t.lap("after the restarts")


# --- every surface ----------------------------------------------------------------------------------

@dataclass
class Gathered:
    """What every surface said about one path's requests."""

    path: str
    cells: dict[str, dict]
    api: dict[str, dict]  #: request id -> /api/requests/{id}/verdict, every stored request
    dashboard: dict[str, dict]  #: judged request id -> /requests/{id}.json's {slow, cache}
    cli_url: dict[str, dict]
    cli_db: dict[str, dict]
    report_url: dict
    report_db: dict
    metrics: dict[str, Counter]  #: series -> Counter(label value tuple)
    missing: list[str]  #: request ids the store never got
    advice_url: dict  #: analyze advise --since all, every miss explained
    advice_db: dict
    rows: dict[str, dict] = field(default_factory=dict)  #: request id -> its merged row (the request page's)


def cli(*args: str) -> tuple[int, str, str]:
    """``tokentrace analyze ARGS`` in this process (the CLI's own code, without a Python start-up)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["analyze", *args])
    return code, out.getvalue(), err.getvalue()


def _cli_verdicts(rid: str, where: list[str]) -> dict:
    result = {}
    for kind in ("slow", "cache"):
        code, out, err = cli(kind, "--request-id", rid, *where, "--json")
        result[kind] = json.loads(out) if code == 0 else {"exit": code, "stderr": err[-500:]}
    return result


def _report(where: list[str]) -> dict:
    code, out, err = cli("report", "--since", "all", "--causes", "100000", *where, "--json")
    assert code == 0, err
    return json.loads(out)


def _advice(where: list[str]) -> dict:
    code, out, err = cli("advise", "--since", "all", "--verdicts", "100000", *where, "--json")
    assert code == 0, err
    return json.loads(out)


#: /metrics token counters the surfaces check reads (docs/metrics.md).
TOKEN_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                  "vllm:prefix_cache_hits_total")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} ([0-9.e+-]+)$')


def _metrics(text: str) -> dict[str, Counter]:
    series: dict[str, Counter] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'([a-z_]+)="((?:[^"\\]|\\.)*)"', match.group(2)))
        name = match.group(1)
        if name == "tokentrace_requests_total":
            key = (labels.get("outcome"), labels.get("category"))
        elif name == "tokentrace_cache_lookups_total":
            key = (labels.get("result"), labels.get("cause"))
        elif (name.removesuffix("_count") in HISTOGRAMS or name.removesuffix("_sum") in HISTOGRAMS
              or name in TOKEN_COUNTERS):
            key = ()  # a latency histogram's observations or their sum, a token counter: every instance's
        else:
            continue
        series.setdefault(name, Counter())[key] += float(match.group(3))
    return series


def gather(t: Topology) -> Gathered:
    """``gather_all`` of one path."""
    return gather_all(t)[t.path]


def gather_all(*paths: Topology) -> dict[str, Gathered]:
    """Read every surface for paths that share one collector (their engines and gateways already
    stopped: their telemetry flushed); stops the collector to read its file with ``--db``. The counts
    are over every request of the collector."""
    collector = paths[0].collector
    assert all(t.collector is collector for t in paths)
    for t in paths:
        t.lap("stopping engines")
    wanted = set(rid for t in paths for rid in t.sent)

    def stored() -> set[str]:
        page = httpx.get(collector.url + "/timeline.json?since=all", timeout=60).json()
        return set(page["requests"]["id"])

    deadline = time.monotonic() + 60
    while not wanted <= (have := stored()) and time.monotonic() < deadline:
        time.sleep(0.5)
    pending = sorted(wanted - have)
    clock = time.monotonic()
    reads: list[str] = []

    def lap(what: str) -> None:
        nonlocal clock
        now = time.monotonic()
        reads.append(f"{what} {now - clock:.1f} s")
        clock = now
    judged = [cell["rid"] for t in paths for cell in t.cells.values() if "rid" in cell]

    def quiet():
        text = httpx.get(collector.url + "/metrics", timeout=60).text
        return text if re.search(r"^tokentrace_verdicts_pending 0$", text, re.M) else None

    metrics = _metrics(wait_for(quiet, 300, "/metrics' verdicts", interval=0.5))
    lap("/metrics settled")
    api = {rid: httpx.get(f"{collector.url}/api/requests/{rid}/verdict", timeout=60).json() for rid in sorted(have)}
    lap(f"{len(api)} API verdicts")
    dashboard, rows = {}, {}
    for rid in sorted(have):
        response = httpx.get(f"{collector.url}/requests/{rid}.json", timeout=60)
        page = response.json() if response.status_code == 200 else {}
        rows[rid] = page.get("request") or {}
        if rid in judged:
            dashboard[rid] = {"slow": page.get("slow"), "cache": page.get("cache")}
    lap("dashboard")
    where = ["--url", collector.url]
    cli_url = {rid: _cli_verdicts(rid, where) for rid in judged}
    report_url = _report(where)
    advice_url = _advice(where)
    lap("CLI --url")
    assert collector.stop() == 0, collector.log_path.read_text()[-3000:]
    where = ["--db", str(collector.db)]
    cli_db = {rid: _cli_verdicts(rid, where) for rid in judged}
    report_db = _report(where)
    advice_db = _advice(where)
    lap("CLI --db")
    out = {}
    for t in paths:
        t.lap("reading every surface")
        print(f"truth matrix, {t.path}: " + ", ".join(f"{what} {s} s" for what, s in t.laps)
              + " (" + ", ".join(reads) + ")")
        out[t.path] = Gathered(t.path, t.cells, api, dashboard, cli_url, cli_db, report_url, report_db, metrics,
                               pending, advice_url, advice_db, rows)
    return out


# --- the two tests of a cell ---------------------------------------------------------------------------

def _evidence(verdict: dict, kind: str) -> list[dict]:
    return [item for item in verdict["evidence"] if item["kind"] == kind]


def _cell(g: Gathered, situation: str) -> tuple[Declaration, dict, dict]:
    declaration = CELLS[(g.path, situation)]
    if declaration.kind == "n/a":
        pytest.skip(f"n/a on {g.path}: {declaration.reason}")
    if situation not in g.cells and declaration.kind == "not_observable":
        pytest.skip(f"not built on {g.path} (not observable: {declaration.reason})")
    cell = g.cells[situation]
    rid = cell["rid"]
    assert rid not in g.missing and rid in g.api, f"{rid} was never stored"
    return declaration, cell, g.api[rid]


def check_answer(g: Gathered, situation: str) -> None:
    """The verdict of the cell's request is the right one (docs/truth.md), or declared unobservable."""
    declaration, cell, verdict = _cell(g, situation)
    if declaration.kind == "not_observable":
        return
    slow, cache = verdict["slow"], verdict["cache"]
    shown = {"category": slow["category"], "outcome": slow["outcome"], "result": cache["result"],
             "cause": cache["cause"], "divergence": cache.get("divergence"), "cached_on": cache.get("cached_on"),
             "evicted_by": cache.get("evicted_by"), "breakdown_ms": slow["breakdown_ms"]}
    detail = declaration.without is None
    answered = cell.get("answered", {})
    assert answered.get("status", 200) == 200, f"{cell['rid']} was not answered: {answered}"
    if situation in ("cold_start", "prefill", "decode", "queueing_engine", "queueing_gateway"):
        expected = "queueing" if situation.startswith("queueing") else situation
        if situation.startswith("queueing"):
            _queue_built(g, situation, cell)
        assert (slow["outcome"], slow["category"]) == ("completed", expected), shown
        if situation.startswith("queueing") and detail:
            # The long requests are named; any other request named was in flight when the short one
            # arrived, by its stored row (an earlier situation's cancelled request that the engine
            # was still generating when the burst came: the plugin records it to its abort).
            blockers = {item["request_id"] for item in _evidence(slow, "blocker")}
            assert blockers & cell["blockers"], (blockers, cell["blockers"])
            arrival = g.rows[cell["rid"]]["start_ns"]
            strays = {rid: (g.rows.get(rid, {}).get("start_ns"), g.rows.get(rid, {}).get("end_ns"))
                      for rid in blockers - cell["blockers"]}
            assert all(start is not None and end is not None and start <= arrival < end
                       for start, end in strays.values()), (
                arrival, strays)
        if situation == "prefill":
            # An engine that reuses single tokens (llama.cpp) reuses the chat template's opening: partial.
            assert cache["cause"] == "new_prefix" and cache["result"] in ("miss", "partial"), shown
    elif situation == "hit":
        assert (cache["result"], cache["cause"]) == ("hit", None), shown
    elif situation == "capacity":
        assert cache["cause"] == "capacity" and cache["result"] in ("miss", "partial"), shown
        if detail:
            assert cache["evicted_by"] in cell["evictors"], shown
    elif situation.startswith("prefix_"):
        assert cache["cause"] == "prefix_change" and cache["result"] in ("miss", "partial"), shown
        divergence = cache["divergence"] or {}
        assert (divergence.get("segment_role"), divergence.get("segment_index")) == ("system", 0), shown
    elif situation == "instance_change":
        first = g.api[cell["first"]]["cache"]["instance_id"]
        assert (cache["cause"], cache["cached_on"]) == ("instance_change", first), shown
        assert cache["instance_id"] != first, shown
    elif situation in ("restart", "too_short", "template_change"):
        assert cache["cause"] == situation and cache["result"] in ("miss", "partial"), shown
    elif situation in ("refused", "cancelled"):
        outcome = "rejected" if situation == "refused" else "cancelled"
        row = g.rows.get(cell["rid"], {})
        if (situation == "cancelled" and slow["outcome"] == "completed" and not row.get("client_disconnected")
                and row.get("finish_reason") in ("length", "stop")):
            # The engine generated the whole answer (and the gateway, if any, sent it all) before the
            # client's hang-up reached it: completed is the truth, and the situation was not built.
            pytest.skip(f"not built: {cell['rid']} ended on its own ({row.get('finish_reason')}, "
                        f"{row.get('completion_tokens')} tokens) before the client's hang-up reached the engine")
        assert (slow["outcome"], cache["outcome"], slow["category"]) == (outcome, outcome, None), shown
    else:
        raise AssertionError(f"no expectation for {situation}")


def _queue_built(g: Gathered, situation: str, cell: dict) -> None:
    """Skip a queueing cell whose situation was not built: the blockers must take every slot (the
    engine's batch, or the narrow gateway's one) before the short request, and still hold it when it
    arrives. Burst harnesses send them together, and an engine (vLLM CPU's API server) or the
    gateway may still take the short one first. Read from the stored rows: a blocker holds a slot
    from its admission (arrival plus its queue: at the gateway, its wait there and the engine's
    queue, a bound that can only call a built situation not built, never the reverse) to its end,
    and took it before the short one did when it was admitted no later than the short one's
    admission (its arrival plus its queue). In a burst the short one may arrive before the blockers'
    admissions: vLLM's queue runs from the API server's arrival, through its hand-over to the engine
    core, to the scheduler's admission (docs/vllm.md, "Times")."""
    short = g.rows.get(cell["rid"], {})
    arrival = short.get("start_ns")
    if arrival is None:
        return  # not stored: the answer check says so
    short_admitted = arrival + int((short.get("queue_ms") or 0.0) * 1e6)
    holding = []
    for rid in sorted(cell["blockers"]):
        row = g.rows.get(rid, {})
        if row.get("start_ns") is None or row.get("end_ns") is None:
            continue
        admitted = row["start_ns"] + int((row.get("queue_ms") or 0.0) * 1e6)
        if admitted <= short_admitted and arrival < row["end_ns"]:
            holding.append(rid)
    if len(holding) < cell["slots"]:
        pytest.skip(f"not built: {len(holding)} of the {cell['slots']} slots were taken by the long requests before "
                    f"{cell['rid']} and held when it arrived ({', '.join(holding) or 'none'}); it was not made to wait")


def _label(verdict: dict) -> tuple[str, str]:
    slow = verdict["slow"]
    return slow["outcome"], slow["category"] or slow["outcome"]


def _lookup(verdict: dict) -> tuple[str, str]:
    cache = verdict["cache"]
    return cache["result"] or "no_lookup", cache["cause"] or "none"


def check_surfaces(g: Gathered, situation: str) -> None:
    """Every surface gives the cell's request the verdict the API gives it, and the counts of the
    report and of /metrics equal the number of the path's requests with the same verdict."""
    _, cell, verdict = _cell(g, situation)
    rid = cell["rid"]
    for name, surface in (("CLI --url", g.cli_url[rid]), ("CLI --db", g.cli_db[rid]),
                          ("dashboard /requests/{id}.json", g.dashboard[rid])):
        for kind in ("slow", "cache"):
            assert surface[kind] == verdict[kind], f"{name} {kind} differs from the API's for {rid}"
    completed = [v for v in g.api.values() if v["slow"]["outcome"] == "completed"]
    completed_ids = [rid for rid, v in g.api.items() if v["slow"]["outcome"] == "completed"]
    outcome, label = _label(verdict)
    for report_name, report in (("report --url", g.report_url), ("report --db", g.report_db)):
        if outcome == "completed":
            want = sum(1 for v in completed if v["slow"]["category"] == label)
            assert report["categories"].get(label, 0) == want, (report_name, label, report["categories"])
        else:
            want = sum(1 for v in g.api.values() if v["slow"]["outcome"] == outcome)
            assert report["outcomes"].get(outcome, 0) == want, (report_name, outcome, report["outcomes"])
    labels = Counter(_label(v) for v in g.api.values())
    requests = g.metrics.get("tokentrace_requests_total", Counter())
    assert requests.get((outcome, label), 0) == labels[(outcome, label)], ("/metrics tokentrace_requests_total",
                                                                            (outcome, label), dict(requests))
    if outcome == "completed":
        # Each latency histogram observed every completed request whose merged row knows that part,
        # with the merged row's value (the first row folded may be a gateway's: its own times, and
        # none of the engine's parts; issue 44).
        rows = [{**g.rows.get(rid, {}), "e2e_ms": (g.rows[rid]["end_ns"] - g.rows[rid]["start_ns"]) / 1e6}
                for rid in completed_ids]
        for name, (column, _, _) in HISTOGRAMS.items():
            values = [row[column] for row in rows if row.get(column) is not None]
            got = g.metrics.get(f"{name}_count", Counter()).get((), 0)
            assert got == len(values), (f"/metrics {name}_count", got, len(values))
            total = g.metrics.get(f"{name}_sum", Counter()).get((), 0)
            assert total == pytest.approx(sum(values) / 1000, abs=1e-6 * max(1, len(values))), (
                f"/metrics {name}_sum", total, sum(values) / 1000)
        # The token counters count every completed request's merged row too (they counted the first
        # row folded: a gateway's, without the engine's cached tokens; issue 44).
        both = [row for row in rows if row.get("prompt_tokens") is not None and row.get("cached_tokens") is not None]
        for name, want in (
                ("vllm:prompt_tokens_total", sum(row.get("prompt_tokens") or 0 for row in rows)),
                ("vllm:generation_tokens_total", sum(row.get("completion_tokens") or 0 for row in rows)),
                ("vllm:prefix_cache_queries_total", sum(row["prompt_tokens"] for row in both)),
                ("vllm:prefix_cache_hits_total", sum(row["cached_tokens"] for row in both))):
            got = g.metrics.get(name, Counter()).get((), 0)
            assert got == want, (f"/metrics {name}", got, want)
        lookups = g.metrics.get("tokentrace_cache_lookups_total", Counter())
        key = _lookup(verdict)
        want = sum(1 for v in completed if _lookup(v) == key)
        assert lookups.get(key, 0) == want, ("/metrics tokentrace_cache_lookups_total", key, dict(lookups))
        cache = verdict["cache"]
        if (cache["cached_tokens"] or 0) < (cache["prompt_tokens"] or 0) - 1:
            candidates = [v["cache"] for v in completed
                          if (v["cache"]["cached_tokens"] or 0) < (v["cache"]["prompt_tokens"] or 0) - 1]
            cause = cache["cause"] or "none"
            want = sum(1 for c in candidates if (c["cause"] or "none") == cause)
            for report_name, report in (("report --url", g.report_url), ("report --db", g.report_db)):
                assert report["causes"].get(cause, 0) == want, (report_name, cause, report["causes"])
        check_advice(g, rid, verdict)


#: The kind of advice a request with each cache cause rests on (analyzers/advise.py); the advice of
#: these kinds lists the requests whose verdicts it counted.
CAUSE_KINDS = {"prefix_change": "context", "instance_change": "routing", "capacity": "capacity",
               "restart": "cold_start"}


def check_advice(g: Gathered, rid: str, verdict: dict) -> None:
    """``analyze advise`` (through the collector and from its file) never rests a piece of advice on
    a request whose verdict says otherwise: the request appears only in the advice of the kind its
    cache cause calls for, and in that kind's advice wherever there is one for its instance."""
    assert g.advice_url["advice"] == g.advice_db["advice"], "analyze advise --url and --db differ"
    cause, instance = verdict["cache"]["cause"], verdict["cache"]["instance_id"]
    for item in g.advice_url["advice"]:
        listed = rid in item["request_ids"]
        ours = item["instance_id"] in (None, instance)
        if item["kind"] == "cold_start":  # it also lists the requests that waited on a load, whatever their cause
            assert listed or not (cause == "restart" and ours), f"advice cold_start leaves out {rid}, a restart's miss"
            continue
        if item["kind"] not in CAUSE_KINDS.values():
            continue
        right = CAUSE_KINDS.get(cause) == item["kind"] and ours
        assert listed == right, (f"advice {item['kind']} ({item['instance_id']}) "
                                 f"{'lists' if listed else 'leaves out'} {rid}, whose cache cause is {cause}")
