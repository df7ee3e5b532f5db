"""A thin cffi binding (ABI mode: no compiler) over libucp: what one-sided RMA needs, no more.

It owns no policy: kvfabric's ``ucx`` transport decides threads, timeouts and errors. It
creates its own UCX context and worker (never another library's), maps memory, packs and
unpacks remote keys, and exposes ``ucp_get_nbx`` / ``ucp_put_nbx`` and request status.
cffi releases the GIL around every C call.

Which libucp: ``$KVFABRIC_UCX_LIB`` (a path or soname: a system or MOFED UCX with verbs for
RDMA NICs), else the ``libucx-cu12`` wheel's ``lib/libucp.so`` (the file ucxx also loads;
the wheel's ``.so.0`` is a separate copy of the same library, so opening it would map UCX
twice), else the soname ``libucp.so.0``.

The declarations are written from the UCX 1.22 headers (``ucp/api/ucp.h``). UCX's
parameter structs only grow at the end and the library reads only the fields a
``field_mask`` names, so the same layout works with every UCX since 1.10 (the ``_nbx`` API);
``ucs_status_t`` is a packed enum, one byte.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "Binding",
    "Context",
    "Endpoint",
    "LibraryError",
    "MemoryMap",
    "RemoteKey",
    "UcxError",
    "Worker",
    "binding",
    "ptr_status",
    "started_in_a_parent",
]

_CDEF = """
typedef int8_t ucs_status_t;
typedef void *ucs_status_ptr_t;
typedef int ucs_thread_mode_t;
typedef int ucs_memory_type_t;
typedef int ucp_err_handling_mode_t;
typedef uint64_t ucp_datatype_t;

typedef struct ucp_config   ucp_config_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker  *ucp_worker_h;
typedef struct ucp_ep      *ucp_ep_h;
typedef struct ucp_mem     *ucp_mem_h;
typedef struct ucp_rkey    *ucp_rkey_h;
typedef struct ucp_address  ucp_address_t;

typedef struct { unsigned long ucs_bits[16]; } ucs_cpu_set_t;
typedef struct { const void *addr; uint32_t addrlen; } ucs_sock_addr_t;
typedef struct { void *cb; void *arg; } ucp_err_handler_t;

typedef struct {
    uint64_t field_mask; uint64_t features; size_t request_size; void *request_init;
    void *request_cleanup; uint64_t tag_sender_mask; int mt_workers_shared;
    size_t estimated_num_eps; size_t estimated_num_ppn; const char *name; size_t node_local_id;
} ucp_params_t;

typedef struct {
    uint64_t field_mask; ucs_thread_mode_t thread_mode; ucs_cpu_set_t cpu_mask;
    unsigned events; void *user_data; int event_fd; uint64_t flags; const char *name;
    size_t am_alignment; uint64_t client_id;
} ucp_worker_params_t;

typedef struct {
    uint64_t field_mask; const ucp_address_t *address; ucp_err_handling_mode_t err_mode;
    ucp_err_handler_t err_handler; void *user_data; unsigned flags; ucs_sock_addr_t sockaddr;
    void *conn_request; const char *name; ucs_sock_addr_t local_sockaddr;
} ucp_ep_params_t;

typedef struct {
    uint64_t field_mask; void *address; size_t length; unsigned flags; unsigned prot;
    ucs_memory_type_t memory_type; const void *exported_memh_buffer;
} ucp_mem_map_params_t;

typedef struct {
    uint32_t op_attr_mask; uint32_t flags; void *request; void *cb; ucp_datatype_t datatype;
    void *user_data; void *reply_buffer; ucs_memory_type_t memory_type; void *recv_info;
    ucp_mem_h memh; ucp_datatype_t remote_datatype; const void *remote; size_t remote_count;
} ucp_request_param_t;

void ucp_get_version(unsigned *major, unsigned *minor, unsigned *release);
const char *ucs_status_string(ucs_status_t status);

ucs_status_t ucp_config_read(const char *env_prefix, const char *filename,
                             ucp_config_t **config_p);
