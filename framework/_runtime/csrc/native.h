/* What the C files of kvfabric._runtime._native share (one extension module, a file per
 * job; module.c says which file holds what): the GIL's release and counted return and the
 * thresholds that decide them, buffers held as views, the arguments every call parses the
 * same way, the batch a helper thread may finish (copies.c), the socket calls' GIL
 * bookkeeping (sockets.c), the Mutex (mutex.c), and each file's Python functions, for
 * module.c's method table.
 *
 * Every declaration here is hidden: the extension exports PyInit__native and nothing of
 * this, and calls between its files bind directly, as calls inside one file do.
 */
#ifndef KVF_NATIVE_H
#define KVF_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <sys/uio.h>

#include "pythread.h"

#include "stream.h"

#pragma GCC visibility push(hidden)

/* -- the GIL -------------------------------------------------------------------------------- */

/* Batches below this many bytes keep the GIL: their work costs a busy neighbour less than
   the switch interval our return would wait out beside it. */
#define GIL_RELEASE_MIN (256 * 1024)
/* A batch of at least this many bytes (a copy, a ucx get's CRCs) ends on a helper thread
   while the calling thread waits for the GIL (run_then_take_gil); below it a thread's start
   costs more than the overlap can save. */
#define HANDOFF_MIN (8u << 20)
/* A copy_many batch this large may run on several threads (its `threads` argument). */
#define PARALLEL_MIN (32u << 20)

/* Per thread: times this module took the GIL back (gil_reacquisitions) and batches ended
   on a helper thread meanwhile (gil_handoffs). Defined in module.c. */
extern _Thread_local unsigned long long reacquired;
extern _Thread_local unsigned long long handed_off;
extern _Thread_local unsigned long long parallel_copies;

#define RELEASE_GIL(ts) ((ts) = PyEval_SaveThread())
#define TAKE_GIL(ts)                                                                         \
    do {                                                                                     \
        PyEval_RestoreThread(ts);                                                            \
        (ts) = NULL;                                                                         \
        reacquired++;                                                                        \
    } while (0)

/* -- buffers held as views (args.c) --------------------------------------------------------- */

typedef struct {
    Py_buffer *v;
    Py_ssize_t n;   /* acquired */
    Py_ssize_t cap; /* allocated */
} Views;

static inline int views_init(Views *vs, Py_ssize_t cap) {
    vs->n = 0;
    vs->cap = cap;
    vs->v = PyMem_Calloc(cap ? (size_t)cap : 1, sizeof(Py_buffer));
    if (!vs->v) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static inline void views_release(Views *vs) {
    for (Py_ssize_t i = 0; i < vs->n; i++)
        PyBuffer_Release(&vs->v[i]);
    PyMem_Free(vs->v);
    vs->v = NULL;
    vs->n = 0;
}

/* Take obj's buffer into the next free view; -1 with the exporter's error set. */
static inline int get_view(Views *vs, PyObject *obj, int writable) {
    if (PyObject_GetBuffer(obj, &vs->v[vs->n], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    vs->n++;
    return 0;
}

void name_error(const char *func, const char *where_fmt, ...);
int get_views(Views *vs, PyObject *fast, int writable, const char *func, const char *what);
int get_view_named(Views *vs, PyObject *obj, int writable, const char *func, const char *what);
int unpack2(PyObject *item, PyObject **a, PyObject **b, const char *what);

/* -- arguments (args.c) --------------------------------------------------------------------- */

Py_ssize_t parse_spans(PyObject *spans, Py_ssize_t count, int32_t *span_of, const char *func);
Py_ssize_t spans_new(PyObject *spans, Py_ssize_t count, int32_t **span_of, uint32_t **crcs,
                     const char *func);
PyObject *crc_list(const uint32_t *crcs, Py_ssize_t n);
int parse_deadline(PyObject *obj, int64_t *out);
int parse_busy_poll(double seconds, int64_t *out, const char *func);

/* -- a batch a helper thread may finish (copies.c) ------------------------------------------ */

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

int64_t switch_interval_ns(void);
void run_then_take_gil(BatchJob *j, size_t total, int64_t interval_ns, PyThreadState **ts);

/* -- socket calls (sockets.c), shared with exchange.c --------------------------------------- */

/* At most this many bytes per recvmsg when CRCs are asked, so the CRC reads what the
   kernel just wrote from cache. */
#define RECV_CRC_WINDOW (256 * 1024)
#define SEND_CRC_WINDOW (1024 * 1024)

/* The exception a peer's early close raises, and this system's IOV_MAX (module.c). */
extern PyObject *PeerClosed;
extern size_t iov_max;

/* Where a socket call stands with the GIL: held (ts NULL) or released (ts saved). */
typedef struct {
    PyThreadState *ts;
    int try_first;      /* small call: try without waiting, GIL held, before releasing it */
    int64_t hold_ns;    /* a small call's waits with the GIL held, in all (request_reply) */
    int64_t hold_until; /* 0: no wait held yet */
} Gil;

struct iovec *iovecs_of(const Py_buffer *v, Py_ssize_t n);
int run_stream(kvf_stream *s, Gil *g);
void gil_end(Gil *g);
size_t total_len(const Py_buffer *v, Py_ssize_t n);
PyObject *stream_error(const char *func, int rc, const kvf_stream *s, uint64_t sent,
                       uint64_t received);
size_t scratch_entries(Py_ssize_t buffers);
void stream_init(kvf_stream *s, int fd, int sending, struct iovec *bufs, size_t count,
                 int64_t deadline_ns, struct iovec *scratch, size_t scratch_len);

/* -- the Mutex (mutex.c), taken by ucp.c ----------------------------------------------------- */

/* A mutex Python code and a native loop share: Python takes it as a context manager (the
   GIL released only when it has to wait), a native loop takes it with the GIL released.
   A threading.Lock cannot be taken outside the interpreter. */
typedef struct {
    PyObject_HEAD PyThread_type_lock lock;
    int locked;
} Mutex;

extern PyTypeObject MutexType;

/* Without the GIL. */
static inline void mutex_take(Mutex *m) {
    PyThread_acquire_lock(m->lock, WAIT_LOCK);
    m->locked = 1;
}

static inline void mutex_give(Mutex *m) {
    m->locked = 0;
    PyThread_release_lock(m->lock);
}

/* -- each file's Python functions, for module.c's method table ------------------------------- */

/* crc_batch.c */
PyObject *py_crc32c(PyObject *self, PyObject *args);
PyObject *py_crc32c_with(PyObject *self, PyObject *args);
PyObject *py_copy_crc32c_with(PyObject *self, PyObject *args);
PyObject *py_crc32c_many(PyObject *self, PyObject *args, PyObject *kwargs);
/* headers.c */
PyObject *py_pack_headers(PyObject *self, PyObject *args);
/* copies.c */
PyObject *py_copy_many(PyObject *self, PyObject *args, PyObject *kwargs);
/* sockets.c */
PyObject *py_send_all(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_send_checksummed(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_recv_into_all(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_serve_reads(PyObject *self, PyObject *args, PyObject *kwargs);
/* exchange.c */
PyObject *py_request_reply(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_request_reply_lanes(PyObject *self, PyObject *args, PyObject *kwargs);
/* prefault.c */
PyObject *py_prefault(PyObject *self, PyObject *args, PyObject *kwargs);
/* ucp.c */
PyObject *py_ucp_post(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_ucp_wait(PyObject *self, PyObject *args, PyObject *kwargs);

#pragma GCC visibility pop

#endif
