"""Decode benchmark (issue 17): the Python path and the compiled decoder side by side, in one run.

On the same OTLP protobuf batches of bench/synth.py (512 engine-shaped spans each; ``--shape light``
for small generic spans), per span:

- Python: ``ExportTraceServiceRequest.FromString`` + ``normalize`` + ``Batch.columns()`` (each part
  shown too), what ``ingest.parse`` costs without the decoder;
- C: ``fastpath.decode``, the Arrow import included (and its two parts, measured in one pass);
- ``Columns.to_bytes()`` / ``from_bytes()`` of the result, how the parse worker ships it;
- the C path on ``--threads`` threads at once (the collector decodes on 4, beside its other
  threads): CPU per span, which what the threads share (the GIL, malloc) adds to.

Each figure is the best of ``--repeat`` passes over all batches, the passes of each figure
interleaved (a shared machine's other load only ever adds time, and falls on all alike). Every
batch must take the C path and give the Python path's tables.

``--against SO`` compares builds: another build of the decoder (the ``_fastotlp`` shared object of
an earlier commit, or of other compiler flags) decodes the same bodies, body by body beside this
one, which goes first swapped each time, and the last line gives the ratio of their decoder times
(Arrow import left out).

    python bench/decode.py [--shape engine|light] [--batches 20] [--repeat 5] [--threads 4] [--against SO]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from synth import Workload, light_batches

from tokentrace.collector.decoding import _fastotlp, fastpath
from tokentrace.collector.decoding.columns import Columns
from tokentrace.collector.decoding.normalize import normalize

LIMIT = 65_536


def make_bodies(count: int, spans_per_batch: int, shape: str) -> tuple[list[bytes], int]:
    """Serialized requests, generated before any timing, and how many spans they hold."""
    batches = Workload(seed=11).batches(spans_per_batch) if shape == "engine" else light_batches(spans_per_batch)
    bodies = [next(batches).SerializeToString() for _ in range(count)]
    requests = [ExportTraceServiceRequest.FromString(body) for body in bodies]
    spans = sum(len(scope.spans) for request in requests for resource in request.resource_spans
                for scope in resource.scope_spans)
    return bodies, spans


def best(repeat: int, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Fewest seconds of ``repeat`` runs of each, the runs interleaved so that a change in the
    machine's other load falls on all of them alike."""
    fewest = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            fewest[name] = min(fewest[name], time.perf_counter() - started)
    return fewest


def c_parts(bodies: list[bytes], repeat: int) -> tuple[float, float]:
    """Seconds of the decoder and of the Arrow import, in the fastest of ``repeat`` passes."""
    fastest = (float("inf"), 0.0)
    for _ in range(repeat):
        started = time.perf_counter()
        found = [_fastotlp.decode(body, LIMIT) for body in bodies]
        decoded = time.perf_counter()
        for result in found:
            fastpath.imported(result)
        done = time.perf_counter()
        if done - started < sum(fastest):
            fastest = (decoded - started, done - decoded)
    return fastest


def threaded(bodies: list[bytes], threads: int, repeat: int) -> float:
    """Fewest CPU seconds of ``repeat`` runs in which ``threads`` threads each decode every body."""
    def work() -> None:
        for body in bodies:
            fastpath.decode(body, LIMIT)

    fewest = float("inf")
    for _ in range(repeat):
        workers = [threading.Thread(target=work) for _ in range(threads)]
        started = time.process_time()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        fewest = min(fewest, (time.process_time() - started) / threads)
    return fewest


def alternating(bodies: list[bytes], first, second, repeat: int) -> tuple[float, float]:
    """CPU seconds of two decoders over ``repeat`` passes, body by body, each body decoded by both
    in turn and which goes first swapped every time (whole passes one after the other favoured the
    first by 11 %, a build against itself)."""
    spent = [0.0, 0.0]
    decoders = (first, second)
    for turn in range(repeat):
        for at, body in enumerate(bodies):
            for which in ((0, 1) if (at + turn) % 2 == 0 else (1, 0)):
                started = time.thread_time()
                decoders[which](body, LIMIT)
                spent[which] += time.thread_time() - started
    return spent[0] / repeat, spent[1] / repeat


