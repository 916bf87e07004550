/* tokentrace.collector._fastotlp: an OTLP ExportTraceServiceRequest protobuf body straight into
 * the Arrow columns of collector/normalize.py (issue 17: ingest at 100k spans/s on 2 cores).
 *
 * decode(body, max_value_length) walks the request as normalize() does -- ResourceSpans, their
 * resource, ScopeSpans, spans, events, links -- and returns (spans, keys, tables), or None when
 * the body is anything this decoder does not reproduce exactly (fastotlp.h); collector/fastpath.py
 * turns the tables into a Columns. Field numbers: opentelemetry-proto's trace.proto, common.proto
 * and resource.proto. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fastotlp.h"
#include "fastotlp_wire.h"

config_t CONFIG;

static const view_t NONE = {NULL, 0};
static const uint8_t EMPTY_TEXT[1] = {0};
static const view_t EMPTY = {EMPTY_TEXT, 0};

/* --- configuration ------------------------------------------------------------------------------ */
static int name_of(PyObject *text, name_t *out) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;
    if (!utf8) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "contract names must be strings");
        return FALLBACK;
    }
    uint8_t *copy = malloc((size_t)n + 1);
    if (!copy) {
        PyErr_NoMemory();
        return FALLBACK;
    }
    memcpy(copy, utf8, (size_t)n + 1);
    out->text.p = copy;
    out->text.n = (size_t)n;
    out->hash = hash_bytes(copy, (size_t)n);
    return 0;
}

static int names_of(PyObject *iterable, names_t *out) {
    PyObject *items = PySequence_Fast(iterable, "expected a sequence of names");
    if (!items) return FALLBACK;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    out->items = calloc((size_t)n + 1, sizeof *out->items);
    out->n = 0;
    for (Py_ssize_t i = 0; out->items && i < n; i++, out->n++) {
        if (name_of(PySequence_Fast_GET_ITEM(items, i), &out->items[i]) < 0) {
            Py_DECREF(items);
            return FALLBACK;
        }
    }
    Py_DECREF(items);
    if (!out->items) PyErr_NoMemory();
    return out->items ? 0 : FALLBACK;
}

static int constant(PyObject *contract, const char *attribute, name_t *out) {
    PyObject *value = PyObject_GetAttrString(contract, attribute);
    if (!value) return FALLBACK;
    int rc = name_of(value, out);
    Py_DECREF(value);
    return rc;
}

static void names_free(names_t *names) {
    for (size_t i = 0; i < names->n; i++) free((void *)names->items[i].text.p);
    free(names->items);
    names->items = NULL;
    names->n = 0;
}

static void config_free(void) {
    name_t *all[] = {CONFIG.keys, CONFIG.spans, CONFIG.words};
    size_t counts[] = {K_COUNT, SPAN_COUNT, WORD_COUNT};
    for (int k = 0; k < 3; k++)
        for (size_t i = 0; i < counts[k]; i++) free((void *)all[k][i].text.p);
    names_free(&CONFIG.expanded);
    names_free(&CONFIG.legacy);
    names_free(&CONFIG.lifecycle);
    names_free(&CONFIG.fallback);
    memset(&CONFIG, 0, sizeof CONFIG);
}

#define AS_STRING(name) #name,
static const char *const KEY_NAMES[K_COUNT] = {CONTRACT_KEYS(AS_STRING)};
static const char *const SPAN_NAMES[SPAN_COUNT] = {CONTRACT_SPANS(AS_STRING)};
static const char *const WORD_NAMES[WORD_COUNT] = {CONTRACT_WORDS(AS_STRING)};
#undef AS_STRING

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *contract, *expanded, *legacy, *lifecycle, *fallback;
    if (!PyArg_ParseTuple(args, "OOOOO", &contract, &expanded, &legacy, &lifecycle, &fallback)) return NULL;
    config_free();
    int ok = 1;
    for (int i = 0; ok && i < K_COUNT; i++) ok = constant(contract, KEY_NAMES[i], &CONFIG.keys[i]) == 0;
    for (int i = 0; ok && i < SPAN_COUNT; i++) ok = constant(contract, SPAN_NAMES[i], &CONFIG.spans[i]) == 0;
    for (int i = 0; ok && i < WORD_COUNT; i++) ok = constant(contract, WORD_NAMES[i], &CONFIG.words[i]) == 0;
    ok = ok && names_of(expanded, &CONFIG.expanded) == 0 && names_of(legacy, &CONFIG.legacy) == 0
         && names_of(lifecycle, &CONFIG.lifecycle) == 0 && names_of(fallback, &CONFIG.fallback) == 0;
    if (!ok) {
        config_free();
        return NULL;
    }
    /* Protobuf and the key hashes are little-endian; elsewhere every payload goes to Python. */
    uint16_t probe = 1;
    CONFIG.ready = *(uint8_t *)&probe == 1;
    Py_RETURN_NONE;
}

