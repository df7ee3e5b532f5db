/* The lookup image: the index's key -> descriptor hash table, read one-sided by clients.
 *
 * The layout is kvfabric.spi.image's (its docstring is the reference); in short, a 64-byte
 * header, then buckets of 64 bytes:
 *
 *   0 u32 seq       0: never written; odd while the owner rewrites the bucket
 *   4 u16 overflow  keys whose home is this bucket that fit in no window (saturating)
 *   6 u16 flags     bit 0: occupied
 *   8 8B  tag       key[8:16] (key[0:8] picks the home bucket)
 *  16 44B fields    node, region, offset, length, rkey, version, crc: the descriptor's wire
 *                   form after its key, byte for byte
 *  60 u32 check     CRC32C of bytes 0..60 (the sequence number included)
 *
 * One writer (the index owner, under its lock) rewrites a bucket as a seqlock: odd sequence
 * number, the bytes, then the next even number. A reader of live memory (the same host's
 * mapping) takes the number before and after its copy; a reader of a landed copy (tcp, ucx)
 * has only the copy. Either way a bucket counts only if its number is even (and unchanged)
 * and its check holds, so a torn or half-written bucket is "unknown", never a hit and
 * never a miss.
 *
 * Probes keep the GIL: a window is 512 bytes, so even 1,024 keys are ~50 us of work, less
 * than the switch interval a return of the GIL would wait out beside a busy thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "crc32c.h"

#define HEADER 64
#define BUCKET 64
#define CHECKED 60
#define FORMAT 1
#define KEY 32
#define WIRE 76 /* a descriptor's wire form: the key, then FIELDS bytes */
#define FIELDS 44
#define FIELDS_AT 16
#define TAG_AT 8
#define OCCUPIED 1
#define MAX_WINDOW 64
#define MAX_LOG2 40
/* How many keys ahead a probe asks the CPU to fetch windows: their cache misses overlap. */
#define PREFETCH_AHEAD 8

enum { MISS = 0, HIT = 1, UNKNOWN = 2, UNUSABLE = 3 };
enum { EMPTY = 0, FULL = 1, TORN = 2 };

static uint16_t get16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static uint32_t get32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static uint64_t get64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* -- header ------------------------------------------------------------------------------ */

typedef struct {
    uint64_t id;
    uint32_t log2;
    uint32_t window;
    Py_ssize_t size; /* bytes of a whole image: header and N + window - 1 buckets */
} Geometry;

/* The header's check skips the heartbeat (bytes 24..32), which the owner restamps. */
static uint32_t header_check(const uint8_t *h) {
    return kvf_crc32c(kvf_crc32c(0, h, 24), h + 32, 28);
}

static int parse_header(const uint8_t *h, Geometry *g) {
    if (memcmp(h, "KVFI", 4) != 0 || get16(h + 4) != FORMAT || get16(h + 6) != BUCKET)
        return -1;
    g->window = get32(h + 8);
    g->log2 = get32(h + 12);
    g->id = get64(h + 16);
    if (g->window < 1 || g->window > MAX_WINDOW || g->log2 > MAX_LOG2 ||
        get32(h + 60) != header_check(h))
        return -1;
    g->size = HEADER + (Py_ssize_t)(((uint64_t)1 << g->log2) + g->window - 1) * BUCKET;
    return 0;
}

/* -- buckets ----------------------------------------------------------------------------- */

/* Copy bucket `b` into `copy`; with `live` (memory another process may be writing) the
   sequence number is read before and after, and a change makes the copy torn. */
static uint32_t copy_bucket(const uint8_t *b, uint8_t *copy, int live) {
    if (!live) {
        memcpy(copy, b, BUCKET);
        return get32(copy);
    }
    uint32_t before = __atomic_load_n((const uint32_t *)b, __ATOMIC_ACQUIRE);
    memcpy(copy, b, BUCKET);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint32_t after = __atomic_load_n((const uint32_t *)b, __ATOMIC_RELAXED);
    return before == after ? before : 1; /* odd: torn */
}

