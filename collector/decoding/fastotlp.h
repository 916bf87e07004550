/* The compiled OTLP decoder (tokentrace.collector.decoding._fastotlp): shared types and declarations.
 *
 * The decoder turns an ExportTraceServiceRequest protobuf body into the Arrow columns that
 * collector/decoding/normalize.py + Batch.columns() produce for it, byte for byte. Anything it does not
 * reproduce exactly -- a malformed body, a rare value kind, a span the normalizer would refuse or
 * change -- makes it give up (FALLBACK) and the Python normalizer decides: it raises the proper
 * error or handles the rare case. So every function that can fail returns 0 or FALLBACK, and no
 * failure is ever an exception or a crash.
 *
 * Parts (one concept per file):
 *   fastotlp_wire.h   protobuf wire format and UTF-8 checks (inline: the hot loop)
 *   fastotlp_attrs.c  KeyValue/AnyValue lists as attribute maps, and the normalizer's value rules
 *   fastotlp_json.c   the normalizer's json.dumps output, byte for byte
 *   fastotlp_arrow.c  column builders and the Arrow C data interface export
 *   fastotlp_tables.c the tables' columns (collector/decoding/tables.py)
 *   fastotlp_walk.c   the request walk: resources, scopes, spans and their spans rows
 *   fastotlp_rows.c   the typed rows of each contract span (normalize._BUILDERS)
 *   fastotlp_events.c events (cache_evictions, instance_events) and links
 *   fastotlp.c        the module: configuration, decode(), the result
 */
#ifndef TOKENTRACE_FASTOTLP_H
#define TOKENTRACE_FASTOTLP_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FALLBACK (-1)
#define TRY(expr) do { if ((expr) < 0) return FALLBACK; } while (0)

/* Times are signed 64-bit nanoseconds in the store (normalize.MAX_TIME_NS). */
#define MAX_TIME_NS INT64_MAX

/* A slice of the request body (or of configuration strings); p == NULL stands for Python's None. */
typedef struct {
    const uint8_t *p;
    size_t n;
} view_t;

#define NONE ((view_t){NULL, 0})
#define EMPTY_VIEW ((view_t){(const uint8_t *)"", 0})  /* "": present, of length 0 */

/* A growable byte buffer. */
typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf_t;

int buf_grow(buf_t *b, size_t extra);
void buf_free(buf_t *b);

static inline int buf_reserve(buf_t *b, size_t extra) {
    return b->cap - b->n >= extra ? 0 : buf_grow(b, extra);
}

static inline int buf_put(buf_t *b, const void *src, size_t n) {
    if (buf_reserve(b, n) < 0) return FALLBACK;
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
    return 0;
}

/* --- names the decoder needs, read from tokentrace.contract at configuration --------------------
 * X-macros: each entry is the name of a constant in core/contract.py; fastpath.py passes the module
 * and the C side reads every constant by that name, so contract.py stays the only source of names. */
#define CONTRACT_KEYS(X)                                                                          \
    X(SERVICE_NAME) X(SERVICE_INSTANCE_ID) X(HOST_NAME) X(ENGINE) X(ENGINE_VERSION) X(MODEL)      \
    X(OBSERVER) X(REQUEST_ID) X(SESSION_ID) X(ENDPOINT) X(QUEUE_MS) X(LOAD_WAIT_MS) X(PREFILL_MS) \
    X(DECODE_MS) X(TTFT_MS) X(TPOT_MS) X(INPUT_TOKENS) X(CACHED_TOKENS) X(OUTPUT_TOKENS)          \
    X(MAX_TOKENS) X(FINISH_REASONS) X(STREAMED) X(CLIENT_DISCONNECTED) X(HTTP_STATUS)             \
    X(ERROR_TYPE) X(FIRST_CONTENT_MS) X(UPSTREAM_EVIDENCE) X(ROUTE_CHOICE) X(ROUTE_POLICY)        \
    X(ROUTE_REASON) X(ROUTE_CANDIDATES) X(ROUTE_SCORES) X(ROUTE_ATTEMPTS) X(ROUTE_SKIPPED)        \
    X(GATEWAY_WAIT_MS) X(AVOIDABLE_PREFILL) X(AVOIDABLE_FROM) X(QUEUE_DEPTH) X(QUEUE_RUNNING)     \
    X(MAX_BATCH) X(LOAD_ID) X(DECODE_STEP_OFFSETS) X(CHUNK_OFFSET) X(CHUNK_TOKENS)                \
    X(CHUNK_BATCH_SIZE) X(CACHE_BLOCK_HASHES) X(SEGMENT_ROLES) X(SEGMENT_STARTS) X(SEGMENT_ENDS)  \
    X(SEGMENT_HASHES) X(SEGMENT_TAIL_HASHES) X(SEGMENT_SNIPPETS) X(CACHE_PROMPT_TOKENS)           \
    X(CACHE_MATCHED_TOKENS)                                                                       \
    X(CACHE_MATCH) X(CACHE_MATCHED_ENTRY) X(CACHE_ENTRIES) X(CACHE_BYTES) X(CACHE_BLOCK_SIZE)     \
    X(CACHE_UNIT) X(ENTRY_FINGERPRINT) X(ENTRY_TOKENS) X(ENTRY_BYTES) X(ENTRY_REQUEST_ID)         \
    X(EVICT_REASON) X(CACHE_MAX_ENTRIES) X(CACHE_MAX_BYTES) X(STEPS_START_OFFSETS)                \
    X(STEPS_DURATIONS) X(STEPS_PREFILL_SEQS) X(STEPS_DECODE_SEQS) X(STEPS_PREFILL_TOKENS)         \
    X(STEPS_DECODE_TOKENS) X(STEPS_REQUESTS) X(STEPS_MEMBERS) X(KV_BYTES_PER_TOKEN) X(MEMORY_BYTES)      \
    X(LOAD_LAZY) X(MODEL_PATH) X(LOAD_BYTES) X(STEPS_COMPUTE) X(STEPS_RING_WAIT) X(MEMORY_FREE) \
    X(STEPS_RING_WAIT_CPU) X(CACHE_LIMIT_RANK)