ucs_status_t ucp_config_modify(ucp_config_t *config, const char *name, const char *value);
void ucp_config_release(ucp_config_t *config);
ucs_status_t ucp_init_version(unsigned api_major, unsigned api_minor,
                              const ucp_params_t *params, const ucp_config_t *config,
                              ucp_context_h *context_p);
void ucp_cleanup(ucp_context_h context);

ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
                               ucp_worker_h *worker_p);
void ucp_worker_destroy(ucp_worker_h worker);
ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p,
                                    size_t *address_length_p);
void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_worker_signal(ucp_worker_h worker);

ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h *ep_p);
ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param);
ucs_status_ptr_t ucp_ep_flush_nbx(ucp_ep_h ep, const ucp_request_param_t *param);

ucs_status_t ucp_mem_map(ucp_context_h context, const ucp_mem_map_params_t *params,
                         ucp_mem_h *memh_p);
ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh);
ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void **rkey_buffer_p,
                           size_t *size_p);
void ucp_rkey_buffer_release(void *rkey_buffer);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p);
void ucp_rkey_destroy(ucp_rkey_h rkey);

ucs_status_ptr_t ucp_put_nbx(ucp_ep_h ep, const void *buffer, size_t count,
                             uint64_t remote_addr, ucp_rkey_h rkey,
                             const ucp_request_param_t *param);
ucs_status_ptr_t ucp_get_nbx(ucp_ep_h ep, void *buffer, size_t count, uint64_t remote_addr,
                             ucp_rkey_h rkey, const ucp_request_param_t *param);