static PyObject *tuple_of_names(const char *const *names, int n) {
    PyObject *out = PyTuple_New(n);
    for (int i = 0; out && i < n; i++) {
        PyObject *text = PyUnicode_FromString(names[i]);
        if (!text) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, text);
    }
    return out;
}

/* --- resources ------------------------------------------------------------------------------------- */
static int resource_value(decoder_t *d, enum key_id key, view_t *out) {
    return value_str(attrs_get(&d->resource_attrs, key), out);
}

/* Resource{attributes=1, dropped_attributes_count=2, entity_refs=3}: the resource's dict, its
 * fields (normalize._Scope) and its JSON, shared by every span of the ResourceSpans. */
static int read_resource(decoder_t *d, view_t msg) {
    attrs_t *a = &d->resource_attrs;
    attrs_reset(a);
    reader_t r = reader_of(msg);
    uint32_t seen = 0;
    while (r.p < r.end) {
        uint32_t field, wt;
        uint64_t ignored;
        view_t sub;
        TRY(wire_tag(&r, &field, &wt));
        switch (field) {
        case 1:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_bytes(&r, &sub));
            TRY(attrs_add(a, sub, d->max_len));
            break;
        case 2:
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_varint(&r, &ignored));
            break;
        case 3:  /* entity_refs: not read by the normalizer, and no SDK of ours sends them */
            return FALLBACK;
        default:
            TRY(wire_skip(&r, wt));
        }
    }
    TRY(attrs_index(a));
    resource_t *res = &d->resource;
    TRY(resource_value(d, K_SERVICE_INSTANCE_ID, &res->instance_id));
    TRY(resource_value(d, K_SERVICE_NAME, &res->service_name));
    TRY(resource_value(d, K_HOST_NAME, &res->host_name));
    TRY(resource_value(d, K_ENGINE, &res->engine));
    TRY(resource_value(d, K_ENGINE_VERSION, &res->engine_version));
    TRY(resource_value(d, K_MODEL, &res->model));
    TRY(resource_value(d, K_OBSERVER, &res->observer));
    d->resource_json.n = 0;
    d->has_resource_json = a->n > 0;
    return d->has_resource_json ? json_attrs(&d->resource_json, a, NULL) : 0;
}

static int put_json(table_t *t, int has, const buf_t *json) {
    if (!has) return put_null(t);
    view_t v = {json->p, json->n};
    return put_str(t, v);
}

static int resource_row(decoder_t *d, uint64_t seen_ns) {
    table_t *t = &d->tables[T_RESOURCES];
    const resource_t *res = &d->resource;
    TRY(put_str(t, res->instance_id));
    TRY(put_str(t, res->service_name));
    TRY(put_str(t, res->host_name));
    TRY(put_str(t, res->engine));
    TRY(put_str(t, res->engine_version));
    TRY(put_str(t, res->model));
    TRY(put_i64(t, (int64_t)seen_ns));
    TRY(put_json(t, d->has_resource_json, &d->resource_json));
    return row_end(t, d->span_index - 1);  /* the resource row goes with its last span */
}

/* --- events and links ------------------------------------------------------------------------------ */
static int put_attr_int_of(table_t *t, const attrs_t *a, enum key_id key) {
    int64_t v = 0;
    int has = value_int_of(attrs_get(a, key), &v);
    TRY(has);
    return put_i64_opt(t, has, v);
}

