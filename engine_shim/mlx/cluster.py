"""A distributed engine: N ranks of one instance over MLX's ``ring`` backend, or ``jaccl`` where
the platform has it (issue 46).

The ranks are started by ``mlx.launch`` (each gets ``MLX_RANK`` and ``MLX_HOSTFILE``, or jaccl's
``MLX_JACCL_COORDINATOR`` and ``MLX_IBV_DEVICES``) or, on one
host, by ``tokentrace engine --ranks N`` itself (``launch_local``: it writes the ring's hostfile,
becomes rank 0 and starts ranks 1..N-1 as children that die with it). Every rank loads its part of
the model (``--parallel pipeline``: a layer range, ``--split`` counts per rank; ``tensor``: a
shard of every layer) and runs the same batches: rank 0 serves the API and decides; before each
engine step it hands the other ranks what it did to its generator since the last one (inserts,
removals, prompt-cache stores and evictions) through the ``Channel``, and they replay it, so every
rank's ``BatchGenerator`` and prompt cache stay the same (notes: mlx-distributed.md).

Every rank exports its own telemetry (its load, heartbeats and steps) from its own process, under
``<instance>/rank<r>`` for ranks above 0: a rank's telemetry never rides on the ring.

Under ``mlx.launch`` rank 0 has no other rank's process at hand; the ``ControlPlane`` (rank 0) and
each rank's ``ControlLink`` are a side channel beside the ring (TCP, rank 0's address in the ring's
host list) on which every rank says who it is and beats, so that a stalled ring's diagnosis names
the rank there too.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hmac
import json
import logging
import os
import pickle
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from tokentrace.errors import ConfigError

log = logging.getLogger(__name__)

PIPELINE, TENSOR, AUTO = "pipeline", "tensor", "auto"
#: The ring's failure, as mlx reports it when a peer's connection drops.
RING_ERROR_MARK = "[ring]"


class Diagnosis(NamedTuple):
    """Why a ring stopped moving, as rank 0 tells it: the error code (analyzers/slowness.py
    STALL_STATES), the reason in words, and the ranks it names (exited or stopped; empty when it
    singles none out). The stall report on rank 0's heartbeats carries the ranks
    (``tokentrace.stall.ranks``), so that a failed request's verdict names its rank even before the
    step that the stall held is stored."""

    code: str
    reason: str
    ranks: tuple[int, ...] = ()


#: What a rank 0 that cannot tell which rank stalled the ring says (no rank's process at hand, no
#: control connection from it): the scheduler's diagnosis when it has none.
UNTOLD = Diagnosis("RankUnresponsive", "a rank has not completed its part of the step; which one this rank "
                   "cannot tell (each rank's own heartbeats can)")


@dataclass(frozen=True)
class Placement:
    """How the model is split between the ranks."""

    parallel: str = AUTO  #: pipeline (layers per rank), tensor (a shard of every layer), or auto
    split: tuple[int, ...] | None = None  #: pipeline layer counts per rank (rank 0 first); None: even


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """``--split 10,6`` as counts; raises ConfigError with the reason."""
    if not text:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--split takes layer counts per rank, comma-separated (10,6), received {text!r}") from None
    if any(count <= 0 for count in counts):
        raise ConfigError(f"--split: every rank needs at least one layer, received {text!r}")
    return counts


def launcher_backend() -> str | None:
    """The backend mlx.launch (or ``launch_local``) started this rank for: "ring" (it gave the ring's
    host list, ``MLX_HOSTFILE``) or "jaccl" (RDMA over Thunderbolt: the coordinator's address,
    ``MLX_JACCL_COORDINATOR``, and the RDMA devices, ``MLX_IBV_DEVICES``, a row per rank); None when
    this process was not launched as a rank."""
    if os.environ.get("MLX_RANK") is None:
        return None
    if os.environ.get("MLX_JACCL_COORDINATOR") or os.environ.get("MLX_IBV_DEVICES"):
        return "jaccl"
    return "ring" if os.environ.get("MLX_HOSTFILE") else None


def under_launcher() -> bool:
    """Whether this process is a rank of a group started by mlx.launch or ``launch_local``."""
    return launcher_backend() is not None


def launched_ranks() -> int | None:
    """How many ranks the launcher started: the rows of its host list (ring) or of its RDMA device
    matrix (jaccl); None when it cannot be read."""
    path = os.environ.get("MLX_IBV_DEVICES" if launcher_backend() == "jaccl" else "MLX_HOSTFILE", "")
    try:
        with open(path) as handle:
            return len(json.load(handle))
    except (OSError, ValueError, TypeError):
        return None


def join_ring() -> Any:
    """This rank's group on the backend it was launched for (``launcher_backend``; blocks until
    every rank joined); a ConfigError where this MLX has no such backend."""
    import mlx.core as mx

    backend = launcher_backend() or "ring"
    if not mx.distributed.is_available(backend):
        raise ConfigError(f"mlx.launch --backend {backend}: this MLX has no {backend} backend (jaccl: RDMA over "
                          "Thunderbolt, on macOS); launch with --backend ring")
    return mx.distributed.init(strict=True, backend=backend)


def place(model: Any, group: Any, placement: Placement) -> tuple[Placement, str]:
    """Split ``model`` (loaded lazily, weights not read yet) for this rank; returns the placement
    used (``auto`` resolved: pipeline where the model can split its layers, else tensor) and what
    this rank holds, in words (``layers 8-15 of 16``, ``tensor shard 2 of 2``); ConfigError when
    the model cannot be split that way."""
    if placement.parallel == AUTO:
        can_pipeline = hasattr(getattr(model, "model", None), "pipeline")
        placement = Placement(PIPELINE if can_pipeline or placement.split else TENSOR, placement.split)
    if placement.parallel == TENSOR:
        if not hasattr(model, "shard"):
            raise ConfigError(f"--parallel tensor: this model ({type(model).__module__}) has no tensor-parallel "
                              f"shard(); use --parallel pipeline with a model that has layers to split")
        model.shard(group)
        return placement, f"tensor shard {group.rank() + 1} of {group.size()}"
    inner = getattr(model, "model", None)
    if not hasattr(inner, "pipeline"):
        raise ConfigError(f"--parallel pipeline: this model ({type(model).__module__}) cannot split its layers "
                          f"(mlx-lm's PipelineMixin: qwen2, qwen3, deepseek...); use --parallel tensor, or "
                          f"`tokentrace make-model --arch qwen2`")
    split = list(placement.split) if placement.split else None
    if split is not None:
        # mlx-lm takes counts in rank order too (rank 0 holds the last layers).
        if len(split) != group.size():
            raise ConfigError(f"--split gives {len(split)} counts for {group.size()} ranks")
        if sum(split) != len(inner.layers):
            raise ConfigError(f"--split {','.join(map(str, split))} sums to {sum(split)} layers; the model has "
                              f"{len(inner.layers)}")
    total = len(inner.layers)
    inner.pipeline(group, split)
    return placement, f"layers {inner.start_idx}-{inner.end_idx - 1} of {total}"


def kv_share(model: Any, group: Any, placement: Placement, full_bytes_per_token: int, layers: int) -> int:
    """KV bytes per token this rank holds: its layers' share (pipeline; ``layers`` in the model)
    or its heads' (tensor)."""
    if placement.parallel == TENSOR:
        return full_bytes_per_token // max(group.size(), 1)
    inner = model.model
    return full_bytes_per_token * (inner.end_idx - inner.start_idx) // max(layers, 1)


