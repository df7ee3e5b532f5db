/* kvfabric._runtime._native: batch operations that take the GIL back once per batch.
 *
 * Why: a GIL released while bytes move is not enough. Each time a thread takes the GIL
 * back while another Python thread is busy, it waits out the interpreter's switch interval
 * (5 ms by default), so a read released and re-took it per segment, per receive and per
 * CRC piece ran 7-12x slower beside a busy thread. Every function here takes all of its
 * Python objects (buffers, with their exports held so nothing can resize them) while it
 * holds the GIL, checks them, releases the GIL once for the whole batch, and takes it back
 * once at the end: the only extra returns are for signals arriving during a socket wait
 * (so Ctrl-C still works), counted like every return by gil_reacquisitions(). Small
 * batches keep the GIL (GIL_RELEASE_MIN); small socket calls release it only to wait.
 *
 * Plain C API with Py_buffer rather than cffi: the buffer protocol gives the pointer and
 * length of any exporter (bytes, bytearray, mmap, numpy, memoryview) and pins it, the
 * GIL is released by two macros, and the module has no run-time dependency.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pythread.h"

#include "crc32c.h"
#include "serve.h"
#include "stream.h"

/* Batches below this many bytes keep the GIL: their work (~20-50 us at worst) costs a busy
   neighbour less than the switch interval our return would wait out beside it. */
#define GIL_RELEASE_MIN (256 * 1024)
/* Without the CPU's CRC instruction, fused copy+CRC works in chunks this size, so the CRC
   reads what the copy just wrote from L2 rather than from memory. */
#define COPY_CHUNK (64 * 1024)
/* The same for receive+CRC: at most this many bytes per recvmsg when CRCs are asked. */
#define RECV_CRC_WINDOW (256 * 1024)
#define SEND_CRC_WINDOW (1024 * 1024)
/* The most a small request_reply may wait for its reply with the GIL held (hold_gil): a
   longer hold would cost other threads more than the switch interval it saves. */
#define HOLD_GIL_MAX 0.001

/* A batch of at least this many bytes (a copy, a ucx get's CRCs) ends on a helper thread
   while the calling thread waits for the GIL (run_then_take_gil); below it a thread's start
   (~50 us) costs more than the overlap can save. */
#define HANDOFF_MIN (8u << 20)
/* The unit a batch is handed over at: an item, or this much of a larger one. */
#define HANDOFF_CHUNK (1u << 20)

static PyObject *PeerClosed;
static size_t iov_max;
static _Thread_local unsigned long long reacquired;
static _Thread_local unsigned long long handed_off;

#define RELEASE_GIL(ts) ((ts) = PyEval_SaveThread())
#define TAKE_GIL(ts)                                                                         \
    do {                                                                                     \
        PyEval_RestoreThread(ts);                                                            \
        (ts) = NULL;                                                                         \
        reacquired++;                                                                        \
    } while (0)

/* -- buffers ------------------------------------------------------------------------------ */

typedef struct {
    Py_buffer *v;
    Py_ssize_t n;   /* acquired */
    Py_ssize_t cap; /* allocated */
} Views;

