"""A distributed engine's rank above 0: it loads its part of the model, then replays what rank 0
did to its generator and prompt cache before each step, and steps with it (cluster.py).

It serves no API and decides nothing: the requests, their admission, cancellations and the
prompt cache's policy are rank 0's. What it reports is its own: its load (with the ring joined
and its shard placed as stages), heartbeats from its own process, and its engine steps, which
time this rank's share of each step (its compute and its waits on the ring). Under mlx.launch it
also beats to rank 0 itself, on a control connection beside the ring (cluster.ControlLink), so that
rank 0 can name it when the ring stalls.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokentrace.engine_shim.mlx import cluster
from tokentrace.engine_shim.mlx.jobs import Job, SamplingObjects
from tokentrace.engine_shim.mlx.loader import LoadOptions, Runtime, load_runtime, new_load_record
from tokentrace.engine_shim.mlx.prompt_cache import _slice_layers
from tokentrace.engine_shim.mlx.records import HeartbeatRecord, RequestRecord, StepWindow
from tokentrace.engine_shim.mlx.scheduler import MSG_CONTROL, MSG_STEP, MSG_STOP, WINDOW_NS, WINDOW_STEPS, Submit
from tokentrace.engine_shim.mlx.settings import EngineSettings

log = logging.getLogger(__name__)


def _own_limit(limit: int, runtime: Runtime | None) -> int:
    """This rank's own bytes when the cache is at its byte limit: rank 0's limit counts the rank
    holding the most KV per token (cluster.limit_rank, prompt_cache.py), and this rank holds its own
    share of every entry."""
    counted, own = cluster.limit_scale(runtime)
    return limit * own // counted


class Diverged(RuntimeError):
    """This rank cannot replay rank 0's step (its generator or cache no longer matches)."""


