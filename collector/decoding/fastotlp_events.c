/* A span's events and links: normalize._event (the cache_evictions and instance_events rows, and
 * the span's events JSON) and normalize._link (its links JSON). */
#include "fastotlp.h"
#include "fastotlp_wire.h"

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
int span_event(decoder_t *d, const span_t *s, view_t msg) {
    attrs_t *a = &d->event_attrs;
    attrs_reset(a);
    reader_t r = reader_of(msg);
    uint32_t seen = 0, dropped = 0;
    uint64_t t_ns = 0, raw;
    view_t name = EMPTY_VIEW, sub;
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
int span_link(decoder_t *d, view_t msg) {
    attrs_t *a = &d->event_attrs;
    attrs_reset(a);
    reader_t r = reader_of(msg);
    uint32_t seen = 0, dropped = 0;
    uint64_t raw;
    view_t trace_id = EMPTY_VIEW, span_id = EMPTY_VIEW, state = EMPTY_VIEW, sub;
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