/* The contract spans whose typed rows fastotlp_rows.c builds: all of normalize._BUILDERS. Other
 * names with a builder (an engine translation's, or one normalize gains) are configured as
 * fallback names. */
#define CONTRACT_SPANS(X)                                                                         \
    X(SPAN_REQUEST) X(SPAN_QUEUE) X(SPAN_LOAD_WAIT) X(SPAN_PREFILL) X(SPAN_DECODE)                \
    X(SPAN_PREFILL_CHUNK) X(SPAN_CACHE_LOOKUP) X(SPAN_CACHE_INSERT) X(SPAN_ENGINE_STEPS)          \
    X(SPAN_HEARTBEAT) X(SPAN_ROUTE) X(SPAN_MODEL_LOAD) X(SPAN_LOAD_RESOLVE) X(SPAN_LOAD_WEIGHTS)      \
    X(SPAN_LOAD_TOKENIZER) X(SPAN_LOAD_WARMUP) X(SPAN_LOAD_GROUP) X(SPAN_LOAD_SHARD)

#define CONTRACT_WORDS(X) X(EVENT_CACHE_EVICT) X(ENGINE_VLLM) X(OBSERVER_PLUGIN) X(OBSERVER_ENGINE)

#define AS_ENUM(name) K_##name,
enum key_id { CONTRACT_KEYS(AS_ENUM) K_COUNT };
#undef AS_ENUM
#define AS_ENUM(name) name,
enum span_id { CONTRACT_SPANS(AS_ENUM) SPAN_COUNT, SPAN_GENERIC = SPAN_COUNT, SPAN_FALLBACK };
enum word_id { CONTRACT_WORDS(AS_ENUM) WORD_COUNT };
#undef AS_ENUM

/* A configured name and its hash (attribute keys are found by hash, then compared). */
typedef struct {
    view_t text;
    uint64_t hash;
} name_t;

/* A list of names (the expanded attributes, the legacy request keys, the fallback span names). */
typedef struct {
    name_t *items;
    size_t n;
    uint64_t bits;  /* bit (hash & 63) of each name's hash: most texts are ruled out by one test */
} names_t;

typedef struct {
    int ready;
    name_t keys[K_COUNT];
    name_t spans[SPAN_COUNT];
    name_t words[WORD_COUNT];
    names_t expanded;   /* normalize.EXPANDED: left out of spans.attributes when a builder ran */
    names_t legacy;     /* llm.request keys vllm.names.with_both_names rewrites */
    names_t lifecycle;  /* contract.LIFECYCLE_EVENTS */
    names_t fallback;   /* span names with a builder this decoder does not reproduce */
} config_t;

extern config_t CONFIG;

uint64_t hash_bytes(const uint8_t *p, size_t n);
int view_eq(view_t a, view_t b);
int names_find(const names_t *names, view_t text, uint64_t hash);

/* --- attribute maps (fastotlp_attrs.c) ----------------------------------------------------------- */
enum value_kind { V_NONE, V_STR, V_BOOL, V_INT, V_DBL, V_ARR };

