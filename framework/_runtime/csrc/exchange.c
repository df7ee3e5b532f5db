/* request_reply: one request and its reply on one socket, then the payloads the reply
 * accepts, with their CRC32Cs, in one GIL release (a tcp client's frame); and
 * request_reply_lanes: several of them at once, each on its own connection, one on the
 * calling thread and each other on a helper thread.
 */
#include "native.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>

/* The most a small request_reply may wait for its reply with the GIL held (hold_gil): a
   longer hold would cost other threads more than the switch interval it saves. */
#define HOLD_GIL_MAX 0.001

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
    x->nspans = spans_new(spans, x->npay, &x->span_of, &x->crcs, func);
    if (x->nspans < 0)
        goto fail;
    x->gated_span_of = PyMem_Calloc((size_t)x->npay + 1, sizeof(int32_t));
    if (!x->gated_span_of) {
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

PyObject *py_request_reply(PyObject *self, PyObject *args, PyObject *kwargs) {
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
   Why: over loopback a node's reply is paced by its sending thread (which also runs the
   kernel's receive path), so two connections move a large read faster than one
   (docs/performance.md). */
#define LANES_MAX 8

static void *run_lane(void *lane) {
    exchange_run((Exchange *)lane, NULL);
    return NULL;
}

PyObject *py_request_reply_lanes(PyObject *self, PyObject *args, PyObject *kwargs) {
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
