/* The typed rows of the contract's spans: normalize._BUILDERS, one function each, with the
 * normalizer's value rules. A builder that would raise _Untyped (or record a value left out)
 * returns FALLBACK before it writes a row that matters: the whole request then goes to Python. */
#include <string.h>

#include "fastotlp.h"

view_t hex_view(const char *hex, size_t n) {
    view_t v = {(const uint8_t *)hex, n};
    return v;
}

static view_t word(enum word_id id) {
    return CONFIG.words[id].text;
}

static view_t text_of(const char *literal) {
    view_t v = {(const uint8_t *)literal, strlen(literal)};
    return v;
}

/* --- one column from one attribute ----------------------------------------------------------------- */
static int put_attr_str(table_t *t, const attrs_t *a, enum key_id key) {
    view_t v;
    TRY(value_str(attrs_get(a, key), &v));
    return put_str(t, v);
}

static int put_attr_int(table_t *t, const attrs_t *a, enum key_id key) {
    int64_t v = 0;
    int has = value_int(attrs_get(a, key), &v);
    return put_i64_opt(t, has, v);
}

/* normalize._rank: an int_value of 0 or more; a bool, a double, a string or a negative is NULL. */
static int put_attr_rank(table_t *t, const attrs_t *a, enum key_id key) {
    const attr_t *found = attrs_get(a, key);
    int has = found && found->kind == V_INT && found->i >= 0;
    return put_i64_opt(t, has, has ? found->i : 0);
}

static int put_attr_ms(table_t *t, const attrs_t *a, enum key_id key) {
    double v = 0;
    int has = value_ms(attrs_get(a, key), &v);
    TRY(has);
    return put_f64_opt(t, has, v);
}

static int put_attr_bool(table_t *t, const attrs_t *a, enum key_id key) {
    const attr_t *found = attrs_get(a, key);
    int has = found && found->kind == V_BOOL;
    return put_bool_opt(t, has, has && found->i);
}

static int put_ids(table_t *t, const span_t *s) {
    TRY(put_str(t, hex_view(s->trace_hex, 32)));
    return put_str(t, hex_view(s->span_hex, 16));
}

static int put_int_list(table_t *t, const int64_t *values, size_t n) {
    column_t *child = put_list_begin(t);
    if (!child) return FALLBACK;
    TRY(elem_i64_all(child, values, n));
    return put_list_end(t);
}

/* [_str(x) for x in _list(value)] */
static int put_str_list(table_t *t, const attr_t *a) {
    column_t *child = put_list_begin(t);
    if (!child) return FALLBACK;
    if (a && a->kind == V_ARR) {
        elements_t it = elements_of(a);
        attr_t element;
        while (elements_next(&it, &element)) {
            view_t v;
            TRY(value_str(&element, &v));
            TRY(elem_str(child, v));
        }
    }
    return put_list_end(t);
}

static void min_max(const int64_t *values, size_t n, int64_t *lo, int64_t *hi) {
    *lo = *hi = values[0];
    for (size_t i = 1; i < n; i++) {
        if (values[i] < *lo) *lo = values[i];
        if (values[i] > *hi) *hi = values[i];
    }
}

/* Offsets from the span's start that land within 0..2^63 ns (else _Untyped offset_out_of_range). */
static int check_offsets(const int64_t *values, size_t n, uint64_t origin) {
    if (!n) return 0;
    int64_t lo, hi;
    min_max(values, n, &lo, &hi);
    return lo < 0 || (uint64_t)hi > (uint64_t)MAX_TIME_NS - origin ? FALLBACK : 0;
}

static int column_of(const attrs_t *a, enum key_id key, const int64_t **values, size_t *n) {
    return value_column(a, attrs_get(a, key), values, n);
}

/* The elements of _list(value) that index lookups read (_at): views, NONE for None; any other
 * element kind would need str(): FALLBACK. */