class Follower:
    """One rank above 0; ``run()`` on the main thread until rank 0 says stop or the ring breaks."""

    def __init__(self, settings: EngineSettings, submit: Submit):
        self.settings = settings
        self._submit = submit
        self.runtime: Runtime | None = None
        self.load_record = None
        self._generator: Any = None
        self._sampling: SamplingObjects | None = None
        self._entries: dict[int, tuple[list[Any], int]] = {}  # cache entry id -> (layers, bytes), as rank 0's
        # uid -> (layers, tokens) of the sequences ended since rank 0's last message
        self._ended: dict[int, tuple[Any, Any]] = {}
        self._requests: dict[int, str] = {}  # uid -> request id of the sequences in the batch
        self._prefilled: dict[int, int] = {}  # uid -> prompt tokens computed so far (prefilling sequences)
        self._window = StepWindow()
        self._timer: cluster.StepTimer | None = None
        self._time_next = False  #: rank 0 asked for the next step to be timed (its "time" op)
        self._failed: str | None = None  # why the last step failed here, until rank 0's reset
        #: Ring operations (messages received, steps) completed: what its control beats tell rank 0.
        self.ring_ops = 0
        self.control: cluster.ControlLink | None = None  #: its control connection to rank 0 (mlx.launch)

    def run(self) -> int:
        """Load, then follow; 0 when rank 0 stopped the instance, 1 when the load failed or the
        ring broke."""
        settings = self.settings
        self.load_record = record = new_load_record(settings.model, lazy=False)
        try:
            self.runtime = load_runtime(record, LoadOptions(
                settings.adapter_path, settings.trust_remote_code, settings.chat_template,
                settings.use_default_chat_template, freeze_heap=True,
                placement=cluster.Placement(settings.parallel, cluster.parse_split(settings.split))))
        except Exception as exc:
            log.error("model load failed: %s", exc)
            self._submit(record)
            return 1
        self._submit(record)
        runtime = self.runtime
        self._sampling = SamplingObjects(runtime.eos_token_ids, int(runtime.config["vocab_size"]),
                                         runtime.tokenizer.encode("\n"))
        self._new_generator()
        self._timer = cluster.step_timer(runtime, self.settings.timed_step_every, self.settings.timed_step_gap)
        self._submit(self.heartbeat())
        channel = cluster.Channel(runtime.group)
        try:
            while True:
                kind, ops = channel.receive()
                self.ring_ops += 1
                if kind == MSG_CONTROL:
                    self._connect(ops)
                    continue
                if self._failed is not None and ops[:1] != [("reset",)]:
                    raise Diverged(f"its step failed ({self._failed}) and rank 0's did not")
                self._failed = None
                self._apply(ops)
                if kind == MSG_STEP:
                    try:
                        self._step()
                    except RuntimeError as exc:
                        if cluster.RING_ERROR_MARK in str(exc):
                            raise
                        self._step_failed(exc)
                    except Exception as exc:  # rank 0's step failed alike: its next message resets the batch
                        self._step_failed(exc)
                    self.ring_ops += 1
                else:
                    self._flush_window()
                if kind == MSG_STOP:
                    return 0
        except Diverged as exc:
            log.error("rank %d cannot follow rank 0 any more (%s); leaving the ring", runtime.group.rank(), exc)
            return 1
        except RuntimeError as exc:
            if cluster.RING_ERROR_MARK not in str(exc):
                raise
            log.error("rank %d lost the ring (%s): rank 0 or another rank is gone", runtime.group.rank(), exc)
            return 1
        finally:
            if self.control is not None:
                self.control.close()
            self._flush_window()
            self._generator.close()

    def _connect(self, setup: tuple[str, int, str]) -> None:
        """Rank 0's control plane is at ``setup`` (address, port, secret): connect and beat from a
        thread of its own; a connection that cannot be made is a warning (ControlLink), never a
        failure of this rank."""
        host, port, secret = setup
        if self.control is not None:
            self.control.close()
        self.control = cluster.ControlLink(host, port, secret, self.runtime.group.rank(),
                                           steps=lambda: self.ring_ops).start()

    def _step_failed(self, exc: Exception) -> None:
        """A step that raised here: rank 0's raised alike (the same batch, the same inputs) and it
        fails its batch and resets the generator; its next message must begin with that reset."""
        log.warning("rank %d: a step failed (%s: %s); waiting for rank 0's reset", self.runtime.group.rank(),
                    type(exc).__name__, exc)
        self._failed = f"{type(exc).__name__}: {exc}"

    def heartbeat(self) -> HeartbeatRecord:
        """This rank's state now (its own process, not rank 0's word)."""
        import mlx.core as mx

        runtime, settings = self.runtime, self.settings
        return HeartbeatRecord(
            at_ns=time.perf_counter_ns(),
            queue_depth=0,
            running=len(self._requests),
            max_batch=settings.max_batch,
            cache_entries=len(self._entries),
            cache_bytes=sum(nbytes for _, nbytes in self._entries.values()),
            cache_max_entries=settings.cache_max_entries,
            cache_max_bytes=_own_limit(settings.cache_max_bytes, runtime),
            kv_bytes_per_token=runtime.kv_bytes_per_token if runtime is not None else 0,
            memory_bytes=mx.get_active_memory(),
            memory_limit_bytes=runtime.memory_limit_bytes if runtime is not None else 0,
        )

    def _new_generator(self) -> None:
        from mlx_lm.generate import BatchGenerator

        self._generator = BatchGenerator(
            self.runtime.model,
            completion_batch_size=self.settings.max_batch,
            prefill_batch_size=self.settings.max_batch,
            prefill_step_size=self.settings.prefill_step_size,
        )

    def _apply(self, ops: list[tuple]) -> None:
        """Replay rank 0's operations since the last message, in its order."""
        for op in ops:
            getattr(self, "_op_" + op[0])(*op[1:])
        self._ended.clear()  # ended sequences rank 0 did not store are not stored here either

    def _op_time(self) -> None:
        self._time_next = True

    def _op_insert(self, uid: int, request_id: str, tokens: list[int], reused: int, entry_id: int | None,
                   max_tokens: int, sampling: Any) -> None:
        layers = None
        if entry_id is not None:
            entry = self._entries.get(entry_id)
            if entry is None:
                raise Diverged(f"rank 0 reuses prompt-cache entry {entry_id}, which this rank does not hold")
            layers = [_slice_layers(entry[0], reused)]
        objects = self._sampling
        job = Job(record=RequestRecord(request_id=request_id, endpoint="", arrival_ns=0), tokens=tokens,
                  max_tokens=max_tokens, sampling=sampling)
        job.sampler = objects.sampler(sampling)
        mine = self._generator.insert(
            [tokens[reused:]],
            max_tokens=[max_tokens],
            caches=layers,
            all_tokens=[tokens[:reused]],
            samplers=[job.sampler],
            logits_processors=[objects.logits_processors(job)],
            stop_sequences=[objects.stop_sequences(sampling)],
        )[0]
        if mine != uid:
            raise Diverged(f"request {request_id} is sequence {uid} on rank 0 and {mine} here")
        self._requests[uid] = request_id

    def _op_remove(self, uids: list[int], keep_cache: bool) -> None:
        removed = self._generator.remove(uids, return_prompt_caches=keep_cache)
        for uid in uids:
            self._requests.pop(uid, None)
            self._prefilled.pop(uid, None)
            if keep_cache and uid in removed:
                self._ended[uid] = removed[uid]

    def _op_store(self, uid: int, entry_id: int, evicted: list[int]) -> None:
        import mlx.core as mx

        ended = self._ended.pop(uid, None)
        if ended is None:
            raise Diverged(f"rank 0 stored sequence {uid} in its prompt cache; it has not ended here")
        layers = ended[0]
        mx.async_eval([array for layer in layers for array in (layer.keys, layer.values)])
        self._entries[entry_id] = (layers, sum(layer.nbytes for layer in layers))
        for old in evicted:
            self._entries.pop(old, None)

    def _op_reset(self) -> None:
        self._generator.close()
        self._new_generator()
        self._requests.clear()
        self._prefilled.clear()

    def _step(self) -> None:
        timed, self._time_next = cluster.timed_step(self._timer, self._time_next), False
        start = time.perf_counter_ns()
        with timed:
            prompt_responses, generated = self._generator.next()
            end = time.perf_counter_ns()
        window, requests = self._window, self._requests
        prefill_tokens = 0
        for response in prompt_responses:
            window.members.append(requests.get(response.uid, ""))
            done = response.progress[0]
            prefill_tokens += done - self._prefilled.get(response.uid, 0)
            self._prefilled[response.uid] = done
        for response in generated:
            self._prefilled.pop(response.uid, None)
            window.members.append(requests.get(response.uid, ""))
            if response.finish_reason is not None:
                self._ended[response.uid] = (response.prompt_cache, response.all_tokens)
                requests.pop(response.uid, None)
        window.start_ns.append(start)
        window.duration_ns.append(timed.result[2] if timed.result else end - start)
        window.prefill_seqs.append(len(prompt_responses))
        window.decode_seqs.append(len(generated))
        window.prefill_tokens.append(prefill_tokens)
        window.decode_tokens.append(len(generated))
        if self._timer is not None:
            window.compute_ns.append(timed.result[0] if timed.result else -1)
            window.ring_wait_ns.append(timed.result[1] if timed.result else -1)
            window.ring_wait_cpu_ns.append(timed.result[3] if timed.result else -1)
        if len(window.start_ns) >= WINDOW_STEPS or end - window.start_ns[0] >= WINDOW_NS:
            self._flush_window()

    def _flush_window(self) -> None:
        if self._window.start_ns:
            window, self._window = self._window, StepWindow()
            self._submit(window)
