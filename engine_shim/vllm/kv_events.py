"""vLLM KV-cache events -> tokentrace cache evictions.

vLLM publishes, with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'``, one msgpack
``KVEventBatch`` per engine step that changed the prefix cache, as the ZMQ multipart
``[topic, seq (8-byte big-endian), payload]`` (``vllm/distributed/kv_events.py``). The batch is an
array ``[ts, events, data_parallel_rank]``; each event is a map tagged ``type``:
``BlockStored`` (full blocks entered the prefix cache: their vLLM hashes, the parent block's hash and
the blocks' token ids), ``BlockRemoved`` (``BlockPool._maybe_evict_cached_block``: a free block that
still held a cached prefix was handed to a new allocation — a real eviction) and ``AllBlocksCleared``
(``reset_prefix_cache``). vLLM 0.32 tags each ``BlockStored`` with the ``session_id`` of the request
that caused it, and, for a request sent with ``kv_cache_report_mode="full"`` (``extra_args``), also
reports the prefix-cache blocks it *reused* as a ``BlockStored`` of blocks already cached
(``KVCacheManager.get_computed_blocks``). The plugin asks for both (``report_mode.py``), so the
tracker can tell, per request, a prefix hit at admission from its own blocks coming back after a
preemption (``RequestReuse``).

vLLM's block hashes are seeded per process (``NONE_HASH`` is random unless ``PYTHONHASHSEED`` is
set), so the tracker re-derives tokentrace's own chained fingerprint (docs/telemetry.md) from the
token ids of each stored block; an evicted block is then reported with the fingerprint of the prefix
it ended, comparable across instances and engines. Decoding is untyped so that added or missing
trailing fields (the schema grows every few releases) do not break it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokentrace.contract import DEFAULT_BLOCK_SIZE
from tokentrace.fingerprint import block_hashes
from tokentrace.threads import os_named

log = logging.getLogger("vllm.tokentrace")

#: Media of vLLM's own prefix cache; offloading connectors report "CPU"/"STORAGE" tiers.
ENGINE_MEDIA = (None, "GPU")


@dataclass(frozen=True)
class Eviction:
    """One block pushed out of vLLM's prefix cache."""

    time_ns: int  #: wall clock of the engine step that evicted it (KVEventBatch.ts)
    fingerprint: int | None  #: tokentrace hash of the prefix the block ended; None if unknown
    prefix_tokens: int | None  #: length of that prefix in tokens; None if unknown
    tokens: int  #: tokens the block held (vLLM's block size)
    entries_after: int  #: cached blocks after this eviction


@dataclass
class RequestReuse:
    """What the full KV-event reports say about one request's prefix-cache reuse.

    vLLM looks a waiting request up again every step until it is admitted, and a preempted request
    is looked up again when it resumes; both report the reused blocks (a lookup that finds nothing
    reports nothing). A report before the request stored any block of its own is its admission
    lookup; a report after it stored blocks is a resumption after a preemption: the tokens it gets
    back then are recomputed work vLLM skips, not prefix hits (vLLM's ``PrefixCacheStats`` counts
    them apart, as ``preempted_hits``). A lookup that did not admit the request (no room) is retried
    the next step: a later report replaces it, and the request's next store says whether the retry
    that admitted it found anything (a store of block 0: it did not).
    """

    hit_tokens: int = 0  #: tokens reused at admission, from blocks other requests stored
    resumes: int = 0  #: reuse reports after the request had stored blocks (preemptions seen)
    recomputed_tokens: int = 0  #: tokens reused on those resumptions (its own blocks and shared ones)
    own_tokens: int = 0  #: of those, tokens from blocks the request had stored itself
    stored: bool = False  #: the request has stored blocks of its own
    _pending: tuple[int, int] | None = field(default=None, repr=False)  #: last resume (tokens, own)


#: Requests whose reuse is remembered until they finish (a bound for requests that never finish),
#: and finished ones whose late events (the last step's stores reach us after the finish) are ignored.
MAX_TRACKED_REQUESTS = 20_000
MAX_FINISHED_REQUESTS = 4_096


def _field(event: Any, name: str, index: int) -> Any:
    """A field of an event decoded as a map (vLLM 0.30+) or as a tagged array (older senders)."""
    if isinstance(event, dict):
        return event.get(name)
    return event[index] if index < len(event) else None


