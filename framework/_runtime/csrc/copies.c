/* copy_many: a batch of copies, with CRC32Cs of spans of them taken as the bytes move, in one
 * GIL release; and the batch runner it shares with ucp_wait's CRC pass, which hands a
 * large batch's tail to a helper thread while the caller waits for the GIL.
 */
#include "native.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>

#include "crc32c.h"

/* Without the CPU's CRC instruction, fused copy+CRC works in chunks this size, so the CRC
   reads what the copy just wrote from L2 rather than from memory. */
#define COPY_CHUNK (64 * 1024)
/* The unit a batch is handed over at: an item, or this much of a larger one. */
#define HANDOFF_CHUNK (1u << 20)

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
int64_t switch_interval_ns(void) {
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
   (5 ms by default), a sizeable part of a large batch's time (docs/performance.md). So once
   what is left should take no longer than that wait, the rest goes to a helper thread and
   this one asks for the GIL meanwhile: the wait and the batch's tail overlap. With no
   thread wanting the GIL this thread gets it at once and holds it while the helper
   finishes: about one switch interval at most, what any Python thread may hold it for.
   Batches below HANDOFF_MIN, and any whose helper cannot start, run here to the end. */
void run_then_take_gil(BatchJob *j, size_t total, int64_t interval_ns, PyThreadState **ts) {
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

/* Run `j`'s items on `threads` threads at once (the caller one of them), cut at span
   boundaries into parts of about equal bytes, with the GIL released by the caller; every
   part's stores are ordered before the caller's later ones by the joins. A part whose
   thread cannot start runs on the caller. */
static void run_parallel(BatchJob *j, size_t total, int threads) {
    enum { MAX_THREADS = 16 };
    BatchJob parts[MAX_THREADS];
    pthread_t helpers[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    size_t share = total / (size_t)threads, acc = 0;
    int count = 0;
    Py_ssize_t start = j->item;
    for (Py_ssize_t i = j->item; i < j->n && count < threads - 1; i++) {
        size_t len = (size_t)(j->kind == JOB_CRC ? j->v[i].len : j->v[2 * i + 1].len);
        acc += len;
        /* A span's CRC runs through its items in order: never cut inside one. */
        int cut_here = i + 1 < j->n && (j->span_of[i + 1] < 0 || j->span_of[i + 1] != j->span_of[i]);
        if (acc >= share * (size_t)(count + 1) && cut_here) {
            parts[count] = *j;
            parts[count].item = start;
            parts[count].at = 0;
            parts[count].n = i + 1;
            count++;
            start = i + 1;
        }
    }
    parts[count] = *j;
    parts[count].item = start;
    parts[count].at = 0;
    count++;
    sigset_t all, mask;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &mask);
    for (int t = 1; t < count; t++)
        started[t] = pthread_create(&helpers[t], NULL, run_thread, &parts[t]) == 0;
    pthread_sigmask(SIG_SETMASK, &mask, NULL);
    run_range(&parts[0]);
    for (int t = 1; t < count; t++) {
        if (started[t])
            pthread_join(helpers[t], NULL);
        else
            run_range(&parts[t]);
    }
    parallel_copies++;
}

PyObject *py_copy_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"pairs", "crc_spans", "crc_of_source", "threads", NULL};
    PyObject *pairs, *spans = Py_None;
    int of_source = 0, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|Opi:copy_many", kwlist, &pairs, &spans,
                                     &of_source, &threads))
        return NULL;
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "copy_many: threads must be at least 1");
        return NULL;
    }
    const char *func = "copy_many";
    PyObject *fast = PySequence_Fast(pairs, "copy_many: pairs must be a sequence of (dest, src)");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Views vs = {NULL, 0, 0};
    int32_t *span_of;
    uint32_t *crcs;
    PyObject *result = NULL;
    Py_ssize_t nspans = spans_new(spans, n, &span_of, &crcs, func);
    if (nspans < 0)
        goto done;
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
    } else if (threads > 1 && total >= PARALLEL_MIN && n > 1) {
        PyThreadState *ts;
        RELEASE_GIL(ts);
        run_parallel(&job, total, threads);
        TAKE_GIL(ts);
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