/* One attribute (or one array element, with no key): an AnyValue of a scalar kind, or an array
 * of scalars. Arrays keep their ArrayValue bytes (s) and, when every element is an int, the
 * elements decoded into the owner's pool (from index ints). */
typedef struct {
    view_t key;
    uint64_t hash;
    uint8_t kind;
    uint8_t mask;    /* arrays: bit (1 << kind) of every element kind present */
    uint32_t count;  /* arrays: elements */
    size_t ints;     /* arrays whose mask is ints only: first element in the pool */
    view_t s;        /* V_STR text; V_ARR the ArrayValue message */
    int64_t i;       /* V_INT value; V_BOOL 0 or 1 */
    double d;        /* V_DBL value */
} attr_t;

/* An attribute map in the order the sender wrote it (normalize's dict of _value). */
typedef struct {
    attr_t *items;
    size_t n, cap;
    uint32_t *slots;  /* open addressing by key hash: item index + 1, 0 for empty */
    size_t nslots;
    int64_t *pool;    /* elements of int arrays */
    size_t npool, poolcap;
} attrs_t;

void attrs_reset(attrs_t *a);
void attrs_free(attrs_t *a);
/* Parse one KeyValue and append it; strings longer than max_len code points give FALLBACK (the
 * normalizer would cut and count them), and so does a key sent twice (a dict keeps its first
 * place and its last value). */
int attrs_add(attrs_t *a, view_t keyvalue, int64_t max_len);
/* Check one KeyValue that the normalizer never reads (Python's parse would refuse a bad one). */
int attrs_check(attrs_t *scratch, view_t keyvalue);
const attr_t *attrs_get(const attrs_t *a, enum key_id key);
const attr_t *attrs_find(const attrs_t *a, view_t key, uint64_t hash);

/* The elements of an array attribute, in order. */
typedef struct {
    const uint8_t *p, *end;
} elements_t;
elements_t elements_of(const attr_t *array);
int elements_next(elements_t *it, attr_t *element); /* 1: one more, 0: done */

/* The normalizer's value rules, on an attribute that may be absent (NULL). */
int value_str(const attr_t *a, view_t *out);           /* _str: None, the text, or FALLBACK (str(x)) */
int value_int(const attr_t *a, int64_t *out);           /* _int: 1 and the value, or 0 for None */
int value_ms(const attr_t *a, double *out);             /* _ms: 1, 0 for absent, FALLBACK when left out */
int value_int_of(const attr_t *a, int64_t *out);       /* _int_of: like _ms for 64-bit integers */
int value_column(const attrs_t *owner, const attr_t *a, const int64_t **values, size_t *n); /* _column */

/* --- JSON (fastotlp_json.c) ------------------------------------------------------------------------ */
int json_string(buf_t *b, view_t text);
int json_int(buf_t *b, int64_t v);
int json_uint(buf_t *b, uint64_t v);
int json_value(buf_t *b, const attrs_t *owner, const attr_t *a);
/* The attribute map as a JSON object, leaving out items whose skip flag is set. */
int json_attrs(buf_t *b, const attrs_t *a, const uint8_t *skip);

/* --- columns and tables (fastotlp_arrow.c) ------------------------------------------------------- */
enum col_type { COL_STR, COL_I64, COL_I32, COL_F64, COL_BOOL, COL_LIST_STR, COL_LIST_F64, COL_LIST_I64 };

typedef struct {
    const char *name;
    uint8_t type;
} colspec_t;

typedef struct column {
    uint8_t type;
    int64_t length, nulls;
    buf_t valid;  /* validity bits, empty until the first null */
    buf_t data;   /* values, or int32 offsets for strings and lists */
    buf_t chars;  /* string bytes */
    struct column *child;  /* list elements */
} column_t;

#define MAX_COLUMNS 32

typedef struct {
    const char *name;
    const colspec_t *specs;
    int ncols;
    column_t cols[MAX_COLUMNS];
    int64_t rows;
    buf_t origin;  /* int32: the span each row came from (Batch.columns() origin) */
    int at;        /* next column of the row being written */
} table_t;

int table_init(table_t *t, const char *name, const colspec_t *specs, int ncols);
void table_free(table_t *t);

/* The sizes a table's buffers reached in a decoder's last request (values or offsets, string bytes,
 * and the same of list elements, per column; then the origins), which its next request reserves
 * before writing: grown by doubling from 256 bytes, each buffer was reallocated (and copied) about
 * ten times a request, and 4 decoding threads spent a third of their time in malloc and page faults
 * (perf, issue 17). */
#define HINT_SLOTS (MAX_COLUMNS * 4 + 1)
typedef struct {
    size_t n[HINT_SLOTS];
} table_hint_t;

