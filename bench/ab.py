"""Two or more versions of the collector side by side under engine-shaped ingest: the ratio a change
makes, measured in one run, on a host whose speed drifts within the hour.

Each round starts one collector of each variant in turn (the order rotates every round), warms it,
drives it as bench/ingest.py does (4 senders over loopback, 512-span engine batches from its cache,
each distinct batch once), waits until the journal is merged, and reads the collector's CPU seconds
(user + system, /proc) and its merges (``/healthz``). It prints, per round and variant, collector
CPU microseconds a span acknowledged, spans/s, the senders' p99, spans a merge, peak resident
memory and the span files it listed when measured (collector/stores/span_files.py: files,
compactions done); then each variant's medians (CPU a span by thread too), its ratios to the first
variant and the rounds in which it used less CPU a span than the first.

A variant is ``LABEL=SPEC``; SPEC is empty (the checkout as it is) or comma-separated items:
``tree:DIR`` runs the collector from another checkout (``git worktree add DIR COMMIT``, then its
extensions built in place: ``python -c "from setuptools import setup; setup()" build_ext --inplace``),
``MODULE.NAME=VALUE`` sets a module's constant (a Python literal) in the collector before it starts,
``env:NAME=VALUE`` sets an environment variable of the collector's process (an allocator's tunables).
Each collector is checked to run the variant's code (its extension modules mapped from the tree,
its settings applied, its environment as given) before it is measured:

    python bench/ab.py --variant half= --variant second=tokentrace.collector.stores.journal.GATHER_S=1.0
    python bench/ab.py --variant old=tree:/tmp/old --variant new= --rounds 4 --seconds 25
    python bench/ab.py --variant mimalloc= --variant system=env:ARROW_DEFAULT_MEMORY_POOL=system
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness_collector import CollectorProcess, proc_status
from ingest import cpu_seconds, drive, make_bodies, percentile, thread_times, wait_merged

ROOT = Path(__file__).resolve().parents[1]

#: Written as sitecustomize.py for a variant with settings: Python imports it at start-up, before
#: the collector's own modules run, and sets each constant on its module.
_SITE = """import importlib, os
for _module, _name, _value in {settings!r}:
    setattr(importlib.import_module(_module), _name, _value)
with open(os.path.join(os.path.dirname(__file__), "applied"), "a") as _out:
    _out.write(f"{{os.getpid()}}\\n")
"""


def parse_variant(text: str) -> tuple[str, Path | None, list[tuple[str, str, object]], dict[str, str]]:
    """``LABEL=SPEC`` -> (label, another checkout or None, (module, name, value) settings, environment)."""
    label, sep, spec = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"a variant is LABEL=SPEC, not {text!r}")
    tree, settings, env = None, [], {}
    for item in filter(None, spec.split(",")):
        if item.startswith("env:"):
            name, sep, value = item[4:].partition("=")
            if not sep or not name:
                raise argparse.ArgumentTypeError(f"an environment variable is env:NAME=VALUE, not {item!r}")
            env[name] = value
            continue
        if item.startswith("tree:"):
            tree = Path(item[5:]).resolve()
            if decoder_of(tree) is None:
                raise argparse.ArgumentTypeError(f"{tree}: no collector/**/_fastotlp*.so "
                                                 "(build its extensions in place)")
            continue
        target, sep, value = item.partition("=")
        module, _, name = target.rpartition(".")
        if not sep or not module:
            raise argparse.ArgumentTypeError(f"a setting is MODULE.NAME=VALUE, not {item!r}")
        try:
            settings.append((module, name, ast.literal_eval(value)))
        except (ValueError, SyntaxError) as exc:
            raise argparse.ArgumentTypeError(f"{item!r}: the value is not a Python literal") from exc
    return label, tree, settings, env


def decoder_of(tree: Path) -> Path | None:
    """The compiled decoder's path in ``tree`` without its suffix (collector/_fastotlp before issue
    45 gave the collector its folders, collector/decoding/_fastotlp after), or None if unbuilt."""
    found = sorted(tree.glob("collector/**/_fastotlp*.so"))
    return found[0].parent / "_fastotlp" if found else None


def prepare(folder: Path, tree: Path | None, settings: list) -> None:
    """The variant's folder for the collector's PYTHONPATH: a ``tokentrace`` package made of links
    into ``tree`` as pyproject.toml's package-dir maps it (the checkout's own install is an editable
    one, found after PYTHONPATH), and a sitecustomize.py that applies ``settings``."""
    folder.mkdir()
    if tree is not None:
        package = folder / "tokentrace"
        package.mkdir()
        for entry in (tree / "core").iterdir():
            (package / entry.name).symlink_to(entry)
        for part in ("collector", "analyzers", "dashboards", "engine_shim"):
            (package / part).symlink_to(tree / part)
    if settings:
        (folder / "sitecustomize.py").write_text(_SITE.format(settings=settings))


def check_variant(pid: int, folder: Path, tree: Path | None, settings: list, env: dict[str, str]) -> None:
    """Fail unless the collector ``pid`` runs the variant's code: its decoder mapped from the
    variant's checkout, its settings applied (the sitecustomize records each process it ran in), and
    its environment holding the variant's variables."""
    expected = decoder_of(tree or ROOT)
    if not any(str(expected) in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines()):
        raise SystemExit(f"the collector (pid {pid}) has not loaded {expected}*.so: it runs another checkout")
    applied = folder / "applied"
    if settings and (not applied.exists() or str(pid) not in applied.read_text().split()):
        raise SystemExit(f"the variant's settings {settings} were not applied in the collector (pid {pid})")
    held = dict(entry.partition("=")[::2] for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if entry)
    if any(held.get(name) != value for name, value in env.items()):
        raise SystemExit(f"the collector (pid {pid}) does not have the variant's environment {env}")