def other_build(path: str):
    """The decoder built at ``path``, loaded beside this one and configured as it is."""
    spec = importlib.util.spec_from_file_location("tokentrace.collector.decoding._fastotlp", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path} is not a loadable build of the decoder")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fastpath.configure(module)
    return module


def check(bodies: list[bytes]) -> list[Columns]:
    """The decoder's Columns of every body, each equal to the Python path's (tables and keys)."""
    out = []
    for body in bodies:
        got = fastpath.decode(body, LIMIT)
        if got is None:
            raise SystemExit("a benchmark batch fell back to the Python path: nothing to compare")
        expected = normalize(ExportTraceServiceRequest.FromString(body), LIMIT).columns()
        same = list(got.tables) == list(expected.tables) and all(
            got.tables[name].equals(table) for name, table in expected.tables.items())
        if not same or not (got.keys == expected.keys).all():
            raise SystemExit("the decoder's columns differ from the Python path's")
        out.append(got)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("engine", "light"), default="engine")
    parser.add_argument("--spans-per-batch", type=int, default=512)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4, help="threads decoding at once, for the last line")
    parser.add_argument("--against", metavar="SO", help="another build of _fastotlp to compare this one with")
    args = parser.parse_args()
    if fastpath.unavailable():
        raise SystemExit(f"the compiled decoder is not in use: {fastpath.unavailable()}")
    bodies, spans = make_bodies(args.batches, args.spans_per_batch, args.shape)
    decoded = check(bodies)
    requests = [ExportTraceServiceRequest.FromString(body) for body in bodies]
    batches = [normalize(request, LIMIT) for request in requests]
    shipped = [columns.to_bytes() for columns in decoded]

    def per_span(seconds: float) -> float:
        return seconds / spans * 1e6

    times = {name: per_span(seconds) for name, seconds in best(args.repeat, {
        "python": lambda: [normalize(ExportTraceServiceRequest.FromString(b), LIMIT).columns() for b in bodies],
        "c_path": lambda: [fastpath.decode(b, LIMIT) for b in bodies],
        "parse": lambda: [ExportTraceServiceRequest.FromString(b) for b in bodies],
        "normalize": lambda: [normalize(r, LIMIT) for r in requests],
        "columns": lambda: [batch.columns() for batch in batches],
        "to_bytes": lambda: [columns.to_bytes() for columns in decoded],
        "from_bytes": lambda: [Columns.from_bytes(data) for data in shipped],
    }).items()}
    decoder, arrow = (per_span(seconds) for seconds in c_parts(bodies, args.repeat))
    alone, together = (per_span(threaded(bodies, n, args.repeat)) for n in (1, args.threads))
    python, c_path, norm = times["python"], times["c_path"], times["normalize"]

    print(f"{args.batches} batches of {args.shape} spans ({spans} spans, {sum(map(len, bodies)) / spans:.0f} "
          f"bytes each), best of {args.repeat}, µs per span")
    print(f"  Python path   {python:7.2f}   (FromString {times['parse']:.2f} + normalize {norm:.2f} "
          f"+ columns() {times['columns']:.2f})")
    print(f"  C path        {c_path:7.2f}   (decoder {decoder:.2f} + Arrow import {arrow:.2f}, in one pass)")
    print(f"  ratio         {python / c_path:7.1f} x  (normalize alone / C path: {norm / c_path:.1f} x)")
    print(f"  to_bytes      {times['to_bytes']:7.2f}   from_bytes {times['from_bytes']:.2f}   "
          f"({sum(map(len, shipped)) / spans:.0f} bytes per span shipped)")
    print(f"  C path, CPU   {together:7.2f}   with {args.threads} threads decoding at once ({alone:.2f} with one)")
    if args.against:
        other = other_build(args.against)
        if any(other.decode(body, LIMIT) is None for body in bodies):
            raise SystemExit(f"{args.against} leaves a benchmark batch to the Python path: nothing to compare")
        this, that = alternating(bodies, _fastotlp.decode, other.decode, args.repeat)
        print(f"  decoder       {per_span(this):7.2f}   against {per_span(that):.2f} with {args.against}: "
              f"{this / that:.3f} of its time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