def kv_shares(group: Any, mine: int) -> tuple[int, ...]:
    """Every rank's KV bytes per token (``kv_share``), by rank: one ``all_sum`` at load, each rank
    adding its own at its index (on the generation stream, as ``same_seed``)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    vector = mx.zeros((group.size(),), dtype=mx.int64)
    vector[group.rank()] = mine
    total = mx.distributed.all_sum(vector, group=group, stream=generation_stream)
    return tuple(int(share) for share in total.tolist())


def limit_rank(shares: tuple[int, ...]) -> int:
    """The rank whose cache the byte limit counts: the one holding the most KV per token (the lowest
    such rank on a tie: rank 0 wherever the shares are even)."""
    return max(range(len(shares)), key=lambda rank: (shares[rank], -rank)) if shares else 0


def limit_scale(runtime: Any) -> tuple[int, int]:
    """(the counted rank's KV bytes per token, this rank's): a cache entry's bytes here x the first
    // the second are the bytes the byte limit counts (prompt_cache.py ``scale``); (1, 1) on one
    process or where this rank's share is unknown."""
    shares = runtime.kv_shares if runtime is not None else ()
    if not shares or shares[runtime.group.rank()] <= 0:
        return 1, 1
    return shares[limit_rank(shares)], shares[runtime.group.rank()]