def event_type(event: Any) -> str:
    """The event's class name: BlockStored, BlockRemoved, AllBlocksCleared, or '' if unreadable."""
    if isinstance(event, dict):
        return str(event.get("type", ""))
    if isinstance(event, (list, tuple)) and event:
        return str(event[0])
    return ""


class KvCacheTracker:
    """Follows vLLM's prefix cache block by block and turns removals into ``Eviction`` records.

    Only blocks whose whole prefix was seen being stored get a fingerprint; blocks stored before the
    subscriber connected are still counted, without one. Memory is bounded by vLLM's block pool.
    """

    def __init__(self, fingerprint_block: int = DEFAULT_BLOCK_SIZE) -> None:
        self.fingerprint_block = fingerprint_block
        self.block_size = 0  #: vLLM's block size, learned from BlockStored
        self.skipped_media = 0  #: events about offload tiers, not the engine's own cache
        self.reused_reports = 0  #: BlockStored events of blocks already cached (full reports)
        #: vLLM hash -> (fingerprint, prefix tokens, session that stored it)
        self._blocks: dict[Any, tuple[int | None, int | None, str | None]] = {}
        self._requests: OrderedDict[str, RequestReuse] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def entries(self) -> int:
        """Cached blocks the tracker knows of."""
        return len(self._blocks)

    def take(self, request_id: str) -> RequestReuse | None:
        """Forget and return what the reports said about ``request_id`` (vLLM's external id)."""
        with self._lock:
            self._finished[request_id] = None
            if len(self._finished) > MAX_FINISHED_REQUESTS:
                self._finished.popitem(last=False)
            return self._requests.pop(request_id, None)

    def _request(self, session: str) -> RequestReuse | None:
        with self._lock:
            if session in self._finished:
                return None
            reuse = self._requests.get(session)
            if reuse is None:
                reuse = self._requests[session] = RequestReuse()
                if len(self._requests) > MAX_TRACKED_REQUESTS:
                    self._requests.popitem(last=False)
            return reuse

    def apply(self, ts: float, events: Iterable[Any]) -> list[Eviction]:
        """Apply one batch's events in order; return its evictions."""
        evictions: list[Eviction] = []
        time_ns = int(ts * 1e9)
        for event in events:
            kind = event_type(event)
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                evictions.extend(self._removed(event, time_ns))
            elif kind == "AllBlocksCleared":
                self._blocks.clear()
        return evictions

    def _stored(self, event: Any) -> None:
        if _field(event, "medium", 6) not in ENGINE_MEDIA:
            self.skipped_media += 1
            return
        hashes = _field(event, "block_hashes", 1) or []
        parent_hash = _field(event, "parent_block_hash", 2)
        tokens = _field(event, "token_ids", 3) or []
        size = int(_field(event, "block_size", 4) or 0)
        if size <= 0 or not hashes:
            return
        self.block_size = size
        session = _field(event, "session_id", 14)
        session = session if isinstance(session, str) and session else None
        known = [self._blocks.get(h) for h in hashes]
        reused = all(k is not None for k in known)
        parent = (0, 0) if parent_hash is None else self._blocks.get(parent_hash, (None, None, None))[:2]
        chain = self._chain(parent, tokens, size, len(hashes))
        for index, vllm_hash in enumerate(hashes):
            fingerprint, prefix = chain[index]
            if reused:
                # A report of blocks already cached: it names a prefix from block 0, so it also
                # gives a fingerprint to a block whose store was not seen; the storer stays.
                old = known[index]
                assert old is not None
                self._blocks[vllm_hash] = (old[0] if old[0] is not None else fingerprint,
                                           old[1] if old[1] is not None else prefix, old[2])
            else:
                self._blocks[vllm_hash] = (fingerprint, prefix, session)
        if reused:
            self.reused_reports += 1
        if session is None:
            return
        reuse = self._request(session)
        if reuse is None:
            return
        if not reused:
            if parent_hash is None:
                # It computes block 0 itself: the lookup that admitted it found nothing. vLLM
                # reports no reuse of zero blocks, so an earlier report was of a lookup that did
                # not admit it (no room), and its blocks went before the retry.
                if reuse._pending is not None:
                    reuse.recomputed_tokens -= reuse._pending[0]
                    reuse.own_tokens -= reuse._pending[1]
                    reuse.resumes -= 1
                elif not reuse.stored:
                    reuse.hit_tokens = 0
            reuse.stored = True
            reuse._pending = None  # the request ran since its last resumption report
            return
        tokens_reused = len(hashes) * size
        own = sum(size for k in known if k is not None and k[2] == session)
        if not reuse.stored:
            reuse.hit_tokens = tokens_reused  # its admission lookup (a retry replaces it)
            return
        if reuse._pending is not None:  # the resumption retried before it ran: replace, not add
            reuse.recomputed_tokens -= reuse._pending[0]
            reuse.own_tokens -= reuse._pending[1]
        else:
            reuse.resumes += 1
        reuse.recomputed_tokens += tokens_reused
        reuse.own_tokens += own
        reuse._pending = (tokens_reused, own)

    def _chain(
        self, parent: tuple[int | None, int | None], tokens: list[int], size: int, count: int
    ) -> list[tuple[int | None, int | None]]:
        prev, prefix = parent
        step = self.fingerprint_block
        if prev is None or prefix is None or size % step or prefix % step or len(tokens) < size * count:
            return [(None, None)] * count
        sub = block_hashes(tokens[: size * count], step, prev=prev)
        per_block = size // step
        return [(sub[(i + 1) * per_block - 1], prefix + (i + 1) * size) for i in range(count)]

    def _removed(self, event: Any, time_ns: int) -> list[Eviction]:
        if _field(event, "medium", 2) not in ENGINE_MEDIA:
            self.skipped_media += 1
            return []
        out = []
        for vllm_hash in _field(event, "block_hashes", 1) or []:
            # A block stored before the subscriber connected is still a real eviction; it is
            # reported without a fingerprint.
            fingerprint, prefix, _ = self._blocks.pop(vllm_hash, (None, None, None))
            out.append(Eviction(time_ns, fingerprint, prefix, self.block_size, len(self._blocks)))
        return out


