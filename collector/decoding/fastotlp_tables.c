/* The tables this decoder writes, in columns.SCHEMAS order and types (collector/decoding/tables.py: TABLES,
 * TYPES, and PACKED/PACKED_TYPES for decode_steps and prefix_blocks). fastpath.py compares the
 * schemas exported from here with SCHEMAS at import and turns the decoder off when they differ,
 * so a change to tables.py can never make it write misplaced columns. */
#include "fastotlp.h"

#define S COL_STR
#define L COL_I64
#define I COL_I32
#define D COL_F64
#define B COL_BOOL

static const colspec_t SPANS[] = {
    {"trace_id", S}, {"span_id", S}, {"parent_span_id", S}, {"name", S}, {"kind", I}, {"start_ns", L},
    {"end_ns", L}, {"status_code", I}, {"status_message", S}, {"service_name", S}, {"instance_id", S},
    {"scope_name", S}, {"request_id", S}, {"attributes", S}, {"events", S}, {"links", S}, {"resource", S},
    {"trace_state", S}, {"scope_version", S}, {"dropped_attributes_count", L}, {"dropped_events_count", L},
    {"dropped_links_count", L},
};
static const colspec_t RESOURCES[] = {
    {"instance_id", S}, {"service_name", S}, {"host_name", S}, {"engine", S}, {"engine_version", S},
    {"model", S}, {"seen_ns", L}, {"attributes", S},
};
static const colspec_t REQUESTS[] = {
    {"request_id", S}, {"trace_id", S}, {"span_id", S}, {"instance_id", S}, {"service_name", S}, {"engine", S},
    {"model", S}, {"session_id", S}, {"endpoint", S}, {"start_ns", L}, {"end_ns", L}, {"queue_ms", D},
    {"load_wait_ms", D}, {"prefill_ms", D}, {"decode_ms", D}, {"ttft_ms", D}, {"tpot_ms", D},
    {"prompt_tokens", L}, {"cached_tokens", L}, {"completion_tokens", L}, {"max_tokens", L},
    {"finish_reason", S}, {"streamed", B}, {"client_disconnected", B}, {"http_status", L}, {"error_type", S},
    {"first_content_ms", D}, {"observer", S}, {"upstream_evidence", S},
};
static const colspec_t ROUTES[] = {
    {"request_id", S}, {"trace_id", S}, {"span_id", S}, {"instance_id", S}, {"session_id", S}, {"start_ns", L},
    {"end_ns", L}, {"policy", S}, {"reason", S}, {"candidates", COL_LIST_STR}, {"scores", COL_LIST_F64},
    {"attempts", L}, {"skipped", COL_LIST_STR}, {"gateway_wait_ms", D}, {"avoidable_prefill_tokens", L},
    {"avoidable_from", S},
};
static const colspec_t PHASES[] = {
    {"request_id", S}, {"instance_id", S}, {"name", S}, {"start_ns", L}, {"end_ns", L}, {"queue_depth", L},
    {"queue_running", L}, {"max_batch", L}, {"load_id", S},
};
static const colspec_t PREFILL_CHUNKS[] = {
    {"request_id", S}, {"instance_id", S}, {"start_ns", L}, {"end_ns", L}, {"chunk_offset", L}, {"tokens", L},
    {"batch_size", L},
};
static const colspec_t STEPS[] = {
    {"instance_id", S}, {"start_ns", L}, {"duration_ns", L}, {"prefill_seqs", L}, {"decode_seqs", L},
    {"prefill_tokens", L}, {"decode_tokens", L}, {"prefill_request_ids", COL_LIST_STR},
    {"decode_request_ids", COL_LIST_STR}, {"compute_ns", L}, {"ring_wait_ns", L}, {"ring_wait_cpu_ns", L},
};
static const colspec_t CACHE_LOOKUPS[] = {
    {"request_id", S}, {"instance_id", S}, {"start_ns", L}, {"end_ns", L}, {"prompt_tokens", L},
    {"matched_tokens", L}, {"match", S}, {"matched_entry", L}, {"cache_entries", L}, {"cache_bytes", L},
    {"block_size", L}, {"cache_unit", S},
};
static const colspec_t SEGMENTS[] = {
    {"request_id", S}, {"instance_id", S}, {"t_ns", L}, {"segment_index", L}, {"role", S}, {"token_start", L},
    {"token_end", L}, {"hash", L}, {"snippet", S}, {"tail_hash", L},
};
static const colspec_t CACHE_INSERTS[] = {
    {"request_id", S}, {"instance_id", S}, {"start_ns", L}, {"end_ns", L}, {"fingerprint", L}, {"tokens", L},
    {"bytes", L}, {"block_size", L}, {"cache_entries", L}, {"cache_bytes", L}, {"max_entries", L},
    {"max_bytes", L}, {"limit_rank", L},
};
static const colspec_t CACHE_EVICTIONS[] = {
    {"instance_id", S}, {"t_ns", L}, {"fingerprint", L}, {"tokens", L}, {"bytes", L}, {"reason", S},
    {"entry_request_id", S}, {"evicted_by_request_id", S}, {"cache_entries", L}, {"cache_bytes", L},
    {"span_id", S},
};
static const colspec_t INSTANCE_EVENTS[] = {
    {"instance_id", S}, {"service_name", S}, {"t_ns", L}, {"event", S}, {"load_id", S}, {"span_name", S},
};
static const colspec_t MODEL_LOADS[] = {
    {"load_id", S}, {"instance_id", S}, {"trace_id", S}, {"span_id", S}, {"start_ns", L}, {"end_ns", L},
    {"lazy", B}, {"model_path", S},
};
static const colspec_t LOAD_STAGES[] = {
    {"load_id", S}, {"instance_id", S}, {"trace_id", S}, {"span_id", S}, {"parent_span_id", S}, {"name", S},
    {"start_ns", L}, {"end_ns", L}, {"bytes", L},
};
static const colspec_t HEARTBEATS[] = {
    {"instance_id", S}, {"t_ns", L}, {"queue_depth", L}, {"running", L}, {"max_batch", L}, {"cache_entries", L},
    {"cache_bytes", L}, {"cache_max_entries", L}, {"cache_max_bytes", L}, {"kv_bytes_per_token", L},
    {"memory_bytes", L}, {"cache_unit", S}, {"memory_free_bytes", L},
};
static const colspec_t DECODE_STEPS[] = {
    {"request_id", S}, {"instance_id", S}, {"start_ns", L}, {"offsets", COL_LIST_I64},
};
static const colspec_t PREFIX_BLOCKS[] = {
    {"request_id", S}, {"instance_id", S}, {"t_ns", L}, {"source", S}, {"fingerprint", L},
    {"hashes", COL_LIST_I64},
};

