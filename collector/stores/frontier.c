/* The memory of recently stored block keys, and each block list's first new block (issue 17).
 *
 * collector/stores/frontier.py explains what is computed and why; this is the loop it runs per merge,
 * which in numpy (sorting every block of a merge three ways) cost 13 us per engine span. Here a
 * key costs one probe of an open-addressing hash table per generation: two generations of about
 * `capacity` keys each; a key in either is a repeat, every key offered joins the new one, and once
 * the new one holds `capacity` keys it becomes the old one (the old one is dropped).
 *
 * Buffers come in through the buffer protocol (numpy arrays), so nothing here knows numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "pybuffer.h"
#include <stdint.h>
#include <string.h>

#define MIX UINT64_C(0x9E3779B97F4A7C15)
#define AHEAD 8
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

typedef struct {
    uint64_t *slots; /* 0 marks an empty slot; the key 0 is kept apart (has_zero) */
    size_t mask;     /* slots - 1, a power of two minus one */
    size_t size;     /* keys held */
    int has_zero;
} KeySet;

typedef struct {
    PyObject_HEAD
    KeySet generations[2]; /* [0] new, [1] old */
    size_t capacity;
} RecentKeys;

static int keyset_init(KeySet *set, size_t capacity) {
    size_t slots = 16;
    while (slots < 2 * capacity) /* at most half full */
        slots <<= 1;
    set->slots = PyMem_RawCalloc(slots, sizeof(uint64_t));
    if (set->slots == NULL)
        return -1;
    set->mask = slots - 1;
    set->size = 0;
    set->has_zero = 0;
    return 0;
}

static void keyset_clear(KeySet *set) {
    memset(set->slots, 0, (set->mask + 1) * sizeof(uint64_t));
    set->size = 0;
    set->has_zero = 0;
}

static inline size_t slot_of(uint64_t key, size_t mask) {
    /* The keys are already mixed (frontier.py); the top bits spread them over the table. */
    return (size_t)((key * MIX) >> 17) & mask;
}

static inline int keyset_has(const KeySet *set, uint64_t key) {
    if (key == 0)
        return set->has_zero;
    for (size_t at = slot_of(key, set->mask);; at = (at + 1) & set->mask) {
        uint64_t found = set->slots[at];
        if (found == key)
            return 1;
        if (found == 0)
            return 0;
    }
}

/* Adds the key; 1 when it was not there. */
static inline int keyset_add(KeySet *set, uint64_t key) {
    if (key == 0) {
        if (set->has_zero)
            return 0;
        set->has_zero = 1;
        set->size++;
        return 1;
    }
    for (size_t at = slot_of(key, set->mask);; at = (at + 1) & set->mask) {
        uint64_t found = set->slots[at];
        if (found == key)
            return 0;
        if (found == 0) {
            set->slots[at] = key;
            set->size++;
            return 1;
        }
    }
}

/* A full new generation becomes the old one (the old one is dropped). Called after every key
 * added, so that a generation never holds more than `capacity` keys, its table stays at most half
 * full, and every probe meets an empty slot (issue 45: `fresh` added a whole call's keys first,
 * and a call of more distinct keys than slots never ended). */
static inline void rotate_if_full(RecentKeys *self) {
    KeySet *young = &self->generations[0], *old = &self->generations[1];
    if (young->size >= self->capacity) {
        KeySet dropped = *old;
        *old = *young;
        *young = dropped;
        keyset_clear(young);
    }
}

/* A key offered: 1 when it is new (in neither generation). It joins the new generation. */
static inline int offer(RecentKeys *self, uint64_t key) {
    int seen = !keyset_add(&self->generations[0], key) || keyset_has(&self->generations[1], key);
    rotate_if_full(self);  /* after the walk of the new generation above: one walk */
    return !seen;
}

