"""What does tokentrace's instrumentation cost? Instrumented engine vs bare mlx-lm, side by side.

Same process, same loaded model, same prompts, runs alternating (bare, instrumented, bare, ...):

* engine, 1 and 8 concurrent streams: the engine's ``Scheduler`` with the engine's telemetry
  pipeline (records -> telemetry thread -> exporter process -> OTLP protobuf written there, in
  batches -> OTLP/HTTP to a sink process) against mlx-lm's ``BatchGenerator`` driven by a minimal
  loop — the primitive the engine is built on. Closed loop: as a request finishes the next one
  starts, so span building overlaps generation as it does in a busy server. The prompt cache is
  off (entries 0) on the engine side: the comparison is about instrumentation, not caching.
* API, 1 stream: ``Instrumentation.stream_generate`` against ``mlx_lm.stream_generate``, with spans
  built on a thread of the caller's process (the default) or in an exporter process
  (``Instrumentation.to_collector``).

Reported per configuration: decode tokens/s per stream ((tokens - 1) / (last - first token)) and
TTFT (submit -> first token), medians over requests, and instrumented/bare ratios (median of the
per-repetition ratios of adjacent runs). On a shared machine wall-clock ratios swing with other
load, so CPU per generated token is reported too: of the thread running the generation loop (the
critical path), of the whole serving process, and of the telemetry threads and exporter process.
Targets: decode loss <= 1 % (small), <= 3 % (tiny); TTFT within 2 %. ``--markdown`` prints the
table for docs/benchmarks.md.

``--paired N`` (issue 17) replaces the table by a paired measurement that a busy machine cannot
bias: the engine at 1 stream runs N rounds, each round one short run (``--pair-requests`` requests)
of every arm in a random order, in this one process: ``bare`` (mlx-lm's loop), ``dropped`` (the
engine's scheduler with its records thrown away before the telemetry thread: the engine without its
telemetry), ``instrumented`` (the whole pipeline) and ``unheld`` (the whole pipeline with the
telemetry thread's prefill hold switched off: ``instrumented / unheld`` is what the hold buys).
Other load slows a round's runs alike, so the per-round ratios cancel it; reported are their
geometric mean and a 95 % confidence interval (a t-interval on the logs of the per-round ratios).
``instrumented / dropped`` is what telemetry costs; ``dropped / bare`` is what the engine's own
structure (scheduler, records, sampling objects) costs next to mlx-lm's bare loop. An interval that
contains 1.0 is no evidence of overhead; one that lies below 1.01 (decode) or above 0.98 bounds it.

    python bench/engine_overhead.py [--sizes tiny small] [--reps 5] [--markdown]
    python bench/engine_overhead.py --sizes small --paired 12 --pair-requests 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import math
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_SINK = r"""
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps connections open, as the collector (uvicorn) does
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0"); self.end_headers()
    def do_GET(self):
        self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

#: Per size: distinct prompts, completion tokens per request, prompt tokens.
WORKLOAD = {"tiny": (16, 128, 256), "small": (16, 32, 256)}


#: Threads that do telemetry work off the generation path: building spans, encoding and sending.
TELEMETRY_THREADS = ("tokentrace-telemetry", "OtelBatchSpanRecordProcessor", "tokentrace-spool")
#: Processes whose CPU counts as telemetry (the engine's exporter process), by pid.
TELEMETRY_PIDS: list[int] = []


