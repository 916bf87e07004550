/* Protobuf wire format (protobuf.dev/programming-guides/encoding) and UTF-8, inline for the hot
 * loop. Every read is bounds-checked against the enclosing message; where upb (the parser behind
 * Python's protobuf) would accept something these functions refuse, refusing is safe: the Python
 * path then decides. Never the other way round. */
#ifndef TOKENTRACE_FASTOTLP_WIRE_H
#define TOKENTRACE_FASTOTLP_WIRE_H

#include <string.h>

#include "fastotlp.h"

enum { WT_VARINT = 0, WT_FIXED64 = 1, WT_LEN = 2, WT_FIXED32 = 5 };

typedef struct {
    const uint8_t *p, *end;
} reader_t;

static inline reader_t reader_of(view_t v) {
    reader_t r = {v.p, v.p + v.n};
    return r;
}

/* A varint of at most 10 bytes (upb accepts any 10th byte without a continuation bit, as here). */
static inline int wire_varint(reader_t *r, uint64_t *out) {
    const uint8_t *p = r->p;
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (p >= r->end) return FALLBACK;
        uint8_t b = *p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            r->p = p;
            *out = v;
            return 0;
        }
    }
    return FALLBACK;
}

/* The low 7 bits of each of w's 8 bytes (the first one lowest), packed into 56 bits: the first 8
 * bytes of a varint whose bytes all have the continuation bit. */
static inline uint64_t varint_pack8(uint64_t w) {
    w &= 0x7f7f7f7f7f7f7f7fULL;
    w = (w & 0x007f007f007f007fULL) | ((w & 0x7f007f007f007f00ULL) >> 1);
    w = (w & 0x00003fff00003fffULL) | ((w & 0x3fff00003fff0000ULL) >> 2);
    return (w & 0x000000000fffffffULL) | ((w & 0x0fffffff00000000ULL) >> 4);
}

/* A field's tag. Field 0, tags beyond 32 bits and tags written in more than 5 bytes (padded with
 * continuation bytes: upb reads a tag as a 32-bit varint) are malformed (upb: "invalid tag"). */
static inline int wire_tag(reader_t *r, uint32_t *field, uint32_t *wire_type) {
    uint64_t tag;
    if (r->p < r->end && *r->p < 0x80) {  /* fields 1-15: one byte */
        tag = *r->p++;
    } else {
        const uint8_t *start = r->p;
        TRY(wire_varint(r, &tag));
        if (tag > UINT32_MAX || r->p - start > 5) return FALLBACK;
    }
    *field = (uint32_t)(tag >> 3);
    *wire_type = (uint32_t)(tag & 7);
    return *field == 0 ? FALLBACK : 0;
}

static inline int wire_fixed64(reader_t *r, uint64_t *out) {
    if (r->end - r->p < 8) return FALLBACK;
    memcpy(out, r->p, 8);  /* protobuf is little-endian, as every machine this builds for */
    r->p += 8;
    return 0;
}

static inline int wire_bytes(reader_t *r, view_t *out) {
    uint64_t n;
    TRY(wire_varint(r, &n));
    if (n > (uint64_t)(r->end - r->p)) return FALLBACK;
    out->p = r->p;
    out->n = (size_t)n;
    r->p += n;
    return 0;
}

/* Skip a field of an unknown number. Groups (wire types 3, 4) are deprecated and never sent by
 * OTLP exporters: left to the Python path, as are the undefined wire types 6 and 7. */
static inline int wire_skip(reader_t *r, uint32_t wire_type) {
    uint64_t ignored;
    view_t skipped;
    switch (wire_type) {
    case WT_VARINT: return wire_varint(r, &ignored);
    case WT_FIXED64:
        if (r->end - r->p < 8) return FALLBACK;
        r->p += 8;
        return 0;
    case WT_LEN: return wire_bytes(r, &skipped);
    case WT_FIXED32:
        if (r->end - r->p < 4) return FALLBACK;
        r->p += 4;
        return 0;
    default: return FALLBACK;
    }
}

/* Strict UTF-8 (no overlong forms, no surrogates, nothing past U+10FFFF), as upb checks proto3
 * string fields and as Python decodes them; sets the length in code points, which is what the
 * normalizer's length limit counts. */
static inline int utf8_count(view_t s, size_t *code_points) {
    const uint8_t *p = s.p, *end = s.p + s.n;
    size_t n = 0;
    while (p < end) {
        if (end - p >= 8) {
            uint64_t word;
            memcpy(&word, p, 8);
            if (!(word & 0x8080808080808080ULL)) {
                p += 8;
                n += 8;
                continue;
            }
        }
        uint8_t c = *p;
        if (c < 0x80) {
            p++;
        } else if (c < 0xC2) {
            return FALLBACK;
        } else if (c < 0xE0) {
            if (end - p < 2 || (p[1] & 0xC0) != 0x80) return FALLBACK;
            p += 2;
        } else if (c < 0xF0) {
            if (end - p < 3) return FALLBACK;
            uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
            if (p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80) return FALLBACK;
            p += 3;
        } else if (c < 0xF5) {
            if (end - p < 4) return FALLBACK;
            uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
            if (p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return FALLBACK;
            p += 4;
        } else {
            return FALLBACK;
        }
        n++;
    }
    *code_points = n;
    return 0;
}

/* A proto3 string field: valid UTF-8, and not longer than max_len code points (the normalizer
 * cuts longer values and counts them; this decoder leaves that to it). */
static inline int wire_string(reader_t *r, view_t *out, int64_t max_len) {
    size_t code_points;
    TRY(wire_bytes(r, out));
    TRY(utf8_count(*out, &code_points));
    if (max_len < 0 || code_points > (uint64_t)max_len) return FALLBACK;
    return 0;
}

/* A singular field seen for the second time: protobuf would keep the last scalar or merge the
 * messages; both are rare enough to leave to the Python path. */
static inline int wire_once(uint32_t *seen, uint32_t field) {
    uint32_t bit = 1u << (field & 31);
    if (*seen & bit) return FALLBACK;
    *seen |= bit;
    return 0;
}

#endif
