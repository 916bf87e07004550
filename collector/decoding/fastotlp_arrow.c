/* Column builders and their export through the Arrow C data interface
 * (arrow.apache.org/docs/format/CDataInterface.html) as PyCapsules (the Arrow PyCapsule
 * interface): pyarrow imports the buffers without copying them and calls release when it is done.
 *
 * Types are those of columns.SCHEMAS: utf8 and list with 32-bit offsets, nullable fields, list
 * elements named "item" (pyarrow's default); fastpath.py checks the exported schemas against
 * SCHEMAS at import. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fastotlp.h"

#define ARROW_FLAG_NULLABLE 2

struct ArrowSchema {
    const char *format;
    const char *name;
    const char *metadata;
    int64_t flags;
    int64_t n_children;
    struct ArrowSchema **children;
    struct ArrowSchema *dictionary;
    void (*release)(struct ArrowSchema *);
    void *private_data;
};

struct ArrowArray {
    int64_t length;
    int64_t null_count;
    int64_t offset;
    int64_t n_buffers;
    int64_t n_children;
    const void **buffers;
    struct ArrowArray **children;
    struct ArrowArray *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};

/* --- builders ------------------------------------------------------------------------------------ */
static int is_list(uint8_t type) {
    return type == COL_LIST_STR || type == COL_LIST_F64 || type == COL_LIST_I64;
}

static int column_init(column_t *c, uint8_t type) {
    memset(c, 0, sizeof *c);
    c->type = type;
    if (type == COL_STR || is_list(type)) {
        int32_t zero = 0;
        TRY(buf_put(&c->data, &zero, 4));  /* offsets start at 0 */
    }
    if (is_list(type)) {
        c->child = calloc(1, sizeof *c->child);
        if (!c->child) return FALLBACK;
        TRY(column_init(c->child, type == COL_LIST_STR ? COL_STR : type == COL_LIST_F64 ? COL_F64 : COL_I64));
    }
    return 0;
}

static void column_free(column_t *c) {
    buf_free(&c->valid);
    buf_free(&c->data);
    buf_free(&c->chars);
    if (c->child) {
        column_free(c->child);
        free(c->child);
        c->child = NULL;
    }
}

/* Record value `length` as valid or null; the bitmap is made at the first null. */
static int column_valid(column_t *c, int valid) {
    size_t bytes = (size_t)(c->length / 8) + 1;
    if (!valid && !c->valid.p) {
        TRY(buf_reserve(&c->valid, bytes > 64 ? bytes : 64));
        memset(c->valid.p, 0xff, c->valid.cap);
        c->valid.n = c->valid.cap;
    }
    if (c->valid.p) {
        if (bytes > c->valid.n) {
            size_t old = c->valid.n;
            TRY(buf_reserve(&c->valid, bytes - old));
            memset(c->valid.p + old, 0xff, c->valid.cap - old);
            c->valid.n = c->valid.cap;
        }
        if (!valid) c->valid.p[c->length / 8] &= (uint8_t)~(1u << (c->length % 8));
    }
    if (!valid) c->nulls++;
    return 0;
}

static int close_offset(column_t *c, size_t end) {
    if (end > INT32_MAX) return FALLBACK;  /* beyond 32-bit offsets: pyarrow would chunk it */
    int32_t offset = (int32_t)end;
    TRY(buf_put(&c->data, &offset, 4));
    c->length++;
    return 0;
}

static int column_null(column_t *c) {
    TRY(column_valid(c, 0));
    switch (c->type) {
    case COL_STR: return close_offset(c, c->chars.n);
    case COL_LIST_STR: case COL_LIST_F64: case COL_LIST_I64: return close_offset(c, (size_t)c->child->length);
    case COL_BOOL: {
        if (c->length % 8 == 0) TRY(buf_put(&c->data, "", 1));
        c->length++;
        return 0;
    }
    default: {
        static const uint8_t zero[8] = {0};
        TRY(buf_put(&c->data, zero, c->type == COL_I32 ? 4 : 8));
        c->length++;
        return 0;
    }
    }
}

int elem_str(column_t *c, view_t s) {
    if (!s.p) return column_null(c);
    TRY(column_valid(c, 1));
    TRY(buf_put(&c->chars, s.p, s.n));
    return close_offset(c, c->chars.n);
}