#: ``--paired`` only: the exporter process's CPU (ns, /proc/PID/schedstat) read at each request's
#: submit and first token, in every arm alike, to see how much of it falls inside TTFT windows.
EXPORTER_PROBE: list[int] = []


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far, in ns (/proc/PID/task/*/schedstat; 0
    where there is none). /proc/PID/stat counts clock ticks (10 ms here: a run's whole exporter CPU
    was one or two ticks, so it read as 117 µs a token whatever it was), and /proc/PID/schedstat
    counts only the main thread, not the batch processor's that encodes and sends."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that just ended
                total += int((task / "schedstat").read_text().split()[0])
    return total


def exporter_cpu_ns() -> int:
    """CPU time of the exporter process so far, in ns (0 when not probing or not on Linux)."""
    return process_cpu_ns(EXPORTER_PROBE[0]) if EXPORTER_PROBE else 0


def telemetry_cpu_ns() -> tuple[int, int]:
    """CPU time consumed so far by telemetry: (threads of this process, exporter processes)."""
    threads = 0
    for thread in threading.enumerate():
        if thread.name.startswith(TELEMETRY_THREADS) and thread.ident is not None:
            with contextlib.suppress(OSError, AttributeError):  # ended, or no per-thread clocks here
                threads += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
    return threads, sum(process_cpu_ns(pid) for pid in TELEMETRY_PIDS)


@dataclass
class Run:
    """Per-request timings of one run (perf_counter_ns)."""

    submit: list[int]
    first: list[int]
    last: list[int]
    tokens: list[int]
    thread_cpu_ns: int = 0  #: CPU the in-process telemetry threads used for this run (instrumented)
    process_cpu_ns: int = 0  #: CPU the exporter process used for this run (instrumented engine)
    loop_cpu_ns: int = 0  #: CPU of the thread that ran the generation loop
    serving_cpu_ns: int = 0  #: CPU of the whole serving process (MLX workers and telemetry included)
    exporter_at_submit: dict = None  #: request index -> exporter CPU ns at submit (``--paired``)
    exporter_in_ttft: list = None  #: exporter CPU ns spent between each request's submit and first token

    def __post_init__(self) -> None:
        self.exporter_at_submit, self.exporter_in_ttft = {}, []

    def probe_submit(self, i: int) -> None:
        if EXPORTER_PROBE:
            self.exporter_at_submit[i] = exporter_cpu_ns()

    def probe_first(self, i: int) -> None:
        if EXPORTER_PROBE:
            self.exporter_in_ttft.append(exporter_cpu_ns() - self.exporter_at_submit.pop(i, 0))

    def loop_us_per_token(self) -> float:
        """Generation-loop CPU per generated token: the critical path, little affected by other load."""
        return self.loop_cpu_ns / sum(self.tokens) / 1e3

    def serving_us_per_token(self) -> float:
        """Serving-process CPU per generated token."""
        return self.serving_cpu_ns / sum(self.tokens) / 1e3

    def decode_tps(self) -> float:
        """Median over requests of (tokens - 1) / (last - first)."""
        return statistics.median((n - 1) / ((b - a) / 1e9) for a, b, n in zip(self.first, self.last, self.tokens,
                                                                             strict=True) if b > a)

    def ttft_ms(self) -> float:
        """Median over requests of first token - submit."""
        return statistics.median((f - s) / 1e6 for s, f in zip(self.submit, self.first, strict=True))


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (different first tokens: no shared prefix)."""
    return [[3 + (i * 131 + k * 17) % (vocab - 3) for k in range(length)] for i in range(count)]


def bare_engine(generator, work: list[list[int]], tokens: int, concurrency: int) -> Run:
    """mlx-lm BatchGenerator, closed loop, no instrumentation (timestamps only per step).

    The generator lives across runs, as the engine's does, so both sides reuse warm buffers.
    """
    from mlx_lm.generate import StopSequences

    never = StopSequences(None)
    run = Run([0] * len(work), [0] * len(work), [0] * len(work), [0] * len(work))
    index: dict[int, int] = {}
    pending = list(range(len(work)))

    def start(i: int) -> None:
        run.probe_submit(i)
        run.submit[i] = time.perf_counter_ns()
        (uid,) = generator.insert([work[i]], max_tokens=[tokens], stop_sequences=[never])
        index[uid] = i

    cpu, process = time.thread_time_ns(), time.process_time_ns()
    for _ in range(concurrency):
        start(pending.pop(0))
    done = 0
    while done < len(work):
        _, generated = generator.next()
        now = time.perf_counter_ns()
        for response in generated:
            i = index[response.uid]
            run.tokens[i] += 1
            if run.first[i] == 0:
                run.first[i] = now
                run.probe_first(i)
            if response.finish_reason is not None:
                run.last[i] = now
                done += 1
                if pending:
                    start(pending.pop(0))
    run.loop_cpu_ns, run.serving_cpu_ns = time.thread_time_ns() - cpu, time.process_time_ns() - process
    return run


def instrumented_engine(scheduler, thread_ident: int, telemetry, work: list[list[int]], tokens: int,
                        concurrency: int) -> Run:
    """The engine's Scheduler with telemetry on, closed loop, records finished as the server does."""
    from tokentrace.engine_shim.mlx.jobs import Job, Sampling
    from tokentrace.engine_shim.mlx.prompts import Prompt
    from tokentrace.engine_shim.mlx.records import RequestRecord

    run = Run([0] * len(work), [0] * len(work), [0] * len(work), [0] * len(work))
    pending = list(range(len(work)))
    finished = threading.Event()
    state = {"done": 0}
    sampling = Sampling(ignore_eos=True)

    def start(i: int) -> None:
        now = time.perf_counter_ns()
        record = RequestRecord(f"bench-{time.monotonic_ns()}-{i}", "/bench", now, max_tokens=tokens)
        record.prompt = Prompt(work[i], ["prompt"], [0], [len(work[i])])
        run.probe_submit(i)
        run.submit[i] = now
        scheduler.submit(Job(record=record, tokens=work[i], max_tokens=tokens, sampling=sampling, sink=i))

    def deliver(items) -> None:
        now = time.perf_counter_ns()
        for job, _token, reason in items:
            i = job.sink
            run.tokens[i] += 1
            if run.first[i] == 0:
                run.first[i] = now
                run.probe_first(i)
            if reason is not None:
                run.last[i] = now
                job.record.end_ns = now
                telemetry.submit(job.record)
                state["done"] += 1
                if pending:
                    start(pending.pop(0))
                elif state["done"] == len(work):
                    finished.set()

    scheduler._deliver = deliver  # the server's delivery hook, pointed at this harness
    clock = time.pthread_getcpuclockid(thread_ident)
    cpu, process = time.clock_gettime_ns(clock), time.process_time_ns()
    for _ in range(concurrency):
        start(pending.pop(0))
    finished.wait()
    run.loop_cpu_ns, run.serving_cpu_ns = time.clock_gettime_ns(clock) - cpu, time.process_time_ns() - process
    return run


def bare_api(model, tokenizer, work: list[list[int]], tokens: int) -> Run:
    """mlx_lm.stream_generate, one request after another."""
    from mlx_lm import stream_generate

    return _api_loop(lambda prompt: stream_generate(model, tokenizer, prompt, max_tokens=tokens), work)


def instrumented_api(shim, model, tokenizer, work: list[list[int]], tokens: int) -> Run:
    """tokentrace's Instrumentation.stream_generate, one request after another."""
    return _api_loop(lambda prompt: shim.stream_generate(model, tokenizer, prompt, max_tokens=tokens), work)


def _api_loop(generate, work: list[list[int]]) -> Run:
    run = Run([], [], [], [])
    cpu, process = time.thread_time_ns(), time.process_time_ns()
    for prompt in work:
        run.submit.append(time.perf_counter_ns())
        count, first = 0, 0
        for _ in generate(prompt):
            count += 1
            if count == 1:
                first = time.perf_counter_ns()
        run.first.append(first)
        run.last.append(time.perf_counter_ns())
        run.tokens.append(count)
    run.loop_cpu_ns, run.serving_cpu_ns = time.thread_time_ns() - cpu, time.process_time_ns() - process
    return run


def compare(name: str, bare, instrumented, settle, reps: int) -> dict:
    """Alternate bare and instrumented runs (order flipped every repetition); paired ratios.

    ``settle`` runs after each instrumented run: it builds and exports the spans still pending
    (those of the run's last requests), so that no run pays for its neighbour's telemetry; spans
    of earlier requests were built while later ones generated, as in a busy server.
    """
    bare_runs, inst_runs = [], []
    for rep in range(reps):
        pair = [("bare", bare), ("inst", instrumented)]
        for kind, fn in pair if rep % 2 == 0 else pair[::-1]:
            cpu = telemetry_cpu_ns()
            run = fn()
            (bare_runs if kind == "bare" else inst_runs).append(run)
            if kind == "inst":
                settle()
                after = telemetry_cpu_ns()
                run.thread_cpu_ns, run.process_cpu_ns = after[0] - cpu[0], after[1] - cpu[1]
    decode = [i.decode_tps() / b.decode_tps() for b, i in zip(bare_runs, inst_runs, strict=True)]
    ttft = [i.ttft_ms() / b.ttft_ms() for b, i in zip(bare_runs, inst_runs, strict=True)]
    loop = [i.loop_us_per_token() / b.loop_us_per_token() for b, i in zip(bare_runs, inst_runs, strict=True)]
    serving = [i.serving_us_per_token() / b.serving_us_per_token() for b, i in zip(bare_runs, inst_runs, strict=True)]
    return {
        "name": name,
        "bare_tps": statistics.median(r.decode_tps() for r in bare_runs),
        "inst_tps": statistics.median(r.decode_tps() for r in inst_runs),
        "bare_ttft": statistics.median(r.ttft_ms() for r in bare_runs),
        "inst_ttft": statistics.median(r.ttft_ms() for r in inst_runs),
        "decode_ratio": statistics.median(decode),
        "decode_spread": (min(decode), max(decode)),
        "ttft_ratio": statistics.median(ttft),
        "ttft_spread": (min(ttft), max(ttft)),
        "loop_ratio": statistics.median(loop),
        "bare_loop_us": statistics.median(r.loop_us_per_token() for r in bare_runs),
        "serving_ratio": statistics.median(serving),
        # telemetry CPU per generated token: in the serving process, and in the exporter process
        "thread_us_per_token": statistics.median(r.thread_cpu_ns / sum(r.tokens) for r in inst_runs) / 1e3,
        "process_us_per_token": statistics.median(r.process_cpu_ns / sum(r.tokens) for r in inst_runs) / 1e3,
    }


class _Dropped:
    """A telemetry sink that throws every record away (the ``dropped`` arm of ``--paired``)."""

    def submit(self, record) -> None:
        pass


def paired(arms: dict, settle: dict, rounds: int, seed: int = 17) -> dict[str, list[Run]]:
    """``rounds`` rounds of one run per arm, in a random order per round; runs per arm, by round."""
    order = random.Random(seed)
    runs: dict[str, list[Run]] = {name: [] for name in arms}
    for _ in range(rounds):
        names = list(arms)
        order.shuffle(names)
        for name in names:
            runs[name].append(arms[name]())
            settle.get(name, lambda: None)()
    return runs


#: Two-sided 95 % quantiles of Student's t by degrees of freedom (1-30); 1.96 beyond.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95 % confidence interval: a t-interval on the logs
    (pairs independent; a bootstrap interval is too narrow with the few pairs a run affords)."""
    logs = [math.log(r) for r in ratios if r > 0]
    if len(logs) < 2:
        return (math.exp(logs[0]) if logs else math.nan), math.nan, math.nan
    mean, n = statistics.fmean(logs), len(logs)
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paired_summary(name: str, runs: dict[str, list[Run]], comparisons: list[tuple[str, str]]) -> list[dict]:
    """Per comparison (numerator arm, denominator arm): decode, TTFT and serving-CPU ratios with CIs."""
    rows = []
    for num, den in comparisons:
        pairs = list(zip(runs[num], runs[den], strict=True))
        rows.append({
            "name": f"{name}: {num} / {den}", "pairs": len(pairs),
            "decode": ratio_ci([a.decode_tps() / b.decode_tps() for a, b in pairs]),
            "ttft": ratio_ci([a.ttft_ms() / b.ttft_ms() for a, b in pairs]),
            "serving_cpu": ratio_ci([a.serving_us_per_token() / b.serving_us_per_token() for a, b in pairs]),
            "loop_cpu": ratio_ci([a.loop_us_per_token() / b.loop_us_per_token() for a, b in pairs]),
            "ttft_ms": (statistics.median(r.ttft_ms() for r in runs[num]),
                        statistics.median(r.ttft_ms() for r in runs[den])),
        })
    return rows


def ttft_overlap(runs: list[Run], busy: list[tuple[int, int]]) -> tuple[float, float, float]:
    """Telemetry-thread work inside TTFT windows: (median ms per request, median share of its TTFT,
    share of requests with any)."""
    per_request, shares = [], []
    for run in runs:
        for submit, first in zip(run.submit, run.first, strict=True):
            inside = sum(max(0, min(end, first) - max(start, submit)) for start, end in busy) / 1e6
            per_request.append(inside)
            shares.append(inside / ((first - submit) / 1e6) if first > submit else 0.0)
    if not per_request:
        return math.nan, math.nan, math.nan
    return (statistics.median(per_request), statistics.median(shares),
            sum(1 for x in per_request if x > 0) / len(per_request))


def _median_mean(values: list[float]) -> tuple[float, float]:
    return (statistics.median(values), statistics.fmean(values)) if values else (math.nan, math.nan)


def bench_size(size: str, model_dir: Path, endpoint: str, spool: Path, reps: int, pair_rounds: int = 0,
               pair_requests: int = 2) -> list[dict]:
    """Every configuration on one model size."""
    from mlx_lm.generate import BatchGenerator

    from tokentrace.engine_shim.mlx.embed import Instrumentation
    from tokentrace.engine_shim.mlx.exporter_process import (
        ExporterConfig,
        ExporterProcess,
        build_tracer_provider,
        engine_resource,
    )
    from tokentrace.engine_shim.mlx.records import Clock
    from tokentrace.engine_shim.mlx.scheduler import LOAD_READY, Scheduler
    from tokentrace.engine_shim.mlx.settings import EngineSettings
    from tokentrace.engine_shim.mlx.telemetry import Telemetry

    count, tokens, length = WORKLOAD[size]
    resource = engine_resource(f"bench-{size}", size)
    # The engine's wiring (as in engine_shim/mlx/cli.py): an exporter process behind the telemetry thread.
    exporter = ExporterProcess(ExporterConfig({k: str(v) for k, v in resource.attributes.items()}, endpoint,
                                              str(spool), 64 << 20, clock_offset_ns=Clock().offset_ns)).start()
    TELEMETRY_PIDS[:] = [exporter.pid]
    telemetry = Telemetry(exporter, heartbeat_interval=5.0)
    # The embedding API builds spans in-process, on a provider of the caller's.
    provider, _ = build_tracer_provider(resource, endpoint, str(spool) + "-api", 64 << 20)
    settings = EngineSettings(model=str(model_dir), max_batch=8, cache_max_entries=0)
    loaded = threading.Event()
    scheduler = Scheduler(settings, deliver=lambda items: None, submit=telemetry.submit,
                          on_load_done=lambda record: loaded.set(), prefill_gate=telemetry.prefilling)
    telemetry.heartbeat = scheduler.heartbeat
    telemetry.start()
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    if not loaded.wait(300) or scheduler.load_state != LOAD_READY:
        raise SystemExit(f"the engine did not load {model_dir} ({scheduler.load_state})")
    model, tokenizer = scheduler.runtime.model, scheduler.runtime.tokenizer
    work = prompts(count, length, int(scheduler.runtime.config["vocab_size"]))
    shim = Instrumentation(provider)
    shim_process = Instrumentation(sink=ExporterProcess(ExporterConfig(
        {k: str(v) for k, v in resource.attributes.items()}, endpoint, str(spool) + "-api-process", 64 << 20,
        clock_offset_ns=Clock().offset_ns)).start())
    TELEMETRY_PIDS.append(shim_process.telemetry.sink.pid)
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bare-mlx-lm")
    results = []
    try:
        if pair_rounds:
            generator = worker.submit(BatchGenerator, model, completion_batch_size=1, prefill_batch_size=1).result()
            scheduler.max_batch = 1
            scheduler._new_generator()
            batch = work[:pair_requests]
            dropped, submit = _Dropped(), scheduler._submit

            def drop_run():
                scheduler._submit = dropped.submit  # the scheduler's own records (steps, heartbeats) too
                try:
                    return instrumented_engine(scheduler, thread.ident, dropped, batch, tokens, 1)
                finally:
                    scheduler._submit = submit

            from tokentrace.engine_shim.mlx import telemetry as telemetry_module

            def unheld_run(hold=telemetry_module.PREFILL_HOLD_S):
                telemetry_module.PREFILL_HOLD_S = 0.0  # records handled at once, even during a prefill
                try:
                    return instrumented_engine(scheduler, thread.ident, telemetry, batch, tokens, 1)
                finally:
                    telemetry_module.PREFILL_HOLD_S = hold

            arms = {"bare": lambda: worker.submit(bare_engine, generator, batch, tokens, 1).result(),
                    "dropped": drop_run,
                    "instrumented": lambda: instrumented_engine(scheduler, thread.ident, telemetry, batch, tokens, 1),
                    "unheld": unheld_run}
            for arm in arms.values():  # warm every path once
                arm()
            telemetry.flush()
            # Where the telemetry thread's work falls in time: (start, end) of each record it handles.
            busy: list[tuple[int, int]] = []
            handle = telemetry._handle

            def timed_handle(item, _handle=handle):
                began = time.perf_counter_ns()
                try:
                    _handle(item)
                finally:
                    if not (isinstance(item, tuple) and len(item) == 3):  # records, not flush markers
                        # (those wait on the exporter)
                        busy.append((began, time.perf_counter_ns()))

            telemetry._handle = timed_handle
            EXPORTER_PROBE[:] = [exporter.pid]
            runs = paired(arms, {"instrumented": telemetry.flush, "unheld": telemetry.flush}, pair_rounds)
            EXPORTER_PROBE.clear()
            telemetry._handle = handle
            generator.close()
            rows = paired_summary(f"{size}, engine, 1 stream", runs,
                                  [("instrumented", "bare"), ("instrumented", "dropped"), ("dropped", "bare"),
                                   ("instrumented", "unheld"), ("unheld", "dropped")])
            rows[0]["overlap"] = ttft_overlap(runs["instrumented"], busy)
            rows[0]["exporter_in_ttft"] = {arm: _median_mean([x / 1e6 for r in arm_runs for x in r.exporter_in_ttft])
                                           for arm, arm_runs in runs.items()}
            return rows
        for concurrency in (1, 8):
            # The bare loop runs on a worker thread of its own, like the engine's generation thread:
            # on this machine mlx-lm steps measurably faster off the main thread.
            generator = worker.submit(BatchGenerator, model, completion_batch_size=concurrency,
                                      prefill_batch_size=concurrency).result()
            scheduler.max_batch = concurrency
            scheduler._new_generator()  # the same generator shape on both sides
            # Two waves at 8 streams, so the first wave's spans are built while the second generates.
            batch = work[: max(count // 2, 2 * concurrency)]
            bare = lambda g=generator, b=batch, c=concurrency: worker.submit(  # noqa: E731
                bare_engine, g, b, tokens, c).result()
            inst = lambda b=batch, c=concurrency: instrumented_engine(scheduler, thread.ident, telemetry, b, tokens, c)  # noqa: E731
            bare()  # warm both paths once
            inst()
            telemetry.flush()
            results.append(compare(f"{size}, engine, {concurrency} stream{'s' if concurrency > 1 else ''}",
                                   bare, inst, telemetry.flush, reps))
            generator.close()
        api_work = work[: count // 2]
        for label, api in (("spans on a thread", shim), ("exporter process", shim_process)):
            results.append(compare(f"{size}, API ({label}), 1 stream",
                                   lambda: bare_api(model, tokenizer, api_work, tokens),
                                   lambda a=api: instrumented_api(a, model, tokenizer, api_work, tokens), api.flush,
                                   reps))
    finally:
        worker.shutdown()
        scheduler.stop()
        thread.join(30)
        shim.close()
        shim_process.close()
        telemetry.close()
        provider.shutdown()
    counters = exporter.counters
    if counters.dropped_spans or counters.spooled_batches or exporter.dropped_records:
        print(f"warning: {size}: {counters.spooled_batches} batches spooled, {counters.dropped_spans} spans "
              f"dropped", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(WORKLOAD))
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions per configuration")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table for docs/benchmarks.md")
    parser.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                        help="paired mode: ROUNDS rounds of bare, dropped and instrumented runs in a random order; "
                             "ratios with 95%% confidence intervals (module docstring)")
    parser.add_argument("--pair-requests", type=int, default=2, help="requests per run in --paired mode (default 2)")
    args = parser.parse_args(argv)

    from tokentrace.engine_shim.mlx.make_model import write_model

    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    started = time.monotonic()
    try:
        endpoint = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
        with tempfile.TemporaryDirectory() as tmp:
            results = []
            for size in args.sizes:
                model_dir = write_model(Path(tmp) / size, size=size)
                results += bench_size(size, model_dir, endpoint, Path(tmp) / f"spool-{size}", args.reps,
                                      args.paired, args.pair_requests)
    finally:
        sink.terminate()
        sink.wait(10)
    elapsed = time.monotonic() - started
    if args.paired:
        _print_paired(results, args.markdown, elapsed)
    else:
        _print(results, args.markdown, elapsed)
    return 0


def _print(results: list[dict], markdown: bool, elapsed: float) -> None:
    header = ("configuration", "bare decode tok/s", "instrumented", "decode ratio (min-max)", "bare TTFT ms",
              "instrumented", "TTFT ratio (min-max)", "loop CPU µs/token (bare)", "loop CPU ratio",
              "serving CPU ratio", "telemetry CPU µs/token: in process", "exporter process")
    rows = [(r["name"], f"{r['bare_tps']:.0f}", f"{r['inst_tps']:.0f}",
             f"{r['decode_ratio']:.3f} ({r['decode_spread'][0]:.3f}-{r['decode_spread'][1]:.3f})",
             f"{r['bare_ttft']:.2f}", f"{r['inst_ttft']:.2f}",
             f"{r['ttft_ratio']:.3f} ({r['ttft_spread'][0]:.3f}-{r['ttft_spread'][1]:.3f})",
             f"{r['bare_loop_us']:.0f}", f"{r['loop_ratio']:.3f}", f"{r['serving_ratio']:.3f}",
             f"{r['thread_us_per_token']:.1f}", f"{r['process_us_per_token']:.1f}") for r in results]
    machine = f"{platform.machine()}, {_cpu()}, load average {_load()}"
    print(f"# {datetime.date.today()} on {machine}; {elapsed:.0f} s")
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def _print_paired(results: list[dict], markdown: bool, elapsed: float) -> None:
    header = ("comparison", "rounds", "decode ratio [95% CI]", "TTFT ratio [95% CI]", "TTFT ms (median, num / den)",
              "serving CPU per token ratio [95% CI]", "loop CPU per token ratio [95% CI]")

    def ci(values: tuple[float, float, float]) -> str:
        return f"{values[0]:.3f} [{values[1]:.3f}, {values[2]:.3f}]"

    rows = [(r["name"], str(r["pairs"]), ci(r["decode"]), ci(r["ttft"]),
             f"{r['ttft_ms'][0]:.2f} / {r['ttft_ms'][1]:.2f}", ci(r["serving_cpu"]), ci(r["loop_cpu"]))
            for r in results]
    machine = f"{platform.machine()}, {_cpu()}, load average {_load()}"
    print(f"# {datetime.date.today()} on {machine}; {elapsed:.0f} s; paired")
    for r in results:
        if "overlap" in r:
            ms, share, hit = r["overlap"]
            print(f"# {r['name']}: the telemetry thread worked {ms:.3f} ms inside the median request's TTFT window "
                  f"({share:.1%} of it; {hit:.0%} of requests had some)")
            print("# exporter process CPU inside TTFT windows, ms, median / mean: " + ", ".join(
                f"{arm} {ms[0]:.3f} / {ms[1]:.3f}" for arm, ms in r["exporter_in_ttft"].items()))
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def _cpu() -> str:
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        return f"{len(names)} x {names[0]}" if names else platform.processor()
    except OSError:
        return platform.processor() or "unknown CPU"


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
