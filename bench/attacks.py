"""Attack benchmark (issue 45): cheap attacks on the collector's and the gateway's memory, each
against a fresh real process, while an honest sender keeps posting.

Issue 45: "Peak RSS under every attack above stays within idle + 2 x the budget; a benchmark prints
the ratio." Each collector attack starts its own ``tokentrace collector`` (tests/harness_collector.py)
with ``--max-pending-bytes B`` (the budget) and ``--store-memory-bytes S``, posts one small warm
batch (one protobuf, one JSON), takes the idle RSS, then runs the attack for ``--seconds`` while one honest sender posts
small batches of 200 spans (waiting ``Retry-After`` on 503 and resending the same batch, as an OTLP
exporter does). RSS is sampled from /proc every 0.1 s in a thread (the collector's own, and with
its parse workers) and the kernel's own high-water mark (VmHWM, reset after the warm batch) is read
at the end, so a peak between two samples is not missed.

1. amplify: ``--senders`` senders post, again and again, a 153 kB body whose 1,000 spans each carry
   a copy of 100 kB of resource attributes (100 MB of columns; tests/test_collector_attacks.py).
2. idle: ``--idle`` connections each declare a Content-Length whose reservation (6 x) is 1/K of
   the budget, send one byte and wait to be cut off (408, after ``--body-timeout``): one wave, as
   tests/test_collector_attacks.py. idle-repeat: the same connections reconnect at once each time
   they are cut off, until the end of the attack.
3. malformed: ``--senders`` senders post the three JSON bodies of issue 45 (``{"\\ud800": 1}``,
   ``"kind": Infinity``, ``"kind": 1e999``; tests/test_collector_validation.py) in a tight loop.
4. large: ``--senders`` senders post bodies of 2 x ``--max-body-bytes``, by turns with a declared
   Content-Length and chunked.
5. gateway: a ``tokentrace gateway`` in front of a ``tokentrace engine`` on a generated tiny model
   (as tests/test_gateway_limits.py) with ``--max-pending-bytes`` the budget; ``--gateway-senders``
   senders post 256 MiB chat bodies, declared and chunked by turns, while an honest client sends
   small chats. Its bound: idle + 2 x the budget, as the collector's (each body is cut at
   ``--max-request-bytes``; the bodies held together at ``--max-pending-bytes``).

Prints, for each attack, one line per measure: idle and peak RSS, (peak - idle) / budget against
the bound 2 (and against 2 x budget + store memory), the attackers' answers by status code, the
honest sender's accepted / total and p99 latency, and whether every honest span acknowledged is
stored exactly once (SQL on the store after the collector stopped). Exits 1 when a bound is not
met, the honest sender got nothing through, or an acknowledged span is missing or stored twice.

    python bench/attacks.py [--seconds 10] [--budget-mib 64] [--store-memory-mib 64] [--senders 4]
                            [--idle 3] [--body-timeout 2] [--max-body-mib 16] [--max-request-mib 8]
                            [--attacks amplify,idle,idle-repeat,malformed,large,gateway]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pytest  # the harnesses report a failure with pytest.fail: its exception is caught here
from harness_collector import CollectorProcess, proc_status, wait_for
from overload import rss  # (RSS of a process, RSS of it and its children)
from test_collector_attacks import amplifying_body
from test_collector_errors import make_request

MIB = 1 << 20
PB, JSON = "application/x-protobuf", "application/json"
TRACES, CHAT_PATH = "/v1/traces", "/v1/chat/completions"
ATTACKS = ("amplify", "idle", "idle-repeat", "malformed", "large", "gateway")
#: Answers the attackers should get; anything else is printed as unexpected (not a failure). A
#: reconnecting idle body that finds the budget taken meanwhile gets 503; a chunked body charged as it
#: arrives meets a budget others share before its size passes --max-body-bytes (alone, it gets 413).
EXPECTED = {"amplify": {"413"}, "idle": {"408"}, "idle-repeat": {"408", "503"}, "malformed": {"400"},
            "large": {"declared 413", "chunked 413", "chunked 503"},
            "gateway": {"declared 413", "chunked 413", "chunked 503"}}
FAILED = (Exception, pytest.fail.Exception)


# --- memory -----------------------------------------------------------------------------------------
class Peak:
    """RSS of a process sampled every 0.1 s in a thread while the block runs (its own, and with its
    children), and its own high-water mark (VmHWM), reset when the block starts where
    /proc/PID/clear_refs lets us, read when it ends: the kernel's peak, which samples can miss."""

    def __init__(self, pid: int):
        self.pid = pid
        self.idle_own, self.idle_all = rss(pid)
        self.own, self.all = self.idle_own, self.idle_all
        self.hwm = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Peak:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # 5: reset the peak RSS to the current one
            self.hwm = 0
        except OSError:
            self.hwm = None
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            own, everything = rss(self.pid)
            self.own, self.all = max(self.own, own), max(self.all, everything)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        if self.hwm is not None:
            self.hwm = proc_status(self.pid, "VmHWM")
            # The workers' own peaks are not reset; a higher own peak raises the sum by as much.
            self.all += max(0, self.hwm - self.own)
            self.own = max(self.own, self.hwm)


