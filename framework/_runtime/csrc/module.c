/* kvfabric._runtime._native: batch operations that take the GIL back once per batch.
 *
 * Why: a GIL released while bytes move is not enough. Each time a thread takes the GIL
 * back while another Python thread is busy, it waits out the interpreter's switch interval
 * (5 ms by default), so a read that released and re-took it per segment, per receive and
 * per CRC piece ran several times slower beside a busy thread (docs/performance.md). Every
 * function here takes all of its Python objects (buffers, with their exports held so
 * nothing can resize them) while it holds the GIL, checks them, releases the GIL once for
 * the whole batch, and takes it back once at the end: the only extra returns are for
 * signals arriving during a socket wait (so Ctrl-C still works), counted like every return
 * by gil_reacquisitions(). Small batches keep the GIL (GIL_RELEASE_MIN); small socket calls
 * release it only to wait.
 *
 * Plain C API with Py_buffer rather than cffi: the buffer protocol gives the pointer and
 * length of any exporter (bytes, bytearray, mmap, numpy, memoryview) and pins it, the
 * GIL is released by two macros, and the module has no run-time dependency.
 *
 * One extension, a C file per job (what they share is in native.h):
 *   module.c     this file: the method table, the module's constants, the GIL counters
 *   args.c       arguments: buffers held as views, CRC spans, deadlines, named errors
 *   crc_batch.c  crc32c, crc32c_many, and the named passes for tests
 *   headers.c    pack_headers: a batch's record headers
 *   copies.c     copy_many, and the batch runner that overlaps a tail with the GIL's return
 *   sockets.c    send_all, send_checksummed, recv_into_all, serve_reads; socket GIL handling
 *   exchange.c   request_reply and request_reply_lanes: a tcp client's frames
 *   prefault.c   prefault
 *   mutex.c      Mutex, a lock native loops take without the GIL
 *   ucp.c        ucp_post and ucp_wait: the ucx transport's batches over libucp
 *   stream.c     kvf_stream: buffers through a socket, no Python (stream.h)
 *   serve.c      kvf_serve_reads: a tcp node's READ loop, no Python (serve.h)
 *   crc32c.c     the CRC32C passes, chosen for the CPU at start (crc32c.h)
 */
#include "native.h"

#include "crc32c.h"
#include "stream.h"

PyObject *PeerClosed;
size_t iov_max;
_Thread_local unsigned long long reacquired;
_Thread_local unsigned long long handed_off;
_Thread_local unsigned long long parallel_copies;

static PyObject *py_gil_reacquisitions(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(reacquired);
}

static PyObject *py_gil_handoffs(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(handed_off);
}

