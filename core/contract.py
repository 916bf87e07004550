"""The telemetry contract: every span, attribute, event and enum value that engine shims emit and
the collector understands.

This module is the single source of names. ``docs/telemetry.md`` is the normative, human copy;
``tests/test_contract_docs.py`` fails when the two disagree (span, attribute, type, unit, event, enum).

Conventions (DESIGN §3):
- ``gen_ai.*`` semantic-convention names where they exist, ``tokentrace.*`` for engine internals.
- Every span of a request's trace carries ``tokentrace.request.id``, so each span normalizes to rows
  on its own (no cross-span join at ingest).
- Durations in summaries are milliseconds (double); offsets inside columnar arrays are nanoseconds
  relative to the carrying span's start (int).
- Block hashes are 64-bit BLAKE2b digests chained over token ids, sent as signed int64 (two's
  complement of the unsigned digest) because OTLP integers are signed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --- Resource -------------------------------------------------------------------------------------
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"
HOST_NAME = "host.name"
ENGINE = "tokentrace.engine"
ENGINE_VERSION = "tokentrace.engine.version"
MODEL = "gen_ai.request.model"
OBSERVER = "tokentrace.observer"
OBSERVER_MEASURES = "tokentrace.observer.measures"
MODEL_REVISION = "tokentrace.model.revision"
CHAT_TEMPLATE_HASH = "tokentrace.chat_template.hash"
HOST_CHIP = "tokentrace.host.chip"
HOST_MEMORY_BANDWIDTH_GBS = "tokentrace.host.memory_bandwidth_gbs"
NODE_RANK = "tokentrace.node.rank"
NODE_RANKS = "tokentrace.node.ranks"
NODE_OF = "tokentrace.node.of"


def node_instance_id(instance_id: str, rank: int) -> str:
    """A distributed engine's rank's own instance id: the instance itself for rank 0, ``<instance>/rank<r>``."""
    return instance_id if rank == 0 else f"{instance_id}/rank{rank}"


def node_rank(instance_id: str, node: str) -> int:
    """The rank of a node of ``instance_id`` by its own instance id (node_instance_id's inverse)."""
    return 0 if node == instance_id else int(node.rsplit("/rank", 1)[1])
NODE_PLACEMENT = "tokentrace.node.placement"

# --- Span names -----------------------------------------------------------------------------------
SPAN_REQUEST = "llm.request"
SPAN_QUEUE = "llm.queue"
SPAN_LOAD_WAIT = "llm.load_wait"
SPAN_CACHE_LOOKUP = "llm.cache.lookup"
SPAN_PREFILL = "llm.prefill"
SPAN_PREFILL_CHUNK = "llm.prefill.chunk"
SPAN_DECODE = "llm.decode"
SPAN_CACHE_INSERT = "llm.cache.insert"
SPAN_MODEL_LOAD = "model.load"
SPAN_LOAD_RESOLVE = "model.load.resolve"
SPAN_LOAD_WEIGHTS = "model.load.weights"
SPAN_LOAD_TOKENIZER = "model.load.tokenizer"
SPAN_LOAD_WARMUP = "model.load.warmup"
SPAN_LOAD_GROUP = "model.load.group"
SPAN_LOAD_SHARD = "model.load.shard"
SPAN_ENGINE_STEPS = "engine.steps"
SPAN_HEARTBEAT = "instance.heartbeat"
SPAN_LIFECYCLE = "instance.lifecycle"
SPAN_CACHE_TRIM = "llm.cache.trim"
SPAN_ROUTE = "gateway.route"
SPAN_CLUSTER_STATE = "cluster.state"

# --- Event names ----------------------------------------------------------------------------------
EVENT_CACHE_EVICT = "llm.cache.evict"
EVENT_STARTED = "instance.started"
EVENT_READY = "instance.ready"
EVENT_FIRST_RESPONSE = "instance.first_response"
EVENT_STOPPED = "instance.stopped"
EVENT_DOWN = "instance.down"
LIFECYCLE_EVENTS = (EVENT_STARTED, EVENT_READY, EVENT_FIRST_RESPONSE, EVENT_STOPPED, EVENT_DOWN)

# --- Attribute keys: request ----------------------------------------------------------------------
REQUEST_ID = "tokentrace.request.id"
SESSION_ID = "tokentrace.session.id"
ENDPOINT = "tokentrace.request.endpoint"
STREAMED = "tokentrace.request.streamed"
CLIENT_DISCONNECTED = "tokentrace.request.client_disconnected"
HTTP_STATUS = "http.response.status_code"
ERROR_TYPE = "error.type"
MAX_TOKENS = "gen_ai.request.max_tokens"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
RESPONSE_ID = "gen_ai.response.id"
OPERATION_CHAT = "chat"
OPERATION_TEXT_COMPLETION = "text_completion"
QUEUE_MS = "tokentrace.request.queue_ms"
LOAD_WAIT_MS = "tokentrace.request.load_wait_ms"
PREFILL_MS = "tokentrace.request.prefill_ms"
DECODE_MS = "tokentrace.request.decode_ms"
TTFT_MS = "tokentrace.request.ttft_ms"
TPOT_MS = "tokentrace.request.tpot_ms"
FIRST_CONTENT_MS = "tokentrace.request.first_content_ms"
E2E_MS = "tokentrace.request.e2e_ms"
UPSTREAM_EVIDENCE = "tokentrace.upstream.evidence"

# --- Attribute keys: gateway routing (gateway.route) -----------------------------------------------
GATEWAY_WAIT_MS = "tokentrace.gateway.wait_ms"
ROUTE_POLICY = "tokentrace.route.policy"
ROUTE_CANDIDATES = "tokentrace.route.candidates"
ROUTE_SCORES = "tokentrace.route.scores"
ROUTE_CHOICE = "tokentrace.route.choice"
ROUTE_REASON = "tokentrace.route.reason"
ROUTE_ATTEMPTS = "tokentrace.route.attempts"
ROUTE_SKIPPED = "tokentrace.route.skipped"
AVOIDABLE_PREFILL = "tokentrace.route.avoidable_prefill_tokens"
AVOIDABLE_FROM = "tokentrace.route.avoidable_from"

# --- Attribute keys: queue, load ------------------------------------------------------------------
QUEUE_DEPTH = "tokentrace.queue.depth"
QUEUE_RUNNING = "tokentrace.queue.running"
MAX_BATCH = "tokentrace.max_batch"
LOAD_ID = "tokentrace.load.id"
LOAD_LAZY = "tokentrace.load.lazy"
LOAD_BYTES = "tokentrace.load.bytes"
MODEL_PATH = "tokentrace.model.path"

# --- Attribute keys: prompt cache -----------------------------------------------------------------
CACHE_PROMPT_TOKENS = "tokentrace.cache.prompt_tokens"
CACHE_MATCHED_TOKENS = "tokentrace.cache.matched_tokens"
CACHE_MATCH = "tokentrace.cache.match"
CACHE_MATCHED_ENTRY = "tokentrace.cache.matched_entry"
CACHE_ENTRIES = "tokentrace.cache.entries"
CACHE_UNIT = "tokentrace.cache.unit"
CLUSTER_INSTANCES = "tokentrace.cluster.instances"
CLUSTER_FINDINGS = "tokentrace.cluster.findings"
CACHE_BYTES = "tokentrace.cache.bytes"
CACHE_MAX_ENTRIES = "tokentrace.cache.max_entries"
CACHE_MAX_BYTES = "tokentrace.cache.max_bytes"
CACHE_LIMIT_RANK = "tokentrace.cache.limit_rank"
CACHE_BLOCK_SIZE = "tokentrace.cache.block_size"
CACHE_BLOCK_HASHES = "tokentrace.cache.block_hashes"
ENTRY_FINGERPRINT = "tokentrace.cache.entry.fingerprint"
ENTRY_TOKENS = "tokentrace.cache.entry.tokens"
ENTRY_BYTES = "tokentrace.cache.entry.bytes"
ENTRY_REQUEST_ID = "tokentrace.cache.entry.request_id"
EVICT_REASON = "tokentrace.cache.evict.reason"
SEGMENT_ROLES = "tokentrace.segments.roles"
SEGMENT_STARTS = "tokentrace.segments.starts"
SEGMENT_ENDS = "tokentrace.segments.ends"
SEGMENT_HASHES = "tokentrace.segments.hashes"
SEGMENT_TAIL_HASHES = "tokentrace.segments.tail_hashes"
SEGMENT_SNIPPETS = "tokentrace.segments.snippets"

# --- Attribute keys: prefill, decode --------------------------------------------------------------
PREFILL_TOKENS = "tokentrace.prefill.tokens"
PREFILL_CHUNKS = "tokentrace.prefill.chunks"
CHUNK_OFFSET = "tokentrace.chunk.offset"
CHUNK_TOKENS = "tokentrace.chunk.tokens"
CHUNK_BATCH_SIZE = "tokentrace.chunk.batch_size"
DECODE_STEPS = "tokentrace.decode.steps"
DECODE_STEP_OFFSETS = "tokentrace.decode.step_offsets_ns"
ITL_P50_MS = "tokentrace.decode.itl_p50_ms"
ITL_P90_MS = "tokentrace.decode.itl_p90_ms"
ITL_MAX_MS = "tokentrace.decode.itl_max_ms"

# --- Attribute keys: engine steps -----------------------------------------------------------------
STEPS_COUNT = "tokentrace.steps.count"
STEPS_START_OFFSETS = "tokentrace.steps.start_offsets_ns"
STEPS_DURATIONS = "tokentrace.steps.durations_ns"
STEPS_PREFILL_SEQS = "tokentrace.steps.prefill_seqs"
STEPS_DECODE_SEQS = "tokentrace.steps.decode_seqs"
STEPS_PREFILL_TOKENS = "tokentrace.steps.prefill_tokens"
STEPS_DECODE_TOKENS = "tokentrace.steps.decode_tokens"
STEPS_COMPUTE = "tokentrace.steps.compute"
STEPS_RING_WAIT = "tokentrace.steps.ring_wait"
STEPS_RING_WAIT_CPU = "tokentrace.steps.ring_wait_cpu"
STEPS_REQUESTS = "tokentrace.steps.requests"
STEPS_MEMBERS = "tokentrace.steps.members"

# --- Attribute keys: heartbeat --------------------------------------------------------------------
KV_BYTES_PER_TOKEN = "tokentrace.kv.bytes_per_token"
MEMORY_BYTES = "tokentrace.memory.bytes"
MEMORY_FREE = "tokentrace.memory.free"
CACHE_REPORT_MODE = "tokentrace.cache.report_mode"
CACHE_PREEMPTED_HIT_TOKENS = "tokentrace.cache.preempted_hit_tokens"
STALL_STATE = "tokentrace.stall.state"
STALL_REASON = "tokentrace.stall.reason"
STALL_MS = "tokentrace.stall.ms"
STALL_RANKS = "tokentrace.stall.ranks"
OPEN_REQUESTS = "tokentrace.requests.open"
STALL_RANK_TIMEOUT_MS = "tokentrace.stall.rank_timeout_ms"

# --- Enum values ----------------------------------------------------------------------------------
ENGINE_MLX = "mlx-lm"
ENGINE_VLLM = "vllm"
ENGINE_MLX_LM_SERVER = "mlx_lm.server"
ENGINE_OPENAI = "openai-compatible"
ENGINE_LLAMA_CPP = "llama.cpp"
ENGINE_OLLAMA = "ollama"
ENGINE_EXO = "exo"
ENGINE_SGLANG = "sglang"
ENGINE_LMSTUDIO = "lmstudio"
MATCH_EXACT = "exact"
MATCH_PREFIX = "prefix"
MATCH_NONE = "none"
EVICT_MAX_ENTRIES = "max_entries"
EVICT_MAX_BYTES = "max_bytes"
EVICT_MEMORY_PRESSURE = "memory_pressure"
EVICT_TRIM = "trim"
EVICT_SUPERSEDED = "superseded"
ROLE_SYSTEM = "system"
ROLE_USER = "user"
ROLE_ASSISTANT = "assistant"
ROLE_TOOL = "tool"
ROLE_TOOLS = "tools"
ROLE_PROMPT = "prompt"
#: Chat roles some clients send that the contract folds into its closed set of segment roles.
_ROLE_ALIASES = {"developer": ROLE_SYSTEM, "function": ROLE_TOOL, "ipython": ROLE_TOOL}


def segment_role(role: object) -> str:
    """The contract's segment role for a chat message's role (unknown roles count as user input);
    every observer that cuts a chat into segments names them by this one rule."""
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else None
    return role if role in (ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL) else ROLE_USER


#: What one of ``tokentrace.cache.entries`` is: a prompt entry (MLX prefix cache), a KV block (vLLM
#: paged cache), a slot (llama.cpp, one cached sequence per slot) or a token.
UNIT_ENTRY = "entry"
UNIT_BLOCK = "block"
UNIT_SLOT = "slot"
UNIT_TOKEN = "token"
OBSERVER_ENGINE = "engine"
OBSERVER_PLUGIN = "plugin"
OBSERVER_NATIVE = "native"
OBSERVER_GATEWAY = "gateway"
#: Key, inside ``UPSTREAM_EVIDENCE``, of the upstream's own id of an answer (the response body's
#: ``id``: llama.cpp's ``chatcmpl-...``, vLLM's, mlx_lm.server's): an alias of the request id.
UPSTREAM_RESPONSE_ID = "upstream.response_id"
#: Keys inside ``UPSTREAM_EVIDENCE`` whose meaning the collector relies on (docs/telemetry.md,
#: "Keys of upstream evidence"); every other key is the adapter's own and only shown.
UPSTREAM_EVIDENCE_KEYS = (UPSTREAM_RESPONSE_ID,)
POLICY_ROUND_ROBIN = "round_robin"
POLICY_LEAST_LOADED = "least_loaded"
POLICY_SESSION = "session"
POLICY_PREFIX = "prefix"

#: Per-request parts an observer can declare it measures (``OBSERVER_MEASURES``): the phase
#: summary of ``llm.request`` by name (``{part}_ms`` in the request row).
OBSERVER_PARTS = ("load_wait", "queue", "prefill", "decode", "ttft", "tpot")

ENUMS: dict[str, tuple[str, ...]] = {
    ENGINE: (ENGINE_MLX, ENGINE_VLLM, ENGINE_MLX_LM_SERVER, ENGINE_OPENAI, ENGINE_LLAMA_CPP, ENGINE_OLLAMA,
             ENGINE_EXO, ENGINE_SGLANG, ENGINE_LMSTUDIO),
    CACHE_MATCH: (MATCH_EXACT, MATCH_PREFIX, MATCH_NONE),
    EVICT_REASON: (
        EVICT_MAX_ENTRIES, EVICT_MAX_BYTES, EVICT_MEMORY_PRESSURE, EVICT_TRIM, EVICT_SUPERSEDED,
    ),
    SEGMENT_ROLES: (ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL, ROLE_TOOLS, ROLE_PROMPT),
    CACHE_UNIT: (UNIT_ENTRY, UNIT_BLOCK, UNIT_SLOT, UNIT_TOKEN),
    OBSERVER: (OBSERVER_ENGINE, OBSERVER_PLUGIN, OBSERVER_NATIVE, OBSERVER_GATEWAY),
    ROUTE_POLICY: (POLICY_ROUND_ROBIN, POLICY_LEAST_LOADED, POLICY_SESSION, POLICY_PREFIX),
    OBSERVER_MEASURES: OBSERVER_PARTS,
    OPERATION_NAME: (OPERATION_CHAT, OPERATION_TEXT_COMPLETION),
}
"""Closed value sets, keyed by the attribute that carries them."""

#: Evictions that drop cached tokens; a superseded entry lives on inside the longer entry that
#: replaced it, so only these can make a later miss a *capacity* miss.
CAPACITY_EVICT_REASONS = (EVICT_MAX_ENTRIES, EVICT_MAX_BYTES, EVICT_MEMORY_PRESSURE, EVICT_TRIM)

#: Tokens per block for the chained prefix fingerprint (DESIGN §3).
DEFAULT_BLOCK_SIZE = 16


# --- Specification tables (checked against docs/telemetry.md) -------------------------------------
@dataclass(frozen=True)
class Attr:
    """One attribute of a span or event."""

    key: str
    type: str  #: "string" | "int" | "double" | "bool" | "string[]" | "int[]"
    unit: str  #: "" when unitless; "ms", "ns", "tokens", "bytes", "count", "hash"
    doc: str


@dataclass(frozen=True)
class EventSpec:
    """A span event and its attributes."""

    name: str
    doc: str
    attributes: tuple[Attr, ...] = ()


@dataclass(frozen=True)
class SpanSpec:
    """A span name, where it sits in the trace, and its attributes."""

    name: str
    kind: str  #: OpenTelemetry span kind: "SERVER" or "INTERNAL"
    parent: str  #: parent span name, or "" for a root span
    doc: str
    attributes: tuple[Attr, ...] = ()
    events: tuple[EventSpec, ...] = field(default=())


def _a(key: str, type_: str, unit: str, doc: str) -> Attr:
    return Attr(key, type_, unit, doc)


_RID = _a(REQUEST_ID, "string", "", "request id (X-Request-Id or generated); on every span of the trace")
_limit_rank_meaning = ("a distributed engine's rank 0: the rank whose bytes its prompt cache's byte limit counts, "
               "the one holding the most KV per token (the lowest on a tie). On llm.cache.insert the "
               "entry's, its evictions' and the cache's bytes and the byte limit are that rank's (each "
               "entry's bytes on rank 0 x that rank's KV bytes per token / rank 0's); on every rank's "
               "heartbeat the cache's bytes and byte limit are that rank's own (the limit: its bytes when "
               "the counted rank's reach the limit). Absent on one-process engines and ranks above 0")
_CACHE_STATE = (
    _a(CACHE_ENTRIES, "int", "count", "entries in the prompt cache (at lookup; after insert/evict)"),
    _a(CACHE_UNIT, "string", "", "what one of those entries (and the entry limit) counts (enum)"),
    _a(CACHE_BYTES, "int", "bytes", "bytes held by the prompt cache (same moment)"),
)
_SEGMENTS = (
    _a(SEGMENT_ROLES, "string[]", "", "role of each prompt segment (chat message or tools block)"),
    _a(SEGMENT_STARTS, "int[]", "tokens", "first token index of each segment"),
    _a(SEGMENT_ENDS, "int[]", "tokens", "end token index (exclusive) of each segment"),
    _a(SEGMENT_HASHES, "int[]", "hash", "64-bit content hash of each segment's token ids"),
    _a(SEGMENT_TAIL_HASHES, "int[]", "hash",
       "content hash of each segment's last block of tokens (0: a segment under two blocks)"),
    _a(SEGMENT_SNIPPETS, "string[]", "", "bounded text of each segment; only with --capture-content"),
)
_EVICT = EventSpec(
    EVENT_CACHE_EVICT,
    "one per entry pushed out of the prompt cache",
    (
        _a(ENTRY_FINGERPRINT, "int", "hash", "last chained block hash of the evicted entry"),
        _a(ENTRY_TOKENS, "int", "tokens", "tokens the evicted entry held"),
        _a(ENTRY_BYTES, "int", "bytes", "bytes the evicted entry held"),
        _a(ENTRY_REQUEST_ID, "string", "", "request whose tokens the evicted entry held"),
        _a(EVICT_REASON, "string", "", "why it was evicted (enum)"),
        *_CACHE_STATE,
    ),
)
_LIFECYCLE = tuple(
    EventSpec(name, doc)
    for name, doc in (
        (EVENT_STARTED, "the engine process started (files may still be missing)"),
        (EVENT_READY, "model loaded and warmed up: the runner can serve"),
        (EVENT_FIRST_RESPONSE, "the first real request was answered"),
        (EVENT_STOPPED, "the engine is shutting down"),
    )
)
_DOWN = EventSpec(EVENT_DOWN, "the gateway marked the upstream down (unreachable, slow to connect, or 5xx)")

SPANS: tuple[SpanSpec, ...] = (
    SpanSpec(
        SPAN_REQUEST, "SERVER", "", "arrival -> last byte sent; root of the request's trace",
        (
            _RID,
            _a(SESSION_ID, "string", "", "X-Session-Id header or the OpenAI `user` field"),
            _a(ENDPOINT, "string", "", "HTTP path that served it, e.g. /v1/chat/completions"),
            _a(MODEL, "string", "", "model name the request asked for"),
            _a(MAX_TOKENS, "int", "tokens", "max_tokens of the request"),
            _a(STREAMED, "bool", "", "response was streamed (SSE)"),
            _a(CLIENT_DISCONNECTED, "bool", "", "client went away before the last token"),
            _a(HTTP_STATUS, "int", "", "HTTP status sent"),
            _a(ERROR_TYPE, "string", "", "error class when the request failed"),
            _a(INPUT_TOKENS, "int", "tokens", "prompt tokens"),
            _a(OUTPUT_TOKENS, "int", "tokens", "completion tokens"),
            _a(CACHED_TOKENS, "int", "tokens", "prompt tokens reused from the prefix cache"),
            _a(FINISH_REASONS, "string[]", "", "finish reason per choice (stop, length, cancelled, error)"),
            _a(OPERATION_NAME, "string", "", "GenAI operation (enum): chat or text_completion, from the endpoint"),
            _a(PROVIDER_NAME, "string", "", "GenAI provider: the engine that served it (mlx-lm, vllm)"),
            _a(RESPONSE_ID, "string", "", "id of the response body; equals the request id"),
            _a(QUEUE_MS, "double", "ms", "waiting for a batch slot"),
            _a(LOAD_WAIT_MS, "double", "ms", "waiting for the model to load (cold start)"),
            _a(PREFILL_MS, "double", "ms", "admission -> first token"),
            _a(DECODE_MS, "double", "ms", "first token -> last token"),
            _a(TTFT_MS, "double", "ms", "arrival -> first token"),
            _a(TPOT_MS, "double", "ms", "decode_ms / (output tokens - 1)"),
            _a(FIRST_CONTENT_MS, "double", "ms", "arrival -> first response chunk carrying answer text"),
            _a(E2E_MS, "double", "ms", "arrival -> last byte, as the gateway measured it"),
            _a(GATEWAY_WAIT_MS, "double", "ms", "waited at the gateway for an upstream slot (queueing)"),
            _a(UPSTREAM_EVIDENCE, "string", "", "engine-specific facts the upstream reported (JSON object)"),
        ),
        _LIFECYCLE[2:3],
    ),
    SpanSpec(
        SPAN_ROUTE, "INTERNAL", SPAN_REQUEST,
        "the gateway's routing decision and hop; the root of the gateway's trace when the upstream "
        "reports the request itself",
        (
            _RID,
            _a(SESSION_ID, "string", "", "session the request belongs to"),
            _a(ROUTE_POLICY, "string", "", "routing policy (enum)"),
            _a(ROUTE_CANDIDATES, "string[]", "", "upstreams considered, in score order"),
            _a(ROUTE_SCORES, "double[]", "", "score of each candidate (policy-specific; higher wins)"),
            _a(ROUTE_CHOICE, "string", "", "upstream chosen (the instance id of the request)"),
            _a(ROUTE_REASON, "string", "", "why it was chosen, in words"),
            _a(ROUTE_ATTEMPTS, "int", "count", "upstreams tried (retries happen only before any token)"),
            _a(ROUTE_SKIPPED, "string[]", "", "upstreams skipped as down or failed, as name:reason"),
            _a(GATEWAY_WAIT_MS, "double", "ms", "waited at the gateway for an upstream slot"),
            _a(AVOIDABLE_PREFILL, "int", "tokens", "prompt tokens another upstream held that the chosen "
               "one recomputed"),
            _a(AVOIDABLE_FROM, "string", "", "the upstream that held them"),
        ),
    ),
    SpanSpec(
        SPAN_QUEUE, "INTERNAL", SPAN_REQUEST, "enqueue -> admitted to a batch",
        (
            _RID,
            _a(QUEUE_DEPTH, "int", "count", "requests already waiting at enqueue"),
            _a(QUEUE_RUNNING, "int", "count", "sequences running at enqueue"),
            _a(MAX_BATCH, "int", "count", "concurrent sequences the engine admits"),
        ),
    ),
    SpanSpec(
        SPAN_LOAD_WAIT, "INTERNAL", SPAN_REQUEST, "waiting for the model to load (cold start only)",
        (_RID, _a(LOAD_ID, "string", "", "id of the model.load it waited on")),
    ),
    SpanSpec(
        SPAN_CACHE_LOOKUP, "INTERNAL", SPAN_REQUEST, "prefix-cache lookup and the prompt's fingerprint",
        (
            _RID,
            _a(CACHE_PROMPT_TOKENS, "int", "tokens", "prompt tokens looked up"),
            _a(CACHE_MATCHED_TOKENS, "int", "tokens", "prompt tokens reused"),
            _a(CACHE_MATCH, "string", "", "match kind (enum)"),
            _a(CACHE_MATCHED_ENTRY, "int", "hash", "fingerprint of the entry reused, when any"),
            *_CACHE_STATE,
            _a(CACHE_BLOCK_SIZE, "int", "tokens", "tokens per block of the fingerprint"),
            _a(CACHE_BLOCK_HASHES, "int[]", "hash", "chained block hashes of the prompt"),
            *_SEGMENTS,
        ),
    ),
    SpanSpec(
        SPAN_PREFILL, "INTERNAL", SPAN_REQUEST, "admission -> first token: the uncached prompt computed",
        (
            _RID,
            _a(PREFILL_TOKENS, "int", "tokens", "uncached prompt tokens computed"),
            _a(PREFILL_CHUNKS, "int", "count", "chunks the prefill was split into"),
        ),
    ),
    SpanSpec(
        SPAN_PREFILL_CHUNK, "INTERNAL", SPAN_PREFILL, "one chunk of the prefill",
        (
            _RID,
            _a(CHUNK_OFFSET, "int", "tokens", "prompt index of the chunk's first token"),
            _a(CHUNK_TOKENS, "int", "tokens", "tokens in the chunk"),
            _a(CHUNK_BATCH_SIZE, "int", "count", "sequences in the same forward pass"),
        ),
    ),
    SpanSpec(
        SPAN_DECODE, "INTERNAL", SPAN_REQUEST, "first token -> last token; per-step times as one array",
        (
            _RID,
            _a(DECODE_STEPS, "int", "count", "tokens generated (step 0 is the first token)"),
            _a(DECODE_STEP_OFFSETS, "int[]", "ns", "time each token was produced, from span start"),
            _a(ITL_P50_MS, "double", "ms", "median inter-token latency"),
            _a(ITL_P90_MS, "double", "ms", "90th percentile inter-token latency"),
            _a(ITL_MAX_MS, "double", "ms", "largest inter-token latency"),
        ),
    ),
    SpanSpec(
        SPAN_CACHE_INSERT, "INTERNAL", SPAN_REQUEST, "the request's tokens stored in the prefix cache",
        (
            _RID,
            _a(ENTRY_FINGERPRINT, "int", "hash", "last chained block hash: identifies the entry"),
            _a(ENTRY_TOKENS, "int", "tokens", "tokens stored (prompt and generated)"),
            _a(ENTRY_BYTES, "int", "bytes", "bytes of the stored entry"),
            _a(CACHE_BLOCK_SIZE, "int", "tokens", "tokens per block of the fingerprint"),
            _a(CACHE_BLOCK_HASHES, "int[]", "hash", "chained block hashes of all stored tokens"),
            *_CACHE_STATE,
            _a(CACHE_MAX_ENTRIES, "int", "count", "entry limit of the cache"),
            _a(CACHE_MAX_BYTES, "int", "bytes", "byte limit of the cache"),
            _a(CACHE_LIMIT_RANK, "int", "", _limit_rank_meaning),
        ),
        (_EVICT,),
    ),
    SpanSpec(
        SPAN_CACHE_TRIM, "INTERNAL", "", "evictions not caused by an insert (trim, memory pressure)",
        (*_CACHE_STATE,),
        (_EVICT,),
    ),
    SpanSpec(
        SPAN_MODEL_LOAD, "INTERNAL", "", "loading the model, from files to warmed-up runner",
        (
            _a(LOAD_ID, "string", "", "id of this load; llm.load_wait spans cite it"),
            _a(LOAD_LAZY, "bool", "", "the load was triggered by a request (--lazy-load)"),
            _a(MODEL_PATH, "string", "", "model directory or repo"),
        ),
        _LIFECYCLE,
    ),
    SpanSpec(SPAN_LOAD_RESOLVE, "INTERNAL", SPAN_MODEL_LOAD, "model files located (files present)",
             (_a(LOAD_ID, "string", "", "id of the load"),)),
    SpanSpec(SPAN_LOAD_WEIGHTS, "INTERNAL", SPAN_MODEL_LOAD, "weights read into memory",
             (_a(LOAD_ID, "string", "", "id of the load"), _a(LOAD_BYTES, "int", "bytes", "weight bytes"))),
    SpanSpec(SPAN_LOAD_GROUP, "INTERNAL", SPAN_MODEL_LOAD, "a distributed engine's rank joined the ring "
             "(every rank up and connected)", (_a(LOAD_ID, "string", "", "id of the load"),)),
    SpanSpec(SPAN_LOAD_SHARD, "INTERNAL", SPAN_MODEL_LOAD, "a distributed engine's rank took its part of the "
             "model (layers or tensor shard) before its weights were read",
             (_a(LOAD_ID, "string", "", "id of the load"),
              _a(NODE_PLACEMENT, "string", "", "what the rank holds: 'layers 8-15 of 16' (pipeline; rank 0 "
                 "holds the last layers) or 'tensor shard 1 of 2'"))),
    SpanSpec(SPAN_LOAD_TOKENIZER, "INTERNAL", SPAN_MODEL_LOAD, "tokenizer loaded",
             (_a(LOAD_ID, "string", "", "id of the load"),)),
    SpanSpec(SPAN_LOAD_WARMUP, "INTERNAL", SPAN_MODEL_LOAD,
             "one warm-up forward pass (runner ready); an engine then collects and freezes its heap",
             (_a(LOAD_ID, "string", "", "id of the load"),)),
    SpanSpec(
        SPAN_LIFECYCLE, "INTERNAL", "", "carrier for lifecycle events outside a model.load",
        (), (*_LIFECYCLE, _DOWN),
    ),
    SpanSpec(
        SPAN_ENGINE_STEPS, "INTERNAL", "", "a window of engine steps (N steps or <= 1 s), columnar",
        (
            _a(STEPS_COUNT, "int", "count", "steps in the window"),
            _a(STEPS_START_OFFSETS, "int[]", "ns", "start of each step, from span start"),
            _a(STEPS_DURATIONS, "int[]", "ns", "duration of each step"),
            _a(STEPS_PREFILL_SEQS, "int[]", "count", "sequences prefilling in each step"),
            _a(STEPS_DECODE_SEQS, "int[]", "count", "sequences decoding in each step (batch size)"),
            _a(STEPS_PREFILL_TOKENS, "int[]", "tokens", "prompt tokens computed in each step"),
            _a(STEPS_DECODE_TOKENS, "int[]", "tokens", "tokens generated in each step"),
            _a(STEPS_REQUESTS, "string[]", "", "distinct request ids in the window"),
            _a(STEPS_MEMBERS, "int[]", "", "per step, prefilling then decoding requests, as indices "
               "into tokentrace.steps.requests, concatenated"),
            _a(STEPS_COMPUTE, "int[]", "ns", "a distributed engine's rank (pipeline placement), per step: the compute "
               "of its layers in the steps it timed (one in 8; their duration is then the whole step's), -1 in "
               "the others"),
            _a(STEPS_RING_WAIT, "int[]", "ns", "the same rank's time waiting on the ring in those steps (receiving "
               "the previous rank's activation, gathering every rank's output), -1 where not timed"),
            _a(STEPS_RING_WAIT_CPU, "int[]", "ns", "the CPU time the same rank's process used during those waits "
               "(the ring's receive polls: a wait that used less CPU than its length spent the rest off the CPU, "
               "starved by other processes, not waiting on the link), -1 where not timed"),
        ),
    ),
    SpanSpec(
        SPAN_HEARTBEAT, "INTERNAL", "", "instance state every few seconds",
        (
            _a(QUEUE_DEPTH, "int", "count", "requests waiting"),
            _a(QUEUE_RUNNING, "int", "count", "sequences running"),
            _a(MAX_BATCH, "int", "count", "concurrent sequences the engine admits"),
            *_CACHE_STATE,
            _a(CACHE_MAX_ENTRIES, "int", "count", "entry limit of the prompt cache"),
            _a(CACHE_MAX_BYTES, "int", "bytes", "byte limit of the prompt cache"),
            _a(CACHE_LIMIT_RANK, "int", "", _limit_rank_meaning),
            _a(KV_BYTES_PER_TOKEN, "int", "bytes", "2 x layers x kv_heads x head_dim x dtype bytes"),
            _a(MEMORY_BYTES, "int", "bytes", "memory the engine holds (device or process)"),
            _a(MEMORY_FREE, "int", "bytes", "memory its node can still give it: the GPU's recommended working set "
               "less what MLX holds (Apple silicon), else the host's available memory (Linux MemAvailable); "
               "absent where neither is known"),
            _a(CACHE_REPORT_MODE, "string", "", "what the engine's KV-event stream reports: full (reused "
               "blocks too) or incremental (stored and removed blocks)"),
            _a(CACHE_PREEMPTED_HIT_TOKENS, "int", "tokens", "since start: tokens preempted requests got "
               "back from the prefix cache when they resumed (recomputed work skipped, not prefix hits)"),
            _a(STALL_STATE, "string", "", "a distributed engine's rank 0 whose ring has not moved for half its "
               "--rank-timeout: RankLost (a rank exited), RankStopped (a rank is alive but its process is "
               "stopped) or RankUnresponsive (every rank alive and running); absent while the ring moves"),
            _a(STALL_REASON, "string", "", "the same, in words: which rank, its process id and state"),
            _a(STALL_MS, "int", "ms", "how long the ring operation in progress has lasted"),
            _a(STALL_RANKS, "int[]", "", "the ranks rank 0's diagnosis names: the ones that exited (RankLost) "
               "or whose processes are stopped or silent (RankStopped); empty when it singles none out"),
            _a(OPEN_REQUESTS, "string[]", "", "with a stall: the ids of the requests it holds open (running, "
               "then waiting; at most 256)"),
            _a(STALL_RANK_TIMEOUT_MS, "int", "ms", "a distributed engine's rank 0: the --rank-timeout its stall "
               "watch runs with (a stall is reported from half of it on); 0 while no watch runs (--rank-timeout 0, "
               "or the ring not joined yet): no stall is ever reported, whether or not the ring moves; absent on "
               "one-process engines and ranks above 0"),
        ),
    ),
    SpanSpec(
        SPAN_CLUSTER_STATE, "INTERNAL", "", "a multi-node upstream's placement and readiness (Exo), when it changed",
        (
            _a(CLUSTER_INSTANCES, "string", "", "JSON: per instance its model, nodes, layers, runner stage and "
               "the four readiness stages"),
            _a(CLUSTER_FINDINGS, "string[]", "", "contradictions between the cluster's views, each with the "
               "time first seen"),
        ),
    ),
)

RESOURCE: tuple[Attr, ...] = (
    _a(SERVICE_NAME, "string", "", "service name (e.g. tokentrace-engine)"),
    _a(SERVICE_INSTANCE_ID, "string", "", "the engine instance; verdicts are per instance"),
    _a(HOST_NAME, "string", "", "machine the instance runs on"),
    _a(ENGINE, "string", "", "engine family (enum)"),
    _a(ENGINE_VERSION, "string", "", "engine package version"),
    _a(MODEL, "string", "", "model served"),
    _a(OBSERVER, "string", "", "who observed this resource's spans (enum); absent: engine"),
    _a(OBSERVER_MEASURES, "string[]", "", "request parts this observer measures (OBSERVER_PARTS); "
       "a part left out is unknown, never zero"),
    _a(MODEL_REVISION, "string", "", "identity of the weights and config served (hex digest)"),
    _a(CHAT_TEMPLATE_HASH, "string", "", "identity of the chat template in use (hex digest)"),
    _a(NODE_RANK, "int", "", "a distributed engine's rank (0 serves the API); absent: one process"),
    _a(NODE_RANKS, "int", "count", "ranks of the distributed engine"),
    _a(NODE_OF, "string", "", "service.instance.id of the instance this rank is a node of (ranks above 0 "
       "report as <instance>/rank<r>)"),
    _a(HOST_CHIP, "string", "", "the chip the engine computes on ('Apple M2 Pro', a CUDA device name)"),
    _a(HOST_MEMORY_BANDWIDTH_GBS, "double", "GB/s", "peak memory bandwidth declared by the operator "
       "(--memory-bandwidth-gbs); overrides the chip's published figure"),
)

SPANS_BY_NAME: dict[str, SpanSpec] = {spec.name: spec for spec in SPANS}