def start(workdir: Path, folder: Path, env: dict[str, str]) -> CollectorProcess:
    """Start a collector with ``folder`` first on its PYTHONPATH and ``env`` added to its environment."""
    path = os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])
    return CollectorProcess(workdir, env={**os.environ, **env, "PYTHONPATH": path}).start()


def measure(collector: CollectorProcess, folder: Path, tree: Path | None, settings: list, env: dict[str, str],
            bodies: list, seconds: float) -> dict:
    """A started collector under the senders, once it is checked to run its variant's code: its CPU
    a span, spans/s, merge size and peak memory."""
    try:
        check_variant(collector.proc.pid, folder, tree, settings, env)
        drive(collector.port, bodies[:8], 4, 5, 8)  # warm: imports, first merges
        cpu, threads = cpu_seconds(collector.proc.pid), thread_times(collector.proc.pid) or {}
        acked, elapsed, latencies, _, refused, _ = drive(collector.port, bodies[8:], 4, seconds, 1_000_000)
        lag = wait_merged(collector)
        cpu = cpu_seconds(collector.proc.pid) - cpu
        after = thread_times(collector.proc.pid) or {}
        by_thread = {name: (used[1] - threads.get(name, [0, 0.0])[1]) / acked * 1e6 for name, used in after.items()}
        journal = collector.health()["journal"]
        peak = proc_status(collector.proc.pid, "VmHWM") / (1 << 20)
    finally:
        collector.stop()
    # Acknowledged spans a second, and the pace of the tables: the acknowledged spans over the run and
    # the wait until the last of them was merged (a collector may acknowledge ahead of its merges).
    return {"us": cpu / acked * 1e6, "rate": acked / elapsed, "p99": percentile(latencies, 0.99),
            "tables": acked / (elapsed + lag), "refused": refused, "threads": by_thread,
            "merge": journal["merged_spans"] / max(1, journal["merges"]), "peak": peak,
            "files": journal.get("span_files", {"files": 0, "compactions": 0})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="LABEL=SPEC (twice or more; the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured ingest of each run")
    parser.add_argument("--distinct-batches", type=int, default=6000)
    args = parser.parse_args()
    if len(args.variant) < 2 or len({label for label, *_ in args.variant}) < len(args.variant):
        parser.error("give two or more variants with distinct labels")
    bodies = make_bodies(args.distinct_batches, 512)
    results: dict[str, list[dict]] = {label: [] for label, *_ in args.variant}
    with tempfile.TemporaryDirectory() as tmp:
        for label, tree, settings, _ in args.variant:
            prepare(Path(tmp, "site-" + label), tree, settings)
        for round_ in range(args.rounds):
            shift = round_ % len(args.variant)
            for label, tree, settings, env in args.variant[shift:] + args.variant[:shift]:
                workdir, folder = Path(tmp, f"{label}-{round_}"), Path(tmp, "site-" + label)
                workdir.mkdir()
                run = measure(start(workdir, folder, env), folder, tree, settings, env, bodies, args.seconds)
                results[label].append(run)
                print(f"round {round_ + 1} {label:>10}: {run['us']:6.2f} us/span  {run['rate']:9,.0f} spans/s  "
                      f"p99 {run['p99']:6.1f} ms  "
                      f"({run['tables']:,.0f} into the tables)  "
                      f"{run['merge']:9,.0f} spans a merge  peak {run['peak']:5.0f} MiB  {run['refused']} refused  "
                      f"{run['files']['files']} span files ({run['files']['compactions']} compactions)", flush=True)
    base_label = args.variant[0][0]
    base = results[base_label]
    base_us, base_rate, base_p99 = (statistics.median(r[key] for r in base) for key in ("us", "rate", "p99"))
    for label, runs in results.items():
        us, rate, p99 = (statistics.median(r[key] for r in runs) for key in ("us", "rate", "p99"))
        line = (f"{label:>10}: median {us:6.2f} us/span, {rate:9,.0f} spans/s, p99 {p99:.1f} ms "
                f"({statistics.median(r['tables'] for r in runs):,.0f} into the tables), "
                f"{statistics.median(r['merge'] for r in runs):9,.0f} spans a merge, "
                f"peak {statistics.median(r['peak'] for r in runs):5.0f} MiB")
        if label != base_label:
            fewer = sum(r["us"] < b["us"] for r, b in zip(runs, base, strict=True))
            line += (f"; {us / base_us:.3f} x {base_label}'s CPU a span, less in {fewer} of {len(runs)} rounds; "
                     f"spans/s {rate / base_rate:.3f} x, p99 {p99 / base_p99:.3f} x {base_label}'s")
        print(line)
        names = sorted({name for r in runs for name in r["threads"]}, key=lambda n: -statistics.median(
            r["threads"].get(n, 0.0) for r in runs))
        print("            us/span by thread: " + ", ".join(
            f"{name} {statistics.median(r['threads'].get(name, 0.0) for r in runs):.2f}" for name in names
            if statistics.median(r["threads"].get(name, 0.0) for r in runs) >= 0.05))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
