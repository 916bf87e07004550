"""What-if replay: recorded traffic (or a trace file) through a model of prefix caches and routing.

The default model, so that anyone can check a figure (docs/whatif.md):
- one cache per instance, LRU over blocks; a capacity of C tokens holds ``C // block_size`` blocks
  (``None``: unlimited);
- a request's blocks are looked up when it arrives, then inserted (or refreshed) at once: its hit is
  the leading run of its blocks present at arrival; the refresh goes from its last block to its first,
  so the head of a chain is the most recently used and capacity takes tails first (as vLLM's free
  queue does);
- token hit ratio = Σ min(hit blocks × block size, input_length) / Σ input_length;
- ``--cache-model entries`` replaces the block cache with an LRU of whole entries (``EntryCache``),
  the way the MLX engine and mlx-lm keep their prompt caches, bounded by tokens and by a number of
  entries; a hit then saves what the MLX engine reuses: its whole blocks, at most the prompt less
  one token (the last prompt token's logits are always computed);
- ``own`` (``Capacity(own=True)``; the cache page's "at its own capacity") replays each recorded
  instance with every limit its latest heartbeat declares: its byte limit (as tokens, / KV bytes
  per token) and, where one entry holds one sequence (cache unit ``entry`` or ``slot``), its entry
  limit, with the entries model; other instances (vLLM's blocks) with the blocks model;
- prefill tokens saved = Σ min(hit blocks × block size, input_length) (against no cache); the TTFT
  they save is each request's saved tokens at the prefill rate measured on its instance.

Routing policies (the gateway's, simulated): ``recorded`` (the instance that served it; store only),
``round_robin``, ``least_loaded`` (fewest requests in flight at arrival), ``session`` (sticky per
session; a session's first request, or one without a session, is placed least-loaded), ``prefix``
(the instance whose cache holds the longest leading run, among those within ``PREFIX_LOAD_SLACK``
requests in flight of the least loaded). Ties go to the fewest in flight, then the lowest index.
A request is in flight from its arrival to its end (recorded, or estimated for a trace file from
``--tpot-ms``); ``least_loaded`` and ``prefix`` need those ends, ``session`` without them places new
sessions in round-robin order.

``replay`` is a pure function of a ``Workload``; ``grid`` runs every combination.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tokentrace.errors import ConfigError

#: Cache models: ``blocks`` (the default model) and ``entries`` (``EntryCache``).
MODELS = ("blocks", "entries")
ROUTES = ("recorded", "round_robin", "least_loaded", "session", "prefix")
#: Routes whose choice does not depend on cache contents: one assignment serves every capacity.
_STATIC_ROUTES = ("recorded", "round_robin", "least_loaded", "session")
#: Routes that weigh requests in flight: they need every request's end.
_LOAD_ROUTES = ("least_loaded", "prefix")
#: ``prefix`` prefers cache hits only among instances within this many in-flight requests of the least loaded.
PREFIX_LOAD_SLACK = 4


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload."""

    t_ms: float  #: arrival, ms from the workload's start
    input_length: int  #: prompt tokens
    output_length: int  #: generated tokens
    blocks: tuple[int, ...]  #: chained block ids of the prompt (the last block may be partial)
    session: str | None = None  #: session id, when known
    instance: str | None = None  #: the instance that served it (recorded traffic)
    end_ms: float | None = None  #: when it ended, ms from the workload's start (None: unknown)
    cached_tokens: int | None = None  #: prompt tokens the engine actually reused (recorded traffic)
    request_id: str | None = None  #: its id in the store


@dataclass
class InstanceFacts:
    """What the window says about one recorded instance."""

    prefill_tokens_per_s: float | None = None  #: Σ uncached tokens / Σ prefill time of its requests
    kv_bytes_per_token: int | None = None  #: from its latest heartbeat
    cache_max_bytes: int | None = None  #: its cache's byte limit
    cache_max_entries: int | None = None  #: its cache's entry limit
    cache_unit: str | None = None  #: what one of its entries is (contract cache units: entry, block, slot)