def same_seed(group: Any) -> None:
    """Give every rank rank 0's random state, so that sampling draws the same tokens everywhere."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mine = mx.random.state[0] if group.rank() == 0 else mx.zeros_like(mx.random.state[0])
    # On the generation stream, behind whatever the warm-up left evaluating (Channel says why).
    seed = mx.distributed.all_sum(mine, group=group, stream=generation_stream).view(mx.uint64)
    mx.random.seed(int(seed.flatten()[0].item()))


class Channel:
    """Rank 0 hands a Python object to every other rank (pickled into an ``all_sum``: the others
    add zeros); two collectives per message.

    They run on mlx-lm's generation stream: ``BatchGenerator.next()`` leaves the next step's
    forward pass (with its own sends, receives and all-reduces) evaluating in the background on
    that stream, and collectives on another stream would interleave with it in a different order on
    each rank and exchange each other's bytes (seen: a message arriving as garbage).
    """

    def __init__(self, group: Any):
        from mlx_lm.generate import generation_stream

        self.group = group
        self.stream = generation_stream

    def send(self, message: Any) -> None:
        """Rank 0: hand ``message`` to the others (blocks until they took it)."""
        import mlx.core as mx
        import numpy as np

        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        mx.eval(mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int64), group=self.group, stream=self.stream))
        mx.eval(mx.distributed.all_sum(mx.array(np.frombuffer(data, dtype=np.uint8)), group=self.group,
                                       stream=self.stream))

    def receive(self) -> Any:
        """Ranks above 0: the next message of rank 0 (blocks until it comes)."""
        import mlx.core as mx
        import numpy as np

        size = mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int64), group=self.group, stream=self.stream)
        length = int(size.item())
        data = mx.distributed.all_sum(mx.zeros((length,), dtype=mx.uint8), group=self.group, stream=self.stream)
        return pickle.loads(np.array(data).tobytes())


# --- one host: tokentrace engine --ranks N -------------------------------------------------------
class LocalRanks:
    """Ranks 1..N-1 started by rank 0 on this host; ``watch`` reports the first that exits."""

    def __init__(self, processes: dict[int, subprocess.Popen], hostfile: str):
        self.processes = processes
        self.hostfile = hostfile
        self._stopped = False

    def watch(self, on_exit: Any) -> None:
        """Call ``on_exit(rank, returncode)`` (from a thread of its own) when a rank exits while
        the engine serves."""
        for rank, process in self.processes.items():
            threading.Thread(target=self._wait, args=(rank, process, on_exit), name=f"tokentrace-rank{rank}-watch",
                             daemon=True).start()

    def _wait(self, rank: int, process: subprocess.Popen, on_exit: Any) -> None:
        code = process.wait()
        if not self._stopped:
            on_exit(rank, code)

    def diagnose(self) -> Diagnosis:
        """Why a ring stopped moving: a rank that exited, one that is stopped (alive, not stepping:
        SIGSTOP, a debugger), or neither (all alive and running)."""
        for rank, process in self.processes.items():
            state = _process_state(process.pid) if process.poll() is None else None
            if state in (None, "Z", "X"):
                return Diagnosis("RankLost", f"rank {rank} (pid {process.pid}) exited", (rank,))
            if state in ("T", "t"):
                return Diagnosis("RankStopped", f"rank {rank} (pid {process.pid}) is alive but not stepping: its "
                                 f"process is stopped (SIGSTOP or a debugger)", (rank,))
        return Diagnosis("RankUnresponsive", "every rank's process is alive and running, but a step has not "
                         "completed: a rank or a link of the ring is stuck")

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the ranks to stop (SIGTERM), then kill what is left."""
        self._stopped = True
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.hostfile)


