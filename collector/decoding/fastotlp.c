/* tokentrace.collector.decoding._fastotlp: an OTLP ExportTraceServiceRequest protobuf body straight into
 * the Arrow columns of collector/decoding/normalize.py (issue 17: ingest at 100k spans/s on 2 cores).
 *
 * configure() takes the names the decoder needs from tokentrace.contract; decode(body,
 * max_value_length) walks the request (fastotlp_walk.c) and returns (spans, keys, tables), or None
 * when the body is anything this decoder does not reproduce exactly (fastotlp.h);
 * collector/decoding/fastpath.py turns the tables into a Columns. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fastotlp.h"
#include "fastotlp_double.h"
#include "fastotlp_wire.h"

config_t CONFIG;

static const uint8_t EMPTY_TEXT[1] = {0};

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
    out->bits = 0;
    for (Py_ssize_t i = 0; out->items && i < n; i++, out->n++) {
        if (name_of(PySequence_Fast_GET_ITEM(items, i), &out->items[i]) < 0) {
            Py_DECREF(items);
            return FALLBACK;
        }
        out->bits |= UINT64_C(1) << (out->items[i].hash & 63);
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
    names->bits = 0;
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

/* --- the module ------------------------------------------------------------------------------------ */
/* Decoders live from call to call in a small pool, with their scratch (attribute maps, JSON being
 * assembled) and what their last request's tables needed (table_hint_t): fresh buffers each time
 * cost page faults and reallocations that showed in profiles. decode() walks the body without the
 * GIL (issue 17: the collector decodes on threads of its own process, beside its HTTP loop and its
 * writer, instead of paying a worker process's pickling and pipe for every batch); only a float,
 * where the C++ library cannot write it (fastotlp_double.cpp), takes the GIL back for Python's repr
 * (fastotlp_json.c). A call takes a decoder from the pool, or makes
 * one, and puts it back after; both under the GIL, so each decoder serves one call at a time
 * (another thread's, or a finalizer's that runs while a result is built). Before, one shared
 * decoder served whichever call found it free, and every call beside it made and freed a decoder of
 * its own, its scratch and its doubling buffers: with 4 threads decoding at once, the pool and the
 * reserved sizes took 2.9 to 2.75 us of CPU a span (bench/decode.py). */
#define POOL_MAX 8
static decoder_t *pool[POOL_MAX];
static int pooled;

static void scratch_trim(buf_t *b) {
    b->n = 0;
    if (b->cap > (1u << 22)) buf_free(b);  /* after a huge payload, give the memory back */
}

static void attrs_trim(attrs_t *a) {
    attrs_reset(a);
    if (a->cap > (1u << 16) || a->poolcap > (1u << 20)) attrs_free(a);
}

static int decoder_start(decoder_t *d, int64_t max_len) {
    d->max_len = max_len;
    d->span_index = 0;
    for (int i = 0; i < T_COUNT; i++) {
        if (table_init(&d->tables[i], TABLE_NAMES[i], TABLE_SPECS[i], TABLE_NCOLS[i]) < 0
            || table_reserve(&d->tables[i], &d->hints[i]) < 0) {
            for (int k = 0; k <= i; k++) table_free(&d->tables[k]);
            return -1;
        }
    }
    return 0;
}

#define SCRATCH_MAPS(d) {&(d)->attrs, &(d)->event_attrs, &(d)->resource_attrs, &(d)->scratch}
#define SCRATCH_BUFS(d) {&(d)->keys, &(d)->events, &(d)->links, &(d)->events_json, &(d)->links_json, \
                         &(d)->resource_json, &(d)->skip, &(d)->views}

static void decoder_end(decoder_t *d) {
    for (int i = 0; i < T_COUNT; i++) table_free(&d->tables[i]);
    attrs_t *maps[] = SCRATCH_MAPS(d);
    for (size_t i = 0; i < sizeof maps / sizeof *maps; i++) attrs_trim(maps[i]);
    buf_t *bufs[] = SCRATCH_BUFS(d);
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) scratch_trim(bufs[i]);
}

/* A decoder the pool has no room for: everything it holds goes with it. */
static void decoder_free(decoder_t *d) {
    decoder_end(d);
    attrs_t *maps[] = SCRATCH_MAPS(d);
    for (size_t i = 0; i < sizeof maps / sizeof *maps; i++) attrs_free(maps[i]);
    buf_t *bufs[] = SCRATCH_BUFS(d);
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) buf_free(bufs[i]);
    free(d);
}

static PyObject *bytearray_of(const buf_t *b) {
    return PyByteArray_FromStringAndSize((const char *)(b->p ? b->p : EMPTY_TEXT), (Py_ssize_t)b->n);
}

/* Each non-empty table's rows as an exported array (exported[i]; NULL for an empty table), the bytes
 * pyarrow counts for them added to `*bytes`, each table's sizes remembered for the next request. C
 * only: run without the GIL. -1, with every array it made released, if memory runs out. */