static int eviction_row(decoder_t *d, const span_t *s, uint64_t t_ns) {
    table_t *t = &d->tables[T_CACHE_EVICTIONS];
    const attrs_t *a = &d->event_attrs;
    view_t reason, entry_request, request;
    TRY(value_str(attrs_get(a, K_EVICT_REASON), &reason));
    TRY(value_str(attrs_get(a, K_ENTRY_REQUEST_ID), &entry_request));
    TRY(value_str(attrs_get(&d->attrs, K_REQUEST_ID), &request));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_i64(t, (int64_t)t_ns));
    TRY(put_attr_int_of(t, a, K_ENTRY_FINGERPRINT));
    TRY(put_attr_int_of(t, a, K_ENTRY_TOKENS));
    TRY(put_attr_int_of(t, a, K_ENTRY_BYTES));
    TRY(put_str(t, reason));
    TRY(put_str(t, entry_request));
    TRY(put_str(t, request));
    TRY(put_attr_int_of(t, a, K_CACHE_ENTRIES));
    TRY(put_attr_int_of(t, a, K_CACHE_BYTES));
    TRY(put_str(t, hex_view(s->span_hex, 16)));
    return row_end(t, d->span_index);
}

static int lifecycle_row(decoder_t *d, const span_t *s, uint64_t t_ns, view_t name) {
    table_t *t = &d->tables[T_INSTANCE_EVENTS];
    /* attrs.get(LOAD_ID, span_attrs.get(LOAD_ID)): the event's value when it has the key at all */
    const attr_t *load = attrs_get(&d->event_attrs, K_LOAD_ID);
    view_t load_id;
    TRY(value_str(load ? load : attrs_get(&d->attrs, K_LOAD_ID), &load_id));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_str(t, d->resource.service_name));
    TRY(put_i64(t, (int64_t)t_ns));
    TRY(put_str(t, name));
    TRY(put_str(t, load_id));
    TRY(put_str(t, s->name));
    return row_end(t, d->span_index);
}

/* Span.Event{time_unix_nano=1, name=2, attributes=3, dropped_attributes_count=4}: its typed row
 * (normalize._event) and its entry in spans.events. */
static int span_event(decoder_t *d, const span_t *s, view_t msg) {
    attrs_t *a = &d->event_attrs;
    attrs_reset(a);
    reader_t r = reader_of(msg);
    uint32_t seen = 0, dropped = 0;
    uint64_t t_ns = 0, raw;
    view_t name = EMPTY, sub;
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        switch (field) {
        case 1:
            if (wt != WT_FIXED64) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_fixed64(&r, &t_ns));
            break;
        case 2:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_string(&r, &name, INT64_MAX));
            break;
        case 3:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_bytes(&r, &sub));
            TRY(attrs_add(a, sub, d->max_len));
            break;
        case 4:
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_varint(&r, &raw));
            dropped = (uint32_t)raw;
            break;
        default:
            TRY(wire_skip(&r, wt));
        }
    }
    if (t_ns > (uint64_t)MAX_TIME_NS) return FALLBACK;  /* a refused span (time_out_of_range) */
    TRY(attrs_index(a));
    if (view_eq(name, CONFIG.words[EVENT_CACHE_EVICT].text)) TRY(eviction_row(d, s, t_ns));
    else if (names_find(&CONFIG.lifecycle, name, hash_bytes(name.p, name.n)) >= 0)
        TRY(lifecycle_row(d, s, t_ns, name));
    buf_t *b = &d->events_json;
    TRY(buf_put(b, b->n ? ",{\"name\":" : "[{\"name\":", 9));
    TRY(json_string(b, name));
    TRY(buf_put(b, ",\"time_ns\":", 11));
    TRY(json_uint(b, t_ns));
    TRY(buf_put(b, ",\"attributes\":", 14));
    TRY(json_attrs(b, a, NULL));
    if (dropped) {
        TRY(buf_put(b, ",\"dropped_attributes_count\":", 28));
        TRY(json_uint(b, dropped));
    }
    return buf_put(b, "}", 1);
}

static int json_hex(buf_t *b, view_t bytes) {
    static const char hex[] = "0123456789abcdef";
    TRY(buf_reserve(b, bytes.n * 2 + 2));
    b->p[b->n++] = '"';
    for (size_t i = 0; i < bytes.n; i++) {
        b->p[b->n++] = (uint8_t)hex[bytes.p[i] >> 4];
        b->p[b->n++] = (uint8_t)hex[bytes.p[i] & 15];
    }
    b->p[b->n++] = '"';
    return 0;
}

