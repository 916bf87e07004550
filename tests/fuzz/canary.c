/* A deliberate heap overflow, built like the real modules (tests/fuzz/build.py): the fuzz harness's
 * self-test (tests/test_fuzz_sanitized.py) checks that AddressSanitizer reports it, so a harness that
 * silently lost its sanitizer would fail instead of passing on nothing. Never installed. */
#include <Python.h>
#include <stdlib.h>
#include <string.h>

static PyObject *canary_copy(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    char *out = malloc(8);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    /* The bug: copies the whole input into 8 bytes once it starts with "BOOM". */
    size_t len = (size_t)view.len;
    size_t n = len >= 4 && memcmp(view.buf, "BOOM", 4) == 0 ? len : (len < 8 ? len : 8);
    memcpy(out, view.buf, n);
    PyObject *result = PyBytes_FromStringAndSize(out, n < 8 ? (Py_ssize_t)n : 8);
    free(out);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", canary_copy, METH_O, "copy(bytes) -> the first 8 bytes"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tokentrace_fuzz_canary", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tokentrace_fuzz_canary(void) { return PyModule_Create(&module); }
