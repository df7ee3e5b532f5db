/* ucp_post and ucp_wait: the ucx transport's per-batch loops over libucp.
 *
 * libucp is loaded by the transport (cffi, ABI mode) and its functions come here as
 * addresses, so this module neither links nor needs UCX. Each cffi call releases the GIL,
 * and one taken back beside a busy Python thread waits out the switch interval: a batch
 * posted, progressed and checked through cffi took it back many times over. Here posting
 * keeps the GIL (nothing in it waits) and the whole wait, with the CRCs, releases it once.
 */
#include "native.h"

#include <poll.h>

#include "crc32c.h"

/* Signatures as in ucp/api/ucp.h (ucs_status_t is one byte). */
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

PyObject *py_ucp_post(PyObject *self, PyObject *args, PyObject *kwargs) {
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

PyObject *py_ucp_wait(PyObject *self, PyObject *args, PyObject *kwargs) {
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
        if ((nspans = spans_new(spans, ncrc, &span_of, &crcs, func)) < 0)
            goto done;
        if (views_init(&vs, ncrc) < 0 || get_views(&vs, cfast, 0, func, "crc buffer") < 0)
            goto done;
    }
    /* Without crc_buffers there is no span to fill or return: span_of and crcs stay NULL. */

    /* A small batch first tries one round holding the GIL: over shared memory it is usually
       done by then, and owes no return of the GIL. The mutex only if free at once: its
       holder may be waiting for the GIL we hold. */
    int finished = 0;
    /* A put's CRCs are taken once, here or below: the try may not run (another thread
       holds the mutex), and then the wait below must take them. */
    int crcs_taken = 0;
    if (try_first && PyThread_acquire_lock(mutex->lock, NOWAIT_LOCK)) {
        mutex->locked = 1;
        if (crc_first) {
            span_crcs(&vs, span_of, crcs);
            crcs_taken = 1;
        }
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
        if (crc_first && !crcs_taken) /* a put: the sources' CRCs while posted puts move */
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
