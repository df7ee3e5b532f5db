/* The lookup image: the index's key -> descriptor hash table, read one-sided by clients.
 *
 * The layout is kvfabric._runtime.image's (its docstring is the reference); in short, a 64-byte
 * header, then buckets of 64 bytes, then a ring of 96-byte entries logging every bucket
 * rewrite (remote clients keep a mirror of the buckets and read only what changed):
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
 * number, the bytes, then the next even number, and then logs the new bytes in the ring. A
 * probe takes the number before and after its copy of a bucket (of the image itself, on its
 * host, or of a client's mirror), and a bucket counts only if its number is even and
 * unchanged and, in a mirror (checksums on), its check holds: a torn or half-written bucket
 * is "unknown", never a hit and never a miss. The owner's memory read in place needs no
 * check (the seqlock shows every torn read there); a mirror's bulk-copied buckets do. A
 * mirror takes only ring entries whose number and CRC hold.
 *
 * Probes and applies keep the GIL: a window is 512 bytes, so even a lookup of 1,024 keys
 * is less work than the switch interval a return of the GIL would wait out beside a busy
 * thread (docs/performance.md, "The lookup image").
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
#define PREFETCH_AHEAD 12

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
    Py_ssize_t size;    /* bytes of the header and the N + window - 1 buckets */
    uint32_t ring_log2; /* 0: no ring */
    uint64_t ring_at;   /* where the ring starts */
} Geometry;

#define ENTRY 96
#define MAX_RING_LOG2 32

/* The header's check skips the heartbeat and the ring's head (bytes 24..40), which the
   owner keeps rewriting. */
static uint32_t header_check(const uint8_t *h) {
    return kvf_crc32c(kvf_crc32c(0, h, 24), h + 40, 20);
}

static int parse_header(const uint8_t *h, Geometry *g) {
    if (memcmp(h, "KVFI", 4) != 0 || get16(h + 4) != FORMAT || get16(h + 6) != BUCKET)
        return -1;
    g->window = get32(h + 8);
    g->log2 = get32(h + 12);
    g->id = get64(h + 16);
    g->ring_log2 = get32(h + 40);
    g->ring_at = get64(h + 48);
    if (g->window < 1 || g->window > MAX_WINDOW || g->log2 > MAX_LOG2 ||
        g->ring_log2 > MAX_RING_LOG2 || get32(h + 60) != header_check(h))
        return -1;
    g->size = HEADER + (Py_ssize_t)(((uint64_t)1 << g->log2) + g->window - 1) * BUCKET;
    if (g->ring_log2 && (get32(h + 44) != ENTRY || g->ring_at < (uint64_t)g->size))
        return -1;
    return 0;
}

/* -- buckets ----------------------------------------------------------------------------- */

/* Copy bucket `b` into `copy`, reading its sequence number before and after (the owner, or
   a thread updating a mirror, may be rewriting it): a change makes the copy torn. */
static uint32_t copy_bucket(const uint8_t *b, uint8_t *copy) {
    uint32_t before = __atomic_load_n((const uint32_t *)b, __ATOMIC_ACQUIRE);
    memcpy(copy, b, BUCKET);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint32_t after = __atomic_load_n((const uint32_t *)b, __ATOMIC_RELAXED);
    return before == after ? before : 1; /* odd: torn */
}

static int bucket_state(const uint8_t *copy, uint32_t seq, int checksums) {
    if (seq == 0) {
        /* Never written (a fresh page of the image): valid only if wholly zero. */
        for (int i = 0; i < BUCKET; i++)
            if (copy[i])
                return TORN;
        return EMPTY;
    }
    if ((seq & 1) || get32(copy) != seq ||
        (checksums && kvf_crc32c(0, copy, CHECKED) != get32(copy + CHECKED)))
        return TORN;
    return (get16(copy + 6) & OCCUPIED) ? FULL : EMPTY;
}