/* Span.Link{trace_id=1, span_id=2, trace_state=3, attributes=4, dropped_attributes_count=5,
 * flags=6} as normalize._link stores it in spans.links. */
static int span_link(decoder_t *d, view_t msg) {
    attrs_t *a = &d->event_attrs;
    attrs_reset(a);
    reader_t r = reader_of(msg);
    uint32_t seen = 0, dropped = 0;
    uint64_t raw;
    view_t trace_id = EMPTY, span_id = EMPTY, state = EMPTY, sub;
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        if (field >= 1 && field <= 6 && field != 4) TRY(wire_once(&seen, field));  /* 4 repeats */
        switch (field) {
        case 1: case 2: case 3: case 4:
            if (wt != WT_LEN) return FALLBACK;
            if (field == 3) TRY(wire_string(&r, &state, INT64_MAX));
            else TRY(wire_bytes(&r, field == 1 ? &trace_id : field == 2 ? &span_id : &sub));
            if (field == 4) TRY(attrs_add(a, sub, d->max_len));
            break;
        case 5:
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_varint(&r, &raw));
            dropped = (uint32_t)raw;
            break;
        case 6:
            if (wt != WT_FIXED32) return FALLBACK;
            TRY(wire_skip(&r, wt));
            break;
        default:
            TRY(wire_skip(&r, wt));
        }
    }
    TRY(attrs_index(a));
    buf_t *b = &d->links_json;
    TRY(buf_put(b, b->n ? ",{\"trace_id\":" : "[{\"trace_id\":", 13));
    TRY(json_hex(b, trace_id));
    TRY(buf_put(b, ",\"span_id\":", 11));
    TRY(json_hex(b, span_id));
    if (state.n) {
        TRY(buf_put(b, ",\"trace_state\":", 15));
        TRY(json_string(b, state));
    }
    if (a->n) {
        TRY(buf_put(b, ",\"attributes\":", 14));
        TRY(json_attrs(b, a, NULL));
    }
    if (dropped) {
        TRY(buf_put(b, ",\"dropped_attributes_count\":", 28));
        TRY(json_uint(b, dropped));
    }
    return buf_put(b, "}", 1);
}

/* --- spans ------------------------------------------------------------------------------------------ */
typedef struct {
    view_t name, version;  /* InstrumentationScope; NONE when empty */
} scope_t;

static void to_hex(view_t bytes, char *out) {
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < bytes.n; i++) {
        out[2 * i] = hex[bytes.p[i] >> 4];
        out[2 * i + 1] = hex[bytes.p[i] & 15];
    }
}

static int span_kind(view_t name) {
    uint64_t hash = hash_bytes(name.p, name.n);
    for (int i = 0; i < SPAN_COUNT; i++)
        if (CONFIG.spans[i].hash == hash && view_eq(CONFIG.spans[i].text, name)) return i;
    return names_find(&CONFIG.fallback, name, hash) >= 0 ? SPAN_FALLBACK : SPAN_GENERIC;
}

/* once.key_hashes: the hex texts as little-endian 64-bit words, mixed word by word. */
static uint64_t key_hash(const span_t *s) {
    static const uint64_t mix[3] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL};
    uint64_t h = 0;
    for (int column = 0; column < 6; column++) {
        uint64_t word;
        memcpy(&word, column < 4 ? s->trace_hex + 8 * column : s->span_hex + 8 * (column - 4), 8);
        h = (h ^ word) * mix[column % 3];
        h ^= h >> 29;
    }
    return h;
}

static int read_status(view_t msg, span_t *s, int64_t max_len) {
    reader_t r = reader_of(msg);
    uint32_t seen = 0;
    uint64_t code;
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        if (field == 2) {
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_string(&r, &s->status_message, max_len));  /* a longer one would be cut */
        } else if (field == 3) {
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_varint(&r, &code));
            s->status_code = (int32_t)(uint32_t)code;  /* an enum is an int32 (upb truncates) */
        } else {
            TRY(wire_skip(&r, wt));
        }
    }
    return 0;
}

static int push_view(buf_t *b, view_t v) {
    return buf_put(b, &v, sizeof v);
}