@dataclass
class Workload:
    """Requests in arrival order, their block size, and the recorded instances' facts."""

    requests: list[TraceRequest]
    block_size: int
    source: str  #: "store" or "mooncake"
    instances: dict[str, InstanceFacts] = field(default_factory=dict)  #: recorded instances, by id
    prefill_tokens_per_s: float | None = None  #: the rate for instances the record does not know
    kv_bytes_per_token: int | None = None  #: for --capacity-bytes where the record does not know it
    skipped: int = 0  #: requests left out (no prompt fingerprint)

    def recorded_ids(self) -> list[str]:
        """The recorded instances, sorted: simulated instance k stands for the k-th of them."""
        return sorted(self.instances)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (what ``/api/workload`` returns)."""
        return {"source": self.source, "block_size": self.block_size, "skipped": self.skipped,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "kv_bytes_per_token": self.kv_bytes_per_token,
                "instances": {k: vars(v) for k, v in self.instances.items()},
                "requests": [{**vars(r), "blocks": list(r.blocks)} for r in self.requests]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """The inverse of ``as_dict``."""
        requests = [TraceRequest(**{**r, "blocks": tuple(r["blocks"])}) for r in data["requests"]]
        instances = {k: InstanceFacts(**v) for k, v in data["instances"].items()}
        return cls(requests, data["block_size"], data["source"], instances, data["prefill_tokens_per_s"],
                   data["kv_bytes_per_token"], data["skipped"])


#: Cache units whose entries each hold one sequence (the entries model's entry limit applies).
SEQUENCE_UNITS = ("entry", "slot")


@dataclass(frozen=True)
class Capacity:
    """One capacity setting: tokens (None: unlimited) or bytes converted per instance, and an entry
    limit (entries model only). ``own``: each recorded instance's own limits wherever this setting
    gives none (its byte limit for tokens, its entry limit for entries; module docstring)."""

    tokens: int | None = None
    bytes: int | None = None
    entries: int | None = None  #: entries an instance's cache holds (entries model; None: unlimited)
    own: bool = False  #: fill the limits not given from each recorded instance's heartbeat

    def blocks(self, workload: Workload, index: int) -> int | None:
        """Blocks simulated instance ``index`` holds (None: unlimited)."""
        tokens = self.tokens_of(workload, index)
        return None if tokens is None else tokens // workload.block_size

    def tokens_of(self, workload: Workload, index: int) -> int | None:
        """Tokens simulated instance ``index`` holds (None: unlimited)."""
        if self.bytes is not None:
            return self.bytes // _kv_bytes_per_token(workload, index)
        if self.tokens is not None or not self.own:
            return self.tokens
        facts = _facts(workload, index)
        if facts is None or not facts.cache_max_bytes or not facts.kv_bytes_per_token:
            return None
        return facts.cache_max_bytes // facts.kv_bytes_per_token

    def entries_of(self, workload: Workload, index: int) -> int | None:
        """Entries simulated instance ``index`` holds (None: unlimited)."""
        if self.entries is not None or not self.own:
            return self.entries
        facts = _facts(workload, index)
        return facts.cache_max_entries if facts is not None and facts.cache_unit in SEQUENCE_UNITS else None

    def known(self, workload: Workload, index: int) -> bool:
        """Whether instance ``index`` has any limit here (an ``own`` capacity of an instance that
        declared none is not "unlimited", it is unknown)."""
        return not self.own or self.tokens_of(workload, index) is not None or \
            self.entries_of(workload, index) is not None


def own_model(workload: Workload, index: int) -> str:
    """The cache model that mirrors recorded instance ``index``: ``entries`` where one entry holds
    one sequence (the MLX engine, mlx-lm), else ``blocks``."""
    facts = _facts(workload, index)
    return "entries" if facts is not None and facts.cache_unit in SEQUENCE_UNITS else "blocks"


def _facts(workload: Workload, index: int) -> InstanceFacts | None:
    ids = workload.recorded_ids()
    return workload.instances[ids[index]] if index < len(ids) else None


def _kv_bytes_per_token(workload: Workload, index: int) -> int:
    facts = _facts(workload, index)
    value = (facts.kv_bytes_per_token if facts else None) or workload.kv_bytes_per_token
    if not value:
        raise ConfigError("--capacity-bytes needs the KV bytes per token: the window's instances sent no heartbeat "
                          "with it; give --kv-bytes-per-token")
    return value


def _prefill_rate(workload: Workload, index: int) -> float | None:
    facts = _facts(workload, index)
    return (facts.prefill_tokens_per_s if facts else None) or workload.prefill_tokens_per_s


# --- routing --------------------------------------------------------------------------------------
class _Load:
    """Requests in flight per instance, by their end times."""

    def __init__(self, instances: int):
        self.counts = [0] * instances
        self._ends: list[tuple[float, int]] = []

    def advance(self, now_ms: float) -> None:
        while self._ends and self._ends[0][0] <= now_ms:
            self.counts[heapq.heappop(self._ends)[1]] -= 1

    def start(self, instance: int, end_ms: float | None) -> None:
        if end_ms is not None:
            self.counts[instance] += 1
            heapq.heappush(self._ends, (end_ms, instance))

    def least(self, order: int, among: list[int] | None = None) -> int:
        """The least loaded instance; ties to the first after ``order`` in round-robin order."""
        n = len(self.counts)
        candidates = among if among is not None else range(n)
        return min(candidates, key=lambda i: (self.counts[i], (i - order) % n))


def assign(workload: Workload, instances: int, route: str) -> list[int]:
    """Instance index per request for a route that does not look at caches."""
    requests = workload.requests
    if route == "recorded":
        index = {name: i for i, name in enumerate(workload.recorded_ids())}
        return [index[r.instance] for r in requests]
    if route == "round_robin":
        return [i % instances for i in range(len(requests))]
    load, sticky, chosen = _Load(instances), {}, []
    for i, r in enumerate(requests):
        load.advance(r.t_ms)
        if route == "session" and r.session is not None and r.session in sticky:
            target = sticky[r.session]
        else:
            target = load.least(i)
            if route == "session" and r.session is not None:
                sticky[r.session] = target
        load.start(target, r.end_ms)
        chosen.append(target)
    return chosen


# --- caches ---------------------------------------------------------------------------------------
def _leading_run(cache, blocks: tuple[int, ...]) -> int:
    run = 0
    for block in blocks:
        if block not in cache:
            break
        run += 1
    return run


def _lookup_and_touch(cache: Any, blocks: tuple[int, ...], capacity: int | None) -> int:
    """The leading run of ``blocks`` present in ``cache``, then insert or refresh them (last first: the
    head ends most recent) and evict to ``capacity``. One pass: refreshing never evicts, so each
    block's presence seen on the way is its presence at arrival."""
    if capacity is None:
        run = _leading_run(cache, blocks)
        cache.update(blocks)
        return run
    move, run, j = cache.move_to_end, len(blocks), len(blocks)
    for block in reversed(blocks):
        j -= 1
        if block in cache:
            move(block)
        else:
            cache[block] = None
            run = j
    pop = cache.popitem
    for _ in range(len(cache) - capacity):
        pop(last=False)
    return run


