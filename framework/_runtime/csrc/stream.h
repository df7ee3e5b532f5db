/* Moving a list of buffers through a stream socket without the GIL.
 *
 * One kvf_stream is one direction over one fd: every buffer in order, sendmsg/recvmsg
 * with up to IOV_MAX of them per call, non-blocking calls (MSG_DONTWAIT) and poll() for
 * what is left of a deadline, partial transfers resumed where they stopped. No Python here:
 * kvf_stream_run returns KVF_INTERRUPTED when a signal cut a wait short, so the caller can
 * take the GIL, run Python's signal handlers and call it again to resume.
 */
#ifndef KVF_STREAM_H
#define KVF_STREAM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

enum kvf_status {
    KVF_DONE = 0,        /* every byte moved */
    KVF_CLOSED = 1,      /* the peer closed the stream (recv saw EOF) */
    KVF_TIMEOUT = 2,     /* the deadline passed while waiting */
    KVF_INTERRUPTED = 3, /* a signal arrived while waiting: run handlers, then resume */
    KVF_ERRNO = 4,       /* a system call failed: `err` holds errno */
    KVF_WOULD_WAIT = 5,  /* `no_wait` is set and the socket is not ready */
};

typedef struct {
    int fd;
    int sending;        /* 1: sendmsg, 0: recvmsg */
    struct iovec *bufs; /* every buffer, in order (caller-owned) */
    size_t count;
    const int32_t *span_of; /* per buffer: the CRC it feeds, or -1; NULL: no CRCs */
    uint32_t *crcs;         /* the running CRC of each span */
    size_t window;          /* at most this many bytes per system call (0: no limit) */
    int no_wait;            /* return KVF_WOULD_WAIT instead of waiting */
    int64_t spin_ns;        /* before the first wait, retry this long without sleeping */
    int64_t deadline_ns;    /* CLOCK_MONOTONIC; negative: none */
    struct iovec *iov;      /* scratch of iov_max entries (caller-owned) */
    size_t iov_max;
    /* progress */
    size_t index;  /* first buffer not yet complete */
    size_t offset; /* bytes of bufs[index] already moved */
    uint64_t moved;
    int64_t spin_until; /* 0: the spin has not started */
    int err;
} kvf_stream;

/* IOV_MAX of this system (sysconf), at least 1. */
size_t kvf_iov_max(void);

/* CLOCK_MONOTONIC now, in nanoseconds (the clock of Python's time.monotonic()). */
int64_t kvf_now_ns(void);

/* Move what is left; returns an enum kvf_status. Call again after KVF_INTERRUPTED. */
int kvf_stream_run(kvf_stream *s);

/* Within spin_ns of the stream's first would-wait (started now if not yet): pauses once and
   returns 1, so the caller retries rather than sleeps; 0 past it (or without a spin). */
int kvf_stream_spinning(kvf_stream *s);

#endif
