"""kvfabric's own machinery, shared by the framework and the built-in plug-ins.

- ``native`` (C sources in ``csrc/``): CRC32C, copies and socket loops that take the GIL
  back once per batch, prefaulting, the ucx loops and a GIL-free mutex;
- ``buffers``: buffer views, addresses, copies and prefaulting of mapped memory;
- ``codec``: the control protocol's reader and writer;
- ``cpus``, ``huge_pages``: what the host gives a process (CPUs, transparent huge pages);
- ``forks``: telling an object inherited through ``os.fork()`` from one made in this process;
- ``image``: the lookup image's format, probes and ring (C in ``csrc/image.c``);
- ``record``, ``record_scan``: the record format, its validation, and scanning a region;
- ``regions``: how a backend cuts its capacity into regions, and unmapping them;
  ``region_files``: region files on a disk, their space checked and reserved at start and
  what a failed start made removed;
- ``bounds``: the ranges option values may take, and host names; ``log_limit``: repeated
  log records rate-limited per key, with a count of those held back;
- ``slots``: the slot allocator; ``frozen``: setters for frozen attrs classes' fields.

Nothing here is part of the plug-in contract (``kvfabric.spi``): a third-party plug-in never
imports it, and it may change in any release. It depends on the public modules only
(``kvfabric.errors``, ``kvfabric.descriptor``), never on ``kvfabric.spi``; ``frozen``
depends on nothing, so the public ``kvfabric.descriptor`` may use it.
"""