static int views_init(Views *vs, Py_ssize_t cap) {
    vs->n = 0;
    vs->cap = cap;
    vs->v = PyMem_Calloc(cap ? (size_t)cap : 1, sizeof(Py_buffer));
    if (!vs->v) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void views_release(Views *vs) {
    for (Py_ssize_t i = 0; i < vs->n; i++)
        PyBuffer_Release(&vs->v[i]);
    PyMem_Free(vs->v);
    vs->v = NULL;
    vs->n = 0;
}

/* Re-raise the pending error with where it happened in front ("copy_many: destination of
   pair 3: ..."), keeping its type and chaining the original; only for the types the buffer
   protocol raises, whose constructors take a message. */
static void name_error(const char *func, const char *where_fmt, ...) {
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

/* Take obj's buffer into the next free view; -1 with the exporter's error set. */
static int get_view(Views *vs, PyObject *obj, int writable) {
    if (PyObject_GetBuffer(obj, &vs->v[vs->n], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    vs->n++;
    return 0;
}

/* Every item of a PySequence_Fast as a buffer, appended to vs (which has room); an error
   names the item ("<what> <index>"). */
static int get_views(Views *vs, PyObject *fast, int writable, const char *func,
                     const char *what) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++)
        if (get_view(vs, items[i], writable) < 0) {
            name_error(func, "%s %zd", what, i);
            return -1;
        }
    return 0;
}

static int get_view_named(Views *vs, PyObject *obj, int writable, const char *func,
                          const char *what) {
    if (get_view(vs, obj, writable) < 0) {
        name_error(func, "%s", what);
        return -1;
    }
    return 0;
}

/* The two items of a 2-sequence (new references); -1 with TypeError/ValueError set. */
static int unpack2(PyObject *item, PyObject **a, PyObject **b, const char *what) {
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
static Py_ssize_t parse_spans(PyObject *spans, Py_ssize_t count, int32_t *span_of,
                              const char *func) {
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

static PyObject *crc_list(const uint32_t *crcs, Py_ssize_t n) {
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

/* -- crc32c --------------------------------------------------------------------------------- */

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

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long value = 0;
    if (!PyArg_ParseTuple(args, "y*|K", &view, &value))
        return NULL;
    PyObject *result = one_crc("crc32c", &view, value, kvf_crc32c_best());
    PyBuffer_Release(&view);
    return result;
}

/* crc32c_with(pass, data, value=0) -> int: crc32c through a named pass (for tests). */
static PyObject *py_crc32c_with(PyObject *self, PyObject *args) {
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

/* pack_headers(keys, versions, lengths, crcs) -> bytes: the 64-byte record headers of a
   batch, back to back, in the layout of kvfabric._runtime.record (magic "KVFR", format 1, flags 0,
   key, version, payload length, payload CRC32C, then the CRC32C of the 60 bytes before it).
   Packing them one by one in Python cost ~2 us a header, twice a write (placeholders, then
   with the CRCs), on the write's GIL-holding path. */
#define RECORD_HEADER 64
#define RECORD_HEADER_CRC_SPAN 60

static int u64_at(PyObject *fast, Py_ssize_t i, uint64_t *out, const char *what) {
    unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "pack_headers: %s %zd is not an unsigned 64-bit int",
                     what, i);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *py_pack_headers(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *versions_obj, *lengths_obj, *crcs_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &keys_obj, &versions_obj, &lengths_obj, &crcs_obj))
        return NULL;
    PyObject *fast[4] = {NULL, NULL, NULL, NULL};
    PyObject *objs[4] = {keys_obj, versions_obj, lengths_obj, crcs_obj};
    PyObject *out = NULL;
    for (int j = 0; j < 4; j++) {
        fast[j] = PySequence_Fast(objs[j], "pack_headers: arguments are sequences");
        if (!fast[j])
            goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast[0]);
    for (int j = 1; j < 4; j++)
        if (PySequence_Fast_GET_SIZE(fast[j]) != n) {
            PyErr_SetString(PyExc_ValueError, "pack_headers: sequences of different lengths");
            goto done;
        }
    out = PyBytes_FromStringAndSize(NULL, n * RECORD_HEADER);
    if (!out)
        goto done;
    uint8_t *h = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, h += RECORD_HEADER) {
        PyObject *key = PySequence_Fast_GET_ITEM(fast[0], i);
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != 32) {
            PyErr_Format(PyExc_TypeError, "pack_headers: key %zd is not 32 bytes", i);
            Py_CLEAR(out);
            goto done;
        }
        uint64_t version, length, crc;
        if (u64_at(fast[1], i, &version, "version") < 0 ||
            u64_at(fast[2], i, &length, "length") < 0 || u64_at(fast[3], i, &crc, "crc") < 0) {
            Py_CLEAR(out);
            goto done;
        }
        if (crc > 0xffffffffULL) {
            PyErr_Format(PyExc_ValueError, "pack_headers: crc %zd is not 32 bits", i);
            Py_CLEAR(out);
            goto done;
        }
        uint16_t format = 1, flags = 0;
        uint32_t crc32 = (uint32_t)crc;
        memcpy(h, "KVFR", 4);
        memcpy(h + 4, &format, 2);
        memcpy(h + 6, &flags, 2);
        memcpy(h + 8, PyBytes_AS_STRING(key), 32);
        memcpy(h + 40, &version, 8);
        memcpy(h + 48, &length, 8);
        memcpy(h + 56, &crc32, 4);
        uint32_t check = kvf_crc32c(0, h, RECORD_HEADER_CRC_SPAN);
        memcpy(h + 60, &check, 4);
    }
done:
    for (int j = 0; j < 4; j++)
        Py_XDECREF(fast[j]);
    return out;
}

/* copy_crc32c_with(pass, dest, src, value=0) -> int: one copy and its CRC through a named
   pass (keeps the GIL; for tests). */
static PyObject *py_copy_crc32c_with(PyObject *self, PyObject *args) {
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

static PyObject *py_crc32c_many(PyObject *self, PyObject *args, PyObject *kwargs) {
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

/* -- copies --------------------------------------------------------------------------------- */

static void copy_crc(char *dest, const char *src, size_t n, uint32_t *crc, int of_source) {
    uintptr_t d = (uintptr_t)dest, s = (uintptr_t)src;
    int overlapping = d < s + n && s < d + n;
    if (!overlapping && kvf_crc32c_hardware()) {
        /* One pass: each word checksummed as it is stored, so the CRC is of exactly the
           bytes that landed, and of exactly the bytes this caller stored (both modes):
           another writer's bytes in the destination are never vouched for. */
        *crc = kvf_copy_crc32c(dest, src, n, *crc);
        return;
    }
    if (overlapping) {
        /* Overlapping: chunks would read bytes an earlier chunk overwrote. */
        if (of_source)
            *crc = kvf_crc32c(*crc, src, n);
        memmove(dest, src, n);
        if (!of_source)
            *crc = kvf_crc32c(*crc, dest, n);
        return;
    }
    for (size_t at = 0; at < n; at += COPY_CHUNK) {
        size_t c = n - at < COPY_CHUNK ? n - at : COPY_CHUNK;
        if (of_source) {
            /* A write into shared memory: the CRC of what this caller meant to store, read
               first (the copy then reads it from cache). Read back from the destination, it
               would vouch for bytes another writer mixed in. */
            *crc = kvf_crc32c(*crc, src + at, c);
            memmove(dest + at, src + at, c);
        } else {
            memmove(dest + at, src + at, c);
            /* A read: the CRC of what landed, read back from the destination (still in
               cache): a source changing under the copy is caught by its reader, not
               hidden. */
            *crc = kvf_crc32c(*crc, dest + at, c);
        }
    }
}

/* The GIL's return overlapped with a batch's tail: see run_then_take_gil. A batch is the
   pairs of a copy (views 2i: destination, 2i + 1: source) or the buffers of a CRC pass
   (view i), from item `item`, byte `at` of it, on; whoever runs it continues each span's
   CRC where the last runner left it. */
typedef enum { JOB_COPY, JOB_COPY_CRC_OF_SOURCE, JOB_CRC } JobKind;

typedef struct {
    Py_buffer *v;
    const int32_t *span_of;
    uint32_t *crcs;
    Py_ssize_t n;
    JobKind kind;
    Py_ssize_t item;
    size_t at;
} BatchJob;

/* Run one unit from where `j` stands: the rest of a pair whose source and destination
   overlap (memmove picks its direction for the whole), else up to HANDOFF_CHUNK bytes.
   Returns the bytes it covered; `j` then stands past them. */
static size_t run_unit(BatchJob *j) {
    Py_ssize_t i = j->item;
    int32_t span = j->span_of[i];
    size_t at = j->at, len, c;
    if (j->kind == JOB_CRC) {
        const char *buf = j->v[i].buf;
        len = (size_t)j->v[i].len;
        c = len - at < HANDOFF_CHUNK ? len - at : HANDOFF_CHUNK;
        if (span >= 0)
            j->crcs[span] = kvf_crc32c(j->crcs[span], buf + at, c);
    } else {
        char *dest = j->v[2 * i].buf;
        const char *src = j->v[2 * i + 1].buf;
        uintptr_t d = (uintptr_t)dest, s = (uintptr_t)src;
        len = (size_t)j->v[2 * i + 1].len;
        c = len - at;
        if (c > HANDOFF_CHUNK && !(d < s + len && s < d + len))
            c = HANDOFF_CHUNK;
        if (span >= 0)
            copy_crc(dest + at, src + at, c, &j->crcs[span], j->kind == JOB_COPY_CRC_OF_SOURCE);
        else if (c)
            memmove(dest + at, src + at, c);
    }
    if (at + c == len) {
        j->item++;
        j->at = 0;
    } else {
        j->at = at + c;
    }
    return c;
}

static void run_range(BatchJob *j) {
    while (j->item < j->n)
        run_unit(j);
    /* Every byte of a copy is stored before any store of a later call: a writer that
       copies payloads in one call and their headers in the next publishes them in that
       order to a reader on another CPU (x86 keeps store order; glibc fences its
       non-temporal stores; this keeps the compiler from moving stores across). A helper
       thread's stores are ordered before the caller's later ones by the join. */
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void *run_thread(void *job) {
    run_range(job);
    return NULL;
}

/* sys.getswitchinterval() in ns (with the GIL); CPython's default, 5 ms, if it cannot be
   read. */
static int64_t switch_interval_ns(void) {
    PyObject *sys = PyImport_ImportModule("sys");
    PyObject *value = sys ? PyObject_CallMethod(sys, "getswitchinterval", NULL) : NULL;
    double seconds = value ? PyFloat_AsDouble(value) : -1.0;
    Py_XDECREF(value);
    Py_XDECREF(sys);
    if (!(seconds > 0)) {
        PyErr_Clear();
        seconds = 0.005;
    }
    return (int64_t)(seconds * 1e9);
}

/* Run `j` (`total` bytes) with the GIL released by the caller, and take the GIL back into
   *ts; `interval_ns` is the switch interval, read while the GIL was held.

   Why: beside a busy Python thread, taking the GIL back waits about one switch interval
   (5 ms by default), 10-20 % of a 64 x 4 MiB shm read. So once what is left should take
   no longer than that wait, the rest goes to a helper thread and this one asks for the
   GIL meanwhile: the wait and the batch's tail overlap. With no thread wanting the GIL
   this thread gets it at once and holds it while the helper finishes: about one switch
   interval at most, what any Python thread may hold it for. Batches below HANDOFF_MIN,
   and any whose helper cannot start, run here to the end. */
static void run_then_take_gil(BatchJob *j, size_t total, int64_t interval_ns,
                              PyThreadState **ts) {
    if (total >= HANDOFF_MIN) {
        int64_t started = kvf_now_ns();
        size_t done = 0;
        while (j->item < j->n) {
            done += run_unit(j);
            double elapsed = (double)(kvf_now_ns() - started);
            /* What is left, at the pace so far, fits in the wait for the GIL. */
            if (j->item < j->n && done && elapsed * (double)(total - done) <=
                                              (double)interval_ns * (double)done) {
                /* The helper blocks every signal (it inherits the mask it starts with):
                   they stay with the threads Python knows. */
                sigset_t all, mask;
                sigfillset(&all);
                pthread_sigmask(SIG_BLOCK, &all, &mask);
                pthread_t helper;
                int started_helper = pthread_create(&helper, NULL, run_thread, j) == 0;
                pthread_sigmask(SIG_SETMASK, &mask, NULL);
                if (!started_helper)
                    break;
                TAKE_GIL(*ts);
                handed_off++;
                pthread_join(helper, NULL);
                return;
            }
        }
    }
    run_range(j);
    TAKE_GIL(*ts);
}

static PyObject *py_copy_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"pairs", "crc_spans", "crc_of_source", NULL};
    PyObject *pairs, *spans = Py_None;
    int of_source = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|Op:copy_many", kwlist, &pairs, &spans,
                                     &of_source))
        return NULL;
    const char *func = "copy_many";
    PyObject *fast = PySequence_Fast(pairs, "copy_many: pairs must be a sequence of (dest, src)");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Views vs = {NULL, 0, 0};
    int32_t *span_of = PyMem_Calloc(n ? (size_t)n : 1, sizeof(int32_t));
    uint32_t *crcs = NULL;
    PyObject *result = NULL;
    if (!span_of) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t nspans = parse_spans(spans, n, span_of, func);
    if (nspans < 0)
        goto done;
    crcs = PyMem_Calloc(nspans ? (size_t)nspans : 1, sizeof(uint32_t));
    if (!crcs) {
        PyErr_NoMemory();
        goto done;
    }
    if (views_init(&vs, 2 * n) < 0)
        goto done;
    size_t total = 0;
    /* Every pair is checked before any byte moves: a refused batch writes nothing. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dest, *src;
        if (unpack2(PySequence_Fast_GET_ITEM(fast, i), &dest, &src, "a pair is (dest, src)") < 0) {
            name_error(func, "pair %zd", i);
            goto done;
        }
        int bad = get_view(&vs, dest, 1);
        if (bad < 0)
            name_error(func, "destination of pair %zd", i);
        else if ((bad = get_view(&vs, src, 0)) < 0)
            name_error(func, "source of pair %zd", i);
        Py_DECREF(dest);
        Py_DECREF(src);
        if (bad < 0)
            goto done;
        Py_ssize_t have = vs.v[2 * i].len, need = vs.v[2 * i + 1].len;
        if (have < need) {
            PyErr_Format(PyExc_ValueError,
                         "%s: pair %zd: destination holds %zd bytes, source has %zd", func, i,
                         have, need);
            goto done;
        }
        total += (size_t)need;
    }

    BatchJob job = {vs.v, span_of, crcs, n, of_source ? JOB_COPY_CRC_OF_SOURCE : JOB_COPY, 0, 0};
    if (total < GIL_RELEASE_MIN) {
        run_range(&job);
    } else {
        int64_t interval_ns = total < HANDOFF_MIN ? 0 : switch_interval_ns();
        PyThreadState *ts;
        RELEASE_GIL(ts);
        run_then_take_gil(&job, total, interval_ns, &ts);
    }
    result = crc_list(crcs, nspans);
done:
    views_release(&vs);
    PyMem_Free(span_of);
    PyMem_Free(crcs);
    Py_DECREF(fast);
    return result;
}

/* -- sockets -------------------------------------------------------------------------------- */

/* A deadline argument: None, or a time.monotonic() value. */
static int parse_deadline(PyObject *obj, int64_t *out) {
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
static int parse_busy_poll(double seconds, int64_t *out, const char *func) {
    if (!(seconds >= 0 && seconds <= 1)) {
        PyErr_Format(PyExc_ValueError, "%s: busy_poll must be 0 to 1 seconds", func);
        return -1;
    }
    *out = (int64_t)(seconds * 1e9);
    return 0;
}

/* The iovecs of a run of views. */
static struct iovec *iovecs_of(const Py_buffer *v, Py_ssize_t n) {
    struct iovec *iov = PyMem_Calloc(n ? (size_t)n : 1, sizeof(struct iovec));
    if (!iov) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        iov[i].iov_base = v[i].buf;
        iov[i].iov_len = (size_t)v[i].len;
    }
    return iov;
}

/* Where a socket call stands with the GIL: held (ts NULL) or released (ts saved). */
typedef struct {
    PyThreadState *ts;
    int try_first;      /* small call: try without waiting, GIL held, before releasing it */
    int64_t hold_ns;    /* a small call's waits with the GIL held, in all (request_reply) */
    int64_t hold_until; /* 0: no wait held yet */
} Gil;

/* Wait for `s`'s socket with the GIL held, within what is left of the call's hold (and
   never past its deadline); 0 when that is spent or a signal came, so the caller lets the
   GIL go and waits as usual. The stream's spin (busy_poll) comes first, as it would with
   the GIL released: a sleep in ppoll costs a wake-up that a reply over loopback beats. */
static int hold_wait(kvf_stream *s, Gil *g) {
    if (kvf_stream_spinning(s))
        return 1;
    int64_t now = kvf_now_ns();
    if (!g->hold_until)
        g->hold_until = now + g->hold_ns;
    int64_t until = g->hold_until;
    if (s->deadline_ns >= 0 && s->deadline_ns < until)
        until = s->deadline_ns;
    if (now >= until)
        return 0;
    struct pollfd p = {.fd = s->fd, .events = s->sending ? POLLOUT : POLLIN};
    struct timespec left = {(time_t)((until - now) / 1000000000),
                            (long)((until - now) % 1000000000)};
    return ppoll(&p, 1, &left, NULL) > 0;
}

/* Run a stream to its end; returns its status, or -1 with an exception set (a signal
   handler raised). A small call first moves what it can without waiting while it holds the
   GIL: a send that fits the socket buffer, or bytes that already arrived, then cost no
   return of the GIL; with a hold (request_reply's hold_gil), it also waits that long in
   all for its socket with the GIL held. From the first wait past that, the GIL is released,
   and taken back only to run signal handlers, until the caller's gil_end. */
static int run_stream(kvf_stream *s, Gil *g) {
    if (!g->ts && g->try_first) {
        s->no_wait = 1;
        int rc;
        do
            rc = kvf_stream_run(s);
        while (rc == KVF_WOULD_WAIT && g->hold_ns > 0 && hold_wait(s, g));
        s->no_wait = 0;
        if (rc != KVF_WOULD_WAIT && rc != KVF_INTERRUPTED)
            return rc;
    }
    if (!g->ts)
        RELEASE_GIL(g->ts);
    for (;;) {
        int rc = kvf_stream_run(s);
        if (rc != KVF_INTERRUPTED)
            return rc;
        TAKE_GIL(g->ts);
        int bad = PyErr_CheckSignals();
        RELEASE_GIL(g->ts);
        if (bad < 0)
            return -1;
    }
}

static void gil_end(Gil *g) {
    if (g->ts)
        TAKE_GIL(g->ts);
}

static size_t total_len(const Py_buffer *v, Py_ssize_t n) {
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        total += (size_t)v[i].len;
    return total;
}

static PyObject *peer_closed(const char *func, uint64_t received) {
    PyObject *msg = PyUnicode_FromFormat(
        "%s: the peer closed the connection after %llu bytes were received", func,
        (unsigned long long)received);
    if (!msg)
        return NULL;
    PyObject *exc = PyObject_CallOneArg(PeerClosed, msg);
    Py_DECREF(msg);
    if (!exc)
        return NULL;
    PyObject *n = PyLong_FromUnsignedLongLong(received);
    if (!n || PyObject_SetAttrString(exc, "received", n) < 0) {
        Py_XDECREF(n);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(n);
    PyErr_SetObject(PeerClosed, exc);
    Py_DECREF(exc);
    return NULL;
}

/* Raise the exception for a stream that stopped with `rc`; returns NULL. */
static PyObject *stream_error(const char *func, int rc, const kvf_stream *s, uint64_t sent,
                              uint64_t received) {
    switch (rc) {
    case KVF_CLOSED:
        return peer_closed(func, received);
    case KVF_TIMEOUT:
        return PyErr_Format(PyExc_TimeoutError,
                            "%s: the deadline passed while %s, after %llu bytes sent and %llu "
                            "received",
                            func, s->sending ? "sending" : "receiving", (unsigned long long)sent,
                            (unsigned long long)received);
    case KVF_ERRNO: {
        /* OSError(errno, text) makes the fitting subclass (ConnectionResetError, ...). */
        PyObject *exc = PyObject_CallFunction(
            PyExc_OSError, "iN", s->err,
            PyUnicode_FromFormat("%s (%s: while %s, after %llu bytes sent and %llu received)",
                                 strerror(s->err), func, s->sending ? "sending" : "receiving",
                                 (unsigned long long)sent, (unsigned long long)received));
        if (exc) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    default: /* -1: a signal handler raised; its exception is set */
        return NULL;
    }
}

/* The iovec scratch a call needs: IOV_MAX entries, or fewer for fewer buffers. A call that
   waits holds it: IOV_MAX entries are 16 KiB, and a node's thousand connections each
   waiting for a frame's table held 16 MiB of them. */
static size_t scratch_entries(Py_ssize_t buffers) {
    size_t n = buffers > 0 ? (size_t)buffers : 1;
    return n < iov_max ? n : iov_max;
}

static void stream_init(kvf_stream *s, int fd, int sending, struct iovec *bufs, size_t count,
                        int64_t deadline_ns, struct iovec *scratch, size_t scratch_len) {
    memset(s, 0, sizeof *s);
    s->fd = fd;
    s->sending = sending;
    s->bufs = bufs;
    s->count = count;
    s->deadline_ns = deadline_ns;
    s->iov = scratch;
    s->iov_max = scratch_len;
}

/* send_all, send_checksummed (`spans` not NULL) and recv_into_all (`sending` 0): every
   buffer one way in one GIL release; returns the bytes sent by send_all, else the CRCs of
   the spans (taken window by window as the bytes move, while they are in cache). */
static PyObject *move_buffers(PyObject *fd_obj, PyObject *buffers, PyObject *deadline_obj,
                              PyObject *spans, int sending, const char *func) {
    int64_t deadline;
    int fd = PyObject_AsFileDescriptor(fd_obj);
    if (fd < 0 || parse_deadline(deadline_obj, &deadline) < 0)
        return NULL;
    char not_a_sequence[80];
    snprintf(not_a_sequence, sizeof not_a_sequence, "%s: buffers must be a sequence", func);
    PyObject *fast = PySequence_Fast(buffers, not_a_sequence);
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Views vs = {NULL, 0, 0};
    struct iovec *bufs = NULL, *scratch = NULL;
    int32_t *span_of = PyMem_Calloc(n ? (size_t)n : 1, sizeof(int32_t));
    uint32_t *crcs = NULL;
    PyObject *result = NULL;
    if (!span_of) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t nspans = parse_spans(spans, n, span_of, func);
    if (nspans < 0)
        goto done;
    crcs = PyMem_Calloc(nspans ? (size_t)nspans : 1, sizeof(uint32_t));
    if (!crcs) {
        PyErr_NoMemory();
        goto done;
    }
    if (views_init(&vs, n) < 0 || get_views(&vs, fast, !sending, func, "buffer") < 0)
        goto done;
    bufs = iovecs_of(vs.v, n);
    scratch = PyMem_Calloc(scratch_entries(n), sizeof(struct iovec));
    if (!bufs || !scratch) {
        PyErr_NoMemory();
        goto done;
    }
    kvf_stream s;
    stream_init(&s, fd, sending, bufs, (size_t)n, deadline, scratch, scratch_entries(n));
    if (nspans) {
        /* Each window is checksummed right after the kernel copied it: the CRC reads the
           bytes from cache instead of making a pass of its own over memory. */
        s.span_of = span_of;
        s.crcs = crcs;
        s.window = sending ? SEND_CRC_WINDOW : RECV_CRC_WINDOW;
    }
    Gil g = {NULL, total_len(vs.v, n) < GIL_RELEASE_MIN, 0, 0};
    int rc = run_stream(&s, &g);
    gil_end(&g);
    if (rc != KVF_DONE)
        result = sending ? stream_error(func, rc, &s, s.moved, 0)
                         : stream_error(func, rc, &s, 0, s.moved);
    else if (sending && !spans)
        result = PyLong_FromUnsignedLongLong(s.moved);
    else
        result = crc_list(crcs, nspans);
done:
    views_release(&vs);
    PyMem_Free(bufs);
    PyMem_Free(scratch);
    PyMem_Free(span_of);
    PyMem_Free(crcs);
    Py_DECREF(fast);
    return result;
}

static PyObject *py_send_all(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd", "buffers", "deadline", NULL};
    PyObject *fd_obj, *buffers, *deadline_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:send_all", kwlist, &fd_obj, &buffers,
                                     &deadline_obj))
        return NULL;
    return move_buffers(fd_obj, buffers, deadline_obj, NULL, 1, "send_all");
}

static PyObject *py_send_checksummed(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd", "buffers", "deadline", "crc_spans", NULL};
    PyObject *fd_obj, *buffers, *deadline_obj, *spans;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:send_checksummed", kwlist, &fd_obj,
                                     &buffers, &deadline_obj, &spans))
        return NULL;
    return move_buffers(fd_obj, buffers, deadline_obj, spans, 1, "send_checksummed");
}