ucs_status_t ucp_request_check_status(void *request);
void ucp_request_free(void *request);
"""

# Values from the headers; unchanged since the _nbx API appeared (1.10).
OK = 0
INPROGRESS = 1
ERR_BUSY = -15
ERR_CANCELED = -16
ERR_TIMED_OUT = -20
_ERR_LAST = -100

_FEATURE_RMA = 1 << 1
_FEATURE_WAKEUP = 1 << 4
_PARAM_FEATURES = 1 << 0
_PARAM_MT_WORKERS_SHARED = 1 << 5
_PARAM_NAME = 1 << 8
THREAD_MODE_SINGLE = 0
THREAD_MODE_SERIALIZED = 1
THREAD_MODE_MULTI = 2
_WORKER_THREAD_MODE = 1 << 0
_EP_REMOTE_ADDRESS = 1 << 0
_EP_ERR_HANDLING_MODE = 1 << 1
_EP_ERR_HANDLER = 1 << 2
_EP_NAME = 1 << 7
_ERR_HANDLING_PEER = 1
_EP_CLOSE_FORCE = 1 << 0
_MAP_ADDRESS = 1 << 0
_MAP_LENGTH = 1 << 1
_MAP_PROT = 1 << 3
_MAP_MEMORY_TYPE = 1 << 4
_PROT_ALL = (1 << 0) | (1 << 1) | (1 << 8) | (1 << 9)  # local and remote, read and write
_OP_FLAGS = 1 << 4
_OP_MEMORY_TYPE = 1 << 6
_MEMORY_TYPE_HOST = 0

_API_MAJOR, _API_MINOR = 1, 22  # the headers the declarations above were written from
_MIN_MINOR = 10  # the _nbx RMA API

# UCX writes its log to the C stdout unless told otherwise, and processes such as
# `kvfabric node` speak a line protocol on stdout: send it to stderr. UCX reads this once,
# when libucs is loaded, so it is set only around the first load and an explicit user
# setting wins.
_LOAD_ENV = {"UCX_LOG_FILE": "stderr"}


class UcxError(RuntimeError):
    """A libucp call failed; ``status`` is the ``ucs_status_t``."""

    def __init__(self, where: str, status: int) -> None:
        self.status = status
        super().__init__(f"{where}: {status_text(status)}")


class LibraryError(OSError):
    """libucp (or cffi) cannot be loaded, or is too old."""


class Binding:
    """The loaded library: ``ffi`` and ``lib`` are cffi's, for the transport's hot path."""

    def __init__(self, ffi: Any, lib: Any, path: str) -> None:
        self.ffi = ffi
        self.lib = lib
        self.path = path
        numbers = ffi.new("unsigned[3]")
        lib.ucp_get_version(numbers, numbers + 1, numbers + 2)
        self.version: tuple[int, int, int] = (numbers[0], numbers[1], numbers[2])
        # op_attr_mask names only the memory type: no callback (requests are polled), and
        # UCX need not look up what kind of memory each buffer is.
        self.host_param = ffi.new("ucp_request_param_t *")
        self.host_param.op_attr_mask = _OP_MEMORY_TYPE
        self.host_param.memory_type = _MEMORY_TYPE_HOST
        self.force_close_param = ffi.new("ucp_request_param_t *")
        self.force_close_param.op_attr_mask = _OP_FLAGS
        self.force_close_param.flags = _EP_CLOSE_FORCE
        self._error_callback = ffi.callback("void(void *, ucp_ep_h, ucs_status_t)", _on_ep_error)


_loaded: Binding | None = None
_load_lock = threading.Lock()


def binding() -> Binding:
    """Load libucp once per process (raises :class:`LibraryError`)."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> Binding:
    try:
        cffi = importlib.import_module("cffi")
    except ImportError as exc:
        raise LibraryError(f"cffi is not installed ({exc})") from exc
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    added = {k: v for k, v in _LOAD_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        errors: list[str] = []
        for path in _candidates():
            try:
                loaded = Binding(ffi, ffi.dlopen(path), path)
            except (OSError, AttributeError) as exc:  # not loadable, or not a libucp
                errors.append(f"{path}: {exc}")
                continue
            break
        else:
            raise LibraryError("cannot load libucp (" + "; ".join(errors) + ")")
    finally:
        for key in added:
            os.environ.pop(key, None)
    major, minor, release = loaded.version
    if major != _API_MAJOR or minor < _MIN_MINOR:
        found = f"{major}.{minor}.{release}"
        raise LibraryError(f"{loaded.path} is UCX {found}; kvfabric needs 1.{_MIN_MINOR} or newer")
    return loaded


def _candidates() -> Iterator[str]:
    override = os.environ.get("KVFABRIC_UCX_LIB")
    if override:
        yield override  # no silent fallback: the operator asked for this one
        return
    try:
        libucx = importlib.import_module("libucx")
    except ImportError:
        pass
    else:
        # Loads the wheel's libucs/libuct/libucp (RTLD_LOCAL) exactly as ucxx does, so a
        # process that also uses ucxx maps one UCX, not two.
        with contextlib.suppress(OSError):  # the dlopen below then says why
            libucx.load_library()
        if libucx.__file__:
            yield str(Path(libucx.__file__).parent / "lib" / "libucp.so")
    yield "libucp.so.0"


def status_text(status: int) -> str:
    if _loaded is None:
        return f"UCX status {status}"
    text = _loaded.ffi.string(_loaded.lib.ucs_status_string(status)).decode()
    return f"{text} ({status})"


def ptr_status(ffi: Any, pointer: Any) -> int:
    """``UCS_PTR_STATUS``: OK for NULL, the error for an encoded one, else INPROGRESS."""
    value = int(ffi.cast("uintptr_t", pointer))
    if value == 0:
        return OK
    if value >= (1 << 64) + _ERR_LAST:
        return value - (1 << 64)
    return INPROGRESS


def _check(where: str, status: int) -> None:
    if status != OK:
        raise UcxError(where, status)


# Endpoint errors, reported by UCX from inside ucp_worker_progress() on whichever thread
# progresses: the callback only records the status; the owner of the endpoint acts on it.
_ep_errors: dict[int, int] = {}
_next_token = iter(range(1, 1 << 62))


def _on_ep_error(arg: Any, ep: Any, status: int) -> None:
    assert _loaded is not None
    _ep_errors.setdefault(int(_loaded.ffi.cast("uintptr_t", arg)), status)


_workers_started_in: int | None = None
"""The process that made the first UCX worker: UCX's event thread runs there from then on."""


def started_in_a_parent() -> int | None:
    """The process this one was forked from after it started UCX, or None (UCX was not
    started, or was started here).

    UCX is not fork-safe: its event thread (``ucs_async``), started with the first worker,
    stays in the process that started it, and the child inherits its event set (an epoll
    instance, shared with that process). A worker made in the child adds its descriptors to
    it, so the parent's thread takes the child's events and runs the parent's handlers for
    them, and the child's own handlers never run (a child over tcp waits on connections
    that never complete).
    """
    started = _workers_started_in
    return started if started is not None and started != os.getpid() else None


class Context:
    """A ``ucp_context`` with RMA and wakeup; ``config`` overrides ``UCX_*`` variables."""

    def __init__(self, config: Mapping[str, str], *, name: str, shared: bool) -> None:
        b = binding()
        self._b = b
        ffi, lib = b.ffi, b.lib
        cfg = ffi.new("ucp_config_t **")
        _check("ucp_config_read", lib.ucp_config_read(ffi.NULL, ffi.NULL, cfg))
        try:
            for key, value in config.items():
                # Options an older UCX lacks are skipped: it then behaves as it always did.
                lib.ucp_config_modify(cfg[0], key.encode(), value.encode())
            params = ffi.new("ucp_params_t *")
            params.field_mask = _PARAM_FEATURES | _PARAM_NAME | _PARAM_MT_WORKERS_SHARED
            params.features = _FEATURE_RMA | _FEATURE_WAKEUP
            params.mt_workers_shared = 1 if shared else 0
            self._name = ffi.new("char[]", name.encode())
            params.name = self._name
            handle = ffi.new("ucp_context_h *")
            # ucp_init() is a static inline around this; ask for the API the library has.
            api_minor = min(_API_MINOR, b.version[1])
            _check("ucp_init", lib.ucp_init_version(_API_MAJOR, api_minor, params, cfg[0], handle))
        finally:
            lib.ucp_config_release(cfg[0])
        self.handle: Any = handle[0]

    def close(self) -> None:
        if self.handle is not None:
            self._b.lib.ucp_cleanup(self.handle)
            self.handle = None


class Worker:
    """A ``ucp_worker``; progress it from one thread at a time unless ``thread_mode`` says."""

    def __init__(self, context: Context, thread_mode: int) -> None:
        b = binding()
        self._b = b
        params = b.ffi.new("ucp_worker_params_t *")
        params.field_mask = _WORKER_THREAD_MODE
        params.thread_mode = thread_mode
        handle = b.ffi.new("ucp_worker_h *")
        _check("ucp_worker_create", b.lib.ucp_worker_create(context.handle, params, handle))
        self.handle: Any = handle[0]
        global _workers_started_in
        if _workers_started_in is None:
            _workers_started_in = os.getpid()

    def address(self) -> bytes:
        ffi = self._b.ffi
        address = ffi.new("ucp_address_t **")
        length = ffi.new("size_t *")
        _check(
            "ucp_worker_get_address",
            self._b.lib.ucp_worker_get_address(self.handle, address, length),
        )
        try:
            return bytes(ffi.buffer(address[0], length[0]))
        finally:
            self._b.lib.ucp_worker_release_address(self.handle, address[0])

    def progress(self) -> int:
        return int(self._b.lib.ucp_worker_progress(self.handle))

    def efd(self) -> int:
        """A file descriptor that becomes readable when an armed worker has events."""
        fd = self._b.ffi.new("int *")
        _check("ucp_worker_get_efd", self._b.lib.ucp_worker_get_efd(self.handle, fd))
        return int(fd[0])

    def arm(self) -> bool:
        """True when armed (safe to sleep on the efd); False when events are pending."""
        status = self._b.lib.ucp_worker_arm(self.handle)
        if status == ERR_BUSY:
            return False
        _check("ucp_worker_arm", status)
        return True

    def signal(self) -> None:
        """Wake a thread sleeping on the efd (callable from any thread)."""
        _check("ucp_worker_signal", self._b.lib.ucp_worker_signal(self.handle))

    def close(self) -> None:
        if self.handle is not None:
            self._b.lib.ucp_worker_destroy(self.handle)
            self.handle = None


class MemoryMap:
    """``ucp_mem_map`` of existing host memory, readable and writable by remote peers."""

    def __init__(self, context: Context, address: int, length: int) -> None:
        b = binding()
        self._b = b
        self._context = context
        params = b.ffi.new("ucp_mem_map_params_t *")
        params.field_mask = _MAP_ADDRESS | _MAP_LENGTH | _MAP_PROT | _MAP_MEMORY_TYPE
        params.address = b.ffi.cast("void *", address)
        params.length = length
        params.prot = _PROT_ALL
        params.memory_type = _MEMORY_TYPE_HOST
        handle = b.ffi.new("ucp_mem_h *")
        _check("ucp_mem_map", b.lib.ucp_mem_map(context.handle, params, handle))
        self.handle: Any = handle[0]

    def pack(self) -> bytes:
        """The packed remote key a peer unpacks on its endpoint to address this memory."""
        ffi, lib = self._b.ffi, self._b.lib
        buffer = ffi.new("void **")
        size = ffi.new("size_t *")
        _check("ucp_rkey_pack", lib.ucp_rkey_pack(self._context.handle, self.handle, buffer, size))
        try:
            return bytes(ffi.buffer(buffer[0], size[0]))
        finally:
            lib.ucp_rkey_buffer_release(buffer[0])

    def close(self) -> None:
        if self.handle is not None:
            self._b.lib.ucp_mem_unmap(self._context.handle, self.handle)
            self.handle = None


class Endpoint:
    """An endpoint to a peer's *worker address* (what lets UCX choose CMA on one host).

    Error handling is PEER: a dead peer or a failed transfer fails the requests and is
    recorded in :attr:`failure` instead of aborting the process, and a force close can
    cancel requests that would otherwise never complete.
    """

    def __init__(self, worker: Worker, address: bytes, *, name: str) -> None:
        b = binding()
        self._b = b
        ffi = b.ffi
        self._token = next(_next_token)
        self._address = ffi.new("char[]", address)
        self._name = ffi.new("char[]", name.encode())
        params = ffi.new("ucp_ep_params_t *")
        params.field_mask = _EP_REMOTE_ADDRESS | _EP_ERR_HANDLING_MODE | _EP_ERR_HANDLER | _EP_NAME
        params.address = ffi.cast("ucp_address_t *", self._address)
        params.err_mode = _ERR_HANDLING_PEER
        params.err_handler.cb = ffi.cast("void *", b._error_callback)
        params.err_handler.arg = ffi.cast("void *", self._token)
        params.name = self._name
        handle = ffi.new("ucp_ep_h *")
        _check("ucp_ep_create", b.lib.ucp_ep_create(worker.handle, params, handle))
        self.handle: Any = handle[0]

    @property
    def failure(self) -> int:
        """The status UCX reported for this endpoint's failure (``OK`` while healthy)."""
        return _ep_errors.get(self._token, OK)

    def unpack(self, packed: bytes) -> RemoteKey:
        return RemoteKey(self, packed)

    def flush(self) -> Any:
        """Start a flush (remote completion of every put so far); a request, NULL or error."""
        return self._b.lib.ucp_ep_flush_nbx(self.handle, self._b.host_param)

    def force_close(self) -> Any:
        """Close now: outstanding requests complete with ``ERR_CANCELED`` on next progress.

        Returns what ``ucp_ep_close_nbx`` returned (free it if it is a request).
        """
        request = self._b.lib.ucp_ep_close_nbx(self.handle, self._b.force_close_param)
        self.handle = None
        _ep_errors.pop(self._token, None)
        return request


class RemoteKey:
    """A peer's packed key unpacked on one endpoint; valid while that endpoint is."""

    def __init__(self, endpoint: Endpoint, packed: bytes) -> None:
        b = binding()
        self._b = b
        handle = b.ffi.new("ucp_rkey_h *")
        _check(
            "ucp_ep_rkey_unpack",
            b.lib.ucp_ep_rkey_unpack(endpoint.handle, b.ffi.from_buffer(packed), handle),
        )
        self.handle: Any = handle[0]

    def close(self) -> None:
        if self.handle is not None:
            self._b.lib.ucp_rkey_destroy(self.handle)
            self.handle = None