static int bucket_state(const uint8_t *copy, uint32_t seq) {
    if (seq == 0) {
        /* Never written (a fresh page of the image): valid only if wholly zero. */
        for (int i = 0; i < BUCKET; i++)
            if (copy[i])
                return TORN;
        return EMPTY;
    }
    if ((seq & 1) || get32(copy) != seq || kvf_crc32c(0, copy, CHECKED) != get32(copy + CHECKED))
        return TORN;
    return (get16(copy + 6) & OCCUPIED) ? FULL : EMPTY;
}

/* One key against its window: HIT (fields copied out), MISS or UNKNOWN. A hit needs only
   its own bucket to be whole; a miss needs every bucket of the window whole, none holding
   the key, and no key of this home that overflowed. */
static int probe(const uint8_t *window, uint32_t w, const uint8_t *key, int live,
                 uint8_t *fields) {
    uint64_t tag = get64(key + TAG_AT);
    int whole = 1;
    uint8_t copy[BUCKET];
    for (uint32_t i = 0; i < w; i++) {
        uint32_t seq = copy_bucket(window + (size_t)i * BUCKET, copy, live);
        int state = bucket_state(copy, seq);
        if (state == TORN) {
            whole = 0;
            continue;
        }
        if (i == 0 && get16(copy + 4) != 0)
            whole = 0; /* a key of this home may be outside the image */
        if (state == FULL && get64(copy + TAG_AT) == tag) {
            memcpy(fields, copy + FIELDS_AT, FIELDS);
            return HIT;
        }
    }
    return whole ? MISS : UNKNOWN;
}

/* -- arguments shared by the probes ------------------------------------------------------ */

typedef struct {
    Py_buffer image;
    Py_buffer positions;
    int has_positions;
    PyObject *keys; /* PySequence_Fast */
    Py_ssize_t n;
    Geometry g;
    int live;
} Probe;

static void probe_release(Probe *p) {
    PyBuffer_Release(&p->image);
    if (p->has_positions)
        PyBuffer_Release(&p->positions);
    Py_XDECREF(p->keys);
}

static int check_keys(PyObject *fast, const char *func) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != KEY) {
            PyErr_Format(PyExc_TypeError, "%s: key %zd is not %d bytes", func, i, KEY);
            return -1;
        }
    return 0;
}

/* Parse (image, keys, image_id, positions, max_age). Returns 0, 1 when the image is not
   usable (wrong id, bad header, stale heartbeat: every key is unknown), -1 on error. */
static int probe_args(PyObject *args, Probe *p, const char *func) {
    PyObject *keys, *positions;
    unsigned long long id;
    double max_age;
    memset(p, 0, sizeof *p);
    if (!PyArg_ParseTuple(args, "y*OKOd", &p->image, &keys, &id, &positions, &max_age))
        return -1;
    p->keys = PySequence_Fast(keys, "keys must be a sequence of 32-byte keys");
    if (!p->keys)
        return -1;
    if (check_keys(p->keys, func) < 0)
        return -1;
    p->n = PySequence_Fast_GET_SIZE(p->keys);
    if (positions != Py_None) {
        if (PyObject_GetBuffer(positions, &p->positions, PyBUF_SIMPLE) < 0)
            return -1;
        p->has_positions = 1;
        if (p->positions.len != p->n * 8) {
            PyErr_Format(PyExc_ValueError, "%s: positions holds %zd bytes for %zd keys", func,
                         p->positions.len, p->n);
            return -1;
        }
    }
    /* Live memory (a mapping the owner writes) is read under the seqlock; a landed copy
       is read as it is. */
    p->live = !p->has_positions;
    const uint8_t *base = p->image.buf;
    if (p->image.len < HEADER || parse_header(base, &p->g) < 0 || p->g.id != id)
        return 1;
    Py_ssize_t span = (Py_ssize_t)p->g.window * BUCKET;
    if (p->has_positions) {
        const uint8_t *pos = p->positions.buf;
        for (Py_ssize_t i = 0; i < p->n; i++) {
            uint64_t at = get64(pos + 8 * i);
            if (at > (uint64_t)p->image.len || (uint64_t)p->image.len - at < (uint64_t)span) {
                PyErr_Format(PyExc_ValueError, "%s: window of key %zd lies outside the buffer",
                             func, i);
                return -1;
            }
        }
    } else if (p->image.len < p->g.size) {
        return 1;
    }
    if (max_age > 0) {
        uint64_t beat = p->live ? __atomic_load_n((const uint64_t *)(base + 24), __ATOMIC_ACQUIRE)
                                : get64(base + 24);
        uint64_t now = now_ns();
        /* 0: the owner closed the image. Older than max_age: the owner stopped. */
        if (beat == 0 || (now > beat && (double)(now - beat) > max_age * 1e9))
            return 1;
    }
    return 0;
}