# --- raw HTTP -----------------------------------------------------------------------------------------
def head(path: str, content_type: str, length: int | None, extra: str = "") -> bytes:
    """A request's head: with Content-Length ``length``, or chunked when it is None."""
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n{extra}"
            f"{framing}\r\n\r\n").encode()


def _write(sock: socket.socket, data: bytes, deadline: float) -> bool:
    """Write ``data``; False as soon as the server has something to say (its answer, or closing)."""
    view = memoryview(data)
    while view:
        readable, writable, _ = select.select([sock], [sock], [], max(0.0, deadline - time.monotonic()))
        if readable:
            return False
        if not writable:
            raise TimeoutError("the server read nothing more before the deadline")
        view = view[sock.send(view[:1 << 18]):]
    return True


def _answer(sock: socket.socket, deadline: float) -> tuple[int | None, str]:
    """The status and the start of the body of the server's answer; None when none came."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        top, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in top.lower().split(b"\r\n")
                       if line.startswith(b"content-length:")), 0)
        while len(body) < min(length, 4096):
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except OSError:
        pass
    if not data.startswith(b"HTTP/1.1 "):
        return None, ""
    return int(data[9:12]), body[:300].decode(errors="replace")


def exchange(port: int, top: bytes, pieces, chunked: bool, timeout: float) -> tuple[int | None, str, int]:
    """One request on a new connection: ``top``, then ``pieces`` (framed as chunks when ``chunked``),
    stopping as soon as the server answers, as a client that reads while it writes does. Returns
    (status or None when the connection closed without an answer, the answer's start, bytes sent)."""
    deadline, sent = time.monotonic() + timeout, 0
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError:
        return None, "connect failed", 0
    try:
        try:
            going = _write(sock, top, deadline)
            for piece in pieces:
                if not going:
                    break
                going = _write(sock, b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece, deadline)
                sent += len(piece)
            if going and chunked:
                _write(sock, b"0\r\n\r\n", deadline)
        except OSError:  # reset while writing: read whatever answer came before it
            pass
        status, text = _answer(sock, deadline)
        return status, text, sent
    finally:
        sock.close()


# --- the honest sender ---------------------------------------------------------------------------------
class Honest:
    """Posts a small request every ``interval`` s until the deadline; a refused one (503) is resent
    after its Retry-After, as an OTLP exporter does. ``make`` gives (body, span keys) of a new one."""

    def __init__(self, port: int, path: str, content_type: str, make, interval: float):
        self.port, self.path, self.content_type, self.make, self.interval = port, path, content_type, make, interval
        self.answers: Counter = Counter()
        self.accepted: list[float] = []
        self.acked: list[str] = []
        self.first: float | None = None  #: seconds from the start to the first request accepted

    def run(self, deadline: float) -> None:
        began = time.monotonic()
        body, keys = self.make()
        while time.monotonic() < deadline:
            start = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                conn.request("POST", self.path, body, {"Content-Type": self.content_type})
                response = conn.getresponse()
                response.read()
                status, retry = response.status, float(response.getheader("Retry-After") or 1)
            except (OSError, http.client.HTTPException):
                status, retry = None, 1.0
            finally:
                conn.close()
            took = time.perf_counter() - start
            self.answers[status] += 1
            if status == 200:
                self.accepted.append(took)
                self.acked.extend(keys)
                if self.first is None:
                    self.first = time.monotonic() - began
                body, keys = self.make()
                time.sleep(self.interval)
            else:
                time.sleep(min(retry, max(0.0, deadline - time.monotonic())))

    def p99(self) -> float:
        ordered = sorted(self.accepted)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else float("nan")


def honest_batch(spans: int):
    def make() -> tuple[bytes, list[str]]:
        request = make_request(spans, name="honest")
        keys = [s.trace_id.hex() + s.span_id.hex() for s in request.resource_spans[0].scope_spans[0].spans]
        return request.SerializeToString(), keys
    return make


def drive(attackers: list, honest: Honest, seconds: float, ready=None) -> Counter:
    """Run every attacker (a callable giving the key of one answer, None once it is done) in a loop on
    its own thread until the deadline, and the honest sender beside them (once ``ready`` returns, when given)."""
    answers, lock = Counter(), threading.Lock()
    deadline = time.monotonic() + seconds

    def loop(one) -> None:
        while time.monotonic() < deadline:
            key = one()
            if key is None:  # this attacker is done
                return
            with lock:
                answers[key] += 1

    threads = [threading.Thread(target=loop, args=(one,)) for one in attackers]
    for thread in threads:
        thread.start()
    if ready is not None:
        ready()
    sender = threading.Thread(target=honest.run, args=(deadline,))
    sender.start()
    for thread in [*threads, sender]:
        thread.join()
    return answers


# --- the attacks on the collector ----------------------------------------------------------------------
def _malformed_bodies() -> list[bytes]:
    def span(text: str) -> bytes:
        return ('{"resourceSpans":[{"scopeSpans":[{"spans":[' + text + "]}]}]}").encode()
    return [rb'{"\ud800": 1}', span('{"name": "x", "kind": Infinity}'), span('{"name": "x", "kind": 1e999}')]


def warm_json() -> bytes:
    """A small valid OTLP JSON batch: the parse workers' first JSON body costs them ~65 MiB once."""
    spans = [{"traceId": os.urandom(16).hex(), "spanId": os.urandom(8).hex(), "name": "warm",
              "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000100000000"} for _ in range(20)]
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()


def collector_attackers(name: str, args, collector: CollectorProcess) -> tuple[str, list, object]:
    """(what the attack is, its attackers, a function that returns once it is under way or None)."""
    port, timeout = collector.port, 60.0
    if name == "amplify":
        body = amplifying_body(100_000, 1000)
        top = head(TRACES, PB, len(body))

        def amplify() -> str:
            return str(exchange(port, top, [body], False, timeout)[0])
        return (f"{args.senders} senders x a {len(body) / 1000:.0f} kB body: 100 kB of resource attributes "
                "copied into 1,000 spans (100 MB of columns)"), [amplify] * args.senders, None
    if name in ("idle", "idle-repeat"):
        budget, repeat = args.budget_mib * MIB, name == "idle-repeat"
        declared = budget // (6 * args.idle)
        top = head(TRACES, PB, declared)

        def idler():
            fired = []

            def idle() -> str | None:
                if fired and not repeat:
                    return None
                fired.append(True)
                return str(exchange(port, top, [b"\n"], False, args.body_timeout + 30)[0])
            return idle

        def ready() -> None:  # every reservation held before the honest sender starts
            wait_for(lambda: collector.health()["pending"]["used_bytes"] >= args.idle * 6 * declared, 10,
                     "the idle connections' reservations")
        how = "reconnecting at once when cut off" if repeat else "once (one wave, as the test)"
        return (f"{args.idle} connections each declaring {declared / MIB:.1f} MiB (6 x = 1/{args.idle} of the "
                f"budget) and sending one byte, {how}; --body-timeout {args.body_timeout:g} s"
                ), [idler() for _ in range(args.idle)], ready
    if name == "malformed":
        bodies = _malformed_bodies()

        turns = itertools.count()

        def malformed() -> str:
            body = bodies[next(turns) % len(bodies)]
            return str(exchange(port, head(TRACES, JSON, len(body)), [body], False, timeout)[0])
        return (f"{args.senders} senders x the three JSON bodies of issue 45 "
                "(\\ud800 as a key, kind Infinity, kind 1e999), in turn"), [malformed] * args.senders, None
    if name == "large":
        limit = args.max_body_mib * MIB
        piece = b"\x0a" * MIB  # field 1 (resource_spans) tags, as a protobuf reader sees them
        count = 2 * args.max_body_mib

        turns = itertools.count()

        def large() -> str:
            chunked = next(turns) % 2 == 1
            top = head(TRACES, PB, None if chunked else count * MIB)
            status = exchange(port, top, [piece] * count, chunked, timeout)[0]
            return f"{'chunked' if chunked else 'declared'} {status}"
        return (f"{args.senders} senders x bodies of {count} MiB (--max-body-bytes {limit // MIB} MiB), declared "
                "and chunked by turns"), [large] * args.senders, None
    raise ValueError(name)


def collector_attack(name: str, args) -> dict:
    budget, store = args.budget_mib * MIB, args.store_memory_mib * MIB
    with tempfile.TemporaryDirectory(prefix=f"attacks-{name}-") as tmp:
        collector = CollectorProcess(Path(tmp), "--max-pending-bytes", str(budget), "--store-memory-bytes", str(store),
                                     "--body-timeout", str(args.body_timeout),
                                     "--max-body-bytes", str(args.max_body_mib * MIB)).start()
        try:
            for body, content_type in ((make_request(20, name="warm").SerializeToString(), PB), (warm_json(), JSON)):
                warm = collector.post(body, content_type)
                assert warm.status_code == 200, warm.text
            time.sleep(0.5)
            title, attackers, ready = collector_attackers(name, args, collector)
            honest = Honest(collector.port, TRACES, PB, honest_batch(args.honest_spans), args.honest_interval)
            with Peak(collector.proc.pid) as peak:
                answers = drive(attackers, honest, args.seconds, ready)
            health = collector.health()
        finally:
            code = collector.stop()
        rows = collector.sql("SELECT trace_id || span_id, count(*) FROM spans WHERE name = 'honest' GROUP BY 1")
    stored = dict(rows)
    acked = set(honest.acked)
    missing = sum(1 for key in acked if key not in stored)
    twice = sum(1 for count in stored.values() if count > 1)
    return {"name": name, "title": title, "peak": peak, "budget": budget, "bound": 2 * budget,
            "wide": 2 * budget + store, "answers": answers, "honest": honest, "health": health, "exit": code,
            "stored": sum(stored.values()), "acked": len(acked), "missing": missing, "twice": twice,
            "unread": len(set(stored) - acked)}


# --- the gateway ---------------------------------------------------------------------------------------
def gateway_attack(args) -> dict:
    limit, budget = args.max_request_mib * MIB, args.budget_mib * MIB
    with tempfile.TemporaryDirectory(prefix="attacks-gateway-") as tmp:
        workdir, model = Path(tmp), Path(tmp) / "tiny"
        try:
            from harness_engine import EngineProcess
            from harness_gateway import GatewayProcess
        except ImportError as exc:
            return {"name": "gateway", "skipped": f"the engine cannot be imported here ({exc})"}
        made = subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(model), "--size", "tiny"],
                              capture_output=True, text=True, timeout=300)
        if made.returncode:
            return {"name": "gateway", "skipped": f"make-model failed: {made.stderr.strip()[-300:]}"}
        engine = gateway = None
        try:
            try:
                engine = EngineProcess(workdir, model, instance_id="attacks").start()
                gateway = GatewayProcess(workdir, {"attacks": engine.url}, "--max-request-bytes", str(limit),
                                         "--max-pending-bytes", str(budget),
                                         "--body-timeout", str(args.body_timeout)).start()
            except FAILED as exc:
                return {"name": "gateway", "skipped": f"the engine or gateway did not start: {str(exc)[:300]}"}
            chat = json.dumps({"model": "default_model", "messages": [{"role": "user", "content": "Hi."}],
                               "max_tokens": 2}).encode()
            warm = chat_status(gateway.port, chat)
            assert warm == 200, warm
            time.sleep(0.5)
            piece, count = b"x" * MIB, 256

            turns = itertools.count()

            def huge() -> str:
                chunked = next(turns) % 2 == 1
                top = head(CHAT_PATH, JSON, None if chunked else 14 + count * MIB)
                status = exchange(gateway.port, top, [b'{"messages": "', *[piece] * count], chunked, 120)[0]
                return f"{'chunked' if chunked else 'declared'} {status}"

            honest = Honest(gateway.port, CHAT_PATH, JSON, lambda: (chat, []), args.honest_interval)
            with Peak(gateway.proc.pid) as peak:
                answers = drive([huge] * args.gateway_senders, honest, args.seconds)
            health = gateway.health()
        finally:
            for process in (gateway, engine):
                if process is not None:
                    with contextlib.suppress(*FAILED):
                        process.stop()
    title = (f"{args.gateway_senders} senders x 256 MiB chat bodies, declared and chunked by turns, through "
             f"`tokentrace gateway` (--max-request-bytes {args.max_request_mib} MiB, --max-pending-bytes "
             f"{args.budget_mib} MiB) in front of an engine")
    return {"name": "gateway", "title": title, "peak": peak, "budget": budget, "bound": 2 * budget,
            "wide": None, "answers": answers, "honest": honest, "health": health, "exit": 0}