static PyObject *py_recv_into_all(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd", "buffers", "deadline", "crc_spans", NULL};
    PyObject *fd_obj, *buffers, *deadline_obj, *spans = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:recv_into_all", kwlist, &fd_obj,
                                     &buffers, &deadline_obj, &spans))
        return NULL;
    return move_buffers(fd_obj, buffers, deadline_obj, spans, 0, "recv_into_all");
}

/* serve_reads: a tcp node's connection served in C until Python is needed (serve.h). */
static PyObject *py_serve_reads(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd",           "regions",       "counters",        "idle_since",
                             "header",       "idle_timeout",  "frame_timeout",   "max_batch_bytes",
                             "busy_poll",    NULL};
    PyObject *fd_obj, *regions, *counters_obj, *idle_obj, *header_obj;
    double idle_timeout, frame_timeout, busy_poll = 0;
    unsigned long long max_batch_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOddK|d:serve_reads", kwlist, &fd_obj,
                                     &regions, &counters_obj, &idle_obj, &header_obj,
                                     &idle_timeout, &frame_timeout, &max_batch_bytes, &busy_poll))
        return NULL;
    const char *func = "serve_reads";
    int64_t spin_ns;
    int fd = PyObject_AsFileDescriptor(fd_obj);
    if (fd < 0 || parse_busy_poll(busy_poll, &spin_ns, func) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(regions, "serve_reads: regions must be a sequence");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Views vs = {NULL, 0, 0};
    kvf_region *table = PyMem_Calloc(n ? (size_t)n : 1, sizeof(kvf_region));
    PyObject *result = NULL;
    if (!table) {
        PyErr_NoMemory();
        goto done;
    }
    if (views_init(&vs, n + 3) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned int id;
        unsigned long long rkey, size;
        PyObject *buffer;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "IKOK", &id, &rkey, &buffer,
                              &size)) {
            name_error(func, "region %zd (id, rkey, buffer, size)", i);
            goto done;
        }
        if (get_view_named(&vs, buffer, 0, func, "a region's buffer") < 0)
            goto done;
        if ((unsigned long long)vs.v[vs.n - 1].len < size) {
            PyErr_Format(PyExc_ValueError, "%s: region %u has %zd bytes, not %llu", func, id,
                         vs.v[vs.n - 1].len, size);
            goto done;
        }
        table[i] = (kvf_region){id, rkey, vs.v[vs.n - 1].buf, size};
    }
    if (get_view_named(&vs, counters_obj, 1, func, "counters") < 0 ||
        get_view_named(&vs, idle_obj, 1, func, "idle_since") < 0 ||
        get_view_named(&vs, header_obj, 1, func, "header") < 0)
        goto done;
    Py_buffer *counters = &vs.v[n], *idle = &vs.v[n + 1], *header = &vs.v[n + 2];
    if (counters->len < (Py_ssize_t)(KVF_C_N * sizeof(uint64_t)) ||
        (uintptr_t)counters->buf % 8 || idle->len < 8 || (uintptr_t)idle->buf % 8 ||
        header->len < KVF_WIRE_HEADER) {
        PyErr_Format(PyExc_ValueError,
                     "%s: counters (%d u64), idle_since (one i64) must be 8-aligned, the "
                     "header %d bytes",
                     func, KVF_C_N, KVF_WIRE_HEADER);
        goto done;
    }
    kvf_serve sv;
    memset(&sv, 0, sizeof sv);
    sv.fd = fd;
    sv.regions = table;
    sv.nregions = (size_t)n;
    sv.counters = counters->buf;
    sv.idle_since = idle->buf;
    sv.idle_timeout_ns = idle_timeout > 0 ? (int64_t)(idle_timeout * 1e9) : 0;
    sv.frame_timeout_ns = (int64_t)(frame_timeout * 1e9);
    sv.max_batch_bytes = max_batch_bytes;
    sv.spin_ns = spin_ns;
    PyThreadState *ts;
    RELEASE_GIL(ts);
    int rc = kvf_serve_reads(&sv);
    TAKE_GIL(ts);
    memcpy(header->buf, sv.header, KVF_WIRE_HEADER);
    result = Py_BuildValue("(ii)", rc, sv.err);