static const uint8_t *window_of(const Probe *p, Py_ssize_t i, const uint8_t *key) {
    const uint8_t *base = p->image.buf;
    if (p->has_positions)
        return base + get64((const uint8_t *)p->positions.buf + 8 * i);
    uint64_t home = get64(key) & (((uint64_t)1 << p->g.log2) - 1);
    return base + HEADER + home * BUCKET;
}

static const uint8_t *key_at(const Probe *p, Py_ssize_t i) {
    return (const uint8_t *)PyBytes_AS_STRING(PySequence_Fast_GET_ITEM(p->keys, i));
}

static void prefetch_window(const Probe *p, Py_ssize_t i) {
    if (i >= p->n)
        return;
    /* A key mostly sits in the first bucket or two of its window. */
    const uint8_t *w = window_of(p, i, key_at(p, i));
    __builtin_prefetch(w);
    __builtin_prefetch(w + BUCKET);
}

/* -- the probes -------------------------------------------------------------------------- */

static PyObject *kvf_image_prefix(PyObject *self, PyObject *args) {
    Probe p;
    int rc = probe_args(args, &p, "image_prefix");
    if (rc < 0) {
        probe_release(&p);
        return NULL;
    }
    if (rc == 1) {
        probe_release(&p);
        return Py_BuildValue("(niy#)", (Py_ssize_t)0, UNUSABLE, "", (Py_ssize_t)0);
    }
    PyObject *wires = PyBytes_FromStringAndSize(NULL, p.n * WIRE);
    if (!wires) {
        probe_release(&p);
        return NULL;
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(wires);
    Py_ssize_t hits = 0;
    int stop = HIT;
    for (Py_ssize_t i = 0; i < PREFETCH_AHEAD; i++)
        prefetch_window(&p, i);
    for (Py_ssize_t i = 0; i < p.n; i++) {
        prefetch_window(&p, i + PREFETCH_AHEAD);
        const uint8_t *key = key_at(&p, i);
        uint8_t *wire = out + hits * WIRE;
        int state = probe(window_of(&p, i, key), p.g.window, key, p.live, wire + KEY);
        if (state != HIT) {
            stop = state;
            break;
        }
        memcpy(wire, key, KEY);
        hits++;
    }
    probe_release(&p);
    if (hits != p.n && _PyBytes_Resize(&wires, hits * WIRE) < 0)
        return NULL;
    return Py_BuildValue("(niN)", hits, stop, wires);
}

static PyObject *kvf_image_exists(PyObject *self, PyObject *args) {
    Probe p;
    int rc = probe_args(args, &p, "image_exists");
    if (rc < 0) {
        probe_release(&p);
        return NULL;
    }
    PyObject *states = PyBytes_FromStringAndSize(NULL, p.n);
    if (!states) {
        probe_release(&p);
        return NULL;
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(states);
    if (rc == 1) {
        memset(out, UNKNOWN, (size_t)p.n);
    } else {
        uint8_t fields[FIELDS];
        for (Py_ssize_t i = 0; i < PREFETCH_AHEAD; i++)
            prefetch_window(&p, i);
        for (Py_ssize_t i = 0; i < p.n; i++) {
            prefetch_window(&p, i + PREFETCH_AHEAD);
            const uint8_t *key = key_at(&p, i);
            out[i] = (uint8_t)probe(window_of(&p, i, key), p.g.window, key, p.live, fields);
        }
    }
    probe_release(&p);
    return Py_BuildValue("(OO)", rc == 1 ? Py_False : Py_True, states);
}

/* -- planning a remote read -------------------------------------------------------------- */

typedef struct {
    uint64_t at;
    Py_ssize_t key;
} Window;

static int by_offset(const void *a, const void *b) {
    uint64_t x = ((const Window *)a)->at, y = ((const Window *)b)->at;
    return (x > y) - (x < y);
}

/* The byte ranges of the image a remote probe must land: the header, then every key's
   window, sorted, with windows that overlap or lie within one window of each other merged
   (a few extra buckets cost less than a segment). `positions` gives each key's window in
   the landing buffer, where the ranges are laid end to end in order. */
static PyObject *kvf_image_windows(PyObject *self, PyObject *args) {
    PyObject *keys;
    unsigned int log2, w;
    if (!PyArg_ParseTuple(args, "OII", &keys, &log2, &w))
        return NULL;
    if (w < 1 || w > MAX_WINDOW || log2 > MAX_LOG2) {
        PyErr_SetString(PyExc_ValueError, "image_windows: bad geometry");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence of 32-byte keys");
    if (!fast)
        return NULL;
    PyObject *ranges = NULL, *positions = NULL, *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Window *order = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Window));
    uint64_t *spans = PyMem_Malloc((size_t)(2 * n + 2) * sizeof(uint64_t));
    if (!order || !spans) {
        PyErr_NoMemory();
        goto done;
    }
    if (check_keys(fast, "image_windows") < 0)
        goto done;
    uint64_t mask = ((uint64_t)1 << log2) - 1, span = (uint64_t)w * BUCKET;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(PySequence_Fast_GET_ITEM(fast, i));
        order[i].at = HEADER + (get64(key) & mask) * BUCKET;
        order[i].key = i;
    }
    qsort(order, (size_t)n, sizeof(Window), by_offset);
    positions = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!positions)
        goto done;
    uint8_t *pos = (uint8_t *)PyBytes_AS_STRING(positions);
    /* Range 0 is the header; the current range is [start, end) of the image, landing at
       `landed` in the buffer. */
    Py_ssize_t count = 0;
    uint64_t start = 0, end = HEADER, landed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t at = order[i].at;
        if (at > end + span) {
            spans[2 * count] = start;
            spans[2 * count + 1] = end - start;
            count++;
            landed += end - start;
            start = at;
            end = at;
        }
        if (at + span > end)
            end = at + span;
        uint64_t where = landed + (at - start);
        memcpy(pos + 8 * order[i].key, &where, 8);
    }
    spans[2 * count] = start;
    spans[2 * count + 1] = end - start;
    count++;
    ranges = PyBytes_FromStringAndSize((const char *)spans, count * 16);
    if (ranges)
        result = PyTuple_Pack(2, ranges, positions);