static int string_elements(decoder_t *d, const attr_t *a, const view_t **out, size_t *n) {
    d->views.n = 0;
    *n = 0;
    if (a && a->kind == V_ARR) {
        elements_t it = elements_of(a);
        attr_t element;
        while (elements_next(&it, &element)) {
            if (element.kind != V_STR && element.kind != V_NONE) return FALLBACK;
            view_t v = element.kind == V_STR ? element.s : NONE;
            TRY(buf_put(&d->views, &v, sizeof v));
            (*n)++;
        }
    }
    *out = (const view_t *)d->views.p;
    return 0;
}

/* _str of a string element (an empty string is None). */
static view_t element_str(view_t v) {
    return v.p && v.n ? v : NONE;
}

/* --- builders -------------------------------------------------------------------------------------- */
static int phase(decoder_t *d, const span_t *s, view_t rid) {
    table_t *t = &d->tables[T_PHASES];
    const attrs_t *a = &d->attrs;
    TRY(put_str(t, rid));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_str(t, s->name));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_attr_int(t, a, K_QUEUE_DEPTH));
    TRY(put_attr_int(t, a, K_QUEUE_RUNNING));
    TRY(put_attr_int(t, a, K_MAX_BATCH));
    TRY(put_attr_str(t, a, K_LOAD_ID));
    return row_end(t, d->span_index);
}

static int request(decoder_t *d, const span_t *s, view_t rid) {
    table_t *t = &d->tables[T_REQUESTS];
    const attrs_t *a = &d->attrs;
    /* with_both_names rewrites legacy usage names and vLLM's latency seconds: left to Python. */
    for (size_t i = 0; i < CONFIG.legacy.n; i++)
        if (attrs_find(a, CONFIG.legacy.items[i].text, CONFIG.legacy.items[i].hash)) return FALLBACK;
    view_t model, finish = NONE;
    TRY(value_str(attrs_get(a, K_MODEL), &model));
    const attr_t *reasons = attrs_get(a, K_FINISH_REASONS);
    if (reasons && reasons->kind == V_ARR) {
        elements_t it = elements_of(reasons);
        attr_t first;
        if (!elements_next(&it, &first)) return FALLBACK;  /* _str([]) is "[]" */
        if (first.kind == V_STR) finish = first.s;         /* reasons[0] as sent, "" included */
        else if (first.kind != V_NONE) return FALLBACK;
    } else {
        TRY(value_str(reasons, &finish));
    }
    TRY(put_str(t, rid.p ? rid : hex_view(s->span_hex, 16)));
    TRY(put_ids(t, s));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_str(t, d->resource.service_name));
    TRY(put_str(t, d->resource.engine));
    TRY(put_str(t, model.p ? model : d->resource.model));
    TRY(put_attr_str(t, a, K_SESSION_ID));
    TRY(put_attr_str(t, a, K_ENDPOINT));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    static const enum key_id phases[] = {K_QUEUE_MS, K_LOAD_WAIT_MS, K_PREFILL_MS, K_DECODE_MS, K_TTFT_MS, K_TPOT_MS};
    for (size_t i = 0; i < sizeof phases / sizeof *phases; i++) TRY(put_attr_ms(t, a, phases[i]));
    static const enum key_id tokens[] = {K_INPUT_TOKENS, K_CACHED_TOKENS, K_OUTPUT_TOKENS, K_MAX_TOKENS};
    for (size_t i = 0; i < sizeof tokens / sizeof *tokens; i++) TRY(put_attr_int(t, a, tokens[i]));
    TRY(put_str(t, finish));
    TRY(put_attr_bool(t, a, K_STREAMED));
    TRY(put_attr_bool(t, a, K_CLIENT_DISCONNECTED));
    TRY(put_attr_int(t, a, K_HTTP_STATUS));
    TRY(put_attr_str(t, a, K_ERROR_TYPE));
    TRY(put_attr_ms(t, a, K_FIRST_CONTENT_MS));
    /* normalize._observer: the resource's word, else the vLLM plugin or a tokentrace engine */
    view_t observer = d->resource.observer;
    if (!observer.p) observer = view_eq(d->resource.engine, word(ENGINE_VLLM)) && d->resource.engine.p
                                    ? word(OBSERVER_PLUGIN) : word(OBSERVER_ENGINE);
    TRY(put_str(t, observer));
    TRY(put_attr_str(t, a, K_UPSTREAM_EVIDENCE));
    return row_end(t, d->span_index);
}