done:
    views_release(&vs);
    PyMem_Free(table);
    Py_DECREF(fast);
    return result;
}

/* One request and its reply on one socket, parsed: what request_reply moves. Prepared
   with the GIL held (every check before a byte moves), run without it, freed with it. */
typedef struct {
    int fd;
    PyObject *send_fast, *pay_fast;
    Py_ssize_t nsend, npay, nspans;
    Views vs; /* the send buffers, then the reply, then the payloads */
    struct iovec *bufs, *scratch;
    size_t nscratch;
    int32_t *span_of, *gated_span_of;
    uint32_t *crcs;
    const unsigned char *status;
    int64_t deadline, spin_ns;
    /* how it ended */
    kvf_stream s;
    int rc;
    uint64_t sent, received;
} Exchange;

static void exchange_free(Exchange *x) {
    views_release(&x->vs);
    PyMem_Free(x->bufs);
    PyMem_Free(x->scratch);
    PyMem_Free(x->span_of);
    PyMem_Free(x->gated_span_of);
    PyMem_Free(x->crcs);
    Py_XDECREF(x->send_fast);
    Py_XDECREF(x->pay_fast);
    memset(x, 0, sizeof *x);
}

/* Parse one exchange into `x` (zeroed); 0, or -1 with an exception set (x then freed). */
static int exchange_prepare(Exchange *x, PyObject *fd_obj, PyObject *send, PyObject *reply,
                            PyObject *payloads, int64_t deadline, Py_ssize_t status_offset,
                            PyObject *spans, int64_t spin_ns, const char *func) {
    x->fd = PyObject_AsFileDescriptor(fd_obj);
    if (x->fd < 0)
        return -1;
    x->deadline = deadline;
    x->spin_ns = spin_ns;
    x->send_fast = PySequence_Fast(send, "request_reply: request must be a sequence");
    if (!x->send_fast)
        goto fail;
    x->pay_fast = PySequence_Fast(payloads, "request_reply: payloads must be a sequence");
    if (!x->pay_fast)
        goto fail;
    x->nsend = PySequence_Fast_GET_SIZE(x->send_fast);
    x->npay = PySequence_Fast_GET_SIZE(x->pay_fast);
    x->span_of = PyMem_Calloc((size_t)x->npay + 1, sizeof(int32_t));
    x->gated_span_of = PyMem_Calloc((size_t)x->npay + 1, sizeof(int32_t));
    if (!x->span_of || !x->gated_span_of) {
        PyErr_NoMemory();
        goto fail;
    }
    x->nspans = parse_spans(spans, x->npay, x->span_of, func);
    if (x->nspans < 0)
        goto fail;
    x->crcs = PyMem_Calloc(x->nspans ? (size_t)x->nspans : 1, sizeof(uint32_t));
    if (!x->crcs) {
        PyErr_NoMemory();
        goto fail;
    }
    if (views_init(&x->vs, x->nsend + 1 + x->npay) < 0 ||
        get_views(&x->vs, x->send_fast, 0, func, "request buffer") < 0 ||
        get_view_named(&x->vs, reply, 1, func, "reply") < 0 ||
        get_views(&x->vs, x->pay_fast, 1, func, "payload") < 0)
        goto fail;
    const Py_buffer *reply_view = &x->vs.v[x->nsend];
    if (status_offset < 0 || status_offset > reply_view->len ||
        x->npay > reply_view->len - status_offset) {
        PyErr_Format(PyExc_ValueError,
                     "%s: a reply of %zd bytes has no status byte for each of %zd payloads "
                     "at offset %zd",
                     func, reply_view->len, x->npay, status_offset);
        goto fail;
    }
    x->status = (const unsigned char *)reply_view->buf + status_offset;
    x->bufs = iovecs_of(x->vs.v, x->nsend + 1 + x->npay);
    x->nscratch = scratch_entries(x->nsend > x->npay ? x->nsend : x->npay);
    x->scratch = PyMem_Calloc(x->nscratch, sizeof(struct iovec));
    if (!x->bufs || !x->scratch) {
        PyErr_NoMemory();
        goto fail;
    }
    return 0;
fail:
    exchange_free(x);
    return -1;
}