def chat_status(port: int, body: bytes) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", CHAT_PATH, body, {"Content-Type": JSON})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


# --- report ---------------------------------------------------------------------------------------------
def report(result: dict) -> bool:
    """Print one attack's measures; True when its bound is met and every acknowledged span is stored once."""
    name = result["name"]
    if "skipped" in result:
        print(f"== {name}: skipped: {result['skipped']}")
        return True
    peak, budget, honest = result["peak"], result["budget"], result["honest"]
    grown_own, grown_all = peak.own - peak.idle_own, peak.all - peak.idle_all
    met = grown_own <= result["bound"] and grown_all <= result["bound"]
    result["met"], result["ratio"], result["bound_ratio"] = met, grown_own / budget, result["bound"] / budget
    unit = "--max-pending-bytes" if name == "gateway" else "budget"
    bound_words = "2"
    print(f"== {name}: {result['title']}")
    hwm = f", high-water {peak.hwm / MIB:.0f}" if peak.hwm else " (VmHWM not resettable: samples only)"
    print(f"  RSS:       idle {peak.idle_own / MIB:.0f} MiB, peak {peak.own / MIB:.0f} MiB{hwm}; "
          f"(peak - idle) / {unit} ({budget / MIB:.0f} MiB) = {grown_own / budget:.2f}, bound {bound_words}: "
          f"{'met' if met else 'NOT met'}")
    if result["wide"]:
        print(f"  RSS:       (peak - idle) / (2 x budget + --store-memory-bytes = {result['wide'] / MIB:.0f} MiB) "
              f"= {grown_own / result['wide']:.2f}")
    if peak.all != peak.own or peak.idle_all != peak.idle_own:
        print(f"  RSS:       with its child processes idle {peak.idle_all / MIB:.0f} MiB, peak "
              f"{peak.all / MIB:.0f} MiB, (peak - idle) / {unit} = {grown_all / budget:.2f}")
    answers = dict(sorted(result["answers"].items()))
    unexpected = {key: count for key, count in answers.items() if key not in EXPECTED[name]}
    print(f"  attackers: {sum(answers.values()):,} answers: "
          f"{', '.join(f'{count:,} x {key}' for key, count in answers.items())}"
          f"{f' (unexpected: {unexpected}; None = closed without an answer)' if unexpected else ''}")
    total = sum(honest.answers.values())
    first = f", first accepted after {honest.first:.1f} s" if honest.first is not None else ""
    print(f"  honest:    {honest.answers[200]:,} / {total:,} accepted, p99 {honest.p99():.3f} s{first}; answers "
          f"{', '.join(f'{count:,} x {key}' for key, count in sorted(honest.answers.items(), key=str))}")
    health, once = result["health"], True
    if name != "gateway":
        pending = health["pending"]
        rejected = {key: value for key, value in health.get("rejected", {}).items() if value}
        print(f"  collector: budget peak held {pending['peak_bytes'] / MIB:.1f} of {pending['limit_bytes'] / MIB:.0f} "
              f"MiB; rejected {rejected}; status {health['status']}; exit {result['exit']}")
        once = result["missing"] == 0 and result["twice"] == 0
        unread = f", {result['unread']:,} stored whose answer was not read" if result["unread"] else ""
        print(f"  stored:    {result['stored']:,} honest spans; {result['acked']:,} acknowledged, "
              f"{result['missing']:,} of them missing, {result['twice']:,} stored twice"
              f"{unread}: "
              f"{'every acknowledged span stored once' if once else 'MISMATCH'}")
    else:
        print(f"  gateway:   status {health['status']}")
    result["once"] = once
    result["served"] = served = honest.answers[200] > 0
    if not served:
        print("  honest:    SHUT OUT: none of its requests was accepted")
    return met and once and served


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each attack lasts")
    parser.add_argument("--budget-mib", type=int, default=64, help="the collector's --max-pending-bytes")
    parser.add_argument("--store-memory-mib", type=int, default=64, help="the collector's --store-memory-bytes")
    parser.add_argument("--senders", type=int, default=4, help="attackers of the amplify, malformed, large, gateway")
    parser.add_argument("--idle", type=int, default=3, help="idle connections (together they hold the budget)")
    parser.add_argument("--body-timeout", type=float, default=2.0, help="the collector's and gateway's --body-timeout")
    parser.add_argument("--max-body-mib", type=int, default=16, help="the collector's --max-body-bytes")
    parser.add_argument("--max-request-mib", type=int, default=8, help="the gateway's --max-request-bytes")
    parser.add_argument("--gateway-senders", type=int, default=8,
                        help="attackers of the gateway (8 x 2 x --max-request-bytes pass a 64 MiB budget)")
    parser.add_argument("--honest-spans", type=int, default=200, help="spans in each honest batch")
    parser.add_argument("--honest-interval", type=float, default=0.1, help="seconds between honest requests")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="which, comma-separated: " + ", ".join(ATTACKS))
    args = parser.parse_args()
    chosen = [name.strip() for name in args.attacks.split(",") if name.strip()]
    for name in chosen:
        if name not in ATTACKS:
            parser.error(f"unknown attack {name!r}")

    print(f"budget (--max-pending-bytes) {args.budget_mib} MiB, --store-memory-bytes {args.store_memory_mib} MiB, "
          f"{args.seconds:g} s an attack, honest batches of {args.honest_spans} spans every {args.honest_interval:g} s")
    results, ok = [], True
    for name in chosen:
        result = gateway_attack(args) if name == "gateway" else collector_attack(name, args)
        ok = report(result) and ok
        results.append(result)
    print("== summary")
    for result in results:
        if "skipped" in result:
            print(f"  {result['name']:<11} skipped")
            continue
        honest = result["honest"]
        unit = "--max-pending-bytes" if result["name"] == "gateway" else "budget"
        print(f"  {result['name']:<11} (peak - idle) / {unit} {result['ratio']:5.2f} "
              f"(bound {result['bound_ratio']:g}): {'bound met' if result['met'] else 'NOT met'}; "
              f"honest {honest.answers[200]:,} / "
              f"{sum(honest.answers.values()):,} accepted, p99 {honest.p99():.3f} s"
              f"{'' if result['served'] else ' (SHUT OUT)'}"
              f"{'' if result['once'] else '; ACKNOWLEDGED SPANS MISSING OR TWICE'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