static int route(decoder_t *d, const span_t *s, view_t rid) {
    table_t *t = &d->tables[T_ROUTES];
    const attrs_t *a = &d->attrs;
    view_t instance = d->resource.instance_id;
    if (!instance.p) TRY(value_str(attrs_get(a, K_ROUTE_CHOICE), &instance));  /* `or` reads it only then */
    TRY(put_str(t, rid));
    TRY(put_ids(t, s));
    TRY(put_str(t, instance));
    TRY(put_attr_str(t, a, K_SESSION_ID));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_attr_str(t, a, K_ROUTE_POLICY));
    TRY(put_attr_str(t, a, K_ROUTE_REASON));
    TRY(put_str_list(t, attrs_get(a, K_ROUTE_CANDIDATES)));
    /* [float(x) for x in _list(scores) if x is an int or a float, not a bool] */
    column_t *scores = put_list_begin(t);
    if (!scores) return FALLBACK;
    const attr_t *sent = attrs_get(a, K_ROUTE_SCORES);
    if (sent && sent->kind == V_ARR) {
        elements_t it = elements_of(sent);
        attr_t element;
        while (elements_next(&it, &element)) {
            if (element.kind == V_INT) TRY(elem_f64(scores, (double)element.i));
            else if (element.kind == V_DBL) TRY(elem_f64(scores, element.d));
        }
    }
    TRY(put_list_end(t));
    TRY(put_attr_int(t, a, K_ROUTE_ATTEMPTS));
    TRY(put_str_list(t, attrs_get(a, K_ROUTE_SKIPPED)));
    TRY(put_attr_ms(t, a, K_GATEWAY_WAIT_MS));
    TRY(put_attr_int(t, a, K_AVOIDABLE_PREFILL));
    TRY(put_attr_str(t, a, K_AVOIDABLE_FROM));
    return row_end(t, d->span_index);
}

static int decode(decoder_t *d, const span_t *s, view_t rid) {
    const int64_t *offsets;
    size_t n;
    TRY(column_of(&d->attrs, K_DECODE_STEP_OFFSETS, &offsets, &n));
    TRY(check_offsets(offsets, n, s->start));
    TRY(phase(d, s, rid));
    if (!n) return 0;
    table_t *t = &d->tables[T_DECODE_STEPS];
    TRY(put_str(t, rid));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_int_list(t, offsets, n));
    return row_end(t, d->span_index);
}

static int chunk(decoder_t *d, const span_t *s, view_t rid) {
    table_t *t = &d->tables[T_PREFILL_CHUNKS];
    TRY(put_str(t, rid));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_attr_int(t, &d->attrs, K_CHUNK_OFFSET));
    TRY(put_attr_int(t, &d->attrs, K_CHUNK_TOKENS));
    TRY(put_attr_int(t, &d->attrs, K_CHUNK_BATCH_SIZE));
    return row_end(t, d->span_index);
}

/* normalize._blocks: the packed prefix_blocks row, when there are hashes. */
static int blocks(decoder_t *d, view_t rid, uint64_t t_ns, const char *source, int has_fingerprint,
                  int64_t fingerprint, const int64_t *hashes, size_t n) {
    if (!n) return 0;
    table_t *t = &d->tables[T_PREFIX_BLOCKS];
    TRY(put_str(t, rid));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_i64(t, (int64_t)t_ns));
    TRY(put_str(t, text_of(source)));
    TRY(put_i64_opt(t, has_fingerprint, fingerprint));
    TRY(put_int_list(t, hashes, n));
    return row_end(t, d->span_index);
}

