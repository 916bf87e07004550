"""What the engine records while it works: plain numbers in plain lists, turned into spans later.

The overhead rule (DESIGN §3): the generation loop only appends ``perf_counter_ns()`` readings and
counters to these objects. Spans are built from finished records elsewhere (the exporter process,
or the telemetry thread for embedders; ``tokentrace.engine_shim.mlx.spans``), with explicit timestamps
converted by a ``Clock``. Records hold plain data only (ints, strings, lists), so they pickle
cheaply and never keep KV-cache arrays alive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokentrace.engine_shim.mlx.prompts import Prompt


class Clock:
    """Maps ``perf_counter_ns()`` readings (monotonic, cheap) to Unix epoch nanoseconds for spans.

    ``perf_counter`` is a system-wide monotonic clock, so an offset measured in one process holds
    for readings taken in another on the same machine (the exporter process uses the engine's).
    """

    def __init__(self, offset_ns: int | None = None) -> None:
        if offset_ns is not None:
            self.offset_ns = offset_ns
            return
        # Read both clocks back to back a few times and keep the tightest pair.
        best = None
        for _ in range(5):
            before = time.perf_counter_ns()
            wall = time.time_ns()
            after = time.perf_counter_ns()
            if best is None or after - before < best[0]:
                best = (after - before, wall - (before + after) // 2)
        self.offset_ns = best[1]

    def epoch(self, perf_ns: int) -> int:
        """The Unix time in nanoseconds of a ``perf_counter_ns()`` reading."""
        return perf_ns + self.offset_ns


@dataclass
class LookupRecord:
    """What a prompt-cache lookup found."""

    reused: int  #: prompt tokens reused
    kind: str  #: contract match kind (exact, prefix, none)
    entries: int  #: cache entries at lookup
    nbytes: int  #: cache bytes at lookup
    entry_tokens: list[int] | None = None  #: tokens of the entry reused (its fingerprint), if any


@dataclass
class EvictionRecord:
    """An entry pushed out of the prompt cache."""

    tokens: list[int]  #: tokens the entry held (its fingerprint)
    nbytes: int  #: bytes it held
    request_id: str  #: request whose tokens they were
    reason: str  #: contract evict reason
    entries_after: int  #: entries left after the eviction
    bytes_after: int  #: bytes left after the eviction


@dataclass
class InsertRecord:
    """An entry stored in the prompt cache and what that evicted."""

    tokens: list[int]  #: tokens stored (prompt and generated)
    nbytes: int  #: bytes stored
    entries_after: int  #: entries after the insert and its evictions
    bytes_after: int  #: bytes after the insert and its evictions
    max_entries: int  #: entry limit in force
    max_bytes: int  #: byte limit in force
    evictions: list[EvictionRecord] = field(default_factory=list)  #: in the order they happened
    #: a distributed rank 0: the rank whose bytes the byte limit and these byte figures count (the one
    #: holding the most KV per token); None on one process (its own)
    limit_rank: int | None = None


@dataclass(eq=False)
class RequestRecord:
    """One request, from arrival to its last byte. The HTTP side fills the edges, the generation
    thread the middle; they never write the same field."""

    request_id: str  #: X-Request-Id or generated
    endpoint: str  #: HTTP path
    arrival_ns: int  #: perf_counter_ns at arrival
    session_id: str | None = None  #: X-Session-Id or the `user` field
    model: str | None = None  #: model the request named
    max_tokens: int | None = None  #: requested completion limit
    streamed: bool = False  #: SSE response
    # cold start
    load_id: str | None = None  #: the model.load waited on, when the request waited
    load_wait_start_ns: int = 0  #: start of the wait for the model (0: no wait)
    load_wait_end_ns: int = 0  #: model ready
    # prompt and queue
    prompt: Prompt | None = None  #: tokenized prompt with segments
    enqueue_ns: int = 0  #: handed to the scheduler
    queue_depth: int = 0  #: requests already waiting at enqueue
    queue_running: int = 0  #: sequences running at enqueue
    max_batch: int = 0  #: admission limit of the engine
    admit_ns: int = 0  #: left the FIFO for a batch slot (0: never admitted)
    # prompt cache lookup
    lookup: LookupRecord | None = None  #: what the prompt cache found
    lookup_end_ns: int = 0  #: lookup done, prefill can start
    # prefill chunks, parallel lists
    chunk_start_ns: list[int] = field(default_factory=list)  #: start of the step that ran the chunk
    chunk_end_ns: list[int] = field(default_factory=list)  #: end of that step
    chunk_offset: list[int] = field(default_factory=list)  #: prompt index of the chunk's first token
    chunk_tokens: list[int] = field(default_factory=list)  #: tokens in the chunk
    chunk_batch: list[int] = field(default_factory=list)  #: sequences prefilling in the same step
    # decode
    token_ns: list[int] = field(default_factory=list)  #: when each generated token was ready
    finish_ns: int = 0  #: generation finished or was cancelled
    finish_reason: str | None = None  #: stop, length, cancelled, error
    # prompt cache insert
    insertion: InsertRecord | None = None  #: the entry stored and what it evicted
    insert_start_ns: int = 0  #: insert began
    insert_end_ns: int = 0  #: insert done
    # response
    first_content_ns: int = 0  #: the first response chunk carrying answer text was sent (0: none)
    end_ns: int = 0  #: last byte sent
    http_status: int = 200  #: status sent
    error_type: str | None = None  #: error class when the request failed
    client_disconnected: bool = False  #: the client went away before the last token
    first_response: bool = False  #: this was the instance's first answered request

    @property
    def completion_tokens(self) -> int:
        """Tokens generated."""
        return len(self.token_ns)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens (0 before tokenization)."""
        return self.prompt.length if self.prompt is not None else 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache."""
        return self.lookup.reused if self.lookup is not None else 0


@dataclass(eq=False)
class StepWindow:
    """Consecutive engine steps, columnar (docs/telemetry.md, "Columnar encoding of engine.steps")."""

    start_ns: list[int] = field(default_factory=list)  #: perf_counter_ns at each step's start
    duration_ns: list[int] = field(default_factory=list)  #: each step's duration
    prefill_seqs: list[int] = field(default_factory=list)  #: sequences prefilling in each step
    decode_seqs: list[int] = field(default_factory=list)  #: sequences decoding in each step
    prefill_tokens: list[int] = field(default_factory=list)  #: prompt tokens computed in each step
    decode_tokens: list[int] = field(default_factory=list)  #: tokens generated in each step
    members: list[str] = field(default_factory=list)  #: request ids: prefilling then decoding, per step
    #: A distributed engine's rank, per step: its compute, its waits on the ring and the CPU its
    #: process used in those waits, in ns (steps it timed; -1 for the others, which it did not).
    #: Empty for one process.
    compute_ns: list[int] = field(default_factory=list)
    ring_wait_ns: list[int] = field(default_factory=list)
    ring_wait_cpu_ns: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.start_ns)


@dataclass(eq=False)
class LoadRecord:
    """One model load: its stages and outcome."""

    load_id: str  #: id cited by llm.load_wait spans
    path: str  #: model directory or repo
    lazy: bool  #: triggered by a request (--lazy-load)
    start_ns: int  #: load began
    end_ns: int = 0  #: load finished (ready or failed)
    stages: list[tuple[str, int, int, dict[str, Any]]] = field(default_factory=list)
    """(span name, start ns, end ns, extra attributes) per completed stage."""
    error: str | None = None  #: why the load failed


@dataclass(eq=False)
class LifecycleRecord:
    """A lifecycle event that rides on an ``instance.lifecycle`` span."""

    event: str  #: contract event name
    at_ns: int  #: perf_counter_ns when it happened


@dataclass(eq=False)
class HeartbeatRecord:
    """Instance state at one moment."""

    at_ns: int  #: perf_counter_ns of the reading
    queue_depth: int  #: requests waiting
    running: int  #: sequences running
    max_batch: int  #: admission limit
    cache_entries: int  #: prompt-cache entries
    cache_bytes: int  #: prompt-cache bytes
    cache_max_entries: int  #: entry limit
    cache_max_bytes: int  #: byte limit
    kv_bytes_per_token: int  #: from the model config
    memory_bytes: int  #: memory the engine holds
    #: the GPU's recommended working set (Apple silicon), 0 where MLX knows none (its CPU backend)
    memory_limit_bytes: int = 0
    #: a distributed rank 0's ring not moving for half its --rank-timeout: (state, reason, ms so far,
    #: the ids of the requests it holds open, the ranks its diagnosis names); None while it moves
    stall: tuple[str, str, int, list[str], tuple[int, ...]] | None = None
    #: a distributed rank 0's declaration of its stall watch: the --rank-timeout it watches with, in ms;
    #: 0 while none runs (--rank-timeout 0, the ring not joined yet): its "no stall" then means nothing.
    #: None: not a distributed rank 0 (no ring to watch)
    stall_watch_ms: int | None = None
    #: a distributed rank 0 with a prompt cache: the rank whose bytes its cache's bytes and byte limit
    #: count (the one holding the most KV per token); None: one process (its own bytes)
    cache_limit_rank: int | None = None