done:
    Py_XDECREF(ranges);
    Py_XDECREF(positions);
    PyMem_Free(order);
    PyMem_Free(spans);
    Py_DECREF(fast);
    return result;
}

/* -- the writer -------------------------------------------------------------------------- */

/* image_store(image, bucket, wire, overflow): rewrite bucket `bucket`. `wire`: a
   descriptor's 76-byte wire form (the bucket then holds it), b"" (empty), or None (keep what
   it holds). `overflow`: the count to store, or -1 to keep it. */
static PyObject *kvf_image_store(PyObject *self, PyObject *args) {
    Py_buffer image;
    unsigned long long bucket;
    PyObject *wire;
    int overflow;
    if (!PyArg_ParseTuple(args, "w*KOi", &image, &bucket, &wire, &overflow))
        return NULL;
    PyObject *result = NULL;
    if (wire != Py_None &&
        (!PyBytes_Check(wire) || (PyBytes_GET_SIZE(wire) != WIRE && PyBytes_GET_SIZE(wire)))) {
        PyErr_SetString(PyExc_ValueError, "image_store: wire is a 76-byte descriptor, b\"\" or None");
        goto done;
    }
    if (image.len < HEADER || bucket >= (uint64_t)(image.len - HEADER) / BUCKET) {
        PyErr_Format(PyExc_IndexError, "image_store: bucket %llu is outside the image", bucket);
        goto done;
    }
    uint8_t *b = (uint8_t *)image.buf + HEADER + bucket * BUCKET;
    uint8_t next[BUCKET];
    memcpy(next, b, BUCKET);
    uint32_t seq = get32(next);
    uint32_t odd = (seq & 1u) ? seq : seq + 1u;
    uint32_t even = odd + 1u;
    if (even == 0u) { /* 0 means "never written": wrap past it */
        odd = 1u;
        even = 2u;
    }
    if (wire != Py_None) {
        const uint8_t *src = (const uint8_t *)PyBytes_AS_STRING(wire);
        uint16_t flags = get16(next + 6) & (uint16_t)~OCCUPIED;
        if (PyBytes_GET_SIZE(wire)) {
            memcpy(next + TAG_AT, src + TAG_AT, 8);
            memcpy(next + FIELDS_AT, src + KEY, FIELDS);
            flags |= OCCUPIED;
        } else {
            memset(next + TAG_AT, 0, 8 + FIELDS);
        }
        memcpy(next + 6, &flags, 2);
    }
    if (overflow >= 0) {
        uint16_t count = overflow > 0xFFFF ? 0xFFFF : (uint16_t)overflow;
        memcpy(next + 4, &count, 2);
    }
    put32(next, even);
    put32(next + CHECKED, kvf_crc32c(0, next, CHECKED));
    /* The odd number is visible before any byte changes, the even one after all of them. */
    __atomic_store_n((uint32_t *)b, odd, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy(b + 4, next + 4, BUCKET - 4);
    __atomic_store_n((uint32_t *)b, even, __ATOMIC_RELEASE);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&image);
    return result;
}