/* The Span's fields; every known field checked for its wire type, singular ones for repeats. */
static int read_span(decoder_t *d, view_t msg, span_t *s) {
    reader_t r = reader_of(msg);
    uint32_t seen = 0;
    uint64_t raw;
    view_t sub;
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        static const uint8_t WIRE[17] = {0, WT_LEN, WT_LEN, WT_LEN, WT_LEN, WT_LEN, WT_VARINT, WT_FIXED64,
                                         WT_FIXED64, WT_LEN, WT_VARINT, WT_LEN, WT_VARINT, WT_LEN, WT_VARINT,
                                         WT_LEN, WT_FIXED32};
        if (field > 16) {
            TRY(wire_skip(&r, wt));
            continue;
        }
        if (wt != WIRE[field]) return FALLBACK;
        if (field != 9 && field != 11 && field != 13) TRY(wire_once(&seen, field));
        switch (field) {
        case 1: TRY(wire_bytes(&r, &s->trace_id)); break;
        case 2: TRY(wire_bytes(&r, &s->span_id)); break;
        case 3: TRY(wire_string(&r, &s->trace_state, INT64_MAX)); break;
        case 4: TRY(wire_bytes(&r, &s->parent)); break;
        case 5: TRY(wire_string(&r, &s->name, d->max_len)); break;  /* a longer one would be cut */
        case 6: TRY(wire_varint(&r, &raw)); s->kind = (int32_t)(uint32_t)raw; break;
        case 7: TRY(wire_fixed64(&r, &s->start)); break;
        case 8: TRY(wire_fixed64(&r, &s->end)); break;
        case 9: TRY(wire_bytes(&r, &sub)); TRY(attrs_add(&d->attrs, sub, d->max_len)); break;
        case 10: TRY(wire_varint(&r, &raw)); s->dropped_attributes = (uint32_t)raw; break;
        case 11: TRY(wire_bytes(&r, &sub)); TRY(push_view(&d->events, sub)); break;
        case 12: TRY(wire_varint(&r, &raw)); s->dropped_events = (uint32_t)raw; break;
        case 13: TRY(wire_bytes(&r, &sub)); TRY(push_view(&d->links, sub)); break;
        case 14: TRY(wire_varint(&r, &raw)); s->dropped_links = (uint32_t)raw; break;
        case 15: TRY(wire_bytes(&r, &sub)); TRY(read_status(sub, s, d->max_len)); break;
        default: TRY(wire_skip(&r, wt)); break;  /* flags */
        }
    }
    return 0;
}

/* normalize._invalid: a span the normalizer refuses (and reports) is left to it. */
static int check_span(const span_t *s) {
    if (s->trace_id.n != 16 || s->span_id.n != 8 || (s->parent.n && s->parent.n != 8)) return FALLBACK;
    if (s->end > (uint64_t)MAX_TIME_NS || s->end < s->start) return FALLBACK;
    return 0;
}

/* spans.attributes: the span's dict, less normalize.EXPANDED when a builder ran. */
static int put_attributes(decoder_t *d, table_t *t, int builder_ran) {
    const attrs_t *a = &d->attrs;
    size_t kept = a->n;
    const uint8_t *skip = NULL;
    if (builder_ran && a->n) {
        d->skip.n = 0;
        TRY(buf_reserve(&d->skip, a->n));
        memset(d->skip.p, 0, a->n);
        for (size_t i = 0; i < CONFIG.expanded.n; i++) {
            const attr_t *found = attrs_find(a, CONFIG.expanded.items[i].text, CONFIG.expanded.items[i].hash);
            if (found) {
                d->skip.p[found - a->items] = 1;
                kept--;
            }
        }
        skip = d->skip.p;
    }
    if (!kept) return put_null(t);  /* _json({}) is None */
    buf_t *b = put_str_begin(t);
    if (!b) return FALLBACK;
    TRY(json_attrs(b, a, skip));
    return put_str_end(t);
}

