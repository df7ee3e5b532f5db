"""What a plugin needs of the record format: the header's size, slot alignment, record size.

A slot holds a record: a fixed header (magic, format version, key, version, payload length,
CRC32C of the payload and of the header) followed by the payload, starting on a
``SLOT_ALIGN`` boundary. Transports move records as bytes and indexes place them; neither
parses them (the client validates every record it lands).
"""

from __future__ import annotations

from kvfabric._runtime.record import HEADER_SIZE, SLOT_ALIGN, record_size

__all__ = ["HEADER_SIZE", "SLOT_ALIGN", "record_size"]