int elem_i64(column_t *c, int64_t v) {
    TRY(column_valid(c, 1));
    TRY(buf_put(&c->data, &v, 8));
    c->length++;
    return 0;
}

int elem_i64_all(column_t *c, const int64_t *values, size_t n) {
    if (c->valid.p) {  /* a null came before: every value needs its validity bit */
        for (size_t i = 0; i < n; i++) TRY(elem_i64(c, values[i]));
        return 0;
    }
    TRY(buf_put(&c->data, values, n * sizeof *values));  /* block hashes, offsets: one copy */
    c->length += (int64_t)n;
    return 0;
}

int elem_f64(column_t *c, double v) {
    TRY(column_valid(c, 1));
    TRY(buf_put(&c->data, &v, 8));
    c->length++;
    return 0;
}

/* --- rows ---------------------------------------------------------------------------------------- */
int table_init(table_t *t, const char *name, const colspec_t *specs, int ncols) {
    memset(t, 0, sizeof *t);
    t->name = name;
    t->specs = specs;
    t->ncols = ncols;
    for (int i = 0; i < ncols; i++) TRY(column_init(&t->cols[i], specs[i].type));
    return 0;
}

void table_free(table_t *t) {
    for (int i = 0; i < t->ncols; i++) column_free(&t->cols[i]);
    buf_free(&t->origin);
}

/* Each growable buffer of a table in hint order (NULL where a column has no list elements). Validity
 * bitmaps are not among them: an allocated bitmap means a null was written (column_valid). */
static void table_buffers(table_t *t, buf_t *out[HINT_SLOTS]) {
    memset(out, 0, HINT_SLOTS * sizeof *out);
    for (int i = 0; i < t->ncols; i++) {
        column_t *c = &t->cols[i];
        out[4 * i] = &c->data;
        out[4 * i + 1] = &c->chars;
        if (c->child) {
            out[4 * i + 2] = &c->child->data;
            out[4 * i + 3] = &c->child->chars;
        }
    }
    out[HINT_SLOTS - 1] = &t->origin;
}

void table_remember(const table_t *t, table_hint_t *hint) {
    buf_t *bufs[HINT_SLOTS];
    table_buffers((table_t *)t, bufs);
    for (int i = 0; i < HINT_SLOTS; i++) hint->n[i] = bufs[i] ? bufs[i]->n : 0;
}

/* Room for an eighth more than last time, in one allocation per buffer; what a request leaves unused
 * is given back when the buffer is exported (give). */
int table_reserve(table_t *t, const table_hint_t *hint) {
    buf_t *bufs[HINT_SLOTS];
    table_buffers(t, bufs);
    for (int i = 0; i < HINT_SLOTS; i++) {
        size_t want = hint->n[i] + hint->n[i] / 8;
        if (!bufs[i] || !hint->n[i] || bufs[i]->cap >= want) continue;
        uint8_t *grown = realloc(bufs[i]->p, want);
        if (!grown) return FALLBACK;
        bufs[i]->p = grown;
        bufs[i]->cap = want;
    }
    return 0;
}

/* The next column of the row, when it has the type the caller writes (a mismatch is a bug in
 * fastotlp_rows.c; the decoder then falls back, and the differential tests fail). */
static column_t *next(table_t *t, int list_or_type) {
    if (t->at >= t->ncols) return NULL;
    column_t *c = &t->cols[t->at];
    if (list_or_type >= 0 && c->type != list_or_type) return NULL;
    t->at++;
    return c;
}

int put_null(table_t *t) {
    column_t *c = next(t, -1);
    return c ? column_null(c) : FALLBACK;
}

int put_str(table_t *t, view_t s) {
    column_t *c = next(t, COL_STR);
    return c ? elem_str(c, s) : FALLBACK;
}

int put_i64(table_t *t, int64_t v) {
    column_t *c = next(t, COL_I64);
    return c ? elem_i64(c, v) : FALLBACK;
}

int put_i64_opt(table_t *t, int has, int64_t v) {
    return has ? put_i64(t, v) : put_null(t);
}

int put_i32(table_t *t, int32_t v) {
    column_t *c = next(t, COL_I32);
    if (!c) return FALLBACK;
    TRY(column_valid(c, 1));
    TRY(buf_put(&c->data, &v, 4));
    c->length++;
    return 0;
}

