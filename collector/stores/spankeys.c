/* The writer's memory of stored span keys: 64-bit key hashes, each with the time bucket of its
 * span's end and a 32-bit check (the low bits of its end time), in one open-addressing hash table
 * (collector/stores/once.py explains what is kept and why).
 *
 * It replaces sorted numpy arrays per minute of start time, which were folded (re-sorted whole)
 * every ninth batch: at a sustained 60k spans/s all of a minute's keys were sorted again and again,
 * 3-4 us per span by the minute's end (issue 17). Here a key costs one probe to test and one to add;
 * dropping every key of the buckets before a horizon rebuilds the table once (the caller drops a
 * quarter of the capacity at a time, so each key is moved a bounded number of times).
 *
 * Slots: the key (8 bytes), its bucket (4) and its check (4); EMPTY in the bucket marks a free slot,
 * so every 64-bit key, 0 included, can be held. At most 3/4 of the slots are used, and the number
 * of slots is any number up to `max_slots` (a key's first slot is its hash scaled to it), so that a
 * table for 4M keys takes 5.3M slots (85 MiB), not the 8M a power of two would.
 *
 * Buffers come in through the buffer protocol (numpy arrays), so nothing here knows numpy. Every
 * call holds the GIL: a table is the writer thread's, and a call never runs beside another.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "pybuffer.h"
#include <stdint.h>
#include <string.h>

#define MIX UINT64_C(0x9E3779B97F4A7C15)
#define EMPTY INT32_MIN
#define MIN_SLOTS 1024

typedef struct {
    PyObject_HEAD
    uint64_t *keys;
    int32_t *buckets;
    uint32_t *checks;
    size_t slots;     /* any number: a key's first slot is its mixed hash scaled to it */
    size_t size;      /* keys held */
    size_t max_slots; /* the most slots the table may take (0: no limit) */
} KeyTable;

static inline size_t slot_of(uint64_t key, size_t slots) {
    return (size_t)(((unsigned __int128)(key * MIX) * slots) >> 64);
}

static inline size_t next_slot(size_t at, size_t slots) {
    return at + 1 == slots ? 0 : at + 1;
}

static void table_free(KeyTable *self) {
    PyMem_RawFree(self->keys);
    PyMem_RawFree(self->buckets);
    PyMem_RawFree(self->checks);
    self->keys = NULL;
    self->buckets = NULL;
    self->checks = NULL;
}

static int table_alloc(KeyTable *self, size_t slots) {
    uint64_t *keys = PyMem_RawMalloc(slots * sizeof *keys);
    int32_t *buckets = PyMem_RawMalloc(slots * sizeof *buckets);
    uint32_t *checks = PyMem_RawMalloc(slots * sizeof *checks);
    if (keys == NULL || buckets == NULL || checks == NULL) {
        PyMem_RawFree(keys);
        PyMem_RawFree(buckets);
        PyMem_RawFree(checks);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < slots; i++)
        buckets[i] = EMPTY;
    self->keys = keys;
    self->buckets = buckets;
    self->checks = checks;
    self->slots = slots;
    self->size = 0;
    return 0;
}

/* The slot holding the key, or -1. */
static inline Py_ssize_t table_find(const KeyTable *self, uint64_t key) {
    for (size_t at = slot_of(key, self->slots);; at = next_slot(at, self->slots)) {
        if (self->buckets[at] == EMPTY)
            return -1;
        if (self->keys[at] == key)
            return (Py_ssize_t)at;
    }
}

/* Adds the key with its bucket and check; 1 when it was not held (a held key keeps its first). */
static inline int table_put(KeyTable *self, uint64_t key, int32_t bucket, uint32_t check) {
    for (size_t at = slot_of(key, self->slots);; at = next_slot(at, self->slots)) {
        if (self->buckets[at] == EMPTY) {
            self->keys[at] = key;
            self->buckets[at] = bucket;
            self->checks[at] = check;
            self->size++;
            return 1;
        }
        if (self->keys[at] == key)
            return 0;
    }
}