static int export_tables(decoder_t *d, void *exported[T_COUNT], int64_t *bytes) {
    for (int i = 0; i < T_COUNT; i++) {
        exported[i] = NULL;
        table_remember(&d->tables[i], &d->hints[i]);
        if (d->tables[i].rows && !(exported[i] = table_export(&d->tables[i], bytes))) {
            for (int k = 0; k < i; k++) table_export_free(exported[k]);
            return -1;
        }
    }
    return 0;
}

/* (spans, keys, [(table, array capsule, its address, origin), ...], bytes) for the exported tables,
 * bytes being what pyarrow counts for their buffers (Columns.nbytes; get_total_buffer_size took
 * 0.16 ms an engine batch, with the GIL, issue 17); NULL, with every array released, on failure. No
 * schema: the Python side imports each array with its table's schema, which it compared with
 * schemas() once (collector/decoding/fastpath.py); building and importing one per call cost 0.15-0.2 us a
 * span (issue 17). */
static PyObject *result_of(decoder_t *d, void *exported[T_COUNT], int64_t bytes) {
    PyObject *tables = PyList_New(0);
    for (int i = 0; i < T_COUNT; i++) {
        if (!exported[i]) continue;
        if (!tables) {  /* an earlier table failed: release the rest */
            table_export_free(exported[i]);
            continue;
        }
        PyObject *array = array_capsule(exported[i]);  /* on failure it released the array */
        PyObject *entry = array ? PyTuple_New(4) : NULL;
        if (entry) {
            PyTuple_SET_ITEM(entry, 0, PyUnicode_FromString(d->tables[i].name));
            PyTuple_SET_ITEM(entry, 1, array);
            PyTuple_SET_ITEM(entry, 2, PyLong_FromVoidPtr(exported[i]));
            PyTuple_SET_ITEM(entry, 3, bytearray_of(&d->tables[i].origin));
            for (int k = 0; k < 4; k++) {
                if (!PyTuple_GET_ITEM(entry, k)) {  /* a tuple with empty slots frees the rest */
                    Py_CLEAR(entry);
                    break;
                }
            }
        } else {
            Py_XDECREF(array);
        }
        if (!entry || PyList_Append(tables, entry) < 0) Py_CLEAR(tables);
        Py_XDECREF(entry);
    }
    if (!tables) return NULL;
    PyObject *keys = bytearray_of(&d->keys);
    if (!keys) {
        Py_DECREF(tables);
        return NULL;
    }
    return Py_BuildValue("(iNNL)", d->span_index, keys, tables, (long long)bytes);
}

/* The GIL is released while the decoder reserves its tables, walks the body and exports the rows
 * (everything but the Python objects of the result): held through all of it but the walk, the call
 * was 9 % of the samples py-spy took of the thread holding the GIL under load (issue 17). */
static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer body;
    PyObject *limit;
    if (!PyArg_ParseTuple(args, "y*O!", &body, &PyLong_Type, &limit)) return NULL;
    int overflow;
    long long max_len = PyLong_AsLongLongAndOverflow(limit, &overflow);
    if (overflow) max_len = overflow > 0 ? INT64_MAX : INT64_MIN;
    /* Below 0 every span's name and status message count as cut, even absent ones: Python's. */
    PyObject *result = NULL;
    decoder_t *d = NULL;
    if (CONFIG.ready && max_len >= 0)  /* taken under the GIL: no other call holds it until it is back */
        d = pooled ? pool[--pooled] : calloc(1, sizeof *d);
    if (d) {
        view_t whole = {body.buf ? (const uint8_t *)body.buf : EMPTY_TEXT, (size_t)body.len};
        void *exported[T_COUNT];
        int64_t bytes = 0;
        int started, rc = -1;
        Py_BEGIN_ALLOW_THREADS
        started = decoder_start(d, max_len);
        if (started == 0 && decode_request(d, whole) == 0) rc = export_tables(d, exported, &bytes);
        Py_END_ALLOW_THREADS
        if (rc == 0) result = result_of(d, exported, bytes);
        if (started == 0) decoder_end(d);
    }
    if (d && pooled < POOL_MAX)
        pool[pooled++] = d;
    else if (d)
        decoder_free(d);
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

/* For the tests: the decoder's text for a float (float.__repr__'s), or None where it would ask Python. */
static PyObject *repr_double(PyObject *self, PyObject *arg) {
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    char text[32];
    int n = double_repr(v, text, sizeof text);
    if (n < 0) Py_RETURN_NONE;
    return PyUnicode_FromStringAndSize(text, n);
}

static PyMethodDef METHODS[] = {
    {"repr_double", repr_double, METH_O, "repr_double(x) -> repr(x) as the decoder writes it, or None (tests)."},
    {"configure", configure, METH_VARARGS,
     "configure(contract, expanded, legacy, lifecycle, fallback): the names decode() needs."},
    {"decode", decode, METH_VARARGS,
     "decode(body, max_value_length) -> (spans, keys, [(table, array capsule, its address, origin)], bytes) or None "
     "(use the Python normalizer)."},
    {"schemas", schemas, METH_NOARGS, "schemas() -> [(table, schema capsule)] of every table decode() writes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_fastotlp", "The compiled OTLP decoder (collector/decoding/fastpath.py).", -1, METHODS,
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
