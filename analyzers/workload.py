"""Workloads for what-if replay: a window of the store, or a trace file in Mooncake's format; and our
own traffic written in that format (``tokentrace export mooncake``).

Mooncake's format (kvcache-ai/Mooncake, FAST25-release/README.md): JSON lines of ``timestamp`` (ms
from the trace's start), ``input_length``, ``output_length`` and ``hash_ids``, the prompt's chained
block ids (equal ids = a reusable prefix; the last block may be partial; 512-token blocks in the
published traces). Our chained block hashes (docs/telemetry.md) are such ids: the store's are
renumbered 0, 1, 2 ... in order of first appearance, as Mooncake's are, so no fingerprint leaves.
Because a chained id names its whole prefix, coarser blocks are exact: block j of k·B tokens is
fine block (j+1)·k - 1 (or the last one).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import polars as pl

from tokentrace.analyzers.session import once
from tokentrace.analyzers.whatif import InstanceFacts, TraceRequest, Workload
from tokentrace.collector.stores.store import TraceReader
from tokentrace.errors import ConfigError
from tokentrace.window import Slice

#: The block size of Mooncake's published traces.
MOONCAKE_BLOCK_SIZE = 512
#: Requests read from a window at most.
LIMIT = 1_000_000


def read_mooncake(path: str | Path, block_size: int, tpot_ms: float | None = None,
                  prefill_tokens_per_s: float | None = None, kv_bytes_per_token: int | None = None) -> Workload:
    """A Mooncake JSON-lines trace. ``tpot_ms`` estimates each request's end (arrival + output × TPOT),
    which load-aware routes need; without it, no end is known."""
    if block_size < 1:
        raise ConfigError(f"--block-size must be 1 or more, received {block_size}")
    requests = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the trace {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            t, inputs, outputs = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
            blocks = tuple(int(b) for b in row["hash_ids"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} line {number}: expected a JSON object with timestamp, input_length, "
                              f"output_length and hash_ids, received {line[:80]!r} ({exc})") from None
        end = t + outputs * tpot_ms if tpot_ms is not None else None
        requests.append(TraceRequest(t, inputs, outputs, blocks, end_ms=end))
    requests.sort(key=lambda r: r.t_ms)  # stable: equal timestamps keep the file's order
    return Workload(requests, block_size, "mooncake", {}, prefill_tokens_per_s, kv_bytes_per_token)


def prefill_rates(requests: pl.DataFrame) -> dict[str, float]:
    """Per instance: Σ uncached prompt tokens / Σ prefill seconds over requests that computed some."""
    uncached = (pl.col("prompt_tokens").fill_null(0) - pl.col("cached_tokens").fill_null(0)).clip(0)
    done = requests.filter((pl.col("prefill_ms") > 0) & (uncached > 0))
    sums = done.group_by("instance_id").agg(uncached.sum().alias("tokens"), pl.col("prefill_ms").sum().alias("ms"))
    return {row["instance_id"]: row["tokens"] / row["ms"] * 1000 for row in sums.iter_rows(named=True)}


def load_workload(reader: TraceReader, since_ns: int | None, until_ns: int | None = None,
                  limit: int = LIMIT, where: Slice | None = None) -> Workload:
    """The requests that started in [since, until) with a prompt fingerprint, in arrival order (the
    latest ``limit`` of them), of the slice ``where`` (one instance, model, session or request-id
    prefix: only that traffic is replayed)."""
    where = where or Slice()
    # The instance in the store's query (the latest ``limit`` are that instance's); the rest of the
    # slice over what it returns.
    requests = once(reader.requests(since_ns=since_ns, until_ns=until_ns, instance_id=where.instance_id,
                                    limit=limit))
    requests = where.keep(requests)
    if requests.height:  # the lookups of older requests are not needed
        since_ns = max(since_ns or 0, requests["start_ns"].min())
    lookups = reader.bulk("lookups_in", since_ns=since_ns, until_ns=until_ns).unique("request_id", keep="last")
    blocks = (reader.bulk("lookup_blocks_in", since_ns=since_ns, until_ns=until_ns)
              .unique(["request_id", "block_index"], keep="last", maintain_order=True)
              .group_by("request_id", maintain_order=True).agg(pl.col("hash")))
    joined = (requests.join(lookups.select("request_id", "block_size", "matched_tokens"), on="request_id", how="inner")
              .join(blocks, on="request_id", how="inner").filter(pl.col("instance_id").is_not_null())
              .sort("start_ns", "request_id"))
    skipped = requests.height - joined.height  # no fingerprint (or no instance id to replay it on)
    sizes = joined["block_size"].drop_nulls().unique().to_list()
    if len(sizes) > 1:
        raise ConfigError(f"the window mixes block sizes {sorted(sizes)}; choose a window (--since) of one")
    block = int(sizes[0]) if sizes else 16
    rates = prefill_rates(requests)
    beats = {row["instance_id"]: row for row in reader.frame("latest_heartbeats").iter_rows(named=True)}
    ids: dict[int, int] = {}
    t0 = joined["start_ns"].min() if joined.height else 0
    out = []
    for row in joined.iter_rows(named=True):
        chain = tuple(ids.setdefault(h, len(ids)) for h in row["hash"])
        end = None if row["end_ns"] is None else (row["end_ns"] - t0) / 1e6
        cached = row["matched_tokens"] if row["matched_tokens"] is not None else row["cached_tokens"]
        out.append(TraceRequest((row["start_ns"] - t0) / 1e6, int(row["prompt_tokens"] or 0),
                                int(row["completion_tokens"] or 0), chain, row["session_id"], row["instance_id"],
                                end, cached, row["request_id"]))
    instances = {}
    for name in sorted({r.instance for r in out if r.instance is not None}):
        beat = beats.get(name, {})
        instances[name] = InstanceFacts(rates.get(name), beat.get("kv_bytes_per_token") or None,
                                        beat.get("cache_max_bytes"), beat.get("cache_max_entries"),
                                        beat.get("cache_unit"))
    total = prefill_rates(requests.with_columns(pl.lit("all").alias("instance_id"))).get("all")
    return Workload(out, block, "store", instances, total, None, skipped)


def coarser(blocks: tuple[int, ...], factor: int) -> tuple[int, ...]:
    """The chain of blocks ``factor`` times as long (exact for chained ids; module docstring)."""
    if factor == 1 or not blocks:
        return blocks
    last = len(blocks) - 1
    return tuple(blocks[min((j + 1) * factor - 1, last)] for j in range((len(blocks) + factor - 1) // factor))


def rechunk(workload: Workload, block_size: int | None) -> Workload:
    """The workload with blocks of ``block_size`` tokens, a multiple of its own (None: unchanged)."""
    if block_size is None or block_size == workload.block_size:
        return workload
    if block_size < workload.block_size or block_size % workload.block_size:
        raise ConfigError(f"--block-size must be a multiple of the recorded block size {workload.block_size}, "
                          f"received {block_size}")
    factor = block_size // workload.block_size
    requests = [TraceRequest(r.t_ms, r.input_length, r.output_length, coarser(r.blocks, factor), r.session,
                             r.instance, r.end_ms, r.cached_tokens, r.request_id) for r in workload.requests]
    return Workload(requests, block_size, workload.source, workload.instances, workload.prefill_tokens_per_s,
                    workload.kv_bytes_per_token, workload.skipped)


def mooncake_lines(workload: Workload) -> Iterator[str]:
    """One JSON line per request in Mooncake's format (timestamps in whole ms, block ids renumbered)."""
    ids: dict[int, int] = {}
    for r in workload.requests:
        yield json.dumps({"timestamp": round(r.t_ms), "input_length": r.input_length,
                          "output_length": r.output_length,
                          "hash_ids": [ids.setdefault(b, len(ids)) for b in r.blocks]})


def write_lines(lines: Iterable[str], out) -> int:
    """Write lines to a text stream; returns how many."""
    count = 0
    for line in lines:
        out.write(line + "\n")
        count += 1
    return count
