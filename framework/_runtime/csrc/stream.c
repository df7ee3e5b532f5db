/* The socket loops behind send_all, recv_into_all and request_reply (see stream.h). */
#define _GNU_SOURCE
#include "stream.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"

size_t kvf_iov_max(void) {
    long n = sysconf(_SC_IOV_MAX);
    if (n <= 0)
        n = 16; /* POSIX's minimum, where the limit is unknown */
    return (size_t)n;
}

int64_t kvf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Account for `n` bytes the last call moved: fold them into their CRCs, step the cursor. */
static void advance(kvf_stream *s, size_t n) {
    s->moved += n;
    while (n) {
        struct iovec *b = &s->bufs[s->index];
        size_t take = b->iov_len - s->offset;
        if (take > n)
            take = n;
        if (s->span_of && s->span_of[s->index] >= 0) {
            uint32_t *crc = &s->crcs[s->span_of[s->index]];
            *crc = kvf_crc32c(*crc, (const char *)b->iov_base + s->offset, take);
        }
        s->offset += take;
        n -= take;
        if (s->offset == b->iov_len) {
            s->index++;
            s->offset = 0;
        }
    }
}

/* Wait until the socket is ready for the next call, or the deadline passes. */
static int wait_ready(kvf_stream *s) {
    int timeout = -1;
    if (s->deadline_ns >= 0) {
        int64_t left = s->deadline_ns - kvf_now_ns();
        if (left <= 0)
            return KVF_TIMEOUT;
        /* Rounded up, so a wake-up never comes just before the deadline and spins. */
        int64_t ms = (left + 999999) / 1000000;
        timeout = ms > INT_MAX ? INT_MAX : (int)ms;
    }
    struct pollfd p = {.fd = s->fd, .events = s->sending ? POLLOUT : POLLIN};
    int rc = poll(&p, 1, timeout);
    if (rc < 0) {
        if (errno == EINTR)
            return KVF_INTERRUPTED;
        s->err = errno;
        return KVF_ERRNO;
    }
    /* Ready, or an error/hang-up: the next call reports which. Or a timeout: checked above
       on the next round. */
    return KVF_DONE;
}

/* Whether to retry at once rather than sleep in poll(): within spin_ns of the first
   would-wait. On an idle host a sleeping thread's wake-up is most of a small reply's round
   trip over loopback (docs/performance.md); a bounded spin keeps that off the short calls
   and costs a long one at most spin_ns of one CPU. */
int kvf_stream_spinning(kvf_stream *s) {
    if (s->spin_ns <= 0)
        return 0;
    int64_t now = kvf_now_ns();
    if (!s->spin_until) {
        s->spin_until = now + s->spin_ns;
        /* A spin never outlasts the deadline: the wait after it reports the timeout. */
        if (s->deadline_ns >= 0 && s->deadline_ns < s->spin_until)
            s->spin_until = s->deadline_ns;
    }
    if (now >= s->spin_until)
        return 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    return 1;
}

int kvf_stream_run(kvf_stream *s) {
    for (;;) {
        while (s->index < s->count && s->bufs[s->index].iov_len == s->offset) {
            s->index++;
            s->offset = 0;
        }
        if (s->index == s->count)
            return KVF_DONE;

        size_t k = 0, bytes = 0;
        for (size_t i = s->index; i < s->count && k < s->iov_max; i++) {
            size_t skip = i == s->index ? s->offset : 0;
            size_t len = s->bufs[i].iov_len - skip;
            if (!len)
                continue;
            if (s->window && bytes + len > s->window)
                len = s->window - bytes;
            s->iov[k].iov_base = (char *)s->bufs[i].iov_base + skip;
            s->iov[k].iov_len = len;
            k++;
            bytes += len;
            if (s->window && bytes == s->window)
                break;
        }
        /* A zero-length entry between two others is skipped above, so the kernel's count
           maps back onto the buffers by walking them in order (advance). */
        struct msghdr m = {.msg_iov = s->iov, .msg_iovlen = k};
        ssize_t n = s->sending ? sendmsg(s->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL)
                               : recvmsg(s->fd, &m, MSG_DONTWAIT);
        if (n > 0) {
            advance(s, (size_t)n);
            continue;
        }
        if (n == 0) {
            if (!s->sending)
                return KVF_CLOSED;
            errno = EAGAIN; /* a send that moved nothing: wait for room */
        }
        if (errno == EINTR)
            return KVF_INTERRUPTED;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            s->err = errno;
            return KVF_ERRNO;
        }
        if (s->no_wait)
            return KVF_WOULD_WAIT;
        if (kvf_stream_spinning(s))
            continue;
        int rc = wait_ready(s);
        if (rc != KVF_DONE)
            return rc;
    }
}