class EntryCache:
    """``--cache-model entries``: LRU over whole entries, as the MLX engine's and mlx-lm's prompt caches
    keep them. Each request stores one entry (its prompt's blocks, holding input + output tokens); a
    hit is the leading run of its blocks held by any live entry, and refreshes that entry; an entry
    whose blocks begin the new one is dropped (superseded); capacity counts every entry's tokens, so a
    prefix shared by two entries is counted twice. Chained ids make "entry E holds block b" mean "E
    begins with the prefix b names", so a block's presence is a reference count."""

    def __init__(self, capacity: int | None, max_entries: int | None = None):
        self.capacity = capacity
        self.max_entries = max_entries
        self.tokens = 0
        self._entries: OrderedDict[int, tuple[tuple[int, ...], int]] = OrderedDict()  # key: last block id
        self._refs: dict[int, int] = {}
        self._owner: dict[int, int] = {}  # block -> key of the latest entry stored with it

    def lookup_and_store(self, blocks: tuple[int, ...], tokens: int) -> int:
        """The hit (leading run), then the request's own entry stored."""
        run = _leading_run(self._refs, blocks)
        if run:
            owner = self._owner.get(blocks[run - 1])
            if owner in self._entries:
                self._entries.move_to_end(owner)
        if not blocks:
            return run
        for block in blocks:
            if block in self._entries:
                self._drop(block)  # superseded: the new entry begins with it
        key = blocks[-1]
        self._entries[key] = (blocks, tokens)
        self.tokens += tokens
        for block in blocks:
            self._refs[block] = self._refs.get(block, 0) + 1
            self._owner[block] = key
        # The MLX engine's order: over the entry limit first, then over the byte (token) limit.
        while self.max_entries is not None and len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
        while self.capacity is not None and self.tokens > self.capacity and self._entries:
            self._drop(next(iter(self._entries)))
        return run

    def _drop(self, key: int) -> None:
        blocks, tokens = self._entries.pop(key)
        self.tokens -= tokens
        for block in blocks:
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
            else:
                del self._refs[block]


