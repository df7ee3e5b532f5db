/* The tcp node's loop for small READ frames (see serve.h). */
#define _GNU_SOURCE
#include "serve.h"

#include <string.h>
#include <sys/uio.h>

#include "stream.h"

#define OP_READ 1
#define WIRE_VERSION 2
static const unsigned char MAGIC[4] = {'K', 'V', 'F', 'T'};

/* SegmentStatus's wire values. */
enum { ST_OK = 0, ST_UNKNOWN_REGION = 1, ST_BAD_RKEY = 2, ST_OUT_OF_BOUNDS = 3 };

static uint32_t get_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v; /* the wire is little-endian, as is every host this builds for (x86-64) */
}

static uint64_t get_u64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static void add(kvf_serve *s, int counter, uint64_t n) {
    __atomic_add_fetch(&s->counters[counter], n, __ATOMIC_RELAXED);
}

/* Move `count` buffers one way by the deadline; a signal only restarts the wait (this runs
   on a server thread, where Python's handlers never run). */
static int move(kvf_serve *s, int sending, struct iovec *bufs, size_t count, int64_t deadline,
                struct iovec *scratch, size_t scratch_len, int64_t spin_ns) {
    kvf_stream st;
    memset(&st, 0, sizeof st);
    st.fd = s->fd;
    st.sending = sending;
    st.bufs = bufs;
    st.count = count;
    st.deadline_ns = deadline;
    st.iov = scratch;
    st.iov_max = scratch_len;
    st.spin_ns = spin_ns;
    for (;;) {
        int rc = kvf_stream_run(&st);
        if (rc == KVF_INTERRUPTED)
            continue;
        if (rc == KVF_ERRNO)
            s->err = st.err;
        return rc;
    }
}

static const kvf_region *find_region(const kvf_serve *s, uint32_t id) {
    for (size_t i = 0; i < s->nregions; i++)
        if (s->regions[i].id == id)
            return &s->regions[i];
    return NULL;
}

static int failed(int rc) {
    if (rc == KVF_TIMEOUT)
        return KVF_SERVE_STALLED;
    if (rc == KVF_CLOSED)
        return KVF_SERVE_TRUNCATED;
    return KVF_SERVE_ERRNO;
}

int kvf_serve_reads(kvf_serve *s) {
    unsigned char table[KVF_SERVE_MAX_COUNT * KVF_WIRE_ENTRY];
    unsigned char reply[KVF_WIRE_HEADER + KVF_SERVE_MAX_COUNT];
    struct iovec bufs[1 + KVF_SERVE_MAX_COUNT];
    struct iovec scratch[1 + KVF_SERVE_MAX_COUNT];
    const size_t scratch_len = 1 + KVF_SERVE_MAX_COUNT;
    unsigned char *h = s->header;
    for (;;) {
        /* Between frames: idle, as the server's admission sees it. */
        int64_t now = kvf_now_ns();
        __atomic_store_n(s->idle_since, now, __ATOMIC_RELAXED);
        struct iovec first = {h, 1};
        int rc = move(s, 0, &first, 1, s->idle_timeout_ns ? now + s->idle_timeout_ns : -1,
                      scratch, scratch_len, s->spin_ns);
        if (rc == KVF_CLOSED)
            return KVF_SERVE_CLOSED;
        if (rc == KVF_TIMEOUT)
            return KVF_SERVE_IDLE;
        if (rc != KVF_DONE)
            return KVF_SERVE_ERRNO;
        __atomic_store_n(s->idle_since, 0, __ATOMIC_RELAXED);
        /* From a frame's first byte, the whole frame and its reply run on one clock. */
        int64_t deadline = kvf_now_ns() + s->frame_timeout_ns;
        struct iovec rest = {h + 1, KVF_WIRE_HEADER - 1};
        rc = move(s, 0, &rest, 1, deadline, scratch, scratch_len, 0);
        if (rc != KVF_DONE)
            return failed(rc);
        uint8_t version = h[4], op = h[5];
        uint16_t code = (uint16_t)(h[6] | h[7] << 8);
        uint32_t count = get_u32(h + 8);
        if (memcmp(h, MAGIC, 4) || version != WIRE_VERSION || code || op != OP_READ ||
            count > KVF_SERVE_MAX_COUNT)
            return KVF_SERVE_HANDOFF; /* Python serves it, or refuses it */
        add(s, KVF_C_FRAMES, 1);
        struct iovec tab = {table, (size_t)count * KVF_WIRE_ENTRY};
        rc = move(s, 0, &tab, 1, deadline, scratch, scratch_len, 0);
        if (rc != KVF_DONE)
            return failed(rc);
        uint64_t total = 0, nbytes = 0;
        uint32_t served = 0;
        size_t nbufs = 1;
        for (uint32_t i = 0; i < count; i++) {
            const unsigned char *e = table + (size_t)i * KVF_WIRE_ENTRY;
            uint32_t id = get_u32(e);
            uint64_t rkey = get_u64(e + 4), offset = get_u64(e + 12), length = get_u64(e + 20);
            total = length > UINT64_MAX - total ? UINT64_MAX : total + length;
            const kvf_region *r = find_region(s, id);
            unsigned char status;
            if (!r)
                status = ST_UNKNOWN_REGION;
            else if (rkey != r->rkey)
                status = ST_BAD_RKEY;
            else if (length > r->size || offset > r->size - length)
                status = ST_OUT_OF_BOUNDS;
            else
                status = ST_OK;
            reply[KVF_WIRE_HEADER + i] = status;
            if (status == ST_OK) {
                served++;
                nbytes += length;
                bufs[nbufs].iov_base = r->base + offset;
                bufs[nbufs].iov_len = length;
                nbufs++;
            }
        }
        if (total > s->max_batch_bytes)
            return KVF_SERVE_TOO_LARGE;
        /* Counted before replying, so a client holding its reply sees the request counted. */
        add(s, KVF_C_REQUESTS, 1);
        add(s, KVF_C_SEGMENTS, served);
        add(s, KVF_C_BYTES, nbytes);
        add(s, KVF_C_REFUSED, count - served);
        memcpy(reply, h, KVF_WIRE_HEADER); /* magic, version, op, count and id as asked */
        reply[6] = reply[7] = 0;           /* code OK */
        bufs[0].iov_base = reply;
        bufs[0].iov_len = KVF_WIRE_HEADER + count;
        rc = move(s, 1, bufs, nbufs, deadline, scratch, scratch_len, 0);
        if (rc != KVF_DONE)
            return failed(rc);
    }
}