/* image_beat(image, alive): the owner's heartbeat, CLOCK_MONOTONIC nanoseconds (0: closed),
   which same-host readers compare with their own clock (the same clock on one host). */
static PyObject *kvf_image_beat(PyObject *self, PyObject *args) {
    Py_buffer image;
    int alive;
    if (!PyArg_ParseTuple(args, "w*p", &image, &alive))
        return NULL;
    if (image.len < HEADER) {
        PyBuffer_Release(&image);
        PyErr_SetString(PyExc_ValueError, "image_beat: not an image");
        return NULL;
    }
    __atomic_store_n((uint64_t *)((uint8_t *)image.buf + 24), alive ? now_ns() : 0,
                     __ATOMIC_RELEASE);
    PyBuffer_Release(&image);
    Py_RETURN_NONE;
}

/* -- module ------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"image_store", kvf_image_store, METH_VARARGS,
     "image_store(image, bucket, wire, overflow, /): rewrite one bucket under its seqlock."},
    {"image_beat", kvf_image_beat, METH_VARARGS,
     "image_beat(image, alive, /): stamp the header's heartbeat (0: closed)."},
    {"image_prefix", kvf_image_prefix, METH_VARARGS,
     "image_prefix(image, keys, image_id, positions, max_age, /) -> (hits, stop, wires)"},
    {"image_exists", kvf_image_exists, METH_VARARGS,
     "image_exists(image, keys, image_id, positions, max_age, /) -> (usable, states)"},
    {"image_windows", kvf_image_windows, METH_VARARGS,
     "image_windows(keys, log2_buckets, window, /) -> (ranges, positions)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvfabric.spi._image",
    .m_doc = "The lookup image's bucket writer and probes (see kvfabric.spi.image).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__image(void) {
    kvf_crc32c_init();
    return PyModule_Create(&module);
}
