/* CRC32C from Python: one buffer (crc32c), a batch of values in one GIL release
 * (crc32c_many), and the named passes for tests (crc32c_with, copy_crc32c_with). The passes
 * themselves are crc32c.c's.
 */
#include "native.h"

#include <string.h>

#include "crc32c.h"

/* A pass named by a caller (crc32c_with, copy_crc32c_with), -1 with ValueError when it is not
   one this CPU runs. */
static int pass_named(const char *func, const char *name) {
    for (int pass = 0; pass <= kvf_crc32c_best(); pass++)
        if (strcmp(name, kvf_crc32c_pass_name(pass)) == 0)
            return pass;
    PyErr_Format(PyExc_ValueError, "%s: no pass '%s' on this CPU (see CRC32C_PASSES)", func,
                 name);
    return -1;
}

static PyObject *one_crc(const char *func, Py_buffer *view, unsigned long long value, int pass) {
    if (value > 0xffffffffULL) {
        PyErr_Format(PyExc_ValueError, "%s: value is an int in [0, 2**32)", func);
        return NULL;
    }
    uint32_t crc = (uint32_t)value;
    if (view->len >= GIL_RELEASE_MIN) {
        PyThreadState *ts;
        RELEASE_GIL(ts);
        crc = kvf_crc32c_with(pass, crc, view->buf, (size_t)view->len);
        TAKE_GIL(ts);
    } else {
        crc = kvf_crc32c_with(pass, crc, view->buf, (size_t)view->len);
    }
    return PyLong_FromUnsignedLong(crc);
}

PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long value = 0;
    if (!PyArg_ParseTuple(args, "y*|K", &view, &value))
        return NULL;
    PyObject *result = one_crc("crc32c", &view, value, kvf_crc32c_best());
    PyBuffer_Release(&view);
    return result;
}

/* crc32c_with(pass, data, value=0) -> int: crc32c through a named pass (for tests). */
PyObject *py_crc32c_with(PyObject *self, PyObject *args) {
    const char *name;
    Py_buffer view;
    unsigned long long value = 0;
    if (!PyArg_ParseTuple(args, "sy*|K", &name, &view, &value))
        return NULL;
    int pass = pass_named("crc32c_with", name);
    PyObject *result = pass < 0 ? NULL : one_crc("crc32c_with", &view, value, pass);
    PyBuffer_Release(&view);
    return result;
}

/* copy_crc32c_with(pass, dest, src, value=0) -> int: one copy and its CRC through a named
   pass (keeps the GIL; for tests). */
PyObject *py_copy_crc32c_with(PyObject *self, PyObject *args) {
    const char *name;
    Py_buffer dest, src;
    unsigned long long value = 0;
    if (!PyArg_ParseTuple(args, "sw*y*|K", &name, &dest, &src, &value))
        return NULL;
    PyObject *result = NULL;
    uintptr_t d = (uintptr_t)dest.buf, s = (uintptr_t)src.buf;
    size_t n = (size_t)src.len;
    int pass = pass_named("copy_crc32c_with", name);
    if (pass < 0)
        ;
    else if (value > 0xffffffffULL)
        PyErr_SetString(PyExc_ValueError, "copy_crc32c_with: value is an int in [0, 2**32)");
    else if (dest.len < src.len)
        PyErr_SetString(PyExc_ValueError, "copy_crc32c_with: dest is shorter than src");
    else if (n && d < s + n && s < d + n)
        PyErr_SetString(PyExc_ValueError, "copy_crc32c_with: dest and src overlap");
    else
        result = PyLong_FromUnsignedLong(
            kvf_copy_crc32c_with(pass, dest.buf, src.buf, n, (uint32_t)value));
    PyBuffer_Release(&dest);
    PyBuffer_Release(&src);
    return result;
}

static int parse_crc_value(PyObject *obj, uint32_t *out, const char *func) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: a CRC value is an int in [0, 2**32)", func);
        }
        return -1;
    }
    if (v > 0xffffffffULL) {
        PyErr_Format(PyExc_ValueError, "%s: a CRC value is an int in [0, 2**32)", func);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

PyObject *py_crc32c_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"values", "initial", NULL};
    PyObject *values, *initial = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:crc32c_many", kwlist, &values, &initial))
        return NULL;
    const char *func = "crc32c_many";
    PyObject *fast = PySequence_Fast(values, "crc32c_many: values must be a sequence");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **inner = PyMem_Calloc(n ? (size_t)n : 1, sizeof(PyObject *));
    Py_ssize_t *first = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    uint32_t *crcs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(uint32_t));
    Views vs = {NULL, 0, 0};
    PyObject *result = NULL;
    if (!inner || !first || !crcs) {
        PyErr_NoMemory();
        goto done;
    }
    /* A value is one buffer or a sequence of pieces; count the pieces first. */
    Py_ssize_t pieces = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        first[i] = pieces;
        if (PyObject_CheckBuffer(item)) {
            pieces += 1;
            continue;
        }
        inner[i] = PySequence_Fast(item, "a value is a buffer or a sequence of buffers");
        if (!inner[i]) {
            name_error(func, "value %zd", i);
            goto done;
        }
        pieces += PySequence_Fast_GET_SIZE(inner[i]);
    }
    first[n] = pieces;
    if (initial != Py_None) {
        PyObject *init = PySequence_Fast(initial, "crc32c_many: initial must be a sequence");
        if (!init)
            goto done;
        if (PySequence_Fast_GET_SIZE(init) != n) {
            PyErr_Format(PyExc_ValueError, "%s: %zd initial values for %zd values", func,
                         PySequence_Fast_GET_SIZE(init), n);
            Py_DECREF(init);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (parse_crc_value(PySequence_Fast_GET_ITEM(init, i), &crcs[i], func) < 0) {
                Py_DECREF(init);
                goto done;
            }
        Py_DECREF(init);
    }
    if (views_init(&vs, pieces) < 0)
        goto done;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (inner[i]) {
            Py_ssize_t count = PySequence_Fast_GET_SIZE(inner[i]);
            for (Py_ssize_t j = 0; j < count; j++)
                if (get_view(&vs, PySequence_Fast_GET_ITEM(inner[i], j), 0) < 0) {
                    name_error(func, "piece %zd of value %zd", j, i);
                    goto done;
                }
        } else if (get_view(&vs, PySequence_Fast_GET_ITEM(fast, i), 0) < 0) {
            name_error(func, "value %zd", i);
            goto done;
        }
    }
    for (Py_ssize_t p = 0; p < pieces; p++)
        total += (size_t)vs.v[p].len;

    PyThreadState *ts = NULL;
    if (total >= GIL_RELEASE_MIN)
        RELEASE_GIL(ts);
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t p = first[i]; p < first[i + 1]; p++)
            crcs[i] = kvf_crc32c(crcs[i], vs.v[p].buf, (size_t)vs.v[p].len);
    if (ts)
        TAKE_GIL(ts);
    result = crc_list(crcs, n);
done:
    views_release(&vs);
    if (inner)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(inner[i]);
    PyMem_Free(inner);
    PyMem_Free(first);
    PyMem_Free(crcs);
    Py_DECREF(fast);
    return result;
}