/* A stream run on a thread that never takes the GIL (a lane's helper, signals blocked):
   an interrupted wait is simply resumed. */
static int run_stream_unlocked(kvf_stream *s) {
    int rc;
    do
        rc = kvf_stream_run(s);
    while (rc == KVF_INTERRUPTED);
    return rc;
}

static int exchange_step(kvf_stream *s, Gil *g) {
    return g ? run_stream(s, g) : run_stream_unlocked(s);
}

/* Send the request, fill the reply, then the payloads it accepts; `g` NULL: on a thread
   without the GIL. Returns (and keeps in x->rc) a kvf_status, or -1 (a signal handler
   raised, its exception set). */
static int exchange_run(Exchange *x, Gil *g) {
    struct iovec *send_iov = x->bufs, *reply_iov = x->bufs + x->nsend;
    struct iovec *pay_iov = reply_iov + 1;
    stream_init(&x->s, x->fd, 1, send_iov, (size_t)x->nsend, x->deadline, x->scratch,
                x->nscratch);
    int rc = exchange_step(&x->s, g);
    x->sent = x->s.moved;
    if (rc == KVF_DONE) {
        stream_init(&x->s, x->fd, 0, reply_iov, 1, x->deadline, x->scratch, x->nscratch);
        /* Only the reply's header is worth a spin: it is what a small call waits for. */
        x->s.spin_ns = x->spin_ns;
        rc = exchange_step(&x->s, g);
        x->received = x->s.moved;
    }
    if (rc == KVF_DONE) {
        /* Only the payloads the reply accepts follow it: pack them in place, in order. */
        size_t k = 0;
        for (Py_ssize_t i = 0; i < x->npay; i++) {
            if (x->status[i] != 0)
                continue;
            pay_iov[k] = pay_iov[i];
            x->gated_span_of[k] = x->span_of[i];
            k++;
        }
        stream_init(&x->s, x->fd, 0, pay_iov, k, x->deadline, x->scratch, x->nscratch);
        if (x->nspans) {
            x->s.span_of = x->gated_span_of;
            x->s.crcs = x->crcs;
            x->s.window = RECV_CRC_WINDOW;
        }
        rc = exchange_step(&x->s, g);
        x->received += x->s.moved;
    }
    x->rc = rc;
    return rc;
}

/* The exchange's result (its CRCs), or NULL with its error raised. */
static PyObject *exchange_result(Exchange *x, const char *func) {
    return x->rc == KVF_DONE ? crc_list(x->crcs, x->nspans)
                             : stream_error(func, x->rc, &x->s, x->sent, x->received);
}

static PyObject *py_request_reply(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd",        "request",   "reply",    "payloads",
                             "deadline",  "status_offset", "crc_spans", "busy_poll",
                             "hold_gil",  NULL};
    PyObject *fd_obj, *send, *reply, *payloads, *deadline_obj, *spans = Py_None;
    Py_ssize_t status_offset = 0;
    double busy_poll = 0, hold_gil = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|nOdd:request_reply", kwlist, &fd_obj,
                                     &send, &reply, &payloads, &deadline_obj, &status_offset,
                                     &spans, &busy_poll, &hold_gil))
        return NULL;
    const char *func = "request_reply";
    int64_t deadline, spin_ns;
    if (parse_deadline(deadline_obj, &deadline) < 0 ||
        parse_busy_poll(busy_poll, &spin_ns, func) < 0)
        return NULL;
    if (!(hold_gil >= 0 && hold_gil <= HOLD_GIL_MAX)) {
        PyErr_Format(PyExc_ValueError, "%s: hold_gil must be 0 to %g seconds", func,
                     HOLD_GIL_MAX);
        return NULL;
    }
    Exchange x;
    memset(&x, 0, sizeof x);
    if (exchange_prepare(&x, fd_obj, send, reply, payloads, deadline, status_offset, spans,
                         spin_ns, func) < 0)
        return NULL;
    Gil g = {NULL, total_len(x.vs.v, x.nsend + 1 + x.npay) < GIL_RELEASE_MIN,
             (int64_t)(hold_gil * 1e9), 0};
    exchange_run(&x, &g);
    gil_end(&g);
    PyObject *result = exchange_result(&x, func);
    exchange_free(&x);
    return result;
}

/* request_reply_lanes: several exchanges at once, each on its own connection, one on the
   calling thread and each other on a helper thread; the GIL is released once for them all.
   Over loopback a node's reply is paced by its sending thread (which also runs the
   kernel's receive path): two connections moved a 256 MiB stream at 4.75-5.15 GB/s
   against 3.3-3.5 on one, on this project's 2-core VM. */
#define LANES_MAX 8

static void *run_lane(void *lane) {
    exchange_run((Exchange *)lane, NULL);
    return NULL;
}