/* Moves the keys whose bucket is at least `from` into a table of `slots` slots. */
static int table_rebuild(KeyTable *self, size_t slots, int64_t from) {
    KeyTable old = *self;
    if (table_alloc(self, slots) < 0) {
        *self = old;
        return -1;
    }
    for (size_t i = 0; i < old.slots; i++)
        if (old.buckets[i] != EMPTY && old.buckets[i] >= from)
            table_put(self, old.keys[i], old.buckets[i], old.checks[i]);
    table_free(&old);
    return 0;
}

static int keytable_init(KeyTable *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"max_slots", NULL};
    Py_ssize_t max_slots = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|n", names, &max_slots))
        return -1;
    if (max_slots < 0) {
        PyErr_SetString(PyExc_ValueError, "max_slots must be 0 (no limit) or more");
        return -1;
    }
    table_free(self);
    self->max_slots = max_slots && (size_t)max_slots < MIN_SLOTS ? MIN_SLOTS : (size_t)max_slots;
    return table_alloc(self, MIN_SLOTS);
}

static void keytable_dealloc(KeyTable *self) {
    table_free(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ready(const KeyTable *self) {
    if (self->keys == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KeyTable.__init__ was not called");
        return 0;
    }
    return 1;
}

static PyObject *keytable_has(KeyTable *self, PyObject *arg) {
    if (!ready(self))
        return NULL;
    Py_buffer keys;
    if (get_buffer(arg, &keys, 8, "keys") < 0)
        return NULL;
    Py_ssize_t count = keys.len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count);
    if (out != NULL) {
        char *mask = PyBytes_AS_STRING(out);
        const uint64_t *values = keys.buf;
        for (Py_ssize_t i = 0; i < count; i++)
            mask[i] = (char)(table_find(self, values[i]) >= 0);
    }
    PyBuffer_Release(&keys);
    return out;
}

/* Takes the `count` buffer arguments of `args` (items of `sizes[i]` bytes, named for errors); on
 * failure nothing is held. */
static int take_buffers(PyObject *args, int count, Py_buffer *views, const int *sizes, const char *const *names) {
    PyObject *objects[3] = {NULL, NULL, NULL};
    if (!PyArg_UnpackTuple(args, "KeyTable", count, count, &objects[0], &objects[1], &objects[2]))
        return -1;
    for (int i = 0; i < count; i++) {
        if (get_buffer(objects[i], &views[i], sizes[i], names[i]) < 0) {
            while (i--)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_buffers(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
}

static PyObject *keytable_match(KeyTable *self, PyObject *args) {
    if (!ready(self))
        return NULL;
    static const int sizes[] = {8, 4};
    static const char *const names[] = {"keys", "checks"};
    Py_buffer views[2];
    if (take_buffers(args, 2, views, sizes, names) < 0)
        return NULL;
    Py_buffer *keys = &views[0], *checks = &views[1];
    PyObject *out = NULL;
    Py_ssize_t count = keys->len / 8;
    if (checks->len / 4 != count) {
        PyErr_SetString(PyExc_ValueError, "keys and checks must have as many items");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, count);
    if (out != NULL) {
        char *found = PyBytes_AS_STRING(out);
        const uint64_t *values = keys->buf;
        const uint32_t *expected = checks->buf;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t at = table_find(self, values[i]);
            found[i] = (char)(at < 0 ? 0 : self->checks[at] == expected[i] ? 1 : 2);
        }
    }
done:
    release_buffers(views, 2);
    return out;
}

static PyObject *keytable_add(KeyTable *self, PyObject *args) {
    if (!ready(self))
        return NULL;
    static const int sizes[] = {8, 4, 4};
    static const char *const names[] = {"keys", "buckets", "checks"};
    Py_buffer views[3];
    if (take_buffers(args, 3, views, sizes, names) < 0)
        return NULL;
    Py_buffer *keys = &views[0], *buckets = &views[1], *checks = &views[2];
    PyObject *out = NULL;
    Py_ssize_t count = keys->len / 8;
    if (buckets->len / 4 != count || checks->len / 4 != count) {
        PyErr_SetString(PyExc_ValueError, "keys, buckets and checks must have as many items");
        goto done;
    }
    const int32_t *at = buckets->buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (at[i] == EMPTY) {
            PyErr_SetString(PyExc_ValueError, "a bucket of -2**31 is reserved");
            goto done;
        }
    }
    size_t slots = self->slots;
    while ((self->size + (size_t)count) * 4 > slots * 3) {
        if (self->max_slots && slots >= self->max_slots) {
            PyErr_Format(PyExc_OverflowError, "%zd more keys would fill more than 3/4 of the %zu slots allowed",
                         count, self->max_slots);
            goto done;
        }
        slots = self->max_slots && slots * 2 > self->max_slots ? self->max_slots : slots * 2;
    }
    if (slots != self->slots && table_rebuild(self, slots, (int64_t)EMPTY + 1) < 0)
        goto done;
    out = PyBytes_FromStringAndSize(NULL, count);
    if (out != NULL) {
        char *added = PyBytes_AS_STRING(out);
        const uint64_t *values = keys->buf;
        const uint32_t *check = checks->buf;
        for (Py_ssize_t i = 0; i < count; i++)
            added[i] = (char)table_put(self, values[i], at[i], check[i]);
    }
done:
    release_buffers(views, 3);
    return out;
}

static PyObject *keytable_drop_before(KeyTable *self, PyObject *arg) {
    if (!ready(self))
        return NULL;
    long long from = PyLong_AsLongLong(arg);
    if (from == -1 && PyErr_Occurred())
        return NULL;
    size_t before = self->size, slots = self->slots;
    /* Halve the slots while what is left would fill at most 3/8 of them (never below MIN_SLOTS). */
    size_t left = 0;
    for (size_t i = 0; i < slots; i++)
        left += self->buckets[i] != EMPTY && self->buckets[i] >= from;
    while (slots > MIN_SLOTS && left * 16 <= slots * 3)
        slots >>= 1;
    if (table_rebuild(self, slots, from) < 0)
        return NULL;
    return PyLong_FromSize_t(before - self->size);
}

static Py_ssize_t keytable_len(KeyTable *self) {
    return (Py_ssize_t)self->size;
}

static PyObject *keytable_nbytes(KeyTable *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->slots * (sizeof(uint64_t) + sizeof(int32_t) + sizeof(uint32_t)));
}

static PyMethodDef keytable_methods[] = {
    {"has", (PyCFunction)keytable_has, METH_O, "has(keys: uint64 buffer) -> bytes: 1 for each key held."},
    {"match", (PyCFunction)keytable_match, METH_VARARGS,
     "match(keys: uint64 buffer, checks: uint32 buffer) -> bytes: for each key 0 (not held), 1 (held "
     "with this check) or 2 (held with another check)."},
    {"add", (PyCFunction)keytable_add, METH_VARARGS,
     "add(keys: uint64 buffer, buckets: int32 buffer, checks: uint32 buffer) -> bytes: 1 for each key "
     "not held before (a held key keeps its first bucket and check)."},
    {"drop_before", (PyCFunction)keytable_drop_before, METH_O,
     "drop_before(bucket: int) -> int: drop the keys of earlier buckets; how many were dropped."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef keytable_getset[] = {
    {"nbytes", (getter)keytable_nbytes, NULL, "bytes the slots take", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods keytable_sequence = {
    .sq_length = (lenfunc)keytable_len,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokentrace.collector.stores._spankeys.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_dealloc = (destructor)keytable_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "64-bit keys, each with an int32 bucket and a uint32 check, in an open-addressing hash table.",
    .tp_methods = keytable_methods,
    .tp_getset = keytable_getset,
    .tp_as_sequence = &keytable_sequence,
    .tp_init = (initproc)keytable_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_spankeys", "The writer's memory of stored span keys (collector/stores/once.py).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__spankeys(void) {
    return module_with_type(&module, &KeyTableType, "KeyTable");
}
