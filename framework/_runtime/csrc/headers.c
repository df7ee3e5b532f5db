/* pack_headers(keys, versions, lengths, crcs) -> bytes: the 64-byte record headers of a
 * batch, back to back, in the layout of kvfabric._runtime.record (magic "KVFR", format 1,
 * flags 0, key, version, payload length, payload CRC32C, then the CRC32C of the 60 bytes
 * before it). Packed here in one call, not one by one in Python: a write packs every header
 * twice (placeholders, then with the CRCs), on its GIL-holding path.
 */
#include "native.h"

#include <string.h>

#include "crc32c.h"

#define RECORD_HEADER 64
#define RECORD_HEADER_CRC_SPAN 60

static int u64_at(PyObject *fast, Py_ssize_t i, uint64_t *out, const char *what) {
    unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "pack_headers: %s %zd is not an unsigned 64-bit int",
                     what, i);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

PyObject *py_pack_headers(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *versions_obj, *lengths_obj, *crcs_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &keys_obj, &versions_obj, &lengths_obj, &crcs_obj))
        return NULL;
    PyObject *fast[4] = {NULL, NULL, NULL, NULL};
    PyObject *objs[4] = {keys_obj, versions_obj, lengths_obj, crcs_obj};
    PyObject *out = NULL;
    for (int j = 0; j < 4; j++) {
        fast[j] = PySequence_Fast(objs[j], "pack_headers: arguments are sequences");
        if (!fast[j])
            goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast[0]);
    for (int j = 1; j < 4; j++)
        if (PySequence_Fast_GET_SIZE(fast[j]) != n) {
            PyErr_SetString(PyExc_ValueError, "pack_headers: sequences of different lengths");
            goto done;
        }
    out = PyBytes_FromStringAndSize(NULL, n * RECORD_HEADER);
    if (!out)
        goto done;
    uint8_t *h = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, h += RECORD_HEADER) {
        PyObject *key = PySequence_Fast_GET_ITEM(fast[0], i);
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != 32) {
            PyErr_Format(PyExc_TypeError, "pack_headers: key %zd is not 32 bytes", i);
            Py_CLEAR(out);
            goto done;
        }
        uint64_t version, length, crc;
        if (u64_at(fast[1], i, &version, "version") < 0 ||
            u64_at(fast[2], i, &length, "length") < 0 || u64_at(fast[3], i, &crc, "crc") < 0) {
            Py_CLEAR(out);
            goto done;
        }
        if (crc > 0xffffffffULL) {
            PyErr_Format(PyExc_ValueError, "pack_headers: crc %zd is not 32 bits", i);
            Py_CLEAR(out);
            goto done;
        }
        uint16_t format = 1, flags = 0;
        uint32_t crc32 = (uint32_t)crc;
        memcpy(h, "KVFR", 4);
        memcpy(h + 4, &format, 2);
        memcpy(h + 6, &flags, 2);
        memcpy(h + 8, PyBytes_AS_STRING(key), 32);
        memcpy(h + 40, &version, 8);
        memcpy(h + 48, &length, 8);
        memcpy(h + 56, &crc32, 4);
        uint32_t check = kvf_crc32c(0, h, RECORD_HEADER_CRC_SPAN);
        memcpy(h + 60, &check, 4);
    }
done:
    for (int j = 0; j < 4; j++)
        Py_XDECREF(fast[j]);
    return out;
}
