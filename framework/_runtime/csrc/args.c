/* Taking a call's arguments: buffers held as views (their exports pinned for the length of
 * the call), CRC spans, deadlines and spins; errors that name the argument and item at
 * fault. Every check happens here, with the GIL held, before a byte moves.
 */
#include "native.h"

#include <stdarg.h>

/* Re-raise the pending error with where it happened in front ("copy_many: destination of
   pair 3: ..."), keeping its type and chaining the original; only for the types the buffer
   protocol raises, whose constructors take a message. */
void name_error(const char *func, const char *where_fmt, ...) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (!PyErr_GivenExceptionMatches(type, PyExc_TypeError) &&
        !PyErr_GivenExceptionMatches(type, PyExc_BufferError) &&
        !PyErr_GivenExceptionMatches(type, PyExc_ValueError)) {
        PyErr_Restore(type, value, tb);
        return;
    }
    va_list va;
    va_start(va, where_fmt);
    PyObject *where = PyUnicode_FromFormatV(where_fmt, va);
    va_end(va);
    if (!where) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return;
    }
    PyErr_Format(type, "%s: %U: %S", func, where, value);
    Py_DECREF(where);
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (v2 && value) {
        PyException_SetCause(v2, value); /* steals value */
        value = NULL;
    }
    PyErr_Restore(t2, v2, tb2);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* Every item of a PySequence_Fast as a buffer, appended to vs (which has room); an error
   names the item ("<what> <index>"). */
int get_views(Views *vs, PyObject *fast, int writable, const char *func, const char *what) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++)
        if (get_view(vs, items[i], writable) < 0) {
            name_error(func, "%s %zd", what, i);
            return -1;
        }
    return 0;
}

int get_view_named(Views *vs, PyObject *obj, int writable, const char *func, const char *what) {
    if (get_view(vs, obj, writable) < 0) {
        name_error(func, "%s", what);
        return -1;
    }
    return 0;
}

/* The two items of a 2-sequence (new references); -1 with TypeError/ValueError set. */
int unpack2(PyObject *item, PyObject **a, PyObject **b, const char *what) {
    PyObject *fast = PySequence_Fast(item, what);
    if (!fast)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != 2) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, what);
        return -1;
    }
    *a = Py_NewRef(PySequence_Fast_GET_ITEM(fast, 0));
    *b = Py_NewRef(PySequence_Fast_GET_ITEM(fast, 1));
    Py_DECREF(fast);
    return 0;
}

/* -- CRC spans ---------------------------------------------------------------------------- */

/* Parse crc_spans ((start, stop) index ranges over `count` buffers, in order, not
   overlapping) into span_of[i] = span index or -1; returns the number of spans or -1. */
Py_ssize_t parse_spans(PyObject *spans, Py_ssize_t count, int32_t *span_of, const char *func) {
    for (Py_ssize_t i = 0; i < count; i++)
        span_of[i] = -1;
    if (spans == NULL || spans == Py_None)
        return 0;
    PyObject *fast = PySequence_Fast(spans, "crc_spans must be a sequence of (start, stop)");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: too many crc_spans", func);
        goto fail;
    }
    Py_ssize_t previous_stop = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *a, *b;
        Py_ssize_t start, stop;
        if (unpack2(PySequence_Fast_GET_ITEM(fast, k), &a, &b, "a crc span is (start, stop)") <
            0) {
            name_error(func, "crc span %zd", k);
            goto fail;
        }
        start = PyNumber_AsSsize_t(a, PyExc_OverflowError);
        stop = start == -1 && PyErr_Occurred() ? -1 : PyNumber_AsSsize_t(b, PyExc_OverflowError);
        Py_DECREF(a);
        Py_DECREF(b);
        if (stop == -1 && PyErr_Occurred()) {
            name_error(func, "crc span %zd", k);
            goto fail;
        }
        if (start < previous_stop || stop < start || stop > count) {
            PyErr_Format(PyExc_ValueError,
                         "%s: crc span %zd is (%zd, %zd): spans must be in order, not overlap "
                         "and lie within the %zd buffers",
                         func, k, start, stop, count);
            goto fail;
        }
        for (Py_ssize_t i = start; i < stop; i++)
            span_of[i] = (int32_t)k;
        previous_stop = stop;
    }
    Py_DECREF(fast);
    return n;
fail:
    Py_DECREF(fast);
    return -1;
}

/* What a call over `count` buffers needs for its crc_spans: span_of (as parse_spans fills
   it) and a running CRC per span, starting at 0. Returns the number of spans, or -1 with
   an exception set; either way what was allocated is in *span_of and *crcs (else NULL),
   for the caller to PyMem_Free. */
Py_ssize_t spans_new(PyObject *spans, Py_ssize_t count, int32_t **span_of, uint32_t **crcs,
                     const char *func) {
    *crcs = NULL;
    *span_of = PyMem_Calloc(count ? (size_t)count : 1, sizeof(int32_t));
    if (!*span_of) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t nspans = parse_spans(spans, count, *span_of, func);
    if (nspans < 0)
        return -1;
    *crcs = PyMem_Calloc(nspans ? (size_t)nspans : 1, sizeof(uint32_t));
    if (!*crcs) {
        PyErr_NoMemory();
        return -1;
    }
    return nspans;
}

PyObject *crc_list(const uint32_t *crcs, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* A deadline argument: None, or a time.monotonic() value. */
int parse_deadline(PyObject *obj, int64_t *out) {
    if (obj == Py_None) {
        *out = -1;
        return 0;
    }
    double d = PyFloat_AsDouble(obj);
    if (d == -1.0 && PyErr_Occurred())
        return -1;
    if (d != d) {
        PyErr_SetString(PyExc_ValueError, "deadline is NaN");
        return -1;
    }
    /* A deadline at or before the clock's origin has passed already: never negative, which
       would mean "none". */
    if (d <= 0)
        *out = 0;
    else if (d >= 9.2e9)
        *out = INT64_MAX;
    else
        *out = (int64_t)(d * 1e9);
    return 0;
}

/* A busy_poll argument: seconds to spin before sleeping on a socket, at most one. */
int parse_busy_poll(double seconds, int64_t *out, const char *func) {
    if (!(seconds >= 0 && seconds <= 1)) {
        PyErr_Format(PyExc_ValueError, "%s: busy_poll must be 0 to 1 seconds", func);
        return -1;
    }
    *out = (int64_t)(seconds * 1e9);
    return 0;
}