def launch_local(ranks: int, argv: list[str]) -> LocalRanks:
    """Make this process rank 0 of a ring of ``ranks`` on 127.0.0.1 and start the others with the
    same options (``argv``); they are killed when this process dies."""
    ports = _free_ports(ranks)
    handle, hostfile = tempfile.mkstemp(prefix="tokentrace-ring-", suffix=".json")
    with os.fdopen(handle, "w") as out:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], out)
    os.environ["MLX_HOSTFILE"] = hostfile
    os.environ["MLX_RANK"] = "0"
    processes = {}
    for rank in range(1, ranks):
        env = {**os.environ, "MLX_RANK": str(rank)}
        processes[rank] = subprocess.Popen([sys.executable, "-m", "tokentrace", "engine", *argv], env=env,
                                           preexec_fn=_die_with_parent)
    local = LocalRanks(processes, hostfile)
    atexit.register(local.stop, 2.0)
    return local


def _process_state(pid: int) -> str | None:
    """A process's state letter (R, S, D, T, Z...) from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent (rank 0) dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# --- the control plane: rank 0's side channel to the other ranks, beside the ring ---------------
#: Seconds between the control heartbeats a rank above 0 sends rank 0.
CONTROL_BEAT_S = 0.5
#: A connected rank that has sent nothing for this many beats' time is silent.
CONTROL_SILENT_BEATS = 2
#: How long a connecting rank has to present itself, and to hear rank 0's answer.
_HELLO_TIMEOUT_S = 5.0
#: The longest line either side reads (a hello or a beat is far shorter).
_MAX_LINE = 4096
#: How long a rank above 0 waits before it tries its control connection again.
_RETRY_S = 2.0


def ring_host(rank: int = 0) -> str | None:
    """The address ``rank`` has in the ring's host list (``MLX_HOSTFILE``: a list per rank of
    ``ip:port``, as mlx.launch and ``launch_local`` write it), or under jaccl rank 0's: its
    coordinator's (``MLX_JACCL_COORDINATOR``, ``ip:port``); None when it cannot be read."""
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR", "") if launcher_backend() == "jaccl" else ""
    try:
        if coordinator:
            if rank != 0:
                return None
            entry = coordinator
        else:
            with open(os.environ.get("MLX_HOSTFILE", "")) as handle:
                entry = json.load(handle)[rank][0]
        host = str(entry).rsplit(":", 1)[0]
    except (OSError, ValueError, TypeError, IndexError, KeyError):
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass
class _Peer:
    """A rank above 0 as its control connection presented it, and what rank 0 last heard from it."""

    rank: int
    pid: int
    host: str
    sock: socket.socket
    heard: float  #: rank 0's time.monotonic() when its last line arrived
    steps: int = -1  #: the ring operations it had completed (its last beat); -1 before its first beat
    closed: float | None = None  #: rank 0's time.monotonic() when its connection closed

    def name(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on host {self.host})"