static int spans_row(decoder_t *d, const span_t *s, const scope_t *scope, int builder_ran) {
    table_t *t = &d->tables[T_SPANS];
    view_t rid;
    TRY(value_str(attrs_get(&d->attrs, K_REQUEST_ID), &rid));
    TRY(put_str(t, hex_view(s->trace_hex, 32)));
    TRY(put_str(t, hex_view(s->span_hex, 16)));
    TRY(put_str(t, s->parent.n ? hex_view(s->parent_hex, 16) : NONE));
    TRY(put_str(t, s->name));
    TRY(put_i32(t, s->kind));
    TRY(put_i64(t, (int64_t)s->start));
    TRY(put_i64(t, (int64_t)s->end));
    TRY(put_i32(t, s->status_code));
    TRY(put_str(t, s->status_message.n ? s->status_message : NONE));
    TRY(put_str(t, d->resource.service_name));
    TRY(put_str(t, d->resource.instance_id));
    TRY(put_str(t, scope->name));
    TRY(put_str(t, rid));
    TRY(put_attributes(d, t, builder_ran));
    TRY(put_json(t, d->events_json.n > 0, &d->events_json));
    TRY(put_json(t, d->links_json.n > 0, &d->links_json));
    TRY(put_json(t, d->has_resource_json, &d->resource_json));
    TRY(put_str(t, s->trace_state.n ? s->trace_state : NONE));
    TRY(put_str(t, scope->version));
    TRY(put_i64_opt(t, s->dropped_attributes != 0, s->dropped_attributes));
    TRY(put_i64_opt(t, s->dropped_events != 0, s->dropped_events));
    TRY(put_i64_opt(t, s->dropped_links != 0, s->dropped_links));
    return row_end(t, d->span_index);
}

static int span(decoder_t *d, view_t msg, const scope_t *scope, uint64_t *seen_ns) {
    span_t s;
    memset(&s, 0, sizeof s);
    s.name = s.trace_id = s.span_id = s.parent = s.trace_state = s.status_message = EMPTY;
    attrs_reset(&d->attrs);
    d->events.n = d->links.n = d->events_json.n = d->links_json.n = 0;
    TRY(read_span(d, msg, &s));
    TRY(check_span(&s));
    TRY(attrs_index(&d->attrs));
    int kind = span_kind(s.name);
    if (kind == SPAN_FALLBACK) return FALLBACK;
    to_hex(s.trace_id, s.trace_hex);
    to_hex(s.span_id, s.span_hex);
    to_hex(s.parent, s.parent_hex);
    if (kind != SPAN_GENERIC) TRY(rows_of_span(d, kind, &s));
    const view_t *events = (const view_t *)d->events.p, *links = (const view_t *)d->links.p;
    for (size_t i = 0; i < d->events.n / sizeof(view_t); i++) TRY(span_event(d, &s, events[i]));
    if (d->events_json.n) TRY(buf_put(&d->events_json, "]", 1));
    for (size_t i = 0; i < d->links.n / sizeof(view_t); i++) TRY(span_link(d, links[i]));
    if (d->links_json.n) TRY(buf_put(&d->links_json, "]", 1));
    TRY(spans_row(d, &s, scope, kind != SPAN_GENERIC));
    uint64_t key = key_hash(&s);
    TRY(buf_put(&d->keys, &key, 8));
    if (d->span_index == INT32_MAX) return FALLBACK;
    d->span_index++;
    if (s.end > *seen_ns) *seen_ns = s.end;
    return 0;
}

/* InstrumentationScope{name=1, version=2, attributes=3, dropped_attributes_count=4}: the normalizer
 * reads name and version; the attributes are checked only (Python's parse would refuse bad ones). */
static int read_scope(decoder_t *d, view_t msg, scope_t *scope) {
    reader_t r = reader_of(msg);
    uint32_t seen = 0;
    uint64_t ignored;
    view_t sub;
    attrs_reset(&d->scratch);
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        switch (field) {
        case 1: case 2:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_string(&r, &sub, INT64_MAX));
            if (sub.n) *(field == 1 ? &scope->name : &scope->version) = sub;
            break;
        case 3:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_bytes(&r, &sub));
            TRY(attrs_add(&d->scratch, sub, INT64_MAX));
            break;
        case 4:
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_varint(&r, &ignored));
            break;
        default:
            TRY(wire_skip(&r, wt));
        }
    }
    return 0;
}

/* ScopeSpans{scope=1, spans=2, schema_url=3}: the scope first (it may follow its spans), then the
 * spans in order. */
