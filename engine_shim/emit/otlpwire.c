/* OTLP attributes written straight to protobuf wire bytes, for the engine's exporter process
 * (engine_shim/emit/otlp_wire.py explains why it does not go through SDK spans).
 *
 * attributes(tag, attrs) -> bytes: every (key, value) of the dict `attrs` as one repeated KeyValue
 * field whose tag byte is `tag` (0x0a: a Resource's attributes, 0x4a: a Span's, 0x1a: an Event's).
 * Values are what OpenTelemetry allows: str, bool, int (int64), float, bytes, and lists or tuples
 * of those (an element None is an empty AnyValue, as the SDK's encoder writes it). A None value
 * is left out (the SDK drops it too). Anything else raises TypeError naming the key; an int
 * outside int64 raises OverflowError.
 *
 * Two passes: the first sizes every message (so every length prefix is known before it is
 * written) and checks every value, the second writes into one bytes object of that size. Every
 * call holds the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* AnyValue's fields (opentelemetry/proto/common/v1/common.proto), as tag bytes. */
#define ANY_STRING 0x0a
#define ANY_BOOL 0x10
#define ANY_INT 0x18
#define ANY_DOUBLE 0x21
#define ANY_ARRAY 0x2a
#define ANY_BYTES 0x3a
#define ARRAY_VALUES 0x0a /* ArrayValue.values */
#define KV_KEY 0x0a       /* KeyValue.key */
#define KV_VALUE 0x12     /* KeyValue.value */

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static char *put_varint(char *out, uint64_t v) {
    while (v >= 0x80) {
        *out++ = (char)((v & 0x7f) | 0x80);
        v >>= 7;
    }
    *out++ = (char)v;
    return out;
}

/* A scalar AnyValue's body size; -1 with an exception set for a value it cannot hold. */
static Py_ssize_t scalar_size(PyObject *value, PyObject *key) {
    if (value == Py_None)
        return 0;
    if (PyBool_Check(value))
        return 2;
    if (PyLong_Check(value)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow) {
            PyErr_Format(PyExc_OverflowError, "attribute %R: %R does not fit an int64", key, value);
            return -1;
        }
        if (v == -1 && PyErr_Occurred())
            return -1;
        return 1 + (Py_ssize_t)varint_size((uint64_t)v);
    }
    if (PyFloat_Check(value))
        return 9;
    if (PyUnicode_Check(value)) {
        Py_ssize_t n;
        if (PyUnicode_AsUTF8AndSize(value, &n) == NULL)
            return -1;
        return 1 + (Py_ssize_t)varint_size((uint64_t)n) + n;
    }
    if (PyBytes_Check(value)) {
        Py_ssize_t n = PyBytes_GET_SIZE(value);
        return 1 + (Py_ssize_t)varint_size((uint64_t)n) + n;
    }
    PyErr_Format(PyExc_TypeError, "attribute %R: a value of type %s is not an OpenTelemetry attribute value",
                 key, Py_TYPE(value)->tp_name);
    return -1;
}

static char *put_scalar(char *out, PyObject *value) {
    if (value == Py_None)
        return out;
    if (PyBool_Check(value)) {
        *out++ = ANY_BOOL;
        *out++ = value == Py_True ? 1 : 0;
        return out;
    }
    if (PyLong_Check(value)) {
        *out++ = ANY_INT;
        return put_varint(out, (uint64_t)PyLong_AsLongLong(value));
    }
    if (PyFloat_Check(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        *out++ = ANY_DOUBLE;
        memcpy(out, &d, 8); /* little-endian fixed64 on every platform mlx and vLLM run on */
        return out + 8;
    }
    Py_ssize_t n;
    const char *data;
    if (PyUnicode_Check(value)) {
        data = PyUnicode_AsUTF8AndSize(value, &n); /* cached by the sizing pass */
        *out++ = ANY_STRING;
    } else {
        data = PyBytes_AS_STRING(value);
        n = PyBytes_GET_SIZE(value);
        *out++ = ANY_BYTES;
    }
    out = put_varint(out, (uint64_t)n);
    memcpy(out, data, (size_t)n);
    return out + n;
}

/* An ArrayValue's body size: each element an AnyValue in its values field. */
static Py_ssize_t array_size(PyObject *value, PyObject *key) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(value), array = 0;
    PyObject **items = PySequence_Fast_ITEMS(value);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyList_Check(items[i]) || PyTuple_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "attribute %R: arrays of arrays are not OpenTelemetry attribute values",
                         key);
            return -1;
        }
        Py_ssize_t element = scalar_size(items[i], key);
        if (element < 0)
            return -1;
        array += 1 + (Py_ssize_t)varint_size((uint64_t)element) + element;
    }
    return array;
}

