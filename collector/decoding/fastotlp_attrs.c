/* Attribute maps: repeated KeyValue as normalize._attributes reads them ({key: _value(value)}),
 * and the normalizer's value rules (_str, _int, _ms, _int_of, _column) on them.
 *
 * Values of the kinds the engine and ordinary SDKs send are kept: strings, bools, ints, doubles,
 * empty values (None) and arrays of those. kvlist, bytes, nested arrays and string_value_strindex
 * are rare (common.proto allows them; no exporter of ours sends them): FALLBACK. */
#include <math.h>
#include <stdlib.h>

#include "fastotlp.h"
#include "fastotlp_wire.h"

uint64_t hash_bytes(const uint8_t *p, size_t n) {
    /* Eight bytes at a time: attribute keys are 10-40 bytes and hashed once per attribute. */
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xC2B2AE3D27D4EB4FULL;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    uint64_t tail = 0;
    if (n) memcpy(&tail, p, n);
    h = (h ^ tail) * 0x165667B19E3779F9ULL;
    return h ^ (h >> 32);
}

int view_eq(view_t a, view_t b) {
    return a.n == b.n && (a.n == 0 || memcmp(a.p, b.p, a.n) == 0);
}

int names_find(const names_t *names, view_t text, uint64_t hash) {
    if (!(names->bits >> (hash & 63) & 1)) return -1;
    for (size_t i = 0; i < names->n; i++)
        if (names->items[i].hash == hash && view_eq(names->items[i].text, text)) return (int)i;
    return -1;
}

void attrs_reset(attrs_t *a) {
    a->n = 0;
    a->npool = 0;
    if (a->nslots > 64) {  /* after a span of many attributes, the next ones start small again */
        free(a->slots);
        a->slots = NULL;
        a->nslots = 0;
    } else if (a->slots) {
        memset(a->slots, 0, a->nslots * sizeof *a->slots);
    }
}

void attrs_free(attrs_t *a) {
    free(a->items);
    free(a->slots);
    free(a->pool);
    memset(a, 0, sizeof *a);
}

static int pool_push(attrs_t *a, int64_t v) {
    if (a->npool == a->poolcap) {
        size_t cap = a->poolcap ? a->poolcap * 2 : 256;
        int64_t *grown = realloc(a->pool, cap * sizeof *grown);
        if (!grown) return FALLBACK;
        a->pool = grown;
        a->poolcap = cap;
    }
    a->pool[a->npool++] = v;
    return 0;
}

static int value_parse(attrs_t *owner, view_t msg, attr_t *out, int64_t max_len, int in_array);

/* The common array element, an AnyValue of nothing but {int_value=3}, read without the general
 * loop (block hashes and step offsets are most of an engine payload's values). A varint of 9 or 10
 * bytes (a 64-bit hash) is read as a word and its last bytes, not byte by byte: that loop was half
 * of value_parse's time, a tenth of the decoder's (issue 17). 0: the general loop decides. */
static int int_element(view_t sub, int64_t *out) {
    if (sub.n < 2 || sub.p[0] != 0x18) return 0;
    const uint8_t *p = sub.p + 1;
    if (sub.n == 10 || sub.n == 11) {
        uint64_t w;
        memcpy(&w, p, 8);
        if ((w & 0x8080808080808080ULL) != 0x8080808080808080ULL) return 0;  /* it ends sooner */
        uint64_t v = varint_pack8(w) | (uint64_t)(p[8] & 0x7f) << 56;
        if (sub.n == 10) {
            if (p[8] & 0x80) return 0;
        } else {
            if (!(p[8] & 0x80) || (p[9] & 0x80)) return 0;
            v |= (uint64_t)p[9] << 63;  /* a 10th byte gives bit 63 alone, as the loop reads it */
        }
        *out = (int64_t)v;
        return 1;
    }
    reader_t r = {p, sub.p + sub.n};
    uint64_t raw;
    if (wire_varint(&r, &raw) < 0 || r.p != r.end) return 0;
    *out = (int64_t)raw;
    return 1;
}