static int scope_spans(decoder_t *d, view_t msg, uint64_t *seen_ns) {
    scope_t scope = {NONE, NONE};
    reader_t r = reader_of(msg);
    uint32_t seen = 0;
    view_t sub;
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        if (field >= 1 && field <= 3 && wt != WT_LEN) return FALLBACK;
        if (field == 1 || field == 3) TRY(wire_once(&seen, field));
        if (field == 1) {
            TRY(wire_bytes(&r, &sub));
            TRY(read_scope(d, sub, &scope));
        } else if (field == 3) {
            TRY(wire_string(&r, &sub, INT64_MAX));
        } else {
            TRY(wire_skip(&r, wt));
        }
    }
    r = reader_of(msg);
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        if (field != 2) {
            TRY(wire_skip(&r, wt));
            continue;
        }
        TRY(wire_bytes(&r, &sub));
        TRY(span(d, sub, &scope, seen_ns));
    }
    return 0;
}

/* ResourceSpans{resource=1, scope_spans=2, schema_url=3}: the resource first, as normalize() does. */
static int resource_spans(decoder_t *d, view_t msg) {
    reader_t r = reader_of(msg);
    uint32_t seen = 0;
    view_t resource = EMPTY, sub;
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        if (field >= 1 && field <= 3 && wt != WT_LEN) return FALLBACK;
        if (field == 1 || field == 3) TRY(wire_once(&seen, field));
        if (field == 1) TRY(wire_bytes(&r, &resource));
        else if (field == 3) TRY(wire_string(&r, &sub, INT64_MAX));
        else TRY(wire_skip(&r, wt));
    }
    TRY(read_resource(d, resource));
    uint64_t seen_ns = 0;
    r = reader_of(msg);
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        if (field != 2) {
            TRY(wire_skip(&r, wt));
            continue;
        }
        TRY(wire_bytes(&r, &sub));
        TRY(scope_spans(d, sub, &seen_ns));
    }
    return seen_ns ? resource_row(d, seen_ns) : 0;
}

/* ExportTraceServiceRequest{resource_spans=1} */
static int decode_request(decoder_t *d, view_t body) {
    reader_t r = reader_of(body);
    while (r.p < r.end) {
        uint32_t field, wt;
        view_t sub;
        TRY(wire_tag(&r, &field, &wt));
        if (field != 1) {
            TRY(wire_skip(&r, wt));
            continue;
        }
        if (wt != WT_LEN) return FALLBACK;
        TRY(wire_bytes(&r, &sub));
        TRY(resource_spans(d, sub));
    }
    return 0;
}

/* --- the module ------------------------------------------------------------------------------------ */
/* The decoder's scratch (attribute maps, JSON being assembled) lives from call to call: fresh
 * buffers each time cost page faults that showed in profiles. decode() holds the GIL throughout, so
 * calls never overlap. Only the tables' buffers are new per call: they move into Arrow. */
static decoder_t *shared;

static void scratch_trim(buf_t *b) {
    b->n = 0;
    if (b->cap > (1u << 22)) buf_free(b);  /* after a huge payload, give the memory back */
}

static void attrs_trim(attrs_t *a) {
    attrs_reset(a);
    if (a->cap > (1u << 16) || a->poolcap > (1u << 20)) attrs_free(a);
}

static decoder_t *decoder_start(int64_t max_len) {
    if (!shared && !(shared = calloc(1, sizeof *shared))) return NULL;
    decoder_t *d = shared;
    d->max_len = max_len;
    d->span_index = 0;
    for (int i = 0; i < T_COUNT; i++) {
        if (table_init(&d->tables[i], TABLE_NAMES[i], TABLE_SPECS[i], TABLE_NCOLS[i]) < 0) {
            for (int k = 0; k <= i; k++) table_free(&d->tables[k]);
            return NULL;
        }
    }
    return d;
}

static void decoder_end(decoder_t *d) {
    for (int i = 0; i < T_COUNT; i++) table_free(&d->tables[i]);
    attrs_t *maps[] = {&d->attrs, &d->event_attrs, &d->resource_attrs, &d->scratch};
    for (size_t i = 0; i < sizeof maps / sizeof *maps; i++) attrs_trim(maps[i]);
    buf_t *bufs[] = {&d->keys, &d->events, &d->links, &d->events_json, &d->links_json, &d->resource_json,
                     &d->skip, &d->views};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) scratch_trim(bufs[i]);
}

