"""The generation thread: FIFO admission, continuous batching with chunked prefill, the prompt
cache, and the numbers the telemetry needs.

Built on mlx-lm's ``BatchGenerator`` through its public methods only (``insert``, ``next``,
``remove``): one ``next()`` is one engine step — a decode step for every generating sequence plus
one prefill chunk (``prefill_step_size`` tokens) for every prefilling one (notes §3). The scheduler
owns the queue in front of it (so queue time is really queue time), admits at most ``max_batch``
sequences, looks prompts up in its own ``PrefixCache`` and stores finished sequences there.

Everything here runs on one thread. Other threads only call ``submit``, ``cancel``,
``request_load`` and read the counters; they hand over through deques and an event.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from tokentrace.contract import MATCH_NONE
from tokentrace.engine_shim.mlx import cluster
from tokentrace.engine_shim.mlx.jobs import Job, SamplingObjects
from tokentrace.engine_shim.mlx.loader import LoadOptions, Runtime, load_runtime, new_load_record
from tokentrace.engine_shim.mlx.prompt_cache import Lookup, PrefixCache, insert_record, is_cacheable, lookup_record
from tokentrace.engine_shim.mlx.records import HeartbeatRecord, LoadRecord, StepWindow
from tokentrace.engine_shim.mlx.settings import EngineSettings

log = logging.getLogger(__name__)

#: A stall report names at most this many open requests.
MAX_OPEN_REPORTED = 256
#: What a rank 0 without its ranks' processes at hand (under mlx.launch) and without a control
#: connection from them says of a stalled ring.
_UNTOLD = cluster.UNTOLD
#: A ring operation still waiting this long after a rank was declared lost waits on the lost rank:
#: its open requests fail then (``Scheduler._watch``). Longer than the ring takes to fail a send or
#: receive to a closed socket, when it does, so that the generation thread's own error path runs first.
LOST_GRACE_S = 1.0
#: A window of engine.steps closes after this many steps or this long, whichever comes first.
WINDOW_STEPS = 256
WINDOW_NS = 1_000_000_000

#: Delivery of one step's results: (job, token, finish_reason or None) per generating sequence.
Deliver = Callable[[list[tuple[Job, int, "str | None"]]], None]
#: Where finished records go (the telemetry thread's queue); must not block or raise.
Submit = Callable[[Any], None]
#: Told True when a prefill starts and False once no admitted sequence is still waiting for its first
#: token (``Telemetry.prefilling``): telemetry holds its work back meanwhile, so that it does not land
#: in a request's time to first token. Must not block or raise.
PrefillGate = Callable[[bool], None]

LOAD_IDLE, LOAD_RUNNING, LOAD_READY, LOAD_FAILED = "not_loaded", "loading", "ready", "failed"
#: What rank 0 of a distributed engine tells the other ranks before each iteration (cluster.py).
MSG_STEP, MSG_IDLE, MSG_STOP = "step", "idle", "stop"
#: Rank 0's first message under mlx.launch: where its control plane listens (cluster.ControlPlane).
MSG_CONTROL = "control"


class Scheduler:
    """Owns the model, the ``BatchGenerator`` and the prompt cache; run ``run()`` on its own thread."""

    def __init__(self, settings: EngineSettings, deliver: Deliver, submit: Submit,
                 on_load_done: Callable[[LoadRecord], None] = lambda record: None,
                 prefill_gate: PrefillGate | None = None):
        self.settings = settings
        self.max_batch = settings.max_batch
        self.prompt_concurrency = settings.prompt_concurrency or settings.max_batch
        self.runtime: Runtime | None = None
        self.cache: PrefixCache | None = None
        self.load_state = LOAD_IDLE
        self.load_record: LoadRecord | None = None
        self.instrumentation_errors = 0
        self._deliver = deliver
        self._submit = submit
        self._on_load_done = on_load_done
        self._prefill_gate = prefill_gate
        self._gate_closed = False
        self._inbox: deque[Job] = deque()
        self._cancels: deque[Job] = deque()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._load_lock = threading.Lock()
        self._generator: Any = None
        self._sampling: SamplingObjects | None = None
        self._window = StepWindow()
        #: A distributed engine's rank 0: the channel to the other ranks and what they must replay
        #: before the next step (inserts, removals, cache stores; follower.py).
        self._channel: cluster.Channel | None = None
        self._ops: list[tuple] = []
        self._timer: cluster.StepTimer | None = None  #: a pipeline rank's timer of some steps
        self._time_next = False  #: whether the next step is timed (on every rank: an op tells them)
        #: Why this distributed instance cannot serve (a rank lost); None while it can.
        self.degraded: str | None = None
        self._lost_ns = 0  #: perf_counter_ns when a rank was declared lost (rank_lost); 0 before
        #: Why its ring has not moved for --rank-timeout (a rank stopped stepping); None while it moves.
        self.stalled: str | None = None
        #: (error code, reason) of a stalled ring: which rank, and whether it is alive (cli.py sets it:
        #: the ranks it started, or under mlx.launch the control plane's connections).
        self.diagnose: Callable[[], cluster.Diagnosis] | None = None
        #: Under mlx.launch, rank 0's control plane: its address goes to the other ranks at load.
        self.control: cluster.ControlPlane | None = None
        #: Ring operations (hand-overs and steps) this rank completed: the control plane compares it
        #: with the other ranks' counts to tell which one lags.
        self.ring_ops = 0
        self._memory_bytes: int | None = None  #: what the last heartbeat read of MLX's active memory
        self._ring_since = 0  # perf_counter_ns when the current ring operation began; 0 outside one
        #: A distributed rank 0's stall watch, as its heartbeats declare it (HeartbeatRecord.stall_watch_ms):
        #: 0 until the watchdog runs, None on one process.
        self._watch_ms: int | None = 0 if settings.distributed else None
        self._abandoned: list[Job] = []
        #: A distributed rank 0's cache: the rank whose bytes its byte limit counts (``_cache_scale``),
        #: as its heartbeats and inserts declare it; None on one process.
        self.limit_rank: int | None = None

    # --- called from other threads -------------------------------------------------------------
    def request_load(self, lazy: bool) -> LoadRecord:
        """Start loading the model unless a load already started; returns that load's record.

        The record is created here, on the caller's thread, so a request that triggers a lazy load
        starts waiting inside the load's window.
        """
        with self._load_lock:
            if self.load_record is None:
                self.load_record = new_load_record(self.settings.model, lazy)
                self.load_state = LOAD_RUNNING
                self._wake.set()
            return self.load_record

    def submit(self, job: Job) -> None:
        """Queue ``job`` (FIFO) and stamp its enqueue time, queue depth and running count."""
        record = job.record
        record.queue_depth = len(self._waiting) + len(self._inbox)
        record.queue_running = len(self._running)
        record.max_batch = self.max_batch
        record.enqueue_ns = time.perf_counter_ns()
        self._inbox.append(job)
        self._wake.set()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop ``job`` wherever it is; it finishes with ``reason`` (cancelled, or stop for a stop string)."""
        job.cancel_reason = reason
        self._cancels.append(job)
        self._wake.set()

    def stop(self) -> None:
        """Ask the loop to finish (pending jobs are cancelled)."""
        self._stopping = True
        self._wake.set()

    @property
    def unavailable(self) -> str | None:
        """Why requests are refused now (a distributed instance degraded or stalled); None: they are not."""
        return self.degraded or self.stalled

    def rank_lost(self, reason: str) -> None:
        """A distributed engine lost a rank (its process exited, or the ring broke): from now on
        every request fails with ``reason`` (the running ones as soon as their step fails)."""
        if self.degraded is None:
            self._lost_ns = time.perf_counter_ns()
            self.degraded = reason
            log.error("distributed instance degraded: %s; requests are refused until it is restarted", reason)
        self._wake.set()

    def heartbeat(self, read_memory: bool = True) -> HeartbeatRecord:
        """The instance's state now (plain reads; safe from any thread). ``read_memory=False``: the
        memory the last heartbeat read (the watchdog's report while the generation thread is inside
        MLX, blocked on the ring, calls nothing of MLX's)."""
        import mlx.core as mx

        runtime, cache = self.runtime, self.cache
        if read_memory or self._memory_bytes is None:
            self._memory_bytes = mx.get_active_memory()
        return HeartbeatRecord(
            at_ns=time.perf_counter_ns(),
            queue_depth=len(self._waiting) + len(self._inbox),
            running=len(self._running),
            max_batch=self.max_batch,
            cache_entries=len(cache) if cache is not None else 0,
            # A node's own bytes and its own bytes at the limit (prompt_cache.py: on a cluster the
            # limit counts the rank holding the most KV per token), as every rank reports them.
            cache_bytes=cache.own(cache.nbytes) if cache is not None else 0,
            cache_max_entries=self.settings.cache_max_entries,
            cache_max_bytes=cache.own(self.settings.cache_max_bytes) if cache is not None
            else self.settings.cache_max_bytes,
            kv_bytes_per_token=runtime.kv_bytes_per_token if runtime is not None else 0,
            memory_bytes=self._memory_bytes,
            memory_limit_bytes=runtime.memory_limit_bytes if runtime is not None else 0,
            stall=self._stall_report(),
            stall_watch_ms=self._watch_ms,
            cache_limit_rank=self.limit_rank,
        )

    def _stall_report(self) -> tuple[str, str, int, list[str], tuple[int, ...]] | None:
        """A distributed rank 0 whose ring operation has lasted half its --rank-timeout: what its
        watchdog would say, and the requests it holds open (the live answer, before the deadline
        fails them; issue 46). None while the ring moves."""
        since = self._ring_since
        if not since or self.settings.rank_timeout <= 0:
            return None
        waited = time.perf_counter_ns() - since
        if waited < self.settings.rank_timeout * 1e9 / 2:
            return None
        code, reason, ranks = self.diagnose() if self.diagnose is not None else _UNTOLD
        try:
            held = [job.record.request_id for job in list(self._running.values()) if not job.abandoned]
            held += [job.record.request_id for job in list(self._waiting)]
        except RuntimeError:  # changed while read: the next report has them
            held = []
        return code, reason, waited // 1_000_000, held[:MAX_OPEN_REPORTED], ranks

    # --- the generation thread -----------------------------------------------------------------
    def run(self) -> None:
        """The loop: load when asked, then admit, step and deliver until ``stop()``."""
        if not self.settings.lazy_load:
            self.request_load(lazy=False)
        while not self._stopping:
            try:
                self._iterate()
            except Exception as exc:
                if self._channel is not None and cluster.RING_ERROR_MARK in str(exc):
                    reason = self.diagnose().reason if self.diagnose is not None else "a rank is unreachable"
                    self.rank_lost(f"{reason} ({exc})")
                    self._fail_running("RankLost")
                    continue
                # Whatever broke (an mlx error in admission, a cache insert), the thread must live
                # on: a dead generation thread means every later request hangs.
                log.exception("generation step failed and no single request could be blamed; failing the "
                              "running requests and serving on with a fresh batch")
                self._fail_running()
        self._shutdown()

    def _iterate(self) -> None:
        if self.load_state == LOAD_RUNNING:
            self._load()
            return
        self._drain()
        if self._running:
            self._time_next = self._timer is not None and self._timer.due(self._fresh_phase())
            if self._time_next:
                self._ops.append(("time",))  # every rank times this step (follower.py)
            self._sync(MSG_STEP)
            self._step()
            if self._gate_closed and not self._prefilling():
                self._set_gate(False)
            return
        if self._gate_closed:
            self._set_gate(False)
        self._flush_window()
        self._sync(MSG_IDLE)
        self._wake.clear()
        if not (self._inbox or self._cancels or self._stopping or self.load_state == LOAD_RUNNING):
            self._wake.wait(1.0)

    def _load(self) -> None:
        record = self.load_record
        try:
            settings = self.settings
            placement = (cluster.Placement(settings.parallel, cluster.parse_split(settings.split))
                         if settings.distributed else None)
            runtime = load_runtime(record, LoadOptions(
                settings.adapter_path, settings.trust_remote_code, settings.chat_template,
                settings.use_default_chat_template, freeze_heap=True, placement=placement))
        except Exception as exc:
            log.error("model load failed: %s", exc)
            self.load_state = LOAD_FAILED
        else:
            self._install(runtime)
            self.load_state = LOAD_READY
        self._emit(record)
        if self.load_state == LOAD_READY:
            self._emit(self.heartbeat())  # the first state report: limits and KV bytes per token
        self._on_load_done(record)
        if self.load_state == LOAD_READY and self.control is not None and self._channel is not None:
            # Setup, not telemetry: where the other ranks connect to rank 0's control plane (follower.py).
            with self._on_ring():
                self._channel.send((MSG_CONTROL, self.control.setup()))

    def _install(self, runtime: Runtime) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.runtime = runtime
        if runtime.group is not None and runtime.group.size() > 1:
            self._channel = cluster.Channel(runtime.group)
            self._timer = cluster.step_timer(runtime, self.settings.timed_step_every, self.settings.timed_step_gap)
            # Also with --rank-timeout 0 (no stall watch): a lost rank must never leave a request hanging.
            threading.Thread(target=self._watch, name="tokentrace-ring-watch", daemon=True).start()
            if self.settings.rank_timeout > 0:
                self._watch_ms = max(1, round(self.settings.rank_timeout * 1000))  # never 0: that says "off"
        self._sampling = SamplingObjects(runtime.eos_token_ids, int(runtime.config["vocab_size"]),
                                         runtime.tokenizer.encode("\n"))
        if self.settings.cache_max_entries <= 0 or self.settings.cache_max_bytes <= 0:
            log.info("prompt cache off (--cache-max-entries/--cache-max-bytes 0); lookups still report fingerprints")
        elif is_cacheable(make_prompt_cache(runtime.model)):
            self.cache = PrefixCache(self.settings.cache_max_entries, self.settings.cache_max_bytes,
                                     scale=self._cache_scale(runtime))
        else:
            log.warning("prompt cache disabled: the model's caches are not plain KVCache layers")
        self._new_generator()

    def _cache_scale(self, runtime: Runtime) -> tuple[int, int]:
        """How this cache counts an entry's bytes (``PrefixCache.scale``): a distributed rank 0 decides
        for every rank, each caching its own share of the same entries, so its byte limit counts the
        rank holding the most KV per token (``cluster.limit_rank``; its heartbeats and inserts declare
        it); one process counts its own."""
        shares = runtime.kv_shares
        if shares and shares[runtime.group.rank()] > 0:
            self.limit_rank = cluster.limit_rank(shares)
        return cluster.limit_scale(runtime)

    def _new_generator(self) -> None:
        from mlx_lm.generate import BatchGenerator

        runtime = self.runtime
        # prefill_batch_size = completion_batch_size = max_batch: every admitted sequence starts
        # prefilling at the next step, so no hidden second queue forms inside the generator.
        self._generator = BatchGenerator(
            runtime.model,
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.max_batch,
            prefill_step_size=self.settings.prefill_step_size,
        )

    def _drain(self) -> None:
        while self._inbox:
            job = self._inbox.popleft()
            if self.load_state != LOAD_READY or self.unavailable is not None:
                self._reject(job)
            else:
                self._waiting.append(job)
        while self._cancels:
            self._cancel(self._cancels.popleft())
        while self._waiting and len(self._running) < self.max_batch and self._prefilling() < self.prompt_concurrency:
            self._admit(self._waiting.popleft())

    def _prefilling(self) -> int:
        """Admitted sequences without a first token yet (--prompt-concurrency bounds them, so the
        wait for a prefill slot is queue time, not prefill time)."""
        return sum(1 for job in self._running.values() if not job.record.token_ns)

    def _admit(self, job: Job) -> None:
        try:
            self._start(job)
        except Exception:  # this request cannot start (e.g. mlx refuses its prompt); others go on
            log.exception("cannot start request %s", job.record.request_id)
            job.record.error_type = "GenerationError"
            self._reject(job)

    def _reject(self, job: Job) -> None:
        """Finish a job that never ran as an error and tell its consumer."""
        if self.unavailable is not None:
            job.record.error_type = "InstanceDegraded"
        self._finish(job, "error", time.perf_counter_ns())
        self._deliver([(job, -1, "error")])

    def _start(self, job: Job) -> None:
        record = job.record
        record.admit_ns = time.perf_counter_ns()
        cache = self.cache
        lookup = cache.lookup(job.tokens) if cache is not None else Lookup(None, 0, MATCH_NONE, None, 0, 0)
        record.lookup_end_ns = time.perf_counter_ns()
        record.lookup = lookup_record(lookup)
        objects = self._sampling
        job.sampler = objects.sampler(job.sampling)
        job.uid = self._generator.insert(
            [job.tokens[lookup.reused:]],
            max_tokens=[job.max_tokens],
            caches=[lookup.layers] if lookup.layers is not None else None,
            all_tokens=[job.tokens[: lookup.reused]],
            samplers=[job.sampler],
            logits_processors=[objects.logits_processors(job)],
            stop_sequences=[objects.stop_sequences(job.sampling)],
        )[0]
        if self._channel is not None:
            self._ops.append(("insert", job.uid, record.request_id, job.tokens, lookup.reused,
                              lookup.entry.id if lookup.entry is not None and lookup.reused else None,
                              job.max_tokens, job.sampling))
        self._running[job.uid] = job
        if not self._gate_closed and self._prefill_gate is not None:
            self._set_gate(True)

    def _cancel(self, job: Job) -> None:
        now = time.perf_counter_ns()
        layers = tokens = None
        if job in self._waiting:
            self._waiting.remove(job)
        elif self._running.get(job.uid) is job:
            keep_cache = job.cancel_reason == "stop" and self.cache is not None
            removed = self._generator.remove([job.uid], return_prompt_caches=keep_cache)
            if self._channel is not None:
                self._ops.append(("remove", [job.uid], keep_cache))
            del self._running[job.uid]
            layers, tokens = removed.get(job.uid, (None, None))
        else:
            return  # already finished: its final delivery is on its way
        self._finish(job, job.cancel_reason, now, layers, tokens)
        self._deliver([(job, -1, job.cancel_reason)])

    def _fresh_phase(self) -> bool:
        """Whether a running sequence is in a phase (prefill until its first token, then decode)
        that no timed step has been asked for yet; each asks once (``StepTimer.due``)."""
        fresh = False
        for job in self._running.values():
            phase = "decode" if job.record.token_ns else "prefill"
            if phase not in job.timed_phases:
                job.timed_phases.add(phase)
                fresh = True
        return fresh

    def _step(self) -> None:
        timed = cluster.timed_step(self._timer, self._time_next)
        start = time.perf_counter_ns()
        # An exception here cannot be attributed to one sequence: run() fails the batch and serves on.
        with self._on_ring(), timed:  # a timed step's drains wait on the ring too: inside the watch
            prompt_responses, generated = self._generator.next()
            end = time.perf_counter_ns()
        faulty = self._faulty()
        try:
            self._record_step(start, end, prompt_responses, generated, timed.result)
        except Exception:
            self._count_instrumentation_error("recording a step")
        deliveries = []
        for response in generated:
            job = self._running.get(response.uid)
            if job is not None and job.abandoned:  # its client was told while the ring stood still
                if response.finish_reason is not None:
                    del self._running[response.uid]
                continue
            if job is None or job in faulty:
                continue
            reason = response.finish_reason
            if job.sampling.top_logprobs is not None:
                job.logprobs.append(_logprobs(response, job.sampling.top_logprobs))
            if reason is not None:
                del self._running[response.uid]
                self._finish(job, reason, end, response.prompt_cache, response.all_tokens)
            deliveries.append((job, response.token, reason))
        if faulty:
            deliveries += self._remove_faulty(faulty, end)
        if deliveries:
            self._deliver(deliveries)
        if self.stalled is not None:
            self._recovered()

    def _faulty(self) -> list[Job]:
        """Sequences whose own sampler or logits processors failed during the last step."""
        return [job for job in self._running.values()
                if job.fault is not None or getattr(job.sampler, "error", None) is not None]

    def _remove_faulty(self, faulty: list[Job], now: int) -> list[tuple[Job, int, str]]:
        """Take the failed sequences out of the batch with an error; the others go on."""
        self._generator.remove([job.uid for job in faulty])
        if self._channel is not None:
            self._ops.append(("remove", [job.uid for job in faulty], False))
        for job in faulty:
            self._running.pop(job.uid, None)
            error = job.fault or job.sampler.error
            log.error("request %s failed in generation (removed; the batch goes on): %s",
                      job.record.request_id, error)
            job.record.error_type = "GenerationError"
            self._finish(job, "error", now)
        return [(job, -1, "error") for job in faulty]

    def _record_step(self, start: int, end: int, prompt_responses: list, generated: list,
                     timing: tuple[int, int, int, int] | None = None) -> None:
        window, running = self._window, self._running
        members = window.members
        batch = len(prompt_responses)
        prefill_tokens = 0
        for response in prompt_responses:
            job = running[response.uid]
            record = job.record
            done = response.progress[0]
            tokens = done - job.prefilled
            record.chunk_start_ns.append(start)
            record.chunk_end_ns.append(end)
            record.chunk_offset.append(record.lookup.reused + job.prefilled)
            record.chunk_tokens.append(tokens)
            record.chunk_batch.append(batch)
            job.prefilled = done
            prefill_tokens += tokens
            members.append(record.request_id)
        for response in generated:
            record = running[response.uid].record
            record.token_ns.append(end)
            members.append(record.request_id)
        window.start_ns.append(start)
        # A timed step of a distributed rank was evaluated whole inside it: its duration is the timer's.
        window.duration_ns.append(timing[2] if timing else end - start)
        window.prefill_seqs.append(batch)
        window.decode_seqs.append(len(generated))
        window.prefill_tokens.append(prefill_tokens)
        window.decode_tokens.append(len(generated))
        if self._timer is not None:
            window.compute_ns.append(timing[0] if timing else -1)
            window.ring_wait_ns.append(timing[1] if timing else -1)
            window.ring_wait_cpu_ns.append(timing[3] if timing else -1)
        if len(window.start_ns) >= WINDOW_STEPS or end - window.start_ns[0] >= WINDOW_NS:
            self._flush_window()

    def _finish(self, job: Job, reason: str, now: int, layers: list | None = None,
                tokens: list[int] | None = None) -> None:
        record = job.record
        record.finish_ns = now
        record.finish_reason = reason
        if layers and tokens and self.cache is not None and reason in ("stop", "length"):
            try:
                self._store(job, layers, tokens)
            except Exception:  # the answer is complete; only its reuse is lost
                log.exception("cannot store request %s in the prompt cache", record.request_id)

    def _store(self, job: Job, layers: list, tokens: list[int]) -> None:
        import mlx.core as mx

        record = job.record
        record.insert_start_ns = time.perf_counter_ns()
        insertion = self.cache.insert(list(tokens), layers, record.request_id)
        # Materialise the entry's slices now (without waiting), so it stops pinning the batch's
        # whole KV arrays.
        mx.async_eval([array for layer in layers for array in (layer.keys, layer.values)])
        record.insert_end_ns = time.perf_counter_ns()
        record.insertion = insert_record(insertion, self.limit_rank)
        if self._channel is not None:
            self._ops.append(("store", job.uid, insertion.entry.id, [e.entry.id for e in insertion.evictions]))

    def _fail_running(self, code: str = "GenerationError") -> None:
        now = time.perf_counter_ns()
        failed = [job for job in self._running.values() if not job.abandoned]
        self._running.clear()
        for job in failed:
            job.record.error_type = code
            self._finish(job, "error", now)
        if self.runtime is not None:
            self._generator.close()
            self._new_generator()  # the failed one's batch state is unusable; the prompt cache stays
            if self._channel is not None:
                self._ops.append(("reset",))
        if failed:
            self._deliver([(job, -1, "error") for job in failed])

    def _set_gate(self, closed: bool) -> None:
        self._gate_closed = closed
        try:
            self._prefill_gate(closed)
        except Exception:
            self._count_instrumentation_error("telling telemetry about a prefill")

    def _flush_window(self) -> None:
        if self._window.start_ns:
            window, self._window = self._window, StepWindow()
            self._emit(window)

    def _emit(self, record: Any) -> None:
        try:
            self._submit(record)
        except Exception:
            self._count_instrumentation_error("handing a record to telemetry")

    def _count_instrumentation_error(self, what: str) -> None:
        self.instrumentation_errors += 1
        if self.instrumentation_errors == 1:
            log.exception("telemetry error while %s (counted; logged once)", what)

    def _shutdown(self) -> None:
        now = time.perf_counter_ns()
        pending = list(self._waiting) + list(self._inbox) + list(self._running.values())
        for job in pending:
            self._finish(job, "cancelled", now)
        if pending:
            self._deliver([(job, -1, "cancelled") for job in pending])
        self._flush_window()
        self._sync(MSG_STOP)
        if self._generator is not None:
            self._generator.close()

    def _sync(self, kind: str) -> None:
        """A distributed engine's rank 0: hand the other ranks what they must replay, then what
        comes next (a step, an idle wait, the end). Nothing once a rank is lost: the ring is gone."""
        if self._channel is None or self.degraded is not None:
            return
        ops, self._ops = self._ops, []
        with self._on_ring():
            self._channel.send((kind, ops))
        # After a step's hand-over, the batch must stay as announced until the step ran: _step
        # takes the failed sequences out after it.
        if self.stalled is not None and kind != MSG_STEP:
            self._recovered()

    @contextlib.contextmanager
    def _on_ring(self) -> Iterator[None]:
        """A ring operation (a hand-over, a step) in progress, for the watchdog."""
        if self._channel is None:
            yield
            return
        self._ring_since = time.perf_counter_ns()
        try:
            yield
        finally:
            self._ring_since = 0
            self.ring_ops += 1

    def _watch(self) -> None:
        """A distributed rank 0's watchdog: a ring operation past half --rank-timeout is reported at
        once (a heartbeat naming the requests it holds open), one past --rank-timeout stalls the
        instance (neither with --rank-timeout 0). A ring operation still waiting ``LOST_GRACE_S``
        after a rank was declared lost (its process exited: ``rank_lost``) fails the open requests
        then, whatever --rank-timeout: the ring waits on a rank that is gone, and does not always
        say so with an error (rank 0's hand-over to a killed rank was seen waiting on for good), so
        the generation thread's own error path may never run."""
        limit = int(self.settings.rank_timeout * 1e9)
        reported = 0
        while not self._stopping:
            time.sleep(min(0.25, self.settings.rank_timeout / 4) if limit > 0 else 0.25)
            since, now = self._ring_since, time.perf_counter_ns()
            if since and since != reported and 0 < limit < 2 * (now - since):
                reported = since
                self._emit(self.heartbeat(read_memory=False))  # the live report; later heartbeats repeat it
            if not since or self.stalled is not None:
                continue
            if self.degraded is not None and now - max(since, self._lost_ns) > LOST_GRACE_S * 1e9:
                code = (self.diagnose() if self.diagnose is not None else _UNTOLD).code
                self._stall(code, self.degraded)
            elif self.degraded is None and 0 < limit < now - since:
                code, reason, _ = self.diagnose() if self.diagnose is not None else _UNTOLD
                self._stall(code, f"{reason} ({self.settings.rank_timeout:g} s without a step)")

    def _stall(self, code: str, reason: str) -> None:
        """Called on the watchdog's thread while the generation thread is blocked on the ring: fail
        every open request now (no client hangs), and refuse new ones until the ring moves."""
        self.stalled = reason
        if self.degraded is not None:
            log.error("distributed instance's ring still waits on a lost rank (%s); its open requests fail", reason)
        else:
            log.error("distributed instance stalled: %s; its open requests fail, new ones are refused until it "
                      "steps again", reason)
        now = time.perf_counter_ns()
        failed = [job for job in list(self._running.values()) if not job.abandoned]
        for job in failed:
            job.abandoned = True
        self._abandoned.extend(failed)
        while self._waiting:
            failed.append(self._waiting.popleft())
        for job in failed:
            job.record.error_type = code
            self._finish(job, "error", now)
        if failed:
            self._deliver([(job, -1, "error") for job in failed])

    def _recovered(self) -> None:
        """The ring moved again after a stall: take the failed sequences out of the batch (their
        clients have their errors) and serve again."""
        stalled, self.stalled = self.stalled, None
        gone = [job for job in self._abandoned if self._running.get(job.uid) is job]
        self._abandoned.clear()
        if gone:
            self._generator.remove([job.uid for job in gone])
            self._ops.append(("remove", [job.uid for job in gone], False))
            for job in gone:
                del self._running[job.uid]
        log.warning("distributed instance steps again after a stall (%s); serving", stalled)


def _logprobs(response: Any, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(token, its logprob, the ``top`` most likely tokens with theirs) from one generated response;
    mlx-lm's logprobs are the log-softmax after logits processors, as mlx_lm.server reports them."""
    import mlx.core as mx

    logprobs = response.logprobs
    chosen = logprobs[response.token].item()
    if top <= 0:
        return response.token, chosen, []
    ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
    values = logprobs[ids]
    pairs = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda pair: -pair[1])
    return response.token, chosen, pairs
