/* What the collector's small C modules (frontier.c, spankeys.c) share: numpy arrays and other
 * objects come in through the buffer protocol, as C-contiguous runs of fixed-size items, and a
 * module registers its one type. */
#ifndef TOKENTRACE_PYBUFFER_H
#define TOKENTRACE_PYBUFFER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A C-contiguous view of `object` holding whole `itemsize`-byte items; -1 with ValueError naming
 * `what` otherwise. */
static inline int get_buffer(PyObject *object, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd-byte items, got %zd bytes", what, itemsize, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The module `def` with `type` ready and added under `name`; NULL on failure. */
static inline PyObject *module_with_type(struct PyModuleDef *def, PyTypeObject *type, const char *name) {
    if (PyType_Ready(type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(def);
    if (m == NULL)
        return NULL;
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#endif