def _hits_static(workload: Workload, chosen: list[int], capacities: list[int | None],
                 models: list[str], entries: list[int | None]) -> list[int]:
    """Hit blocks per request, each instance's cache (of its model) replayed on its own requests."""
    caches: list[Any] = [
        EntryCache(None if cap is None else cap * workload.block_size, limit) if model == "entries"
        else set() if cap is None else OrderedDict()
        for cap, model, limit in zip(capacities, models, entries, strict=True)]
    return [caches[k].lookup_and_store(r.blocks, r.input_length + r.output_length) if models[k] == "entries"
            else _lookup_and_touch(caches[k], r.blocks, capacities[k])
            for r, k in zip(workload.requests, chosen, strict=True)]


def _saved(hit_blocks: int, input_length: int, block: int, model: str) -> int:
    """Prompt tokens a hit of ``hit_blocks`` saves: the default model's rule, or the MLX engine's
    (whole blocks, at most the prompt less one token) for the entries model."""
    if model != "entries":
        return min(hit_blocks * block, input_length)
    return max(0, min(min(hit_blocks, input_length // block) * block, input_length - 1)) if hit_blocks else 0


def _hits_prefix(workload: Workload, capacities: list[int | None]) -> tuple[list[int], list[int]]:
    """``prefix`` routing: the choice depends on every cache's contents at arrival."""
    n = len(capacities)
    caches: list[Any] = [set() if cap is None else OrderedDict() for cap in capacities]
    load, hits, chosen = _Load(n), [], []
    for i, r in enumerate(workload.requests):
        load.advance(r.t_ms)
        floor = min(load.counts)
        eligible = [k for k in range(n) if load.counts[k] <= floor + PREFIX_LOAD_SLACK]
        runs = {k: _leading_run(caches[k], r.blocks) for k in eligible}
        best = max(runs.values())
        target = load.least(i, [k for k in eligible if runs[k] == best])
        load.start(target, r.end_ms)
        _lookup_and_touch(caches[target], r.blocks, capacities[target])
        hits.append(best)
        chosen.append(target)
    return hits, chosen


# --- results --------------------------------------------------------------------------------------
def replay(workload: Workload, capacity: Capacity, instances: int, route: str,
           chosen: list[int] | None = None, model: str = "blocks") -> dict[str, Any]:
    """One combination's result (schema in docs/whatif.md). ``chosen``: a static route's assignment;
    ``model``: ``blocks`` (the default model), ``entries`` (``EntryCache``) or ``own`` (per recorded
    instance, the model that mirrors it: ``own_model``)."""
    capacities = [capacity.blocks(workload, k) for k in range(instances)]
    models = [own_model(workload, k) if model == "own" else model for k in range(instances)]
    if route == "prefix":
        if set(models) != {"blocks"}:
            raise ConfigError("--route prefix is simulated with the blocks cache model only")
        hits, chosen = _hits_prefix(workload, capacities)
    else:
        chosen = chosen if chosen is not None else assign(workload, instances, route)
        hits = _hits_static(workload, chosen, capacities, models,
                            [capacity.entries_of(workload, k) for k in range(instances)])
    block = workload.block_size
    per = [{"input_tokens": 0, "saved": 0, "requests": 0, "ttft_saved_ms": 0.0} for _ in range(instances)]
    rates = [_prefill_rate(workload, k) for k in range(instances)]
    for r, h, k in zip(workload.requests, hits, chosen, strict=True):
        saved = _saved(h, r.input_length, block, models[k])
        row = per[k]
        row["input_tokens"] += r.input_length
        row["saved"] += saved
        row["requests"] += 1
        if rates[k]:
            row["ttft_saved_ms"] += saved / rates[k] * 1000
    names = workload.recorded_ids() if route == "recorded" else [f"sim-{k}" for k in range(instances)]
    tokens = capacity.tokens_of(workload, 0) if instances else capacity.tokens
    total_in, total_saved = sum(p["input_tokens"] for p in per), sum(p["saved"] for p in per)
    ttft_known = all(rates[k] for k in range(instances) if per[k]["requests"])
    ttft_total = round(sum(p["ttft_saved_ms"] for p in per), 3) if ttft_known else None
    return {
        "capacity_tokens": tokens, "capacity_bytes": capacity.bytes, "instances": instances, "route": route,
        "requests": len(workload.requests), "input_tokens": total_in,
        "token_hit_ratio": round(total_saved / total_in, 6) if total_in else None,
        "prefill_tokens_saved": total_saved,
        "ttft_saved_ms": ttft_total,
        "ttft_saved_ms_mean": None if ttft_total is None or not workload.requests
        else round(ttft_total / len(workload.requests), 3),
        "per_instance": [{
            "instance": names[k], "capacity_tokens": capacity.tokens_of(workload, k),
            "capacity_entries": capacity.entries_of(workload, k) if models[k] == "entries" else None,
            "cache_model": models[k], "requests": p["requests"],
            "input_tokens": p["input_tokens"], "prefill_tokens_saved": p["saved"],
            "token_hit_ratio": round(p["saved"] / p["input_tokens"], 6) if p["input_tokens"] else None,
            "prefill_tokens_per_s": rates[k],
            "ttft_saved_ms": round(p["ttft_saved_ms"], 3) if rates[k] else None,
        } for k, p in enumerate(per)],
    }


def recorded(workload: Workload) -> dict[str, Any] | None:
    """What the engines actually achieved over the same requests (recorded traffic only)."""
    known = [r for r in workload.requests if r.cached_tokens is not None]
    if not known:
        return None
    total_in = sum(r.input_length for r in known)
    saved = sum(min(r.cached_tokens, r.input_length) for r in known)
    return {"requests": len(known), "input_tokens": total_in, "prefill_tokens_saved": saved,
            "token_hit_ratio": round(saved / total_in, 6) if total_in else None,
            "instances": {name: {**vars(facts)} for name, facts in sorted(workload.instances.items())}}


def grid(workload: Workload, capacities: list[Capacity], instances: int | None, routes: list[str],
         model: str = "blocks") -> dict[str, Any]:
    """Every combination of ``capacities`` × ``routes`` on ``instances`` (default: as recorded, or 1)."""
    if workload.source == "store" and not workload.requests:
        raise ConfigError("nothing to replay: no request in this window (and slice) has a prompt fingerprint"
                          + (f" ({workload.skipped} without one)" if workload.skipped else ""))
    recorded_n = len(workload.instances)
    n = instances if instances is not None else max(1, recorded_n)
    if n < 1:
        raise ConfigError(f"--instances must be 1 or more, received {n}")
    for route in routes:
        if route not in ROUTES:
            raise ConfigError(f"--route must be among {', '.join(ROUTES)}, received {route!r}")
        if route == "recorded" and (workload.source != "store" or n != recorded_n):
            raise ConfigError("--route recorded replays the store's own placement: it needs recorded traffic and "
                              f"--instances equal to the {recorded_n} instances that served it")
        if route in _LOAD_ROUTES and any(r.end_ms is None for r in workload.requests):
            raise ConfigError(f"--route {route} weighs requests in flight, and this trace gives no end times: "
                              "give --tpot-ms to estimate them (arrival + output_length x TPOT)")
    results = []
    for route in routes:
        chosen = assign(workload, n, route) if route in _STATIC_ROUTES else None
        for capacity in capacities:
            results.append(replay(workload, capacity, n, route, chosen, model))
    return {"source": workload.source, "block_size": workload.block_size, "cache_model": model,
            "requests": len(workload.requests), "skipped_requests": workload.skipped,
            "recorded": recorded(workload), "results": results}