static PyObject *py_request_reply_lanes(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"lanes", "deadline", "busy_poll", NULL};
    PyObject *lanes_obj, *deadline_obj;
    double busy_poll = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|d:request_reply_lanes", kwlist,
                                     &lanes_obj, &deadline_obj, &busy_poll))
        return NULL;
    const char *func = "request_reply_lanes";
    int64_t deadline, spin_ns;
    if (parse_deadline(deadline_obj, &deadline) < 0 ||
        parse_busy_poll(busy_poll, &spin_ns, func) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(lanes_obj, "request_reply_lanes: lanes must be a sequence");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Exchange xs[LANES_MAX];
    memset(xs, 0, sizeof xs);
    Py_ssize_t prepared = 0;
    PyObject *result = NULL;
    if (n < 1 || n > LANES_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: 1 to %d lanes, not %zd", func, LANES_MAX, n);
        goto done;
    }
    for (; prepared < n; prepared++) {
        PyObject *fd_obj, *send, *reply, *payloads, *spans;
        Py_ssize_t status_offset;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, prepared), "OOOOnO", &fd_obj,
                              &send, &reply, &payloads, &status_offset, &spans)) {
            name_error(func, "lane %zd (fd, request, reply, payloads, status_offset, crc_spans)",
                       prepared);
            goto done;
        }
        if (exchange_prepare(&xs[prepared], fd_obj, send, reply, payloads, deadline,
                             status_offset, spans, spin_ns, func) < 0)
            goto done;
        for (Py_ssize_t k = 0; k < prepared; k++)
            if (xs[k].fd == xs[prepared].fd) {
                PyErr_Format(PyExc_ValueError, "%s: lanes %zd and %zd share a socket", func, k,
                             prepared);
                exchange_free(&xs[prepared]);
                goto done;
            }
    }
    pthread_t helpers[LANES_MAX];
    int started[LANES_MAX] = {0};
    Gil g = {NULL, 0, 0, 0};
    RELEASE_GIL(g.ts);
    /* Helpers never run Python: every signal stays with the calling thread. */
    sigset_t all, mask;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &mask);
    for (Py_ssize_t i = 1; i < n; i++)
        started[i] = pthread_create(&helpers[i], NULL, run_lane, &xs[i]) == 0;
    pthread_sigmask(SIG_SETMASK, &mask, NULL);
    int rc = exchange_run(&xs[0], &g);
    if (rc != KVF_DONE) {
        /* The call fails whatever the others do, and the caller closes every lane's
           connection: end the helpers' transfers now rather than at the deadline. */
        for (Py_ssize_t i = 1; i < n; i++)
            if (started[i])
                shutdown(xs[i].fd, SHUT_RDWR);
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (started[i])
            pthread_join(helpers[i], NULL);
        else if (rc == KVF_DONE)
            rc = exchange_run(&xs[i], &g); /* no thread to be had: in turn, here */
        else
            xs[i].rc = rc;
    }
    gil_end(&g);
    if (rc == -1)
        goto done; /* a signal handler raised: its exception stands */
    for (Py_ssize_t i = 0; i < n; i++)
        if (xs[i].rc != KVF_DONE) {
            exchange_result(&xs[i], func);
            goto done;
        }
    result = PyList_New(n);
    if (!result)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *crcs = exchange_result(&xs[i], func);
        if (!crcs) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, crcs);
    }
done:
    for (Py_ssize_t i = 0; i < prepared; i++)
        exchange_free(&xs[i]);
    Py_DECREF(fast);
    return result;
}

/* -- memory ----------------------------------------------------------------------------- */

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Fault in every page of [buf, buf + len) by touching it: a read, or (write) an atomic add
   of zero, which a concurrent writer to the same byte cannot lose its store to. */
static void touch_pages(unsigned char *buf, size_t len, size_t page, int write) {
    uintptr_t at = (uintptr_t)buf, end = (uintptr_t)buf + len;
    while (at < end) {
        if (write)
            __atomic_fetch_add((unsigned char *)at, 0, __ATOMIC_RELAXED);
        else
            (void)*(volatile unsigned char *)at;
        at = (at & ~(uintptr_t)(page - 1)) + page;
    }
}

static PyObject *py_prefault(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buffer", "write", "force_touch", NULL};
    PyObject *obj;
    int write = 1, force_touch = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|pp:prefault", kwlist, &obj, &write,
                                     &force_touch))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, write ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError))
            name_error("prefault", "buffer");
        return NULL;
    }
    size_t len = (size_t)view.len, page = (size_t)sysconf(_SC_PAGESIZE);
    int populated = 0, err = 0;
    PyThreadState *ts = NULL;
    if (len >= GIL_RELEASE_MIN)
        RELEASE_GIL(ts);
    if (len && !force_touch) {
        /* The kernel fills the page tables itself (Linux 5.14+), faulting each page as a
           read or a write would, without a trap per page. Its range starts on a page. */
        uintptr_t start = (uintptr_t)view.buf & ~(uintptr_t)(page - 1);
        size_t span = (uintptr_t)view.buf + len - start;
        if (madvise((void *)start, span, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0)
            populated = 1;
        else if (errno != EINVAL) /* EINVAL: an older kernel, or a mapping it cannot do */
            err = errno;
    }
    if (len && !populated && !err)
        touch_pages(view.buf, len, page, write);
    if (ts)
        TAKE_GIL(ts);
    PyBuffer_Release(&view);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(populated);
}

/* -- a lock native loops can take without the GIL ----------------------------------------- */

/* A mutex Python code and a native loop share: Python takes it as a context manager (the
   GIL released only when it has to wait), a native loop takes it with the GIL released.
   A threading.Lock cannot be taken outside the interpreter. */
typedef struct {
    PyObject_HEAD PyThread_type_lock lock;
    int locked;
} Mutex;

static PyTypeObject MutexType;

static PyObject *mutex_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Mutex() takes no arguments");
        return NULL;
    }
    Mutex *self = (Mutex *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void mutex_dealloc(Mutex *self) {
    if (self->lock)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Without the GIL. */
static void mutex_take(Mutex *m) {
    PyThread_acquire_lock(m->lock, WAIT_LOCK);
    m->locked = 1;
}

static void mutex_give(Mutex *m) {
    m->locked = 0;
    PyThread_release_lock(m->lock);
}

static PyObject *mutex_acquire(Mutex *self, PyObject *unused) {
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        PyThreadState *ts;
        RELEASE_GIL(ts);
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        TAKE_GIL(ts);
    }
    self->locked = 1;
    Py_RETURN_TRUE;
}

static PyObject *mutex_release(Mutex *self, PyObject *unused) {
    if (!self->locked) {
        PyErr_SetString(PyExc_RuntimeError, "Mutex.release: not held");
        return NULL;
    }
    mutex_give(self);
    Py_RETURN_NONE;
}

static PyObject *mutex_exit(Mutex *self, PyObject *args) { return mutex_release(self, NULL); }

static PyObject *mutex_is_locked(Mutex *self, PyObject *unused) {
    return PyBool_FromLong(self->locked);
}

static PyMethodDef mutex_methods[] = {
    {"acquire", (PyCFunction)mutex_acquire, METH_NOARGS, "Take it (waits, the GIL released)."},
    {"release", (PyCFunction)mutex_release, METH_NOARGS, "Give it back."},
    {"locked", (PyCFunction)mutex_is_locked, METH_NOARGS, "Whether someone holds it."},
    {"__enter__", (PyCFunction)mutex_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)mutex_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MutexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric._runtime._native.Mutex",
    .tp_basicsize = sizeof(Mutex),
    .tp_dealloc = (destructor)mutex_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mutex native batch loops take without the GIL; a context manager in Python.",
    .tp_methods = mutex_methods,
    .tp_new = mutex_new,
};

/* -- libucp batches ------------------------------------------------------------------------ */

/* The ucx transport's per-batch loops. libucp is loaded by the transport (cffi, ABI mode) and
   its functions come here as addresses, so this module neither links nor needs UCX. Each
   cffi call releases the GIL, and one taken back beside a busy Python thread waits out the
   switch interval: a 64-segment batch posted, progressed and checked through cffi took it
   back ~30 times. Here posting keeps the GIL (nothing in it waits) and the whole wait, with
   the CRCs, releases it once. Signatures as in ucp/api/ucp.h (ucs_status_t is one byte). */
typedef void *(*ucp_rma_fn)(void *ep, void *buffer, size_t count, uint64_t remote_addr,
                            void *rkey, const void *param);
typedef void *(*ucp_flush_fn)(void *ep, const void *param);
typedef unsigned (*ucp_progress_fn)(void *worker);
typedef int8_t (*ucp_check_fn)(void *request);
typedef void (*ucp_free_fn)(void *request);
typedef int8_t (*ucp_arm_fn)(void *worker);

#define UCS_OK 0
#define UCS_INPROGRESS 1
#define UCS_ERR_TIMED_OUT (-20)
#define UCS_ERR_LAST (-100)
/* Progress calls per round before the completions are checked, as the transport drains. */
#define UCP_DRAIN_MAX 65536

/* UCS_PTR_STATUS: OK for NULL, the error an encoded pointer carries, else INPROGRESS. */
static int ptr_status(void *p) {
    uintptr_t v = (uintptr_t)p;
    if (v == 0)
        return UCS_OK;
    if (v >= (uintptr_t)(intptr_t)UCS_ERR_LAST)
        return (int)(intptr_t)v;
    return UCS_INPROGRESS;
}

static int parse_address(PyObject *obj, void **out, const char *what) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s must be an address (int)", what);
        return -1;
    }
    *out = (void *)(uintptr_t)v;
    return 0;
}

