/* Mutex: a lock native loops can take without the GIL (ucp_wait takes it around each
 * libucp round), and Python takes as a context manager. The struct and its take/give,
 * which the loops call, are in native.h.
 */
#include "native.h"

static PyObject *mutex_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Mutex() takes no arguments");
        return NULL;
    }
    Mutex *self = (Mutex *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void mutex_dealloc(Mutex *self) {
    if (self->lock)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *mutex_acquire(Mutex *self, PyObject *unused) {
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        PyThreadState *ts;
        RELEASE_GIL(ts);
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        TAKE_GIL(ts);
    }
    self->locked = 1;
    Py_RETURN_TRUE;
}

static PyObject *mutex_release(Mutex *self, PyObject *unused) {
    if (!self->locked) {
        PyErr_SetString(PyExc_RuntimeError, "Mutex.release: not held");
        return NULL;
    }
    mutex_give(self);
    Py_RETURN_NONE;
}

static PyObject *mutex_exit(Mutex *self, PyObject *args) { return mutex_release(self, NULL); }

static PyObject *mutex_is_locked(Mutex *self, PyObject *unused) {
    return PyBool_FromLong(self->locked);
}

static PyMethodDef mutex_methods[] = {
    {"acquire", (PyCFunction)mutex_acquire, METH_NOARGS, "Take it (waits, the GIL released)."},
    {"release", (PyCFunction)mutex_release, METH_NOARGS, "Give it back."},
    {"locked", (PyCFunction)mutex_is_locked, METH_NOARGS, "Whether someone holds it."},
    {"__enter__", (PyCFunction)mutex_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)mutex_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject MutexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric._runtime._native.Mutex",
    .tp_basicsize = sizeof(Mutex),
    .tp_dealloc = (destructor)mutex_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mutex native batch loops take without the GIL; a context manager in Python.",
    .tp_methods = mutex_methods,
    .tp_new = mutex_new,
};