def subscriber_endpoint(publisher_endpoint: str, engine_index: int = 0) -> tuple[str, bool]:
    """Where the subscriber connects (or binds) for vLLM's publisher endpoint.

    vLLM binds when the endpoint has a wildcard or is ipc (``ZmqEventPublisher``), else it connects,
    and offsets a tcp port by the data-parallel rank. Returns (address, bind?).
    """
    endpoint = publisher_endpoint
    if engine_index and endpoint.startswith("tcp://") and not endpoint.endswith(":0"):
        base, port = endpoint.rsplit(":", 1)
        endpoint = f"{base}:{int(port) + engine_index}"
    if endpoint.startswith("inproc://"):
        raise ValueError(f"KV events on {endpoint!r} stay inside vLLM's process; use tcp:// or ipc://")
    if endpoint.startswith("ipc://"):
        return endpoint, False
    for wildcard in ("*", "[::]", "0.0.0.0"):
        if f"//{wildcard}:" in endpoint:
            return endpoint.replace(f"//{wildcard}:", "//127.0.0.1:"), False
    return endpoint, True


class KvEventSubscriber:
    """A daemon thread that reads vLLM's KV-event stream and feeds ``on_evictions``."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        tracker: KvCacheTracker,
        on_evictions: Callable[[list[Eviction]], None],
        bind: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.tracker = tracker
        self.on_evictions = on_evictions
        self.bind = bind
        self.batches = 0  #: batches decoded
        self.missed = 0  #: batches lost, from gaps in the sequence numbers
        self.bad = 0  #: payloads that did not decode
        self._stop = threading.Event()
        self._thread = threading.Thread(target=os_named(self._run), name="tokentrace-kv-events", daemon=True)

    def start(self) -> None:
        """Start reading."""
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop reading and close the socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        import msgspec
        import zmq

        decoder = msgspec.msgpack.Decoder()
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sock.setsockopt(zmq.LINGER, 0)
            (sock.bind if self.bind else sock.connect)(self.endpoint)
            last_seq = -1
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    self.bad += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if last_seq >= 0 and seq > last_seq + 1:
                    self.missed += seq - last_seq - 1
                last_seq = seq
                self._handle(decoder, frames[2])
        except Exception:  # a broken stream must never reach vLLM; the plugin keeps the rest
            log.exception("tokentrace: KV-event subscriber on %s stopped", self.endpoint)
        finally:
            sock.close(0)

    def _handle(self, decoder: Any, payload: bytes) -> None:
        try:
            batch = decoder.decode(payload)
            ts, events = float(batch[0]), batch[1]
        except Exception:
            self.bad += 1
            return
        self.batches += 1
        evictions = self.tracker.apply(ts, events)
        if evictions:
            self.on_evictions(evictions)