/* An ArrayValue of scalars: element kinds, count, and int elements into the pool. */
static int array_parse(attrs_t *owner, view_t msg, attr_t *out, int64_t max_len) {
    reader_t r = reader_of(msg);
    out->kind = V_ARR;
    out->s = msg;
    out->mask = 0;
    out->count = 0;
    out->ints = owner->npool;
    while (r.p < r.end) {
        uint32_t field, wt;
        TRY(wire_tag(&r, &field, &wt));
        if (field != 1) {
            TRY(wire_skip(&r, wt));
            continue;
        }
        view_t sub;
        attr_t element;
        if (wt != WT_LEN) return FALLBACK;
        TRY(wire_bytes(&r, &sub));
        if (int_element(sub, &element.i)) element.kind = V_INT;
        else TRY(value_parse(owner, sub, &element, max_len, 1));
        if (out->count == UINT32_MAX) return FALLBACK;
        out->count++;
        out->mask |= (uint8_t)(1u << element.kind);
        if (element.kind == V_INT && out->mask == (1u << V_INT)) TRY(pool_push(owner, element.i));
    }
    if (out->mask != (1u << V_INT)) owner->npool = out->ints;  /* not an int column: drop them */
    return 0;
}

/* One AnyValue. A oneof set twice in the wire (the last one would win) is left to Python. */
static int value_parse(attrs_t *owner, view_t msg, attr_t *out, int64_t max_len, int in_array) {
    reader_t r = reader_of(msg);
    int set = 0;
    out->kind = V_NONE;
    while (r.p < r.end) {
        uint32_t field, wt;
        uint64_t raw;
        view_t sub;
        TRY(wire_tag(&r, &field, &wt));
        if (field >= 1 && field <= 8) {
            if (set++) return FALLBACK;
        }
        switch (field) {
        case 1:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_string(&r, &out->s, max_len));
            out->kind = V_STR;
            break;
        case 2:
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_varint(&r, &raw));
            out->kind = V_BOOL;
            out->i = raw != 0;
            break;
        case 3:
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_varint(&r, &raw));
            out->kind = V_INT;
            out->i = (int64_t)raw;
            break;
        case 4:
            if (wt != WT_FIXED64) return FALLBACK;
            TRY(wire_fixed64(&r, &raw));
            out->kind = V_DBL;
            memcpy(&out->d, &raw, 8);
            break;
        case 5:
            if (wt != WT_LEN || in_array) return FALLBACK;
            TRY(wire_bytes(&r, &sub));
            TRY(array_parse(owner, sub, out, max_len));
            break;
        case 6: case 7: case 8:
            return FALLBACK;
        default:
            TRY(wire_skip(&r, wt));
        }
    }
    return 0;
}

/* One KeyValue{key=1, value=2, key_strindex=3}. */
static int keyvalue_parse(attrs_t *a, view_t keyvalue, int64_t max_len, attr_t *item) {
    reader_t r = reader_of(keyvalue);
    uint32_t seen = 0;
    item->key.p = keyvalue.p;  /* an absent key is "" */
    item->key.n = 0;
    item->kind = V_NONE;       /* an absent value is an empty AnyValue: None */
    while (r.p < r.end) {
        uint32_t field, wt;
        uint64_t ignored;
        view_t sub;
        TRY(wire_tag(&r, &field, &wt));
        switch (field) {
        case 1:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_string(&r, &item->key, INT64_MAX));
            break;
        case 2:
            if (wt != WT_LEN) return FALLBACK;
            TRY(wire_once(&seen, field));
            TRY(wire_bytes(&r, &sub));
            TRY(value_parse(a, sub, item, max_len, 0));
            break;
        case 3:  /* key_strindex (profiles' string table): not read by the normalizer */
            if (wt != WT_VARINT) return FALLBACK;
            TRY(wire_varint(&r, &ignored));
            break;
        default:
            TRY(wire_skip(&r, wt));
        }
    }
    item->hash = hash_bytes(item->key.p, item->key.n);
    return 0;
}

/* Put item i in the key index; its key already there gives FALLBACK. */
static int slot_insert(attrs_t *a, size_t i) {
    size_t mask = a->nslots - 1, at = a->items[i].hash & mask;
    while (a->slots[at]) {
        const attr_t *other = &a->items[a->slots[at] - 1];
        if (other->hash == a->items[i].hash && view_eq(other->key, a->items[i].key)) return FALLBACK;
        at = (at + 1) & mask;
    }
    a->slots[at] = (uint32_t)(i + 1);
    return 0;
}

static int slots_resize(attrs_t *a, size_t nslots) {
    uint32_t *grown = realloc(a->slots, nslots * sizeof *grown);
    if (!grown) return FALLBACK;
    a->slots = grown;
    a->nslots = nslots;
    memset(a->slots, 0, nslots * sizeof *a->slots);
    for (size_t i = 0; i < a->n; i++) TRY(slot_insert(a, i));
    return 0;
}