static int lookup(decoder_t *d, const span_t *s, view_t rid) {
    const attrs_t *a = &d->attrs;
    const int64_t *hashes, *starts, *ends, *segment_hashes, *tails;
    size_t n_hashes, n_starts, n_ends, n_segment_hashes, n_tails;
    TRY(column_of(a, K_CACHE_BLOCK_HASHES, &hashes, &n_hashes));
    TRY(column_of(a, K_SEGMENT_STARTS, &starts, &n_starts));
    TRY(column_of(a, K_SEGMENT_ENDS, &ends, &n_ends));
    TRY(column_of(a, K_SEGMENT_HASHES, &segment_hashes, &n_segment_hashes));
    TRY(column_of(a, K_SEGMENT_TAIL_HASHES, &tails, &n_tails));
    const view_t *snippets;
    size_t n_snippets;
    TRY(string_elements(d, attrs_get(a, K_SEGMENT_SNIPPETS), &snippets, &n_snippets));
    TRY(phase(d, s, rid));
    table_t *t = &d->tables[T_CACHE_LOOKUPS];
    TRY(put_str(t, rid));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_attr_int(t, a, K_CACHE_PROMPT_TOKENS));
    TRY(put_attr_int(t, a, K_CACHE_MATCHED_TOKENS));
    TRY(put_attr_str(t, a, K_CACHE_MATCH));
    TRY(put_attr_int(t, a, K_CACHE_MATCHED_ENTRY));
    TRY(put_attr_int(t, a, K_CACHE_ENTRIES));
    TRY(put_attr_int(t, a, K_CACHE_BYTES));
    TRY(put_attr_int(t, a, K_CACHE_BLOCK_SIZE));
    TRY(put_attr_str(t, a, K_CACHE_UNIT));
    TRY(row_end(t, d->span_index));
    TRY(blocks(d, rid, s->start, "lookup", 0, 0, hashes, n_hashes));
    const attr_t *roles = attrs_get(a, K_SEGMENT_ROLES);
    if (!roles || roles->kind != V_ARR) return 0;  /* _list: anything else is [] */
    t = &d->tables[T_SEGMENTS];
    elements_t it = elements_of(roles);
    attr_t role;
    for (size_t i = 0; elements_next(&it, &role); i++) {
        view_t role_text;
        TRY(value_str(&role, &role_text));
        TRY(put_str(t, rid));
        TRY(put_str(t, d->resource.instance_id));
        TRY(put_i64(t, (int64_t)s->start));
        TRY(put_i64(t, (int64_t)i));
        TRY(put_str(t, role_text));
        TRY(put_i64_opt(t, i < n_starts, i < n_starts ? starts[i] : 0));
        TRY(put_i64_opt(t, i < n_ends, i < n_ends ? ends[i] : 0));
        TRY(put_i64_opt(t, i < n_segment_hashes, i < n_segment_hashes ? segment_hashes[i] : 0));
        TRY(put_str(t, i < n_snippets ? element_str(snippets[i]) : NONE));
        /* normalize._lookup: 0 (a segment under two blocks) is stored as null */
        TRY(put_i64_opt(t, i < n_tails && tails[i] != 0, i < n_tails ? tails[i] : 0));
        TRY(row_end(t, d->span_index));
    }
    return 0;
}

static int insert(decoder_t *d, const span_t *s, view_t rid) {
    const attrs_t *a = &d->attrs;
    const int64_t *hashes;
    size_t n;
    TRY(column_of(a, K_CACHE_BLOCK_HASHES, &hashes, &n));
    TRY(phase(d, s, rid));
    int64_t fingerprint = 0;
    int has_fingerprint = value_int(attrs_get(a, K_ENTRY_FINGERPRINT), &fingerprint);
    table_t *t = &d->tables[T_CACHE_INSERTS];
    TRY(put_str(t, rid));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_i64_opt(t, has_fingerprint, fingerprint));
    static const enum key_id rest[] = {K_ENTRY_TOKENS, K_ENTRY_BYTES, K_CACHE_BLOCK_SIZE, K_CACHE_ENTRIES,
                                       K_CACHE_BYTES, K_CACHE_MAX_ENTRIES, K_CACHE_MAX_BYTES};
    for (size_t i = 0; i < sizeof rest / sizeof *rest; i++) TRY(put_attr_int(t, a, rest[i]));
    TRY(put_attr_rank(t, a, K_CACHE_LIMIT_RANK));
    TRY(row_end(t, d->span_index));
    return blocks(d, rid, s->start, "insert", has_fingerprint, fingerprint, hashes, n);
}

