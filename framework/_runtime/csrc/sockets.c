/* Socket calls from Python: send_all, send_checksummed and recv_into_all (every buffer one
 * way, CRCs taken window by window as the bytes move) and serve_reads (a tcp node's
 * connection served in C until Python is needed, serve.h); and what request_reply
 * (exchange.c) shares with them: how a call holds, releases and takes back the GIL around a
 * kvf_stream (stream.h), and the errors a stream ends with.
 */
#include "native.h"

#include <poll.h>
#include <string.h>
#include <time.h>

#include "serve.h"

/* The iovecs of a run of views. */
struct iovec *iovecs_of(const Py_buffer *v, Py_ssize_t n) {
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
int run_stream(kvf_stream *s, Gil *g) {
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

void gil_end(Gil *g) {
    if (g->ts)
        TAKE_GIL(g->ts);
}

size_t total_len(const Py_buffer *v, Py_ssize_t n) {
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
PyObject *stream_error(const char *func, int rc, const kvf_stream *s, uint64_t sent,
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
   waiting for a frame's table would hold 16 MiB of them. */
size_t scratch_entries(Py_ssize_t buffers) {
    size_t n = buffers > 0 ? (size_t)buffers : 1;
    return n < iov_max ? n : iov_max;
}

void stream_init(kvf_stream *s, int fd, int sending, struct iovec *bufs, size_t count,
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
    int32_t *span_of;
    uint32_t *crcs;
    PyObject *result = NULL;
    Py_ssize_t nspans = spans_new(spans, n, &span_of, &crcs, func);
    if (nspans < 0)
        goto done;
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

PyObject *py_send_all(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd", "buffers", "deadline", NULL};
    PyObject *fd_obj, *buffers, *deadline_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:send_all", kwlist, &fd_obj, &buffers,
                                     &deadline_obj))
        return NULL;
    return move_buffers(fd_obj, buffers, deadline_obj, NULL, 1, "send_all");
}

PyObject *py_send_checksummed(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd", "buffers", "deadline", "crc_spans", NULL};
    PyObject *fd_obj, *buffers, *deadline_obj, *spans;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:send_checksummed", kwlist, &fd_obj,
                                     &buffers, &deadline_obj, &spans))
        return NULL;
    return move_buffers(fd_obj, buffers, deadline_obj, spans, 1, "send_checksummed");
}

PyObject *py_recv_into_all(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"fd", "buffers", "deadline", "crc_spans", NULL};
    PyObject *fd_obj, *buffers, *deadline_obj, *spans = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:recv_into_all", kwlist, &fd_obj,
                                     &buffers, &deadline_obj, &spans))
        return NULL;
    return move_buffers(fd_obj, buffers, deadline_obj, spans, 0, "recv_into_all");
}

/* serve_reads: a tcp node's connection served in C until Python is needed (serve.h). */
PyObject *py_serve_reads(PyObject *self, PyObject *args, PyObject *kwargs) {
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
