"""kvfabric's own machinery, shared by the framework and the built-in plug-ins.

The native data path (``native``: CRC32C, copies and socket loops that take the GIL back
once per batch; its C sources in ``csrc/``), buffers and prefaulting, the control wire
codec, CPU and huge-page probes, the lookup image, the record codec and scanner, the
slot allocator, and setters for frozen attrs classes' fields (``frozen``). Nothing here is
part of the plug-in contract (``kvfabric.spi``): a third-party plug-in never imports it,
and it may change in any release. It depends on the
public modules only (``kvfabric.errors``, ``kvfabric.descriptor``), never on ``kvfabric.spi``;
``frozen`` depends on nothing, so the public ``kvfabric.descriptor`` may use it.
"""