int put_f64_opt(table_t *t, int has, double v) {
    if (!has) return put_null(t);
    column_t *c = next(t, COL_F64);
    return c ? elem_f64(c, v) : FALLBACK;
}

int put_bool_opt(table_t *t, int has, int v) {
    if (!has) return put_null(t);
    column_t *c = next(t, COL_BOOL);
    if (!c) return FALLBACK;
    TRY(column_valid(c, 1));
    if (c->length % 8 == 0) TRY(buf_put(&c->data, "", 1));
    if (v) c->data.p[c->length / 8] |= (uint8_t)(1u << (c->length % 8));
    c->length++;
    return 0;
}

buf_t *put_str_begin(table_t *t) {
    column_t *c = next(t, COL_STR);
    if (!c || column_valid(c, 1) < 0) return NULL;
    return &c->chars;
}

int put_str_end(table_t *t) {
    column_t *c = &t->cols[t->at - 1];
    return close_offset(c, c->chars.n);
}

column_t *put_list_begin(table_t *t) {
    if (t->at >= t->ncols || !is_list(t->cols[t->at].type)) return NULL;
    column_t *c = next(t, -1);
    if (column_valid(c, 1) < 0) return NULL;
    return c->child;
}

int put_list_end(table_t *t) {
    column_t *c = &t->cols[t->at - 1];
    return close_offset(c, (size_t)c->child->length);
}

int row_end(table_t *t, int32_t origin) {
    if (t->at != t->ncols) return FALLBACK;
    t->at = 0;
    t->rows++;
    return buf_put(&t->origin, &origin, 4);
}

/* --- export -------------------------------------------------------------------------------------- */
static const char *format_of(uint8_t type) {
    switch (type) {
    case COL_STR: return "u";
    case COL_I64: return "l";
    case COL_I32: return "i";
    case COL_F64: return "g";
    case COL_BOOL: return "b";
    default: return "+l";
    }
}

static void schema_release(struct ArrowSchema *s) {
    for (int64_t i = 0; i < s->n_children; i++) {
        struct ArrowSchema *child = s->children[i];
        if (child->release) child->release(child);
        free(child);
    }
    free(s->children);
    s->release = NULL;
}

static int schema_fill(struct ArrowSchema *s, const char *format, const char *name, int64_t n_children) {
    memset(s, 0, sizeof *s);
    s->format = format;
    s->name = name;
    s->flags = ARROW_FLAG_NULLABLE;
    s->release = schema_release;
    if (!n_children) return 0;
    s->children = calloc((size_t)n_children, sizeof *s->children);
    if (!s->children) return FALLBACK;
    for (int64_t i = 0; i < n_children; i++) {
        s->children[i] = calloc(1, sizeof **s->children);
        if (!s->children[i]) return FALLBACK;
        s->n_children = i + 1;  /* so that release frees what exists */
    }
    return 0;
}

static int schema_of_table(struct ArrowSchema *s, const table_t *t) {
    TRY(schema_fill(s, "+s", "", t->ncols));
    s->flags = 0;
    for (int i = 0; i < t->ncols; i++) {
        uint8_t type = t->specs[i].type;
        TRY(schema_fill(s->children[i], format_of(type), t->specs[i].name, is_list(type) ? 1 : 0));
        if (is_list(type))
            TRY(schema_fill(s->children[i]->children[0],
                            format_of(type == COL_LIST_STR ? COL_STR : type == COL_LIST_F64 ? COL_F64 : COL_I64),
                            "item", 0));
    }
    return 0;
}

/* Unused bytes past which an exported buffer is cut to its length (give). */
#define SHRINK_SLACK 4096

/* What an exported array owns: its buffers (moved out of the builder) and its children. */
typedef struct {
    const void *buffers[3];
    void *owned[3];
} owned_t;

static void array_release(struct ArrowArray *a) {
    for (int64_t i = 0; i < a->n_children; i++) {
        struct ArrowArray *child = a->children[i];
        if (child->release) child->release(child);
        free(child);
    }
    free(a->children);
    owned_t *own = a->private_data;
    if (own) {
        for (int i = 0; i < 3; i++) free(own->owned[i]);
        free(own);
    }
    a->release = NULL;
}

