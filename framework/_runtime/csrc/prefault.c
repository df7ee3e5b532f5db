/* prefault: every page of a buffer faulted in (allocated and mapped) before its first use,
 * by the kernel where it can (MADV_POPULATE_*), else by touching each page.
 */
#include "native.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Fault in every page of [buf, buf + len) by touching it: a read, or (write) an atomic add
   of zero, which a concurrent writer to the same byte cannot lose its store to. */
static void touch_pages(unsigned char *buf, size_t len, size_t page, int write) {
    uintptr_t at = (uintptr_t)buf, end = (uintptr_t)buf + len;
    while (at < end) {
        if (write)
            __atomic_fetch_add((unsigned char *)at, 0, __ATOMIC_RELAXED);
        else
            (void)*(volatile unsigned char *)at;
        at = (at & ~(uintptr_t)(page - 1)) + page;
    }
}

PyObject *py_prefault(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buffer", "write", "force_touch", NULL};
    PyObject *obj;
    int write = 1, force_touch = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|pp:prefault", kwlist, &obj, &write,
                                     &force_touch))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, write ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError))
            name_error("prefault", "buffer");
        return NULL;
    }
    size_t len = (size_t)view.len, page = (size_t)sysconf(_SC_PAGESIZE);
    int populated = 0, err = 0;
    PyThreadState *ts = NULL;
    if (len >= GIL_RELEASE_MIN)
        RELEASE_GIL(ts);
    if (len && !force_touch) {
        /* The kernel fills the page tables itself (Linux 5.14+), faulting each page as a
           read or a write would, without a trap per page. Its range starts on a page. */
        uintptr_t start = (uintptr_t)view.buf & ~(uintptr_t)(page - 1);
        size_t span = (uintptr_t)view.buf + len - start;
        if (madvise((void *)start, span, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0)
            populated = 1;
        else if (errno != EINVAL) /* EINVAL: an older kernel, or a mapping it cannot do */
            err = errno;
    }
    if (len && !populated && !err)
        touch_pages(view.buf, len, page, write);
    if (ts)
        TAKE_GIL(ts);
    PyBuffer_Release(&view);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(populated);
}