static int64_t at_or_zero(const int64_t *values, size_t n, size_t i) {
    return i < n ? values[i] : 0;
}

static uint64_t add_saturating(uint64_t a, uint64_t b) {
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static int steps(decoder_t *d, const span_t *s) {
    const attrs_t *a = &d->attrs;
    const int64_t *starts, *durations, *prefill_seqs, *decode_seqs, *prefill_tokens, *decode_tokens, *members;
    size_t n, n_durations, n_prefill_seqs, n_decode_seqs, n_prefill_tokens, n_decode_tokens, n_members;
    TRY(column_of(a, K_STEPS_START_OFFSETS, &starts, &n));
    TRY(column_of(a, K_STEPS_DURATIONS, &durations, &n_durations));
    TRY(column_of(a, K_STEPS_PREFILL_SEQS, &prefill_seqs, &n_prefill_seqs));
    TRY(column_of(a, K_STEPS_DECODE_SEQS, &decode_seqs, &n_decode_seqs));
    TRY(column_of(a, K_STEPS_PREFILL_TOKENS, &prefill_tokens, &n_prefill_tokens));
    TRY(column_of(a, K_STEPS_DECODE_TOKENS, &decode_tokens, &n_decode_tokens));
    const view_t *names;
    size_t n_names;
    const attr_t *requests = attrs_get(a, K_STEPS_REQUESTS);
    TRY(string_elements(d, requests, &names, &n_names));
    TRY(column_of(a, K_STEPS_MEMBERS, &members, &n_members));
    const int64_t *compute, *ring_wait, *ring_wait_cpu;
    size_t n_compute, n_ring_wait, n_ring_wait_cpu;
    TRY(column_of(a, K_STEPS_COMPUTE, &compute, &n_compute));
    TRY(column_of(a, K_STEPS_RING_WAIT, &ring_wait, &n_ring_wait));
    TRY(column_of(a, K_STEPS_RING_WAIT_CPU, &ring_wait_cpu, &n_ring_wait_cpu));
    /* normalize._check_steps */
    TRY(check_offsets(starts, n, s->start));
    for (size_t i = 0; i < n; i++)
        if (at_or_zero(prefill_seqs, n_prefill_seqs, i) < 0 || at_or_zero(decode_seqs, n_decode_seqs, i) < 0)
            return FALLBACK;
    if (n_members) {
        int64_t lo, hi;
        min_max(members, n_members, &lo, &hi);
        if (lo < 0 || (uint64_t)hi >= n_names) return FALLBACK;
    }
    table_t *t = &d->tables[T_STEPS];
    uint64_t cursor = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t n_prefill = (uint64_t)at_or_zero(prefill_seqs, n_prefill_seqs, i);
        uint64_t n_decode = (uint64_t)at_or_zero(decode_seqs, n_decode_seqs, i);
        /* picked = members[cursor : cursor + n_prefill + n_decode]; Python's ints never overflow */
        uint64_t end = add_saturating(cursor, add_saturating(n_prefill, n_decode));
        size_t lo = cursor < n_members ? (size_t)cursor : n_members;
        size_t hi = end < n_members ? (size_t)end : n_members;
        size_t split = n_prefill < hi - lo ? lo + (size_t)n_prefill : hi;
        cursor = end;
        TRY(put_str(t, d->resource.instance_id));
        TRY(put_i64(t, (int64_t)s->start + starts[i]));
        TRY(put_i64_opt(t, i < n_durations, at_or_zero(durations, n_durations, i)));
        TRY(put_i64(t, (int64_t)n_prefill));
        TRY(put_i64(t, (int64_t)n_decode));
        TRY(put_i64_opt(t, i < n_prefill_tokens, at_or_zero(prefill_tokens, n_prefill_tokens, i)));
        TRY(put_i64_opt(t, i < n_decode_tokens, at_or_zero(decode_tokens, n_decode_tokens, i)));
        for (int part = 0; part < 2; part++) {
            column_t *ids = put_list_begin(t);
            if (!ids) return FALLBACK;
            for (size_t m = part ? split : lo; m < (part ? hi : split); m++)
                TRY(elem_str(ids, element_str(names[members[m]])));
            TRY(put_list_end(t));
        }
        /* a rank's compute and ring wait: null where it did not time the step (-1) or sent none */
        TRY(put_i64_opt(t, i < n_compute && compute[i] >= 0, at_or_zero(compute, n_compute, i)));
        TRY(put_i64_opt(t, i < n_ring_wait && ring_wait[i] >= 0, at_or_zero(ring_wait, n_ring_wait, i)));
        TRY(put_i64_opt(t, i < n_ring_wait_cpu && ring_wait_cpu[i] >= 0,
                        at_or_zero(ring_wait_cpu, n_ring_wait_cpu, i)));
        TRY(row_end(t, d->span_index));
    }
    return 0;
}