static int recent_init(RecentKeys *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"capacity", NULL};
    Py_ssize_t capacity = 1000000;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|n", names, &capacity))
        return -1;
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity must be at least 1");
        return -1;
    }
    self->capacity = (size_t)capacity;
    for (int g = 0; g < 2; g++) {
        PyMem_RawFree(self->generations[g].slots);
        self->generations[g].slots = NULL;
        if (keyset_init(&self->generations[g], self->capacity) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static void recent_dealloc(RecentKeys *self) {
    for (int g = 0; g < 2; g++)
        PyMem_RawFree(self->generations[g].slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *recent_fresh(RecentKeys *self, PyObject *arg) {
    Py_buffer keys;
    if (get_buffer(arg, &keys, 8, "keys") < 0)
        return NULL;
    Py_ssize_t count = keys.len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count);
    if (out != NULL) {
        char *mask = PyBytes_AS_STRING(out);
        const uint64_t *values = keys.buf;
        /* As the numpy version: every key is judged against the memory before the call. */
        for (Py_ssize_t i = 0; i < count; i++)
            mask[i] = !(keyset_has(&self->generations[0], values[i]) ||
                        keyset_has(&self->generations[1], values[i]));
        for (Py_ssize_t i = 0; i < count; i++) {
            keyset_add(&self->generations[0], values[i]);
            rotate_if_full(self);
        }
    }
    PyBuffer_Release(&keys);
    return out;
}

/* frontiers(hashes int64[], starts int64[rows + 1], salts uint64[rows], order int64[rows]) ->
 * bytes of int32[rows]: per row, the first index whose key is new, or -1. Rows are taken in
 * `order`, blocks in index order; a key is new unless remembered or offered before. */
static PyObject *recent_frontiers(RecentKeys *self, PyObject *args) {
    PyObject *objects[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objects[0], &objects[1], &objects[2], &objects[3]))
        return NULL;
    Py_buffer views[4];
    const char *what[4] = {"hashes", "starts", "salts", "order"};
    int got = 0;
    PyObject *out = NULL;
    for (; got < 4; got++)
        if (get_buffer(objects[got], &views[got], 8, what[got]) < 0)
            goto done;
    const int64_t *hashes = views[0].buf, *starts = views[1].buf, *order = views[3].buf;
    const uint64_t *salts = views[2].buf;
    Py_ssize_t blocks = views[0].len / 8, rows = views[2].len / 8;
    if (views[1].len / 8 != rows + 1 || views[3].len / 8 != rows) {
        PyErr_SetString(PyExc_ValueError, "starts must have one more item than salts, order as many");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, rows * (Py_ssize_t)sizeof(int32_t));
    if (out == NULL)
        goto done;
    int32_t *fresh = (int32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t r = 0; r < rows; r++)
        fresh[r] = -1;
    for (Py_ssize_t k = 0; k < rows; k++) {
        int64_t row = order[k];
        if (row < 0 || row >= rows || starts[row] < 0 || starts[row + 1] < starts[row] || starts[row + 1] > blocks) {
            Py_CLEAR(out);
            PyErr_SetString(PyExc_ValueError, "order or starts point outside the blocks");
            goto done;
        }
    }
    /* The probes (a merge of 50k engine spans offers 1.4M keys: ~45 ms) run without the GIL, so that
     * the HTTP and writer threads answer senders meanwhile. Only the store's merge thread uses a
     * RecentKeys, and the buffers stay held by the views until done. */
    Py_ssize_t total = 0;
    for (Py_ssize_t k = 0; k < rows; k++)
        total += (Py_ssize_t)(starts[order[k] + 1] - starts[order[k]]);
    uint64_t *keys = PyMem_RawMalloc((size_t)(total ? total : 1) * sizeof *keys);
    if (keys == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t n = 0;
    for (Py_ssize_t k = 0; k < rows; k++) {
        int64_t row = order[k];
        for (int64_t at = starts[row]; at < starts[row + 1]; at++) {
            uint64_t key = ((uint64_t)hashes[at] ^ salts[row]) * MIX;
            keys[n++] = key ^ (key >> 31);
        }
    }
    /* Each probe misses the cache (two tables of 16 MB): the slots of the key AHEAD places on are
     * asked for before this one is probed: 36 -> 21 ns a key, a merge's worth of keys (50k rows of
     * 28, half repeats); 0.78-0.86 -> 0.59-0.71 us an engine span (bench/merge.py's frontiers). */
    n = 0;
    for (Py_ssize_t k = 0; k < rows; k++) {
        int64_t row = order[k];
        for (int64_t at = starts[row]; at < starts[row + 1]; at++, n++) {
            if (n + AHEAD < total) {
                uint64_t ahead = keys[n + AHEAD];
                for (int g = 0; g < 2; g++) {
                    const KeySet *set = &self->generations[g];
                    PREFETCH(&set->slots[slot_of(ahead, set->mask)]);
                }
            }
            if (offer(self, keys[n]) && fresh[row] < 0)
                fresh[row] = (int32_t)(at - starts[row]);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(keys);
done:
    while (got-- > 0)
        PyBuffer_Release(&views[got]);
    return out;
}

static PyMethodDef recent_methods[] = {
    {"fresh", (PyCFunction)recent_fresh, METH_O,
     "fresh(keys: uint64 buffer) -> bytes: 1 for each key not recorded lately; all count as recorded now."},
    {"frontiers", (PyCFunction)recent_frontiers, METH_VARARGS,
     "frontiers(hashes, starts, salts, order) -> bytes of int32: each row's first new block index, or -1."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RecentKeysType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokentrace.collector.stores._frontier.RecentKeys",
    .tp_basicsize = sizeof(RecentKeys),
    .tp_dealloc = (destructor)recent_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "64-bit keys recorded lately, in two generations of about `capacity` keys each.",
    .tp_methods = recent_methods,
    .tp_init = (initproc)recent_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_frontier", "Recent block keys and first new blocks (collector/stores/frontier.py).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__frontier(void) {
    return module_with_type(&module, &RecentKeysType, "RecentKeys");
}