class ControlPlane:
    """Rank 0's side of the control plane (under mlx.launch, where no other rank's process is at
    hand): a TCP listener on rank 0's address in the ring's host list, never on the ring. At load
    rank 0 hands the other ranks ``setup()`` (its address, port and a random secret) over the
    ``Channel``; each connects (``ControlLink``), presents the secret with its rank, pid and host, and
    beats every ``CONTROL_BEAT_S`` with the ring operations it completed. Connections without the
    secret are closed unheard. ``diagnose`` names the rank that stalled a ring, as ``LocalRanks`` does
    on one host, with the same codes."""

    def __init__(self, ranks: int, host: str, beat_s: float = CONTROL_BEAT_S, port: int = 0):
        self.ranks = ranks
        self.host = host
        self.beat_s = beat_s
        self.secret = secrets.token_hex(16)
        #: Rank 0's own completed ring operations (the scheduler's ``ring_ops``), to tell who lags.
        self.own_steps: Callable[[], int] | None = None
        self.peers: dict[int, _Peer] = {}
        self.rejected = 0  #: connections closed for a wrong or missing secret (or a malformed hello)
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host, port), family=family)
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="tokentrace-control", daemon=True).start()

    @classmethod
    def open(cls, ranks: int, host: str | None = None, port: int = 0) -> ControlPlane | None:
        """Rank 0's control plane on its address in the ring's host list (``host`` overrides it), on
        ``port`` (0: a free one); None, with a warning, when it cannot listen there: the watchdog
        then cannot name a rank. A chosen ``port`` that cannot be had is a ConfigError."""
        host = host or ring_host(0)
        if host is None:
            log.warning("no control plane: rank 0's address in the ring's host list cannot be read; a stalled "
                        "ring's diagnosis cannot name the rank")
            return None
        try:
            return cls(ranks, host, port=port)
        except OSError as exc:
            if port:  # a port the operator chose (and opened in a firewall): no other one will do
                raise ConfigError(f"--control-port {port}: cannot listen on {host} port {port} ({exc})") from exc
            log.warning("no control plane: cannot listen on %s (%s); a stalled ring's diagnosis cannot name the "
                        "rank", host, exc)
            return None

    def setup(self) -> tuple[str, int, str]:
        """What the other ranks need to connect: (address, port, secret)."""
        return self.host, self.port, self.secret

    def close(self) -> None:
        """Stop listening and close every rank's connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            peers = list(self.peers.values())
        for peer in peers:
            _shut(peer.sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tokentrace-control-peer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = None
        reader = conn.makefile("rb")
        try:
            conn.settimeout(_HELLO_TIMEOUT_S)
            peer = self._hello(conn, reader.readline(_MAX_LINE))
            if peer is None:
                return
            conn.settimeout(None)
            _keepalive(conn)
            conn.sendall(b"ok\n")
            while True:
                line = reader.readline(_MAX_LINE)
                if not line:
                    return
                now = time.monotonic()
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    peer.steps = int(json.loads(line).get("steps", peer.steps))
                peer.heard = now
        except OSError:
            return
        finally:
            if peer is not None:
                peer.closed = time.monotonic()
            _shut(conn)
            reader.close()

    def _hello(self, conn: socket.socket, line: bytes) -> _Peer | None:
        """The rank a connection presents, registered; None (the connection refused) without the secret."""
        try:
            hello = json.loads(line)
            secret, rank = str(hello["secret"]), int(hello["rank"])
            pid, host = int(hello["pid"]), str(hello["host"])[:255]
        except (ValueError, TypeError, KeyError):
            secret, rank, pid, host = "", -1, 0, ""
        if not hmac.compare_digest(secret.encode(), self.secret.encode()) or not 0 < rank < self.ranks:
            self.rejected += 1
            log.warning("control plane: refused a connection from %s (no valid secret and rank)",
                        _address(conn))
            return None
        peer = _Peer(rank, pid, host, conn, time.monotonic())
        with self._lock:
            old, self.peers[rank] = self.peers.get(rank), peer
        if old is not None:
            _shut(old.sock)  # the same rank again (it reconnected): the new connection is its own
        log.info("control plane: %s connected from %s", peer.name(), _address(conn))
        return peer

    def diagnose(self) -> Diagnosis:
        """Why a ring stopped moving, from the control connections: a rank
        whose connection closed (``RankLost``), one connected but silent for more than
        ``CONTROL_SILENT_BEATS`` beats (``RankStopped``), else ``RankUnresponsive`` naming the ranks
        whose completed ring operations lag, if any; a rank without a control connection is one this
        rank cannot tell about (``UNTOLD``)."""
        with self._lock:
            peers = dict(self.peers)
        self._notice_closed(peers.values())
        now = time.monotonic()
        lost, silent, reporting, untold = [], [], {}, []
        for rank in range(1, self.ranks):
            peer = peers.get(rank)
            if peer is None:
                untold.append(rank)
            elif peer.closed is not None:
                lost.append(peer)
            elif now - peer.heard > CONTROL_SILENT_BEATS * self.beat_s:
                silent.append((peer, now - peer.heard))
            else:
                reporting[rank] = peer
        if lost:
            return Diagnosis("RankLost", "; ".join(f"{peer.name()} closed its control connection: its process "
                                                   f"exited or its host went down" for peer in lost),
                             tuple(peer.rank for peer in lost))
        if silent:
            return Diagnosis("RankStopped", "; ".join(
                f"{peer.name()} is connected but silent (nothing for {quiet:.1f} s): stopped (SIGSTOP, a debugger) "
                f"or its host hangs" for peer, quiet in silent), tuple(peer.rank for peer, _ in silent))
        if untold:
            ranks = ", ".join(map(str, untold))
            reason = (f"{UNTOLD.reason[:-1]}: rank{'s' if len(untold) > 1 else ''} {ranks} "
                      f"{'have' if len(untold) > 1 else 'has'} no control connection)")
        else:
            reason = ("every rank is connected and beating on its control connection, but a step has not "
                      "completed: a rank or a link of the ring is stuck")
        steps = {rank: peer.steps for rank, peer in reporting.items() if peer.steps >= 0}
        if self.own_steps is not None:
            with contextlib.suppress(Exception):
                steps[0] = int(self.own_steps())
        if len(steps) > 1 and min(steps.values()) < max(steps.values()):
            ahead = max(steps.values())
            lagging = [f"{'rank 0 (this process)' if rank == 0 else reporting[rank].name()} has completed "
                       f"{count:,} ring operations" for rank, count in sorted(steps.items()) if count < ahead]
            reason += f"; lagging: {', '.join(lagging)}, the others {ahead:,}"
        return Diagnosis("RankUnresponsive", reason)

    @staticmethod
    def _notice_closed(peers: Any) -> None:
        """Mark the connections whose rank has closed its end, before their reader threads have read
        to it (a ring that broke because a rank exited is diagnosed at once): Linux's POLLRDHUP."""
        rdhup = getattr(select, "POLLRDHUP", 0)
        if not rdhup or not hasattr(select, "poll"):
            return
        for peer in peers:
            if peer.closed is not None:
                continue
            poller = select.poll()
            try:
                poller.register(peer.sock, rdhup | select.POLLHUP | select.POLLERR)
                if poller.poll(0):
                    peer.closed = time.monotonic()
            except (OSError, ValueError):
                peer.closed = peer.closed or time.monotonic()