static PyObject *bytearray_of(const buf_t *b) {
    return PyByteArray_FromStringAndSize((const char *)(b->p ? b->p : EMPTY_TEXT), (Py_ssize_t)b->n);
}

/* (spans, keys, [(table, schema capsule, array capsule, origin), ...]) for the non-empty tables. */
static PyObject *result_of(decoder_t *d) {
    PyObject *tables = PyList_New(0);
    for (int i = 0; tables && i < T_COUNT; i++) {
        table_t *t = &d->tables[i];
        if (!t->rows) continue;
        PyObject *entry = PyTuple_New(4);
        if (entry) {
            PyTuple_SET_ITEM(entry, 0, PyUnicode_FromString(t->name));
            PyTuple_SET_ITEM(entry, 1, table_schema_capsule(t));
            PyTuple_SET_ITEM(entry, 2, table_array_capsule(t));
            PyTuple_SET_ITEM(entry, 3, bytearray_of(&t->origin));
            for (int k = 0; k < 4; k++) {
                if (!PyTuple_GET_ITEM(entry, k)) {  /* a tuple with empty slots frees the rest */
                    Py_CLEAR(entry);
                    break;
                }
            }
        }
        if (!entry) {
            Py_CLEAR(tables);
            break;
        }
        int rc = PyList_Append(tables, entry);
        Py_DECREF(entry);
        if (rc < 0) Py_CLEAR(tables);
    }
    if (!tables) return NULL;
    PyObject *keys = bytearray_of(&d->keys);
    if (!keys) {
        Py_DECREF(tables);
        return NULL;
    }
    return Py_BuildValue("(iNN)", d->span_index, keys, tables);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer body;
    PyObject *limit;
    if (!PyArg_ParseTuple(args, "y*O!", &body, &PyLong_Type, &limit)) return NULL;
    int overflow;
    long long max_len = PyLong_AsLongLongAndOverflow(limit, &overflow);
    if (overflow) max_len = overflow > 0 ? INT64_MAX : INT64_MIN;
    decoder_t *d = CONFIG.ready ? decoder_start(max_len) : NULL;
    PyObject *result = NULL;
    if (d) {
        view_t whole = {body.buf ? (const uint8_t *)body.buf : EMPTY_TEXT, (size_t)body.len};
        if (decode_request(d, whole) == 0) result = result_of(d);
        decoder_end(d);
    }
    PyBuffer_Release(&body);
    if (!result) {  /* never an exception: whatever went wrong, the Python path decides */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return result;
}

static PyObject *schemas(PyObject *self, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < T_COUNT; i++) {
        table_t t;
        if (table_init(&t, TABLE_NAMES[i], TABLE_SPECS[i], TABLE_NCOLS[i]) < 0) {
            table_free(&t);
            Py_CLEAR(out);
            return PyErr_NoMemory();
        }
        PyObject *entry = Py_BuildValue("(sN)", TABLE_NAMES[i], table_schema_capsule(&t));
        table_free(&t);
        if (!entry || PyList_Append(out, entry) < 0) Py_CLEAR(out);
        Py_XDECREF(entry);
    }
    return out;
}

static PyMethodDef METHODS[] = {
    {"configure", configure, METH_VARARGS,
     "configure(contract, expanded, legacy, lifecycle, fallback): the names decode() needs."},
    {"decode", decode, METH_VARARGS,
     "decode(body, max_value_length) -> (spans, keys, tables) or None (use the Python normalizer)."},
    {"schemas", schemas, METH_NOARGS, "schemas() -> [(table, schema capsule)] of every table decode() writes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_fastotlp", "The compiled OTLP decoder (collector/fastpath.py).", -1, METHODS,
};

PyMODINIT_FUNC PyInit__fastotlp(void) {
    PyObject *module = PyModule_Create(&MODULE);
    if (!module) return NULL;
    PyObject *keys = tuple_of_names(KEY_NAMES, K_COUNT);
    PyObject *spans = tuple_of_names(SPAN_NAMES, SPAN_COUNT);
    PyObject *words = tuple_of_names(WORD_NAMES, WORD_COUNT);
    if (PyModule_AddObject(module, "KEYS", keys) < 0 || PyModule_AddObject(module, "SPANS", spans) < 0
        || PyModule_AddObject(module, "WORDS", words) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