/* Indexed as they come, so that a payload of one key repeated millions of times stops at the
 * second, before it has cost memory. */
int attrs_add(attrs_t *a, view_t keyvalue, int64_t max_len) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 32;
        if (cap > UINT32_MAX) return FALLBACK;
        attr_t *grown = realloc(a->items, cap * sizeof *grown);
        if (!grown) return FALLBACK;
        a->items = grown;
        a->cap = cap;
    }
    TRY(keyvalue_parse(a, keyvalue, max_len, &a->items[a->n]));
    a->n++;
    if (a->n * 2 > a->nslots) return slots_resize(a, a->nslots ? a->nslots * 2 : 16);
    return slot_insert(a, a->n - 1);
}

int attrs_check(attrs_t *scratch, view_t keyvalue) {
    attr_t item;
    size_t pool = scratch->npool;
    int rc = keyvalue_parse(scratch, keyvalue, INT64_MAX, &item);
    scratch->npool = pool;
    return rc;
}

const attr_t *attrs_find(const attrs_t *a, view_t key, uint64_t hash) {
    if (!a->n) return NULL;
    size_t mask = a->nslots - 1;
    for (size_t at = hash & mask; a->slots[at]; at = (at + 1) & mask) {
        const attr_t *item = &a->items[a->slots[at] - 1];
        if (item->hash == hash && view_eq(item->key, key)) return item;
    }
    return NULL;
}

const attr_t *attrs_get(const attrs_t *a, enum key_id key) {
    return attrs_find(a, CONFIG.keys[key].text, CONFIG.keys[key].hash);
}

elements_t elements_of(const attr_t *array) {
    elements_t it = {array->s.p, array->s.p + array->s.n};
    return it;
}

int elements_next(elements_t *it, attr_t *element) {
    /* The array was checked when it was parsed; these reads cannot fail, but stay bounded. */
    reader_t r = {it->p, it->end};
    attrs_t none = {0};
    while (r.p < r.end) {
        uint32_t field, wt;
        view_t sub;
        if (wire_tag(&r, &field, &wt) < 0) return 0;
        if (field != 1) {
            if (wire_skip(&r, wt) < 0) return 0;
            continue;
        }
        if (wire_bytes(&r, &sub) < 0 || value_parse(&none, sub, element, INT64_MAX, 1) < 0) return 0;
        it->p = r.p;
        return 1;
    }
    it->p = r.p;
    return 0;
}

int value_str(const attr_t *a, view_t *out) {
    out->p = NULL;
    out->n = 0;
    if (!a || a->kind == V_NONE) return 0;
    if (a->kind != V_STR) return FALLBACK;  /* str(value): Python's spelling of it */
    if (a->s.n) *out = a->s;
    return 0;
}

/* Python's float.is_integer() and -2**63 <= value <= 2**63 - 1 (compared exactly). */
static int double_as_int64(double v, int64_t *out) {
    if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0) || v != trunc(v)) return 0;
    *out = (int64_t)v;
    return 1;
}

int value_int(const attr_t *a, int64_t *out) {
    if (!a) return 0;
    if (a->kind == V_INT) {
        *out = a->i;
        return 1;
    }
    return a->kind == V_DBL && double_as_int64(a->d, out);
}

int value_int_of(const attr_t *a, int64_t *out) {
    if (!a || a->kind == V_NONE) return 0;
    return value_int(a, out) ? 1 : FALLBACK;  /* left out and counted by the normalizer */
}

int value_ms(const attr_t *a, double *out) {
    if (!a || a->kind == V_NONE) return 0;
    double ms;
    if (a->kind == V_DBL) ms = a->d;
    else if (a->kind == V_INT) ms = (double)a->i;  /* Python's int * 1.0: the nearest double */
    else return FALLBACK;
    if (!(ms >= 0.0 && ms <= 1e10)) return FALLBACK;  /* normalize.MAX_MS; NaN fails both */
    *out = ms;
    return 1;
}

int value_column(const attrs_t *owner, const attr_t *a, const int64_t **values, size_t *n) {
    *values = NULL;
    *n = 0;
    if (!a || a->kind == V_NONE) return 0;
    if (a->kind != V_ARR || (a->count && a->mask != (1u << V_INT))) return FALLBACK;  /* _Untyped */
    if (!a->count) return 0;  /* [] (and the pool may not exist yet) */
    *values = owner->pool + a->ints;
    *n = a->count;
    return 0;
}