class ControlLink:
    """A rank above 0's side of the control plane: from a thread of its own (which beats on while
    the main thread waits in the ring: MLX's evaluation releases the GIL), it connects to rank 0's
    ``ControlPlane``, presents the secret, its rank, pid and host, then sends a line every
    ``beat_s`` with the ring operations it completed (``steps()``). A connection that cannot be made
    is a warning, never a failure: the rank serves on (rank 0 cannot name it if the ring stalls),
    and the link tries again every few seconds."""

    def __init__(self, host: str, port: int, secret: str, rank: int, steps: Callable[[], int],
                 beat_s: float = CONTROL_BEAT_S):
        self.host, self.port, self.secret, self.rank = host, port, secret, rank
        self.steps = steps
        self.beat_s = beat_s
        self.connected = threading.Event()  #: set while rank 0 has accepted this rank's connection
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="tokentrace-control-link", daemon=True)

    def start(self) -> ControlLink:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            _shut(self._sock)

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                self._session()
            except OSError as exc:
                if self._stop.is_set():
                    return
                if self.connected.is_set():
                    log.warning("rank %d: lost its control connection to rank 0 (%s); connecting again", self.rank,
                                exc)
                    warned = False
                elif not warned:
                    log.warning("rank %d: no control connection to rank 0 at %s:%d (%s); serving on without it: "
                                "rank 0 cannot name this rank if the ring stalls (trying again every %g s)",
                                self.rank, self.host, self.port, exc, _RETRY_S)
                    warned = True
            self.connected.clear()
            self._stop.wait(_RETRY_S)

    def _session(self) -> None:
        with socket.create_connection((self.host, self.port), timeout=_HELLO_TIMEOUT_S) as sock:
            self._sock = sock
            hello = {"secret": self.secret, "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}
            sock.sendall(json.dumps(hello).encode() + b"\n")
            with sock.makefile("rb") as reader:
                if reader.readline(_MAX_LINE).strip() != b"ok":
                    raise ConnectionRefusedError("rank 0 refused it")
            self.connected.set()
            log.info("rank %d: control connection to rank 0 at %s:%d", self.rank, self.host, self.port)
            while not self._stop.wait(self.beat_s):
                sock.sendall(json.dumps({"steps": self.steps(), "t": round(time.monotonic(), 3)}).encode() + b"\n")


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive probes after 2 s without a byte: a connection whose host went down (no FIN)
    closes within seconds, as one whose process exited does at once; a stopped process's kernel still
    answers them."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _address(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


# --- each rank's compute and its waits on the ring ----------------------------------------------
#: Every this many engine steps (--timed-step-every), each rank of a pipeline times one: its compute
#: and its waits on the ring. The others keep mlx-lm's overlap of one step's evaluation with the
#: next's dispatch.
TIMED_EVERY = 8
#: ... but at most one each this many seconds (--timed-step-gap): a timed step loses that overlap
#: (about the Python time of building one step's graph, ~1 ms here), which on a small model's 4 ms
#: steps cost 3 % of decode tokens/s at one in 8 (bench/cluster.py).
TIMED_GAP_S = 0.25


class StepTimer:
    """Times some engine steps on a rank of a pipeline placement: rank 0 decides which (``due``)
    and tells the other ranks with the step (an op of its hand-over), so that every rank times the
    same steps. Due is one step in ``every``, at most one each ``gap_s``, and any step in which a
    sequence begins a phase (prefill, decode) that no timed step of its own has covered yet: a short
    request still gets its phases split, and the cost stays bounded by the gap.

    A timed step first drains what the generator left evaluating (so that it starts clean), then
    evaluates the forward pass at the rank's boundaries, not per layer: the input of its first layer
    (the activation received from the previous rank: the time to it is a wait on the ring, except on
    the rank holding the first layers, which only embeds the tokens), the output of its last layer
    (the time to it is this rank's compute: its layers, the part its placement gives it) and the
    input of the final norm (after the activation went on and every rank's output was gathered: a
    wait). What is left of the step (embedding, norm, head and sampling, which every rank computes
    alike) is the rest. The wrappers sit in the model's layer list; an untimed step passes through
    them untouched.

    Beside each wait's length, the CPU time the process used during it: the ring's receive polls
    its sockets, so a rank that waits on the link burns about as much CPU as wall time, and one that
    another process keeps off its CPU burns less (its wait is then partly starvation, not the link).
    """

    def __init__(self, model: Any, every: int = TIMED_EVERY, gap_s: float = TIMED_GAP_S):
        from mlx_lm.generate import generation_stream

        inner = model.model
        self.every = every
        self.gap_ns = int(gap_s * 1e9)
        self._timed_step = self._timed_ns = 0  # the last timed step's number and start
        self.stream = generation_stream
        self.receives = inner.pipeline_rank < inner.pipeline_size - 1
        self.armed = False
        self.steps = 0
        self._start = self._last = self._compute = self._wait = self._last_cpu = self._wait_cpu = 0
        first, last = inner.start_idx, inner.end_idx - 1
        inner.layers[first] = _Mark(inner.layers[first], self, before=True, after=first == last)
        if last != first:
            inner.layers[last] = _Mark(inner.layers[last], self, before=False, after=True)
        if hasattr(inner, "norm"):
            inner.norm = _Mark(inner.norm, self, before=True, after=False, gathered=True)

    def due(self, fresh: bool = False) -> bool:
        """Rank 0, before a step: whether every rank times it; ``fresh`` when a sequence in it
        begins a phase no timed step has covered."""
        self.steps += 1
        if self.every <= 0:
            return False
        return fresh or (self.steps - self._timed_step >= self.every
                         and time.perf_counter_ns() - self._timed_ns >= self.gap_ns)

    def arm(self, due: bool) -> bool:
        """Before a step rank 0 found ``due``: time it (from a drained stream); returns ``due``."""
        if not due:
            return False
        import mlx.core as mx

        mx.synchronize(self.stream)
        self._start = self._last = self._timed_ns = time.perf_counter_ns()
        self._timed_step = self.steps
        self._last_cpu = time.process_time_ns()
        self._compute = self._wait = self._wait_cpu = 0
        self.armed = True
        return True

    def finish(self) -> tuple[int, int, int, int]:
        """After a timed step: this rank's (compute, ring wait, whole step, CPU used in the ring
        waits) in ns."""
        import mlx.core as mx

        mx.synchronize(self.stream)
        self.armed = False
        return self._compute, self._wait, time.perf_counter_ns() - self._start, self._wait_cpu

    def stamp(self, part: str) -> None:
        """A boundary reached: the time since the last one was ``compute`` (the rank's layers),
        ``wait`` (on the ring) or ``rest``."""
        now, cpu = time.perf_counter_ns(), time.process_time_ns()
        if part == "compute":
            self._compute += now - self._last
        elif part == "wait":
            self._wait += now - self._last
            self._wait_cpu += cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu


class _Mark:
    """A layer (or the final norm) of the model with a boundary before or after it, stamped while
    the timer is armed. Attribute reads go to the layer (a cache factory may ask it)."""

    def __init__(self, inner: Any, timer: StepTimer, before: bool, after: bool, gathered: bool = False):
        self.inner, self.timer, self.before, self.after, self.gathered = inner, timer, before, after, gathered

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        timer = self.timer
        if timer.armed and self.before:
            import mlx.core as mx

            mx.eval(x)
            # Before the first layer: a wait where an activation is received (else the embedding,
            # the rest); before the norm: the output went on and every rank's was gathered, a wait.
            timer.stamp("wait" if self.gathered or timer.receives else "rest")
        y = self.inner(x, *args, **kwargs)
        if timer.armed and self.after:
            import mlx.core as mx

            mx.eval(y)
            timer.stamp("compute")
        return y

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class timed_step:
    """``with timed_step(timer, due):`` around one engine step; ``result`` is then (compute, ring
    wait, whole step, CPU in the ring waits) in ns when the step was timed, else None (no timer, or
    a step rank 0 did not find due)."""

    def __init__(self, timer: StepTimer | None, due: bool):
        self.timer = timer
        self.due = due
        self.result: tuple[int, int, int, int] | None = None

    def __enter__(self) -> timed_step:
        self.armed = self.timer is not None and self.timer.arm(self.due)
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if self.armed:
            if kind is None:
                self.result = self.timer.finish()
            else:
                self.timer.armed = False


def step_timer(runtime: Any, every: int = TIMED_EVERY, gap_s: float = TIMED_GAP_S) -> StepTimer | None:
    """The step timer of a pipeline rank (``StepTimer``); None for one process, a tensor placement
    (whose communication is inside every layer: its ranks report step times only) or ``every`` 0."""
    model = runtime.model
    if every <= 0:
        return None
    if runtime.group is None or runtime.group.size() < 2 or not hasattr(getattr(model, "model", None), "start_idx"):
        return None
    if getattr(model.model, "pipeline_size", 1) < 2:
        return None
    return StepTimer(model, every, gap_s)