static int heartbeat(decoder_t *d, const span_t *s) {
    table_t *t = &d->tables[T_HEARTBEATS];
    const attrs_t *a = &d->attrs;
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_i64(t, (int64_t)s->end));
    static const enum key_id counts[] = {K_QUEUE_DEPTH, K_QUEUE_RUNNING, K_MAX_BATCH, K_CACHE_ENTRIES, K_CACHE_BYTES,
                                         K_CACHE_MAX_ENTRIES, K_CACHE_MAX_BYTES, K_KV_BYTES_PER_TOKEN, K_MEMORY_BYTES};
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) TRY(put_attr_int(t, a, counts[i]));
    TRY(put_attr_str(t, a, K_CACHE_UNIT));
    TRY(put_attr_int(t, a, K_MEMORY_FREE));
    return row_end(t, d->span_index);
}

static int model_load(decoder_t *d, const span_t *s) {
    table_t *t = &d->tables[T_MODEL_LOADS];
    view_t load_id;
    TRY(value_str(attrs_get(&d->attrs, K_LOAD_ID), &load_id));
    TRY(put_str(t, load_id.p ? load_id : hex_view(s->span_hex, 16)));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_ids(t, s));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_attr_bool(t, &d->attrs, K_LOAD_LAZY));
    TRY(put_attr_str(t, &d->attrs, K_MODEL_PATH));
    return row_end(t, d->span_index);
}

static int load_stage(decoder_t *d, const span_t *s) {
    table_t *t = &d->tables[T_LOAD_STAGES];
    TRY(put_attr_str(t, &d->attrs, K_LOAD_ID));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_ids(t, s));
    TRY(put_str(t, s->parent.n ? hex_view(s->parent_hex, 16) : NONE));
    TRY(put_str(t, s->name));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_attr_int(t, &d->attrs, K_LOAD_BYTES));
    return row_end(t, d->span_index);
}

int rows_of_span(decoder_t *d, int kind, const span_t *s) {
    view_t rid;
    TRY(value_str(attrs_get(&d->attrs, K_REQUEST_ID), &rid));
    switch (kind) {
    case SPAN_REQUEST: return request(d, s, rid);
    case SPAN_QUEUE: case SPAN_LOAD_WAIT: case SPAN_PREFILL: return phase(d, s, rid);
    case SPAN_DECODE: return decode(d, s, rid);
    case SPAN_PREFILL_CHUNK: return chunk(d, s, rid);
    case SPAN_CACHE_LOOKUP: return lookup(d, s, rid);
    case SPAN_CACHE_INSERT: return insert(d, s, rid);
    case SPAN_ENGINE_STEPS: return steps(d, s);
    case SPAN_HEARTBEAT: return heartbeat(d, s);
    case SPAN_ROUTE: return route(d, s, rid);
    case SPAN_MODEL_LOAD: return model_load(d, s);
    case SPAN_LOAD_RESOLVE: case SPAN_LOAD_WEIGHTS: case SPAN_LOAD_TOKENIZER: case SPAN_LOAD_WARMUP:
    case SPAN_LOAD_GROUP: case SPAN_LOAD_SHARD:
        return load_stage(d, s);
    default: return 0;  /* a generic span: its spans row only */
    }
}