/* A hit read straight out of the owner's memory under its seqlock (no copy, no checksum):
   the fields are copied out between the two reads of the sequence number, and count only
   if that number is even, nonzero and unchanged. 0 when the bucket was not a whole hit. */
static int seqlocked_hit(const uint8_t *b, uint64_t tag, uint8_t *fields) {
    uint32_t before = __atomic_load_n((const uint32_t *)b, __ATOMIC_ACQUIRE);
    uint16_t flags = get16(b + 6);
    uint64_t seen = get64(b + TAG_AT);
    memcpy(fields, b + FIELDS_AT, FIELDS);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint32_t after = __atomic_load_n((const uint32_t *)b, __ATOMIC_RELAXED);
    return before == after && before != 0 && !(before & 1) && (flags & OCCUPIED) && seen == tag;
}

/* One key against its window: HIT (fields copied out), MISS or UNKNOWN. A hit needs only
   its own bucket to be whole; a miss needs every bucket of the window whole, none holding
   the key, and no key of this home that overflowed. */
static int probe(const uint8_t *window, uint32_t w, const uint8_t *key, uint8_t *fields,
                 int checksums, const uint8_t **hit) {
    uint64_t tag = get64(key + TAG_AT);
    int whole = 1;
    uint8_t copy[BUCKET];
    /* Hits are the common case and need only their own bucket whole: find the tag with a
       plain look (it may be mid-rewrite), then read that bucket under its seqlock and check
       it. Anything else takes the full walk below. */
    for (uint32_t i = 0; i < w; i++) {
        const uint8_t *b = window + (size_t)i * BUCKET;
        if (get64(b + TAG_AT) != tag)
            continue;
        if (!checksums) {
            if (seqlocked_hit(b, tag, fields)) {
                *hit = b;
                return HIT;
            }
            break;
        }
        uint32_t seq = copy_bucket(b, copy);
        if (bucket_state(copy, seq, 1) == FULL && get64(copy + TAG_AT) == tag) {
            memcpy(fields, copy + FIELDS_AT, FIELDS);
            *hit = b;
            return HIT;
        }
        break;
    }
    for (uint32_t i = 0; i < w; i++) {
        const uint8_t *b = window + (size_t)i * BUCKET;
        uint32_t seq = copy_bucket(b, copy);
        int state = bucket_state(copy, seq, checksums);
        if (state == TORN) {
            whole = 0;
            continue;
        }
        if (i == 0 && get16(copy + 4) != 0)
            whole = 0; /* a key of this home may be outside the image */
        if (state == FULL && get64(copy + TAG_AT) == tag) {
            memcpy(fields, copy + FIELDS_AT, FIELDS);
            *hit = b;
            return HIT;
        }
    }
    return whole ? MISS : UNKNOWN;
}

/* -- arguments shared by the probes ------------------------------------------------------ */

typedef struct {
    Py_buffer image;
    int has_image;
    PyObject *keys; /* PySequence_Fast */
    Py_ssize_t n;
    Geometry g;
    int checksums; /* check each bucket's CRC (a mirror); else the seqlock alone (the owner's memory) */
    Py_buffer stamps; /* the owner's: one double per bucket, set to `now` by each hit */
    int has_stamps;
    double now;
} Probe;

static void probe_release(Probe *p) {
    if (p->has_image)
        PyBuffer_Release(&p->image);
    if (p->has_stamps)
        PyBuffer_Release(&p->stamps);
    Py_XDECREF(p->keys);
}

/* A hit in bucket `b`: its stamp is now (the owner's own probes, which count as uses).
   memcpy, not a double store: the caller's buffer need not be aligned. */
