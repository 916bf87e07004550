/* JSON text exactly as normalize._json writes it: json.dumps(value, separators=(",", ":"),
 * ensure_ascii=False), NaN and infinities as the strings "NaN", "Infinity", "-Infinity"
 * (normalize._finite), dict keys in insertion order. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>

#include "fastotlp.h"
#include "fastotlp_double.h"

int buf_grow(buf_t *b, size_t extra) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->n < extra) {
        if (cap > SIZE_MAX / 2) return FALLBACK;
        cap *= 2;
    }
    uint8_t *grown = realloc(b->p, cap);
    if (!grown) return FALLBACK;
    b->p = grown;
    b->cap = cap;
    return 0;
}

void buf_free(buf_t *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

static inline int put_byte(buf_t *b, uint8_t c) {
    TRY(buf_reserve(b, 1));
    b->p[b->n++] = c;
    return 0;
}

/* Whether none of the 8 bytes at p needs escaping: no control character, '"' or '\\' (a byte
 * below 0x20 or equal to one of the two, found with word arithmetic; UTF-8's bytes from 0x80 on
 * never match). */
static inline int plain8(const uint8_t *p) {
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    uint64_t w, quote, backslash;
    memcpy(&w, p, 8);
    quote = w ^ (ones * '"');
    backslash = w ^ (ones * '\\');
    return !((((w - ones * 0x20) & ~w) | ((quote - ones) & ~quote) | ((backslash - ones) & ~backslash)) & highs);
}

/* json's escaping with ensure_ascii=False: the two-character escapes, \u00XX (lower-case hex) for
 * the other control characters, everything else (valid UTF-8 already) as it is. Eight bytes are
 * checked at a time (this function was 7 % of decoding an engine batch, issue 17). */
int json_string(buf_t *b, view_t text) {
    static const char hex[] = "0123456789abcdef";
    TRY(buf_reserve(b, text.n + 2));
    b->p[b->n++] = '"';
    size_t start = 0;
    for (size_t i = 0; i < text.n; i++) {
        if (i + 8 <= text.n && plain8(text.p + i)) {
            i += 7;
            continue;
        }
        uint8_t c = text.p[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        TRY(buf_put(b, text.p + start, i - start));
        char escaped[6] = {'\\', 0, 0, 0, 0, 0};
        size_t n = 2;
        switch (c) {
        case '"': escaped[1] = '"'; break;
        case '\\': escaped[1] = '\\'; break;
        case '\n': escaped[1] = 'n'; break;
        case '\r': escaped[1] = 'r'; break;
        case '\t': escaped[1] = 't'; break;
        case '\b': escaped[1] = 'b'; break;
        case '\f': escaped[1] = 'f'; break;
        default:
            escaped[1] = 'u';
            escaped[2] = '0';
            escaped[3] = '0';
            escaped[4] = hex[c >> 4];
            escaped[5] = hex[c & 15];
            n = 6;
        }
        TRY(buf_put(b, escaped, n));
        start = i + 1;
    }
    TRY(buf_put(b, text.p + start, text.n - start));
    return put_byte(b, '"');
}

int json_uint(buf_t *b, uint64_t v) {
    char digits[20];
    int n = 0;
    do {
        digits[19 - n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return buf_put(b, digits + 20 - n, (size_t)n);
}

int json_int(buf_t *b, int64_t v) {
    if (v >= 0) return json_uint(b, (uint64_t)v);
    TRY(put_byte(b, '-'));
    return json_uint(b, (uint64_t)0 - (uint64_t)v);
}

/* float.__repr__, which json.dumps uses: the shortest text that reads back as the same double. */
static int json_double(buf_t *b, double v) {
    if (isnan(v)) return buf_put(b, "\"NaN\"", 5);
    if (isinf(v)) return v > 0 ? buf_put(b, "\"Infinity\"", 10) : buf_put(b, "\"-Infinity\"", 11);
    if (v == trunc(v) && fabs(v) < 1e16) {  /* repr writes these as digits and ".0" */
        if (v == 0 && signbit(v)) TRY(put_byte(b, '-'));
        TRY(json_int(b, (int64_t)v));
        return buf_put(b, ".0", 2);
    }
    char shortest[32];
    int n = double_repr(v, shortest, sizeof shortest);
    if (n > 0) return buf_put(b, shortest, (size_t)n);
    /* Where the C++ library cannot: decode() runs without the GIL; Python's own repr needs it. */
    PyGILState_STATE gil = PyGILState_Ensure();
    char *text = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    int rc = FALLBACK;
    if (text) {
        rc = buf_put(b, text, strlen(text));
        PyMem_Free(text);
    } else {
        PyErr_Clear();
    }
    PyGILState_Release(gil);
    return rc;
}

static int json_scalar(buf_t *b, const attr_t *a) {
    switch (a->kind) {
    case V_STR: return json_string(b, a->s);
    case V_BOOL: return a->i ? buf_put(b, "true", 4) : buf_put(b, "false", 5);
    case V_INT: return json_int(b, a->i);
    case V_DBL: return json_double(b, a->d);
    case V_NONE: return buf_put(b, "null", 4);
    default: return FALLBACK;
    }
}

int json_value(buf_t *b, const attrs_t *owner, const attr_t *a) {
    if (a->kind != V_ARR) return json_scalar(b, a);
    TRY(put_byte(b, '['));
    if (a->count && a->mask == (1u << V_INT)) {
        const int64_t *values = owner->pool + a->ints;
        for (uint32_t i = 0; i < a->count; i++) {
            if (i) TRY(put_byte(b, ','));
            TRY(json_int(b, values[i]));
        }
    } else {
        elements_t it = elements_of(a);
        attr_t element;
        for (int first = 1; elements_next(&it, &element); first = 0) {
            if (!first) TRY(put_byte(b, ','));
            TRY(json_scalar(b, &element));
        }
    }
    return put_byte(b, ']');
}

int json_attrs(buf_t *b, const attrs_t *a, const uint8_t *skip) {
    TRY(put_byte(b, '{'));
    int first = 1;
    for (size_t i = 0; i < a->n; i++) {
        if (skip && skip[i]) continue;
        if (!first) TRY(put_byte(b, ','));
        first = 0;
        TRY(json_string(b, a->items[i].key));
        TRY(put_byte(b, ':'));
        TRY(json_value(b, a, &a->items[i]));
    }
    return put_byte(b, '}');
}