static PyObject *request_list(void **requests, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong((uintptr_t)requests[i]);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *py_ucp_post(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"rma", "flush", "ep", "param", "buffers", "remote", "put", NULL};
    PyObject *rma_obj, *flush_obj, *ep_obj, *param_obj, *buffers, *remote;
    int put;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOp:ucp_post", kwlist, &rma_obj,
                                     &flush_obj, &ep_obj, &param_obj, &buffers, &remote, &put))
        return NULL;
    const char *func = "ucp_post";
    void *rma_p, *flush_p, *ep, *param;
    if (parse_address(rma_obj, &rma_p, "rma") < 0 || parse_address(flush_obj, &flush_p, "flush") < 0 ||
        parse_address(ep_obj, &ep, "ep") < 0 || parse_address(param_obj, &param, "param") < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(buffers, "ucp_post: buffers must be a sequence");
    if (!fast)
        return NULL;
    PyObject *rfast = PySequence_Fast(remote, "ucp_post: remote must be a sequence");
    if (!rfast) {
        Py_DECREF(fast);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Views vs = {NULL, 0, 0};
    uint64_t *addrs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(uint64_t));
    void **rkeys = PyMem_Calloc(n ? (size_t)n : 1, sizeof(void *));
    void **requests = PyMem_Calloc((size_t)n + 1, sizeof(void *));
    PyObject *result = NULL;
    if (!addrs || !rkeys || !requests) {
        PyErr_NoMemory();
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(rfast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd remote entries for %zd buffers", func,
                     PySequence_Fast_GET_SIZE(rfast), n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a, *b;
        if (unpack2(PySequence_Fast_GET_ITEM(rfast, i), &a, &b,
                    "a remote entry is (address, rkey handle)") < 0) {
            name_error(func, "remote entry %zd", i);
            goto done;
        }
        unsigned long long addr = PyLong_AsUnsignedLongLong(a);
        int bad = addr == (unsigned long long)-1 && PyErr_Occurred();
        bad = bad || parse_address(b, &rkeys[i], "an rkey handle") < 0;
        Py_DECREF(a);
        Py_DECREF(b);
        if (bad)
            goto done;
        addrs[i] = addr;
    }
    if (views_init(&vs, n) < 0 || get_views(&vs, fast, !put, func, "buffer") < 0)
        goto done;
    /* Posting does not wait (RMA on shared memory and RDMA is queued; progress moves it):
       the GIL stays held, and no return of it is owed. */
    ucp_rma_fn rma = (ucp_rma_fn)rma_p;
    int failure = UCS_OK;
    Py_ssize_t pending = 0;
    for (Py_ssize_t i = 0; i < n && failure == UCS_OK; i++) {
        void *request = rma(ep, vs.v[i].buf, (size_t)vs.v[i].len, addrs[i], rkeys[i], param);
        int status = ptr_status(request);
        if (status == UCS_INPROGRESS)
            requests[pending++] = request;
        else if (status != UCS_OK)
            failure = status;
    }
    if (put && failure == UCS_OK) {
        /* A completed put only frees our buffer; the flush completes once every put has
           landed in the node's memory, so a publish after it is safe. */
        void *request = ((ucp_flush_fn)flush_p)(ep, param);
        int status = ptr_status(request);
        if (status == UCS_INPROGRESS)
            requests[pending++] = request;
        else if (status != UCS_OK)
            failure = status;
    }
    PyObject *list = request_list(requests, pending);
    if (list) {
        result = Py_BuildValue("(iN)", failure, list);
    }
done:
    views_release(&vs);
    PyMem_Free(addrs);
    PyMem_Free(rkeys);
    PyMem_Free(requests);
    Py_DECREF(fast);
    Py_DECREF(rfast);
    return result;
}

/* One wait: the worker, its functions, the requests still in flight. */
typedef struct {
    ucp_progress_fn progress;
    ucp_check_fn check;
    ucp_free_fn release;
    ucp_arm_fn arm;
    void *worker;
    void **requests;
    Py_ssize_t n;
    int failure;
    int idle;
    int spins;
    int64_t deadline;
} UcpWait;

/* One round, the mutex held: drain progress, then check and free what completed. Returns
   whether the worker is armed (the caller may sleep on its fd). Drain first, then check:
   with CMA each progress call copies, and checking after every call would cost O(n^2). */
static int ucp_round(UcpWait *w) {
    unsigned moved = 0;
    for (int i = 0; i < UCP_DRAIN_MAX; i++) {
        unsigned done_now = w->progress(w->worker);
        if (!done_now)
            break;
        moved += done_now;
    }
    Py_ssize_t still = 0;
    int completed = 0;
    for (Py_ssize_t i = 0; i < w->n; i++) {
        int status = w->check(w->requests[i]);
        if (status == UCS_INPROGRESS) {
            w->requests[still++] = w->requests[i];
            continue;
        }
        w->release(w->requests[i]);
        completed = 1;
        if (status != UCS_OK && w->failure == UCS_OK)
            w->failure = status;
    }
    w->n = still;
    if (w->failure != UCS_OK || !w->n)
        return 0;
    if (w->deadline >= 0 && kvf_now_ns() > w->deadline) {
        w->failure = UCS_ERR_TIMED_OUT;
        return 0;
    }
    w->idle = moved || completed ? 0 : w->idle + 1;
    /* Armed, UCX signals the fd when a reply arrives (tcp, RDMA completions); CMA copies
       happen inside progress, so arm() refuses while any are queued. */
    return w->idle >= w->spins && w->arm(w->worker) == UCS_OK;
}

static void span_crcs(const Views *vs, const int32_t *span_of, uint32_t *crcs) {
    for (Py_ssize_t i = 0; i < vs->n; i++)
        if (span_of[i] >= 0)
            crcs[span_of[i]] = kvf_crc32c(crcs[span_of[i]], vs->v[i].buf, (size_t)vs->v[i].len);
}

static PyObject *py_ucp_wait(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fns",         "worker",    "efd",       "requests",
                             "mutex",       "deadline",  "spins",     "idle_ms",
                             "crc_buffers", "crc_spans", "crc_first", "try_first",
                             NULL};
    PyObject *fns_obj, *worker_obj, *requests_obj, *mutex_obj, *deadline_obj;
    PyObject *crc_buffers = Py_None, *spans = Py_None;
    int efd, spins, idle_ms, crc_first = 0, try_first = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOiOOOii|OOpp:ucp_wait", kwlist, &fns_obj,
                                     &worker_obj, &efd, &requests_obj, &mutex_obj,
                                     &deadline_obj, &spins, &idle_ms, &crc_buffers, &spans,
                                     &crc_first, &try_first))
        return NULL;
    const char *func = "ucp_wait";
    if (!PyObject_TypeCheck(mutex_obj, &MutexType)) {
        PyErr_SetString(PyExc_TypeError, "ucp_wait: mutex must be a kvfabric Mutex");
        return NULL;
    }
    Mutex *mutex = (Mutex *)mutex_obj;
    UcpWait w = {.failure = UCS_OK, .spins = spins};
    void *fn[4];
    PyObject *fns = PySequence_Fast(fns_obj, "ucp_wait: fns is (progress, check, free, arm)");
    if (!fns)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fns) != 4) {
        Py_DECREF(fns);
        PyErr_SetString(PyExc_ValueError, "ucp_wait: fns is (progress, check, free, arm)");
        return NULL;
    }
    for (int i = 0; i < 4; i++)
        if (parse_address(PySequence_Fast_GET_ITEM(fns, i), &fn[i], "a function") < 0) {
            Py_DECREF(fns);
            return NULL;
        }
    Py_DECREF(fns);
    w.progress = (ucp_progress_fn)fn[0];
    w.check = (ucp_check_fn)fn[1];
    w.release = (ucp_free_fn)fn[2];
    w.arm = (ucp_arm_fn)fn[3];
    if (parse_address(worker_obj, &w.worker, "worker") < 0 ||
        parse_deadline(deadline_obj, &w.deadline) < 0)
        return NULL;
    PyObject *rfast = PySequence_Fast(requests_obj, "ucp_wait: requests must be a sequence");
    if (!rfast)
        return NULL;
    w.n = PySequence_Fast_GET_SIZE(rfast);
    w.requests = PyMem_Calloc(w.n ? (size_t)w.n : 1, sizeof(void *));
    PyObject *cfast = NULL, *result = NULL;
    Views vs = {NULL, 0, 0};
    Py_ssize_t nspans = 0;
    int32_t *span_of = NULL;
    uint32_t *crcs = NULL;
    if (!w.requests) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < w.n; i++)
        if (parse_address(PySequence_Fast_GET_ITEM(rfast, i), &w.requests[i], "a request") < 0)
            goto done;
    if (crc_buffers != Py_None) {
        cfast = PySequence_Fast(crc_buffers, "ucp_wait: crc_buffers must be a sequence");
        if (!cfast)
            goto done;
        Py_ssize_t ncrc = PySequence_Fast_GET_SIZE(cfast);
        span_of = PyMem_Calloc(ncrc ? (size_t)ncrc : 1, sizeof(int32_t));
        if (!span_of) {
            PyErr_NoMemory();
            goto done;
        }
        if ((nspans = parse_spans(spans, ncrc, span_of, func)) < 0)
            goto done;
        if (views_init(&vs, ncrc) < 0 || get_views(&vs, cfast, 0, func, "crc buffer") < 0)
            goto done;
    }
    crcs = PyMem_Calloc(nspans ? (size_t)nspans : 1, sizeof(uint32_t));
    if (!crcs) {
        PyErr_NoMemory();
        goto done;
    }

    /* A small batch first tries one round holding the GIL: over shared memory it is usually
       done by then, and owes no return of the GIL. The mutex only if free at once: its
       holder may be waiting for the GIL we hold. */
    int finished = 0;
    if (try_first && PyThread_acquire_lock(mutex->lock, NOWAIT_LOCK)) {
        mutex->locked = 1;
        if (crc_first)
            span_crcs(&vs, span_of, crcs);
        (void)ucp_round(&w);
        mutex_give(mutex);
        finished = w.failure != UCS_OK || !w.n;
        if (finished && w.failure == UCS_OK && !crc_first)
            span_crcs(&vs, span_of, crcs);
    }
    if (!finished) {
        /* A get's CRC pass comes last: its tail overlaps the GIL's return. */
        size_t crc_bytes = 0;
        for (Py_ssize_t i = 0; i < vs.n; i++)
            if (span_of[i] >= 0)
                crc_bytes += (size_t)vs.v[i].len;
        int64_t interval_ns = crc_first || crc_bytes < HANDOFF_MIN ? 0 : switch_interval_ns();
        PyThreadState *ts;
        RELEASE_GIL(ts);
        if (crc_first && !try_first) /* a put: the sources' CRCs while posted puts move */
            span_crcs(&vs, span_of, crcs);
        for (;;) {
            mutex_take(mutex);
            int armed = ucp_round(&w);
            mutex_give(mutex);
            if (w.failure != UCS_OK || !w.n)
                break;
            if (armed) {
                struct pollfd p = {.fd = efd, .events = POLLIN};
                (void)poll(&p, 1, idle_ms); /* EINTR: the next round checks the deadline */
            }
        }
        if (w.failure == UCS_OK && !crc_first) {
            BatchJob job = {vs.v, span_of, crcs, vs.n, JOB_CRC, 0, 0};
            run_then_take_gil(&job, crc_bytes, interval_ns, &ts);
        } else {
            TAKE_GIL(ts);
        }
    }
    PyObject *left = request_list(w.requests, w.n);
    PyObject *crc_out = left ? crc_list(crcs, w.failure == UCS_OK ? nspans : 0) : NULL;
    if (left && crc_out)
        result = Py_BuildValue("(iNN)", w.failure, left, crc_out);
    else {
        Py_XDECREF(left);
        Py_XDECREF(crc_out);
    }