static inline void stamp_hit(Probe *p, const uint8_t *b) {
    if (p->has_stamps) {
        size_t bucket = (size_t)(b - ((const uint8_t *)p->image.buf + HEADER)) / BUCKET;
        memcpy((uint8_t *)p->stamps.buf + bucket * sizeof(double), &p->now, sizeof(double));
    }
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

/* Parse (image, keys, image_id, max_age[, checksums[, stamps, now]]). Returns 0, 1 when the
   image is not usable (another image, a bad header, a stale heartbeat: every key is unknown),
   -1 on error. */
static int probe_args(PyObject *args, Probe *p, const char *func) {
    PyObject *keys;
    unsigned long long id;
    double max_age;
    int checksums = 1;
    PyObject *stamps = Py_None;
    memset(p, 0, sizeof *p);
    if (!PyArg_ParseTuple(args, "y*OKd|pOd", &p->image, &keys, &id, &max_age, &checksums,
                          &stamps, &p->now))
        return -1;
    p->checksums = checksums;
    p->has_image = 1;
    if (stamps != Py_None) {
        if (PyObject_GetBuffer(stamps, &p->stamps, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        p->has_stamps = 1;
    }
    p->keys = PySequence_Fast(keys, "keys must be a sequence of 32-byte keys");
    if (!p->keys)
        return -1;
    p->n = PySequence_Fast_GET_SIZE(p->keys);
    /* The probes check each key as they reach it (one pass over the keys, not two); an
       image that cannot answer checks them all here, so a bad key raises either way. */
    const uint8_t *base = p->image.buf;
    if (p->image.len < HEADER || parse_header(base, &p->g) < 0 || p->g.id != id ||
        p->image.len < p->g.size)
        return check_keys(p->keys, func) < 0 ? -1 : 1;
    if (max_age > 0) {
        uint64_t beat = __atomic_load_n((const uint64_t *)(base + 24), __ATOMIC_ACQUIRE);
        uint64_t now = now_ns();
        /* 0: the owner closed the image. Older than max_age: the owner stopped. */
        if (beat == 0 || (now > beat && (double)(now - beat) > max_age * 1e9))
            return check_keys(p->keys, func) < 0 ? -1 : 1;
    }
    if (p->has_stamps) {
        Py_ssize_t buckets = (Py_ssize_t)(((uint64_t)1 << p->g.log2) + p->g.window - 1);
        if (p->stamps.len < buckets * (Py_ssize_t)sizeof(double)) {
            PyErr_Format(PyExc_ValueError,
                         "%s: stamps hold %zd bytes, the image's %zd buckets need %zd", func,
                         p->stamps.len, buckets, buckets * (Py_ssize_t)sizeof(double));
            return -1;
        }
    }
    return 0;
}

static const uint8_t *window_of(const Probe *p, const uint8_t *key) {
    uint64_t home = get64(key) & (((uint64_t)1 << p->g.log2) - 1);
    return (const uint8_t *)p->image.buf + HEADER + home * BUCKET;
}

/* Key i's bytes, or NULL when it is not 32 bytes. */
static const uint8_t *key_at(const Probe *p, Py_ssize_t i) {
    PyObject *item = PySequence_Fast_GET_ITEM(p->keys, i);
    if (!PyBytes_CheckExact(item) || PyBytes_GET_SIZE(item) != KEY)
        return NULL;
    return (const uint8_t *)PyBytes_AS_STRING(item);
}

static const uint8_t *key_or_raise(const Probe *p, Py_ssize_t i, const char *func) {
    const uint8_t *key = key_at(p, i);
    if (!key)
        PyErr_Format(PyExc_TypeError, "%s: key %zd is not %d bytes", func, i, KEY);
    return key;
}

static void prefetch_window(const Probe *p, Py_ssize_t i) {
    if (i >= p->n)
        return;
    const uint8_t *key = key_at(p, i);
    if (!key)
        return; /* the probe raises when it gets there */
    /* A key mostly sits in the first bucket or two of its window. */
    const uint8_t *w = window_of(p, key);
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
        const uint8_t *key = key_or_raise(&p, i, "image_prefix");
        if (!key) {
            probe_release(&p);
            Py_DECREF(wires);
            return NULL;
        }
        uint8_t *wire = out + hits * WIRE;
        const uint8_t *bucket = NULL;
        int state = probe(window_of(&p, key), p.g.window, key, wire + KEY, p.checksums, &bucket);
        if (state != HIT) {
            stop = state;
            break;
        }
        stamp_hit(&p, bucket);
        memcpy(wire, key, KEY);
        hits++;
    }
    /* A walk that stopped early has not seen every key: a bad one still raises. */
    if (hits != p.n && check_keys(p.keys, "image_prefix") < 0) {
        probe_release(&p);
        Py_DECREF(wires);
        return NULL;
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
            const uint8_t *key = key_or_raise(&p, i, "image_exists");
            if (!key) {
                probe_release(&p);
                Py_DECREF(states);
                return NULL;
            }
            const uint8_t *bucket = NULL;
            out[i] = (uint8_t)probe(window_of(&p, key), p.g.window, key, fields, p.checksums,
                                    &bucket);
            if (out[i] == HIT)
                stamp_hit(&p, bucket);
        }
    }
    probe_release(&p);
    return Py_BuildValue("(OO)", rc == 1 ? Py_False : Py_True, states);
}

/* -- the ring ---------------------------------------------------------------------------- */

/* A ring entry: u64 sequence number | u64 bucket | the bucket's 64 bytes | u64 sequence
   number again | u32 CRC32C of bytes 0..88 | u32 zero. */
static void pack_entry(uint8_t *e, uint64_t seq, uint64_t bucket, const uint8_t *bytes) {
    memset(e, 0, ENTRY);
    memcpy(e, &seq, 8);
    memcpy(e + 8, &bucket, 8);
    memcpy(e + 16, bytes, BUCKET);
    memcpy(e + 80, &seq, 8);
    put32(e + 88, kvf_crc32c(0, e, 88));
}

/* Log a bucket's new bytes in the ring (if the image has one), then advance the head: a
   reader that sees head h finds entries h - R .. h - 1 written. */
static void log_rewrite(uint8_t *base, Py_ssize_t len, uint64_t bucket, const uint8_t *bytes) {
    Geometry g;
    if (len < HEADER || parse_header(base, &g) < 0 || !g.ring_log2)
        return;
    uint64_t slots = (uint64_t)1 << g.ring_log2;
    if (g.ring_at + slots * ENTRY > (uint64_t)len)
        return;
    uint64_t head = get64(base + 32);
    uint8_t entry[ENTRY];
    pack_entry(entry, head, bucket, bytes);
    memcpy(base + g.ring_at + (head & (slots - 1)) * ENTRY, entry, ENTRY);
    __atomic_store_n((uint64_t *)(base + 32), head + 1, __ATOMIC_RELEASE);
}

enum { CAUGHT_UP = 0, BEHIND = 1, GAP = 2, LAPPED = 3, FOREIGN = 4 };

/* image_apply(mirror, header, entries, first, cursor) -> (cursor, head, code): bring a
   client's mirror of the buckets up to date from ring entries it landed.

   `header`: the image's header as just landed (its head tells how far the log goes);
   `entries`: landed ring entries, the first one logging rewrite number `first`; `cursor`:
   the first rewrite the mirror lacks. Applies rewrites cursor .. head - 1 that were landed,
   each checked (its CRC, and its number: a slot the owner reused since is LAPPED).
   Code: CAUGHT_UP; BEHIND (more were logged than landed: read on from the new cursor); GAP
   (the entries start after the cursor); LAPPED (the ring moved on more than its length:
   copy the buckets again); FOREIGN (another image). */
static PyObject *kvf_image_apply(PyObject *self, PyObject *args) {
    Py_buffer mirror, header, entries;
    unsigned long long first, cursor;
    if (!PyArg_ParseTuple(args, "w*y*y*KK", &mirror, &header, &entries, &first, &cursor))
        return NULL;
    PyObject *result = NULL;
    Geometry mine, theirs;
    uint64_t head = 0;
    int code = FOREIGN;
    if (header.len < HEADER || mirror.len < HEADER ||
        parse_header((const uint8_t *)mirror.buf, &mine) < 0 ||
        parse_header((const uint8_t *)header.buf, &theirs) < 0 || mine.id != theirs.id ||
        mine.log2 != theirs.log2 || mine.window != theirs.window || !theirs.ring_log2 ||
        mirror.len < mine.size)
        goto done;
    head = get64((const uint8_t *)header.buf + 32);
    uint64_t slots = (uint64_t)1 << theirs.ring_log2;
    uint64_t landed = (uint64_t)entries.len / ENTRY;
    uint64_t buckets = ((uint64_t)1 << mine.log2) + mine.window - 1;
    if (head <= cursor) {
        /* Nothing new (another thread may have applied a later head already). */
        code = CAUGHT_UP;
        goto done;
    }
    if (head - cursor > slots) {
        code = LAPPED;
        goto done;
    }
    if (cursor < first && cursor < head) {
        code = GAP;
        goto done;
    }
    uint8_t *base = (uint8_t *)mirror.buf;
    const uint8_t *log = (const uint8_t *)entries.buf;
    code = CAUGHT_UP;
    for (; cursor < head; cursor++) {
        if (cursor - first >= landed) {
            code = BEHIND;
            break;
        }
        const uint8_t *e = log + (cursor - first) * ENTRY;
        uint64_t bucket = get64(e + 8);
        if (get64(e) != cursor || get64(e + 80) != cursor ||
            get32(e + 88) != kvf_crc32c(0, e, 88) || bucket >= buckets) {
            code = LAPPED; /* overwritten by a later lap (or torn while it was) */
            break;
        }
        memcpy(base + HEADER + bucket * BUCKET, e + 16, BUCKET);
    }
done:
    result = Py_BuildValue("(KKi)", (unsigned long long)cursor, (unsigned long long)head, code);
    PyBuffer_Release(&mirror);
    PyBuffer_Release(&header);
    PyBuffer_Release(&entries);
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
    Geometry g;
    if (image.len < HEADER || parse_header((const uint8_t *)image.buf, &g) < 0 ||
        image.len < g.size) {
        PyErr_SetString(PyExc_ValueError, "image_store: not an image");
        goto done;
    }
    if (bucket >= ((uint64_t)1 << g.log2) + g.window - 1) {
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
    log_rewrite((uint8_t *)image.buf, image.len, bucket, next);
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

/* The position of the first item of a sequence that is not a 32-byte bytes, or -1: a
   client checks every key of a lookup, so the loop is C rather than Python. */
static PyObject *kvf_first_bad_key(PyObject *self, PyObject *keys) {
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence of 32-byte keys");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), bad = -1;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != KEY) {
            bad = i;
            break;
        }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(bad);
}

/* -- module ------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"image_store", kvf_image_store, METH_VARARGS,
     "image_store(image, bucket, wire, overflow, /): rewrite one bucket under its seqlock."},
    {"image_beat", kvf_image_beat, METH_VARARGS,
     "image_beat(image, alive, /): stamp the header's heartbeat (0: closed)."},
    {"image_prefix", kvf_image_prefix, METH_VARARGS,
     "image_prefix(image, keys, image_id, max_age, checksums=True, stamps=None, now=0.0, /) "
     "-> (hits, stop, wires)"},
    {"image_exists", kvf_image_exists, METH_VARARGS,
     "image_exists(image, keys, image_id, max_age, checksums=True, stamps=None, now=0.0, /) "
     "-> (usable, states)"},
    {"first_bad_key", kvf_first_bad_key, METH_O,
     "first_bad_key(keys, /) -> the position of the first item not 32 bytes, or -1"},
    {"image_apply", kvf_image_apply, METH_VARARGS,
     "image_apply(mirror, header, entries, first, cursor, /) -> (cursor, head, code)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvfabric._runtime._image",
    .m_doc = "The lookup image's bucket writer and probes (see kvfabric._runtime.image).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__image(void) {
    kvf_crc32c_init();
    return PyModule_Create(&module);
}
