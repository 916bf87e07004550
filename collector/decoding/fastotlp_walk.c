/* The request walk, as normalize() makes it: ResourceSpans, their resource, ScopeSpans, spans, and
 * each span's rows -- its typed rows (fastotlp_rows.c), events and links (fastotlp_events.c), its
 * spans row -- then the resource's row. Field numbers: opentelemetry-proto's trace.proto,
 * common.proto and resource.proto (checked against the installed descriptors). */
#include "fastotlp.h"
#include "fastotlp_wire.h"

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

/* A JSON column: the text in json, or null when !has. */
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

static int all_zero(view_t id) {
    uint8_t any = 0;
    for (size_t i = 0; i < id.n; i++) any |= id.p[i];
    return !any;
}

/* normalize._invalid: a span the normalizer refuses (and reports) is left to it. */
static int check_span(const span_t *s) {
    if (s->trace_id.n != 16 || s->span_id.n != 8 || (s->parent.n && s->parent.n != 8)) return FALLBACK;
    if (all_zero(s->trace_id) || all_zero(s->span_id)) return FALLBACK;  /* invalid ids (trace.proto) */
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
        for (size_t i = 0; i < a->n; i++) {  /* keys are unique (attrs_add): each is one item at most */
            if (names_find(&CONFIG.expanded, a->items[i].key, a->items[i].hash) >= 0) {
                d->skip.p[i] = 1;
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

static int one_span(decoder_t *d, view_t msg, const scope_t *scope, uint64_t *seen_ns) {
    span_t s;
    memset(&s, 0, sizeof s);
    s.name = s.trace_id = s.span_id = s.parent = s.trace_state = s.status_message = EMPTY_VIEW;
    attrs_reset(&d->attrs);
    d->events.n = d->links.n = d->events_json.n = d->links_json.n = 0;
    TRY(read_span(d, msg, &s));
    TRY(check_span(&s));
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
            TRY(attrs_check(&d->scratch, sub));
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
        TRY(one_span(d, sub, &scope, seen_ns));
    }
    return 0;
}

/* ResourceSpans{resource=1, scope_spans=2, schema_url=3}: the resource first, as normalize() does. */
static int resource_spans(decoder_t *d, view_t msg) {
    reader_t r = reader_of(msg);
    uint32_t seen = 0;
    view_t resource = EMPTY_VIEW, sub;
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
int decode_request(decoder_t *d, view_t body) {
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