done:
    views_release(&vs);
    PyMem_Free(w.requests);
    PyMem_Free(span_of);
    PyMem_Free(crcs);
    Py_XDECREF(cfast);
    Py_DECREF(rfast);
    return result;
}

static PyObject *py_gil_reacquisitions(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(reacquired);
}

static PyObject *py_gil_handoffs(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(handed_off);
}

/* -- module --------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(data, value=0, /) -> int: CRC32C of one buffer, continuing from value."},
    {"pack_headers", py_pack_headers, METH_VARARGS,
     "pack_headers(keys, versions, lengths, crcs, /) -> bytes: record headers, back to back."},
    {"crc32c_many", (PyCFunction)(void (*)(void))py_crc32c_many, METH_VARARGS | METH_KEYWORDS,
     "crc32c_many(values, initial=None) -> list[int]: one CRC32C per value (a buffer or a "
     "sequence of pieces)."},
    {"copy_many", (PyCFunction)(void (*)(void))py_copy_many, METH_VARARGS | METH_KEYWORDS,
     "copy_many(pairs, crc_spans=None, crc_of_source=False) -> list[int]: copy each (dest, "
     "src); CRC32C per span."},
    {"prefault", (PyCFunction)(void (*)(void))py_prefault, METH_VARARGS | METH_KEYWORDS,
     "prefault(buffer, write=True, force_touch=False) -> bool: fault in every page of buffer."},
    {"send_all", (PyCFunction)(void (*)(void))py_send_all, METH_VARARGS | METH_KEYWORDS,
     "send_all(fd, buffers, deadline) -> int: send every buffer in order."},
    {"serve_reads", (PyCFunction)(void (*)(void))py_serve_reads, METH_VARARGS | METH_KEYWORDS,
     "serve_reads(fd, regions, counters, idle_since, header, idle_timeout, frame_timeout, "
     "max_batch_bytes) -> (rc, errno): serve small READ frames until Python is needed."},
    {"send_checksummed", (PyCFunction)(void (*)(void))py_send_checksummed,
     METH_VARARGS | METH_KEYWORDS,
     "send_checksummed(fd, buffers, deadline, crc_spans) -> list[int]: send every buffer in "
     "order, with the CRC32C of each span of them."},
    {"recv_into_all", (PyCFunction)(void (*)(void))py_recv_into_all,
     METH_VARARGS | METH_KEYWORDS,
     "recv_into_all(fd, buffers, deadline, crc_spans=None) -> list[int]: fill every buffer."},
    {"request_reply_lanes", (PyCFunction)(void (*)(void))py_request_reply_lanes,
     METH_VARARGS | METH_KEYWORDS,
     "request_reply_lanes(lanes, deadline, busy_poll=0): request_reply on each lane's socket "
     "at once."},
    {"request_reply", (PyCFunction)(void (*)(void))py_request_reply, METH_VARARGS | METH_KEYWORDS,
     "request_reply(fd, request, reply, payloads, deadline, status_offset=0, crc_spans=None, "
     "busy_poll=0.0, hold_gil=0.0) -> list[int]: send, receive the reply, then the payloads "
     "it accepts."},
    {"ucp_post", (PyCFunction)(void (*)(void))py_ucp_post, METH_VARARGS | METH_KEYWORDS,
     "ucp_post(rma, flush, ep, param, buffers, remote, put) -> (status, requests): post a "
     "batch of libucp gets or puts (and a flush after puts), keeping the GIL."},
    {"ucp_wait", (PyCFunction)(void (*)(void))py_ucp_wait, METH_VARARGS | METH_KEYWORDS,
     "ucp_wait(fns, worker, efd, requests, mutex, deadline, spins, idle_ms, crc_buffers=None, "
     "crc_spans=None, crc_first=False, try_first=False) -> (status, pending, crcs): progress "
     "until done."},
    {"gil_reacquisitions", py_gil_reacquisitions, METH_NOARGS,
     "gil_reacquisitions() -> int: times this module took the GIL back, in this thread."},
    {"gil_handoffs", py_gil_handoffs, METH_NOARGS,
     "gil_handoffs() -> int: batches (copies, a ucx get's CRCs) this thread ended on a "
     "helper thread while it took the GIL back."},
    {"crc32c_with", py_crc32c_with, METH_VARARGS,
     "crc32c_with(pass, data, value=0, /) -> int: crc32c through a named pass."},
    {"copy_crc32c_with", py_copy_crc32c_with, METH_VARARGS,
     "copy_crc32c_with(pass, dest, src, value=0, /) -> int: one copy and its crc32c through a "
     "named pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvfabric._runtime._native",
    .m_doc = "Batch operations that take the GIL back once per batch (see kvfabric._runtime.native).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    kvf_crc32c_init();
    iov_max = kvf_iov_max();
    if (PyType_Ready(&MutexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Mutex", (PyObject *)&MutexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PeerClosed = PyErr_NewExceptionWithDoc(
        "kvfabric._runtime._native.PeerClosed",
        "The peer closed the connection before every byte arrived; `received` says how many "
        "did (in this call).",
        PyExc_ConnectionError, NULL);
    if (!PeerClosed || PyModule_AddObjectRef(m, "PeerClosed", PeerClosed) < 0 ||
        PyModule_AddIntConstant(m, "GIL_RELEASE_MIN", GIL_RELEASE_MIN) < 0 ||
        PyModule_AddIntConstant(m, "IOV_MAX", (long)iov_max) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_PASS", kvf_crc32c_pass_name(kvf_crc32c_best())) <
            0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *passes = PyTuple_New(kvf_crc32c_best() + 1);
    for (int pass = 0; passes && pass <= kvf_crc32c_best(); pass++) {
        PyObject *name = PyUnicode_FromString(kvf_crc32c_pass_name(pass));
        if (!name)
            Py_CLEAR(passes);
        else
            PyTuple_SET_ITEM(passes, pass, name);
    }
    int added = passes ? PyModule_AddObjectRef(m, "CRC32C_PASSES", passes) : -1;
    Py_XDECREF(passes);
    if (added < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
