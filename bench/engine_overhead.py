"""What does tokentrace's instrumentation cost? Instrumented engine vs bare mlx-lm, side by side.

Same process, same loaded model, same prompts, runs alternating (bare, instrumented, bare, ...):

* engine, 1 and 8 concurrent streams: the engine's ``Scheduler`` with the engine's telemetry
  pipeline (records -> telemetry thread -> exporter process -> SDK spans -> BatchSpanProcessor ->
  OTLP/HTTP protobuf to a sink process) against mlx-lm's ``BatchGenerator`` driven by a minimal
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

    python bench/engine_overhead.py [--sizes tiny small] [--reps 5] [--markdown]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import os
import platform
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


def telemetry_cpu_ns() -> tuple[int, int]:
    """CPU time consumed so far by telemetry: (threads of this process, exporter processes)."""
    threads = 0
    for thread in threading.enumerate():
        if thread.name.startswith(TELEMETRY_THREADS) and thread.ident is not None:
            with contextlib.suppress(OSError, AttributeError):  # ended, or no per-thread clocks here
                threads += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
    processes = 0
    for pid in TELEMETRY_PIDS:
        with contextlib.suppress(OSError, ValueError, IndexError):  # Linux /proc only
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            processes += (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return threads, processes


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
        run.submit[i] = now
        scheduler.submit(Job(record=record, tokens=work[i], max_tokens=tokens, sampling=sampling, sink=i))

    def deliver(items) -> None:
        now = time.perf_counter_ns()
        for job, _token, reason in items:
            i = job.sink
            run.tokens[i] += 1
            if run.first[i] == 0:
                run.first[i] = now
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


def bench_size(size: str, model_dir: Path, endpoint: str, spool: Path, reps: int) -> list[dict]:
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
                          on_load_done=lambda record: loaded.set())
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
                results += bench_size(size, model_dir, endpoint, Path(tmp) / f"spool-{size}", args.reps)
    finally:
        sink.terminate()
        sink.wait(10)
    elapsed = time.monotonic() - started
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
