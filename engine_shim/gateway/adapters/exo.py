"""Exo (exo-explore/exo), API on port 52415. Tested against recorded ``/state`` documents, not a live
cluster: Exo needs macOS and its Rust bindings. Shapes from exo at b5375f8c (2026-06-22):
``src/exo/shared/types/state.py`` (``State``, camelCase aliases), ``worker/runners.py`` (runner status
machine), ``worker/instances.py``, ``worker/shards.py``, ``worker/downloads.py``, ``profiling.py``
(``NodeIdentity``), ``utils/pydantic_ext.py`` (a tagged union serialises as ``{"ClassName": {...}}``),
``shared/apply.py`` (``NodeTimedOut`` drops a node from topology and ``lastSeen`` but keeps its
``nodeIdentities`` entry — the ghost identities of exo#2194).

``parse_state`` turns one ``/state`` into instances (model, nodes, shards, per node the four readiness
stages: files present, runner process up, runner ready, first answer), nodes, and findings: the
contradictions between Exo's views. The adapter polls it, keeps when each finding was first seen, and
gives a request that went to an instance whose runner was loading or failed a cold-start reason
naming the node and the stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from tokentrace.engine_shim.gateway.adapters.base import (
    Adapter,
    Facts,
    InstanceState,
    LifecycleEvent,
    Probe,
)
from tokentrace.engine_shim.gateway.adapters.openai import get_json

PREFIX = "exo."
DEFAULT_PORT = 52415

#: Runner statuses (worker/runners.py) in the order a runner passes them, and what each means for
#: readiness: process up from Connecting on, ready at Ready/Running.
RUNNER_ORDER = ("RunnerIdle", "RunnerConnecting", "RunnerConnected", "RunnerLoading", "RunnerLoaded",
                "RunnerWarmingUp", "RunnerReady", "RunnerRunning", "RunnerShuttingDown", "RunnerShutdown")
PROCESS_UP = frozenset(RUNNER_ORDER[1:8])
READY = frozenset({"RunnerReady", "RunnerRunning"})
NOT_READY = frozenset({"RunnerIdle", "RunnerConnecting", "RunnerConnected", "RunnerLoading", "RunnerLoaded",
                       "RunnerWarmingUp", "RunnerFailed"})


@dataclass(frozen=True)
class Runner:
    """One runner process (one per instance and node)."""

    runner_id: str
    node_id: str | None  #: the node it runs on (None: in no instance's nodeToRunner)
    instance_id: str | None  #: the instance it serves (None: a runner with no instance)
    status: str | None  #: e.g. "Loading" (the class name without "Runner"); None: no status yet
    layers_loaded: int | None = None  #: while Loading
    total_layers: int | None = None  #: while Loading
    error: str | None = None  #: Failed: error message and diagnostics

    def stage(self) -> str:
        """Human text: "Loading 12/28 layers", "Failed: <error>", "WarmingUp", "no status"."""
        if self.status is None:
            return "no status"
        if self.status == "Loading" and self.total_layers:
            return f"Loading {self.layers_loaded or 0}/{self.total_layers} layers"
        if self.status == "Failed":
            return f"Failed: {self.error or 'no message'}"
        return self.status


@dataclass(frozen=True)
class Shard:
    """The layers one node holds for an instance."""

    node_id: str
    runner_id: str
    kind: str  #: "Pipeline" | "Tensor" | "Cfg"
    start_layer: int | None
    end_layer: int | None  #: exclusive
    n_layers: int | None
    device_rank: int | None
    world_size: int | None


@dataclass(frozen=True)
class Node:
    """A node as the views see it."""

    node_id: str
    name: str | None  #: NodeIdentity.friendlyName
    in_topology: bool
    last_seen: str | None  #: lastSeen, as Exo wrote it (None: timed out or never seen)
    ram_total: int | None = None
    ram_available: int | None = None


@dataclass
class ExoInstance:
    """One deployed model over one or more nodes."""

    instance_id: str
    model_id: str | None
    backend: str  #: "MlxRing" | "MlxJaccl"
    shards: list[Shard] = field(default_factory=list)
    runners: list[Runner] = field(default_factory=list)
    files_present: dict[str, bool | None] = field(default_factory=dict)  #: per node: DownloadCompleted

    def runner_on(self, node_id: str) -> Runner | None:
        """The runner of this instance on ``node_id``."""
        return next((r for r in self.runners if r.node_id == node_id), None)

    def ready(self) -> bool:
        """Every runner is Ready or Running."""
        return bool(self.runners) and all(r.status is not None and "Runner" + r.status in READY
                                          for r in self.runners)

    def stages(self, node_id: str, first_answer: bool | None) -> dict[str, bool | None]:
        """The four readiness stages of the field report for one node of this instance."""
        runner = self.runner_on(node_id)
        status = None if runner is None or runner.status is None else "Runner" + runner.status
        return {
            "files_present": self.files_present.get(node_id),
            "runner_process_up": None if status is None else status in PROCESS_UP,
            "runner_ready": None if status is None else status in READY,
            "first_answer": first_answer,
        }


@dataclass
class ExoState:
    """One ``/state``, parsed."""

    nodes: dict[str, Node]
    instances: dict[str, ExoInstance]
    findings: list[str]  #: contradictions between views, human text (stable for the same problem)


def _tagged(value: Any) -> tuple[str | None, dict[str, Any]]:
    """``{"ClassName": {...}}`` -> ("ClassName", {...})."""
    if isinstance(value, dict) and len(value) == 1:
        ((name, inner),) = value.items()
        if isinstance(inner, dict):
            return name, inner
    return None, {}


def _runner_status(value: Any) -> tuple[str | None, dict[str, Any]]:
    name, inner = _tagged(value)
    return (name.removeprefix("Runner") if name else None), inner


def _failure(inner: dict[str, Any]) -> str:
    parts = [str(inner["errorMessage"])] if inner.get("errorMessage") else []
    for diagnostic in inner.get("diagnostics") or ():
        kind, body = _tagged(diagnostic)
        if kind:
            parts.append(f"{kind}: {body.get('message', '')}".strip())
    return "; ".join(parts) or "no message"


def _memory(value: Any) -> int | None:
    return value.get("inBytes") if isinstance(value, dict) and isinstance(value.get("inBytes"), int) else None


def parse_state(document: Any) -> ExoState:
    """Instances, nodes and findings of one Exo ``/state`` document."""
    doc = document if isinstance(document, dict) else {}
    topology = doc.get("topology") if isinstance(doc.get("topology"), dict) else {}
    in_topology = {str(n) for n in topology.get("nodes") or ()}
    last_seen = doc.get("lastSeen") if isinstance(doc.get("lastSeen"), dict) else {}
    identities = doc.get("nodeIdentities") if isinstance(doc.get("nodeIdentities"), dict) else {}
    memory = doc.get("nodeMemory") if isinstance(doc.get("nodeMemory"), dict) else {}
    nodes = {}
    for node_id in sorted(in_topology | set(last_seen) | set(identities)):
        identity, ram = identities.get(node_id) or {}, memory.get(node_id) or {}
        nodes[node_id] = Node(node_id, identity.get("friendlyName"), node_id in in_topology,
                              last_seen.get(node_id), _memory(ram.get("ramTotal")), _memory(ram.get("ramAvailable")))
    statuses = doc.get("runners") if isinstance(doc.get("runners"), dict) else {}
    completed = _completed_downloads(doc.get("downloads"))
    instances: dict[str, ExoInstance] = {}
    placed: set[str] = set()
    for instance_id, tagged in (doc.get("instances") or {}).items():
        backend, body = _tagged(tagged)
        assignments = body.get("shardAssignments") or {}
        model = assignments.get("modelId")
        instance = ExoInstance(str(instance_id), model, (backend or "").removesuffix("Instance"))
        to_shard = assignments.get("runnerToShard") or {}
        for node_id, runner_id in (assignments.get("nodeToRunner") or {}).items():
            placed.add(runner_id)
            kind, shard = _tagged(to_shard.get(runner_id))
            instance.shards.append(Shard(node_id, runner_id, (kind or "").removesuffix("ShardMetadata"),
                                         shard.get("startLayer"), shard.get("endLayer"), shard.get("nLayers"),
                                         shard.get("deviceRank"), shard.get("worldSize")))
            status, inner = _runner_status(statuses.get(runner_id))
            instance.runners.append(Runner(
                runner_id, node_id, str(instance_id), status, inner.get("layersLoaded"), inner.get("totalLayers"),
                _failure(inner) if status == "Failed" else None))
            instance.files_present[node_id] = (model in completed.get(node_id, set())) if node_id in completed \
                else None
        instances[str(instance_id)] = instance
    return ExoState(nodes, instances, _findings(nodes, instances, statuses, placed))


def _completed_downloads(downloads: Any) -> dict[str, set[str]]:
    """{node: model ids whose download completed} (``DownloadCompleted`` entries)."""
    done: dict[str, set[str]] = {}
    for node_id, entries in (downloads or {}).items() if isinstance(downloads, dict) else ():
        models = done.setdefault(node_id, set())
        for entry in entries or ():
            kind, body = _tagged(entry)
            if kind == "DownloadCompleted":
                _, shard = _tagged(body.get("shardMetadata"))
                card = shard.get("modelCard") or {}
                if card.get("modelId"):
                    models.add(card["modelId"])
    return done


def _findings(nodes: dict[str, Node], instances: dict[str, ExoInstance], statuses: dict[str, Any],
              placed: set[str]) -> list[str]:
    found = []
    for node in nodes.values():
        if not node.in_topology and node.last_seen is None:
            found.append(f"node {node.name or node.node_id} ({node.node_id}) is still in nodeIdentities but has "
                         f"timed out: it is in neither the topology nor lastSeen")
    for runner_id in sorted(set(statuses) - placed):
        status, _ = _runner_status(statuses[runner_id])
        found.append(f"runner {runner_id} ({status or 'no status'}) belongs to no instance: a leftover runner")
    for instance in instances.values():
        for shard in instance.shards:
            node = nodes.get(shard.node_id)
            if node is None or not node.in_topology:
                found.append(f"instance {instance.instance_id} places layers on node {shard.node_id}, which is not "
                             f"in the topology")
        # Ready next to Loading is a load in progress; Ready next to a runner that failed, is shutting
        # down or has no status is an instance that serves on some ranks only.
        seen = {r.status for r in instance.runners}
        if seen & {"Ready", "Running"} and seen & {"Failed", "ShuttingDown", "Shutdown", None}:
            stages = ", ".join(f"{_name(nodes, r.node_id)}: {r.stage()}" for r in instance.runners)
            found.append(f"instance {instance.instance_id} has runners that disagree ({stages})")
        for runner in instance.runners:
            if runner.status == "Failed":
                found.append(f"runner {runner.runner_id} of instance {instance.instance_id} on "
                             f"{_name(nodes, runner.node_id)} failed: {runner.error}")
    return found


def _name(nodes: dict[str, Node], node_id: str | None) -> str:
    node = nodes.get(node_id or "")
    return f"node {node.name}" if node is not None and node.name else f"node {node_id}"


def cold_start_reason(state: ExoState, model: str | None) -> tuple[str, str, str] | None:
    """(instance id, node id, text) when the instance serving ``model`` had a runner that was not
    ready: the node and the stage it was in. None when every runner was ready (or none matched)."""
    for instance in state.instances.values():
        if model is not None and instance.model_id not in (model, None) and \
                str(instance.model_id).split("/")[-1] != model.split("/")[-1]:
            continue
        for runner in instance.runners:
            if runner.status is None or "Runner" + runner.status in NOT_READY:
                return (instance.instance_id, runner.node_id or "",
                        f"waited on instance {instance.instance_id}: runner {runner.runner_id} on "
                        f"{_name(state.nodes, runner.node_id)} was {runner.stage()}")
    return None


class ExoAdapter(Adapter):
    """An Exo node's API (any node; each serves the whole cluster's state)."""

    kind: ClassVar[str] = "exo"
    engine: ClassVar[str] = "exo"
    measures: ClassVar[frozenset[str]] = frozenset({"prompt_tokens", "completion_tokens", "lifecycle"})

    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient, probe: Probe):
        super().__init__(name, base_url, client, probe)
        self.state: ExoState | None = None  #: the latest /state
        self.first_seen: dict[str, int] = {}  #: finding -> when a poll first saw it (epoch ns)
        self.answered: set[str] = set()  #: instances that returned a first answer through the gateway
        self._stages: dict[str, str] = {}  #: runner id -> stage at the previous poll

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str) -> Probe | None:
        """``/node_id`` answers and ``/state`` has ``instances`` and ``topology``."""
        base = base_url.rstrip("/")
        node = await get_json(client, base + "/node_id")
        state = await get_json(client, base + "/state")
        if node is None or not isinstance(state, dict) or "topology" not in state or "instances" not in state:
            return None
        parsed = parse_state(state)
        return Probe(kind=cls.kind, models=tuple(sorted({i.model_id for i in parsed.instances.values()
                                                         if i.model_id})),
                     details={"node_id": str(node)})

    def finish(self, facts: Facts) -> None:
        """A request served while its instance had a runner loading or failed gets the reason."""
        if self.state is None:
            return
        model = facts.evidence.get(f"{PREFIX}model")
        found = cold_start_reason(self.state, model if isinstance(model, str) else None)
        if found is not None:
            instance_id, node_id, text = found
            facts.evidence.update({f"{PREFIX}cold_start": text, f"{PREFIX}instance_id": instance_id,
                                   f"{PREFIX}node_id": node_id})
        elif facts.error is None and facts.completion_tokens:
            for instance in self.state.instances.values():
                if model in (instance.model_id, None):
                    self.answered.add(instance.instance_id)

    def facts_from_payload(self, facts: Facts, payload: Any, route) -> None:
        """OpenAI shapes through the base, plus the model that answered."""
        super().facts_from_payload(facts, payload, route)
        if isinstance(payload, dict) and isinstance(payload.get("model"), str):
            facts.evidence[f"{PREFIX}model"] = payload["model"]

    async def poll(self) -> InstanceState:
        """``/state``: readiness of every instance, runner stage changes as events, findings with the
        time a poll first saw each."""
        document = await get_json(self.client, self.base_url + "/state")
        if document is None:
            return InstanceState(reachable=False)
        now = time.time_ns()
        state = self.state = parse_state(document)
        for finding in state.findings:
            self.first_seen.setdefault(finding, now)
        for gone in set(self.first_seen) - set(state.findings):
            del self.first_seen[gone]
        events = []
        for instance in state.instances.values():
            for runner in instance.runners:
                stage = runner.stage()
                if self._stages.get(runner.runner_id) != stage:
                    events.append(LifecycleEvent(f"exo.runner.{runner.status or 'unknown'}", now,
                                                 f"runner {runner.runner_id} on {_name(state.nodes, runner.node_id)} "
                                                 f"(instance {instance.instance_id}): {stage}"))
                    self._stages[runner.runner_id] = stage
        runners = [r for i in state.instances.values() for r in i.runners]
        # Exo's API takes a request for a placed instance whatever its runners are doing (the request
        # waits for them), so the upstream is ready to receive when an instance exists.
        return InstanceState(
            reachable=True,
            ready=bool(state.instances),
            loading=any(r.status in ("Connecting", "Connected", "Loading", "Loaded", "WarmingUp") for r in runners),
            running=sum(r.status == "Running" for r in runners),
            models=tuple(sorted({i.model_id for i in state.instances.values() if i.model_id})),
            events=tuple(events),
            findings=tuple(f"{_iso(self.first_seen[f])} {f}" for f in state.findings),
        )

    def cluster_view(self) -> list[dict[str, Any]] | None:
        """Per Exo instance: model, backend, per node its shard, runner stage and the four readiness
        stages (what the instances page shows)."""
        if self.state is None:
            return []
        view = []
        for instance in self.state.instances.values():
            nodes = []
            for shard in sorted(instance.shards, key=lambda s: (s.device_rank is None, s.device_rank or 0)):
                runner = instance.runner_on(shard.node_id)
                node = self.state.nodes.get(shard.node_id) or Node(shard.node_id, None, False, None)
                nodes.append({
                    "node_id": shard.node_id, "name": node.name,
                    "layers": [shard.start_layer, shard.end_layer], "n_layers": shard.n_layers,
                    # the node model of a tokentrace cluster (dashboards/nodes.py): rank, what it holds, memory
                    "rank": shard.device_rank, "ranks": shard.world_size, "placement": _placement(shard),
                    "memory_free_bytes": node.ram_available, "memory_total_bytes": node.ram_total,
                    "runner_id": shard.runner_id, "stage": runner.stage() if runner else "no runner",
                    "stages": instance.stages(shard.node_id, instance.instance_id in self.answered or None),
                })
            view.append({"instance_id": instance.instance_id, "model": instance.model_id,
                         "backend": instance.backend, "ready": instance.ready(), "nodes": nodes})
        return view


def _placement(shard: Shard) -> str | None:
    """What a node holds, in the words of a tokentrace rank (``tokentrace.node.placement``): 'layers
    24-47 of 48' (Exo's end layer is exclusive), 'tensor shard 2 of 2'."""
    if shard.kind == "Tensor" and shard.device_rank is not None and shard.world_size:
        return f"tensor shard {shard.device_rank + 1} of {shard.world_size}"
    if shard.start_layer is None or shard.end_layer is None:
        return None
    return f"layers {shard.start_layer}-{shard.end_layer - 1} of {shard.n_layers or '?'}"


def _iso(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))