void table_remember(const table_t *t, table_hint_t *hint);
int table_reserve(table_t *t, const table_hint_t *hint);
/* Writing a row: one put per column, in order, then row_end (which checks the count). */
int put_null(table_t *t);
int put_str(table_t *t, view_t s);         /* NULL view: null */
int put_i64(table_t *t, int64_t v);
int put_i64_opt(table_t *t, int has, int64_t v);
int put_i32(table_t *t, int32_t v);
int put_f64_opt(table_t *t, int has, double v);
int put_bool_opt(table_t *t, int has, int v);
buf_t *put_str_begin(table_t *t);          /* write the text into the returned buffer ... */
int put_str_end(table_t *t);               /* ... then close the value */
column_t *put_list_begin(table_t *t);      /* append elements to the returned column ... */
int put_list_end(table_t *t);              /* ... then close the list */
int elem_str(column_t *c, view_t s);
int elem_i64(column_t *c, int64_t v);
int elem_i64_all(column_t *c, const int64_t *values, size_t n);
int elem_f64(column_t *c, double v);
int row_end(table_t *t, int32_t origin);

/* The table's schema as the Arrow C data interface's PyCapsule ("arrow_schema"). */
void *table_schema_capsule(const table_t *t);
/* The table's rows as an Arrow C data interface array (a struct ArrowArray, NULL if out of memory),
 * without Python: the rows' buffers move into it (zero-copy for the consumer), and the bytes pyarrow
 * counts for them (Table.get_total_buffer_size) are added to `*bytes`. table_export_free releases an
 * array no capsule took; array_capsule hands it to a PyCapsule ("arrow_array"; with the GIL), which
 * releases it when freed, or releases it and returns NULL. */
void *table_export(table_t *t, int64_t *bytes);
void table_export_free(void *exported);
void *array_capsule(void *exported);

/* --- the decoder's state for one request ---------------------------------------------------------- */
enum table_id {
    T_SPANS, T_RESOURCES, T_REQUESTS, T_ROUTES, T_PHASES, T_PREFILL_CHUNKS, T_STEPS,
    T_CACHE_LOOKUPS, T_SEGMENTS, T_CACHE_INSERTS, T_CACHE_EVICTIONS, T_INSTANCE_EVENTS,
    T_MODEL_LOADS, T_LOAD_STAGES, T_HEARTBEATS, T_DECODE_STEPS, T_PREFIX_BLOCKS, T_COUNT
};

extern const colspec_t *const TABLE_SPECS[T_COUNT];
extern const int TABLE_NCOLS[T_COUNT];
extern const char *const TABLE_NAMES[T_COUNT];

/* The resource of the ResourceSpans being decoded (normalize._Scope); NULL views are None. */
typedef struct {
    view_t instance_id, service_name, host_name, engine, engine_version, model, observer;
} resource_t;

/* One span's fields, ids as hex text. */
typedef struct {
    view_t trace_id, span_id, parent, trace_state, name, status_message;
    int32_t kind, status_code;
    uint64_t start, end;
    uint32_t dropped_attributes, dropped_events, dropped_links;
    char trace_hex[32], span_hex[16], parent_hex[16];
} span_t;

typedef struct {
    int64_t max_len;
    table_t tables[T_COUNT];
    table_hint_t hints[T_COUNT];
    int32_t span_index;  /* spans accepted so far */
    buf_t keys;          /* uint64 key hash per span (once.key_hashes) */
    attrs_t attrs;       /* the span's */
    attrs_t event_attrs; /* the event's or link's */
    attrs_t resource_attrs;
    attrs_t scratch;     /* attributes read only to check them (scope) */
    buf_t events;        /* views of the span's events */
    buf_t links;         /* views of the span's links */
    buf_t events_json, links_json, resource_json, skip;
    buf_t views;         /* scratch: the elements of a string array, for access by index */
    int has_resource_json;
    resource_t resource;
} decoder_t;

/* The request walk (fastotlp_walk.c): every table's rows for one request body. */
int decode_request(decoder_t *d, view_t body);
/* The typed rows of one span (fastotlp_rows.c); attributes in d->attrs. */
int rows_of_span(decoder_t *d, int kind, const span_t *s);
/* One event of the span: its typed row, and its entry in d->events_json (fastotlp_events.c). */
int span_event(decoder_t *d, const span_t *s, view_t msg);
/* One link of the span: its entry in d->links_json. */
int span_link(decoder_t *d, view_t msg);
/* A view of a hex id in a span. */
view_t hex_view(const char *hex, size_t n);

#endif