static PyObject *py_parallel_copies(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(parallel_copies);
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(data, value=0, /) -> int: CRC32C of one buffer, continuing from value."},
    {"pack_headers", py_pack_headers, METH_VARARGS,
     "pack_headers(keys, versions, lengths, crcs, /) -> bytes: record headers, back to back."},
    {"crc32c_many", (PyCFunction)(void (*)(void))py_crc32c_many, METH_VARARGS | METH_KEYWORDS,
     "crc32c_many(values, initial=None) -> list[int]: one CRC32C per value (a buffer or a "
     "sequence of pieces)."},
    {"copy_many", (PyCFunction)(void (*)(void))py_copy_many, METH_VARARGS | METH_KEYWORDS,
     "copy_many(pairs, crc_spans=None, crc_of_source=False, threads=1) -> list[int]: copy "
     "each (dest, src); CRC32C per span."},
    {"prefault", (PyCFunction)(void (*)(void))py_prefault, METH_VARARGS | METH_KEYWORDS,
     "prefault(buffer, write=True, force_touch=False) -> bool: fault in every page of buffer."},
    {"send_all", (PyCFunction)(void (*)(void))py_send_all, METH_VARARGS | METH_KEYWORDS,
     "send_all(fd, buffers, deadline) -> int: send every buffer in order."},
    {"serve_reads", (PyCFunction)(void (*)(void))py_serve_reads, METH_VARARGS | METH_KEYWORDS,
     "serve_reads(fd, regions, counters, idle_since, header, idle_timeout, frame_timeout, "
     "max_batch_bytes) -> (rc, errno): serve small READ frames until Python is needed."},
    {"send_checksummed", (PyCFunction)(void (*)(void))py_send_checksummed,
     METH_VARARGS | METH_KEYWORDS,
     "send_checksummed(fd, buffers, deadline, crc_spans) -> list[int]: send every buffer in "
     "order, with the CRC32C of each span of them."},
    {"recv_into_all", (PyCFunction)(void (*)(void))py_recv_into_all,
     METH_VARARGS | METH_KEYWORDS,
     "recv_into_all(fd, buffers, deadline, crc_spans=None) -> list[int]: fill every buffer."},
    {"request_reply_lanes", (PyCFunction)(void (*)(void))py_request_reply_lanes,
     METH_VARARGS | METH_KEYWORDS,
     "request_reply_lanes(lanes, deadline, busy_poll=0): request_reply on each lane's socket "
     "at once."},
    {"request_reply", (PyCFunction)(void (*)(void))py_request_reply, METH_VARARGS | METH_KEYWORDS,
     "request_reply(fd, request, reply, payloads, deadline, status_offset=0, crc_spans=None, "
     "busy_poll=0.0, hold_gil=0.0) -> list[int]: send, receive the reply, then the payloads "
     "it accepts."},
    {"ucp_post", (PyCFunction)(void (*)(void))py_ucp_post, METH_VARARGS | METH_KEYWORDS,
     "ucp_post(rma, flush, ep, param, buffers, remote, put) -> (status, requests): post a "
     "batch of libucp gets or puts (and a flush after puts), keeping the GIL."},
    {"ucp_wait", (PyCFunction)(void (*)(void))py_ucp_wait, METH_VARARGS | METH_KEYWORDS,
     "ucp_wait(fns, worker, efd, requests, mutex, deadline, spins, idle_ms, crc_buffers=None, "
     "crc_spans=None, crc_first=False, try_first=False) -> (status, pending, crcs): progress "
     "until done."},
    {"gil_reacquisitions", py_gil_reacquisitions, METH_NOARGS,
     "gil_reacquisitions() -> int: times this module took the GIL back, in this thread."},
    {"parallel_copies", py_parallel_copies, METH_NOARGS,
     "parallel_copies() -> int: copy_many batches this thread ran on several threads."},
    {"gil_handoffs", py_gil_handoffs, METH_NOARGS,
     "gil_handoffs() -> int: batches (copies, a ucx get's CRCs) this thread ended on a "
     "helper thread while it took the GIL back."},
    {"crc32c_with", py_crc32c_with, METH_VARARGS,
     "crc32c_with(pass, data, value=0, /) -> int: crc32c through a named pass."},
    {"copy_crc32c_with", py_copy_crc32c_with, METH_VARARGS,
     "copy_crc32c_with(pass, dest, src, value=0, /) -> int: one copy and its crc32c through a "
     "named pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvfabric._runtime._native",
    .m_doc = "Batch operations that take the GIL back once per batch (see kvfabric._runtime.native).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    kvf_crc32c_init();
    iov_max = kvf_iov_max();
    if (PyType_Ready(&MutexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Mutex", (PyObject *)&MutexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PeerClosed = PyErr_NewExceptionWithDoc(
        "kvfabric._runtime._native.PeerClosed",
        "The peer closed the connection before every byte arrived; `received` says how many "
        "did (in this call).",
        PyExc_ConnectionError, NULL);
    if (!PeerClosed || PyModule_AddObjectRef(m, "PeerClosed", PeerClosed) < 0 ||
        PyModule_AddIntConstant(m, "GIL_RELEASE_MIN", GIL_RELEASE_MIN) < 0 ||
        PyModule_AddIntConstant(m, "IOV_MAX", (long)iov_max) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_PASS", kvf_crc32c_pass_name(kvf_crc32c_best())) <
            0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *passes = PyTuple_New(kvf_crc32c_best() + 1);
    for (int pass = 0; passes && pass <= kvf_crc32c_best(); pass++) {
        PyObject *name = PyUnicode_FromString(kvf_crc32c_pass_name(pass));
        if (!name)
            Py_CLEAR(passes);
        else
            PyTuple_SET_ITEM(passes, pass, name);
    }
    int added = passes ? PyModule_AddObjectRef(m, "CRC32C_PASSES", passes) : -1;
    Py_XDECREF(passes);
    if (added < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