/* An AnyValue's body size; a list or tuple is an ArrayValue of scalars. */
static Py_ssize_t value_size(PyObject *value, PyObject *key) {
    if (!PyList_Check(value) && !PyTuple_Check(value))
        return scalar_size(value, key);
    Py_ssize_t array = array_size(value, key);
    return array < 0 ? -1 : 1 + (Py_ssize_t)varint_size((uint64_t)array) + array;
}

/* Writes an AnyValue checked by value_size (so nothing here can fail). */
static char *put_value(char *out, PyObject *value, PyObject *key) {
    if (!PyList_Check(value) && !PyTuple_Check(value))
        return put_scalar(out, value);
    *out++ = ANY_ARRAY;
    out = put_varint(out, (uint64_t)array_size(value, key));
    Py_ssize_t count = PySequence_Fast_GET_SIZE(value);
    PyObject **items = PySequence_Fast_ITEMS(value);
    for (Py_ssize_t i = 0; i < count; i++) {
        *out++ = ARRAY_VALUES;
        out = put_varint(out, (uint64_t)scalar_size(items[i], key));
        out = put_scalar(out, items[i]);
    }
    return out;
}

static PyObject *attributes(PyObject *Py_UNUSED(self), PyObject *args) {
    int tag;
    PyObject *attrs;
    if (!PyArg_ParseTuple(args, "iO!:attributes", &tag, &PyDict_Type, &attrs))
        return NULL;
    if (tag <= 0 || tag >= 0x80) {
        PyErr_SetString(PyExc_ValueError, "tag must be a one-byte field tag (1-127)");
        return NULL;
    }
    Py_ssize_t pos = 0, total = 0, count = PyDict_GET_SIZE(attrs), index = 0;
    Py_ssize_t *sizes = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(count ? count : 1));
    if (sizes == NULL)
        return PyErr_NoMemory();
    PyObject *key, *value, *result = NULL;
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        sizes[index] = -1;
        if (value == Py_None) {
            index++;
            continue;
        }
        Py_ssize_t key_size;
        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "attribute keys must be str, not %s", Py_TYPE(key)->tp_name);
            goto done;
        }
        if (PyUnicode_AsUTF8AndSize(key, &key_size) == NULL)
            goto done;
        Py_ssize_t any = value_size(value, key);
        if (any < 0)
            goto done;
        sizes[index++] = any;
        Py_ssize_t kv = 1 + (Py_ssize_t)varint_size((uint64_t)key_size) + key_size +
                        1 + (Py_ssize_t)varint_size((uint64_t)any) + any;
        total += 1 + (Py_ssize_t)varint_size((uint64_t)kv) + kv;
    }
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL)
        goto done;
    char *out = PyBytes_AS_STRING(result);
    pos = 0;
    index = 0;
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        Py_ssize_t any = sizes[index++];
        if (any < 0)
            continue;
        Py_ssize_t key_size;
        const char *key_data = PyUnicode_AsUTF8AndSize(key, &key_size);
        Py_ssize_t kv = 1 + (Py_ssize_t)varint_size((uint64_t)key_size) + key_size +
                        1 + (Py_ssize_t)varint_size((uint64_t)any) + any;
        *out++ = (char)tag;
        out = put_varint(out, (uint64_t)kv);
        *out++ = KV_KEY;
        out = put_varint(out, (uint64_t)key_size);
        memcpy(out, key_data, (size_t)key_size);
        out += key_size;
        *out++ = KV_VALUE;
        out = put_varint(out, (uint64_t)any);
        out = put_value(out, value, key);
    }
done:
    PyMem_Free(sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"attributes", attributes, METH_VARARGS,
     "attributes(tag, attrs) -> bytes: a dict of OpenTelemetry attributes as repeated KeyValue wire bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_otlpwire", "OTLP attributes as protobuf wire bytes (engine_shim/emit/otlp_wire.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__otlpwire(void) { return PyModule_Create(&module); }