static int array_fill(struct ArrowArray *a, int64_t length, int64_t n_buffers, int64_t n_children) {
    memset(a, 0, sizeof *a);
    a->length = length;
    a->n_buffers = n_buffers;
    a->release = array_release;
    owned_t *own = calloc(1, sizeof *own);
    if (!own) return FALLBACK;
    a->private_data = own;
    a->buffers = own->buffers;
    if (!n_children) return 0;
    a->children = calloc((size_t)n_children, sizeof *a->children);
    if (!a->children) return FALLBACK;
    for (int64_t i = 0; i < n_children; i++) {
        a->children[i] = calloc(1, sizeof **a->children);
        if (!a->children[i]) return FALLBACK;
        a->n_children = i + 1;
    }
    return 0;
}

/* Hand a builder buffer to the array (never a NULL data buffer: one byte at least), cut to its
 * length: a buffer grown by doubling holds up to twice what it exports, and an exported batch stays
 * in memory until the store has merged it, counted against the byte budget by its exported size
 * (Columns.nbytes). Without the cut, a collector under overload held ~1.3x its unmerged columns in
 * malloc (bench/overload.py, docs/benchmarks.md). glibc shrinks in place: no copy. */
static int give(owned_t *own, int slot, buf_t *b) {
    if (!b->p) TRY(buf_reserve(b, 1));
    if (b->cap - b->n >= SHRINK_SLACK && b->n) {
        uint8_t *cut = realloc(b->p, b->n);
        if (cut) b->p = cut;  /* a failed shrink keeps the larger buffer, still valid */
    }
    own->buffers[slot] = own->owned[slot] = b->p;
    b->p = NULL;
    b->n = b->cap = 0;
    return 0;
}

/* Add to `bytes` what pyarrow counts for the buffers a column exports (its list's child apart): the
 * sizes an importer gives them from the array's length (a bitmap of length bits; length values, or
 * offsets past the first and the characters the last one ends at). Those are the bytes the builder
 * wrote, except the null bitmap, which it makes whole bytes and 64 at least (column_valid). */
static void count_buffers(const column_t *c, int64_t *bytes) {
    if (c->nulls) *bytes += (c->length + 7) / 8;
    *bytes += (int64_t)c->data.n;
    if (c->type == COL_STR) *bytes += (int64_t)c->chars.n;
}

static int array_of_column(struct ArrowArray *a, column_t *c, int64_t *bytes) {
    int list = is_list(c->type);
    TRY(array_fill(a, c->length, c->type == COL_STR ? 3 : 2, list ? 1 : 0));
    count_buffers(c, bytes);
    owned_t *own = a->private_data;
    a->null_count = c->nulls;
    if (c->nulls) TRY(give(own, 0, &c->valid));
    TRY(give(own, 1, &c->data));
    if (c->type == COL_STR) TRY(give(own, 2, &c->chars));
    if (list) TRY(array_of_column(a->children[0], c->child, bytes));
    return 0;
}

static int array_of_table(struct ArrowArray *a, table_t *t, int64_t *bytes) {
    TRY(array_fill(a, t->rows, 1, t->ncols));
    for (int i = 0; i < t->ncols; i++) TRY(array_of_column(a->children[i], &t->cols[i], bytes));
    return 0;
}

static void schema_capsule_free(PyObject *capsule) {
    struct ArrowSchema *s = PyCapsule_GetPointer(capsule, "arrow_schema");
    if (s && s->release) s->release(s);
    free(s);
}

static void array_capsule_free(PyObject *capsule) {
    struct ArrowArray *a = PyCapsule_GetPointer(capsule, "arrow_array");
    if (a && a->release) a->release(a);
    free(a);
}

void *table_schema_capsule(const table_t *t) {
    struct ArrowSchema *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    if (schema_of_table(s, t) < 0) {
        if (s->release) s->release(s);
        free(s);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(s, "arrow_schema", schema_capsule_free);
    if (!capsule) {
        s->release(s);
        free(s);
    }
    return capsule;
}

void *table_export(table_t *t, int64_t *bytes) {
    struct ArrowArray *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    if (array_of_table(a, t, bytes) < 0) {
        table_export_free(a);
        return NULL;
    }
    return a;
}

void table_export_free(void *exported) {
    struct ArrowArray *a = exported;
    if (a && a->release) a->release(a);
    free(a);
}

void *array_capsule(void *exported) {
    PyObject *capsule = PyCapsule_New(exported, "arrow_array", array_capsule_free);
    if (!capsule) table_export_free(exported);
    return capsule;
}
