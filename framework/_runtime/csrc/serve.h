/* A tcp node's loop for READ frames, without the GIL (kvfabric.transports.tcp.server).
 *
 * One call serves one connection's small READ frames, one after another, until something
 * needs Python: the peer closed or was woken, it sat idle too long, a frame stalled, a
 * frame the loop does not serve (a WRITE, a large READ, anything malformed: handed back
 * with its header read, for Python to serve or refuse), or a socket error. Per frame:
 * the header, the entry table (on the stack: at most KVF_SERVE_MAX_COUNT entries, so no
 * size the peer sent is allocated), each entry checked against the regions (known
 * region, rkey, bounds: the rules of kvfabric.spi.segments.segment_status), the counters bumped
 * before the reply, then the reply and the accepted bytes in one gather. No Python here.
 */
#ifndef KVF_SERVE_H
#define KVF_SERVE_H

#include <stddef.h>
#include <stdint.h>

#define KVF_SERVE_MAX_COUNT 256
#define KVF_WIRE_HEADER 20 /* tcp.wire.HEADER: <4sBBHIQ */
#define KVF_WIRE_ENTRY 28  /* tcp.wire.ENTRY: <IQQQ */

enum kvf_serve_rc {
    KVF_SERVE_CLOSED = 0,    /* the peer closed (or was woken) between frames */
    KVF_SERVE_IDLE = 1,      /* no frame within the idle timeout */
    KVF_SERVE_HANDOFF = 2,   /* a frame for Python: its header is in `header` */
    KVF_SERVE_STALLED = 3,   /* a frame did not complete within the frame timeout */
    KVF_SERVE_ERRNO = 4,     /* a socket call failed: `err` */
    KVF_SERVE_TOO_LARGE = 5, /* a READ whose entries add up to more than max_batch_bytes */
    KVF_SERVE_TRUNCATED = 6, /* the peer closed in the middle of a frame */
};

/* Counters, in this order (kvfabric._runtime.native.SERVE_COUNTERS). */
enum { KVF_C_FRAMES, KVF_C_REQUESTS, KVF_C_SEGMENTS, KVF_C_BYTES, KVF_C_REFUSED, KVF_C_N };

typedef struct {
    uint32_t id;
    uint64_t rkey;
    char *base;
    uint64_t size;
} kvf_region;

typedef struct {
    int fd;
    const kvf_region *regions;
    size_t nregions;
    uint64_t *counters;      /* KVF_C_N, shared by a server's connections (atomic adds) */
    int64_t *idle_since;     /* CLOCK_MONOTONIC ns while waiting for a frame, else 0 */
    int64_t idle_timeout_ns; /* 0: none */
    int64_t frame_timeout_ns;
    uint64_t max_batch_bytes;
    int64_t spin_ns;          /* between frames, spin this long before sleeping (busy_poll) */
    unsigned char header[KVF_WIRE_HEADER]; /* a handed-off frame's header */
    int err;
} kvf_serve;

/* Serve until Python is needed; returns an enum kvf_serve_rc. */
int kvf_serve_reads(kvf_serve *s);

#endif