#define N(specs) ((int)(sizeof specs / sizeof *specs))

const colspec_t *const TABLE_SPECS[T_COUNT] = {
    SPANS, RESOURCES, REQUESTS, ROUTES, PHASES, PREFILL_CHUNKS, STEPS, CACHE_LOOKUPS, SEGMENTS,
    CACHE_INSERTS, CACHE_EVICTIONS, INSTANCE_EVENTS, MODEL_LOADS, LOAD_STAGES, HEARTBEATS, DECODE_STEPS,
    PREFIX_BLOCKS,
};
const int TABLE_NCOLS[T_COUNT] = {
    N(SPANS), N(RESOURCES), N(REQUESTS), N(ROUTES), N(PHASES), N(PREFILL_CHUNKS), N(STEPS), N(CACHE_LOOKUPS),
    N(SEGMENTS), N(CACHE_INSERTS), N(CACHE_EVICTIONS), N(INSTANCE_EVENTS), N(MODEL_LOADS), N(LOAD_STAGES),
    N(HEARTBEATS), N(DECODE_STEPS), N(PREFIX_BLOCKS),
};
const char *const TABLE_NAMES[T_COUNT] = {
    "spans", "resources", "requests", "routes", "phases", "prefill_chunks", "steps", "cache_lookups",
    "segments", "cache_inserts", "cache_evictions", "instance_events", "model_loads", "load_stages",
    "heartbeats", "decode_steps", "prefix_blocks",
};
