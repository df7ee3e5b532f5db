"""A tenant's store: every key the caller passes becomes the tenant's index key.

``kvfabric://HOST:PORT?tenant=NAME&secret_file=FILE&controller_key=KEY`` connects as tenant
NAME. The caller's keys are its own content addresses, as anywhere; this store turns each
into a keyed hash carrying the tenant's tag (:class:`~kvfabric._control.tenant_keys.TenantKeys`)
at the door, and everything inside — the lookup image it probes, the prefetch cache, the
records it writes and validates, what it asks the controller — works on those. The
controller does not rely on it: it sets the tag on whatever a tenant's connection sends
(:mod:`kvfabric._control.tenant_index`). The keyed hash is what keeps the shared lookup
image from telling other readers which prompts this tenant stored.

Descriptors this store returns (``locate``, ``prefetched``) carry the index keys, and
``remember`` takes them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfabric._client.key_checks import check_keys
from kvfabric._client.put_outcome import PutOutcome
from kvfabric._client.store import Opener, Store
from kvfabric._control.tenant_keys import TenantKeys
from kvfabric._plugins import PluginManager
from kvfabric.descriptor import Descriptor
from kvfabric.spi.events import EngineBlock
from kvfabric.urls import ClientOptions

__all__ = ["TenantStore"]


class TenantStore(Store):
    """A :class:`Store` whose keys are one tenant's namespace."""

    def __init__(
        self,
        *,
        options: ClientOptions,
        plugins: PluginManager,
        opener: Opener,
        tenant: TenantKeys,
    ) -> None:
        self._tenant = tenant
        super().__init__(options=options, plugins=plugins, opener=opener)

    @property
    def tenant(self) -> str:
        return self._tenant.name

    def index_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys ``keys`` are stored under in the index (a bad key raises)."""
        check_keys(keys)
        return self._tenant.index_keys(keys)

    def batched_contains(self, keys: Sequence[bytes]) -> int:
        return super().batched_contains(self.index_keys(keys))

    def batched_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return super().batched_exists(self.index_keys(keys))

    def locate(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return super().locate(self.index_keys(keys))

    def prefetched(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return super().prefetched(self.index_keys(keys))

    def batched_get(
        self, keys: Sequence[bytes], into: Sequence[Any] | None = None
    ) -> list[memoryview | None]:
        return super().batched_get(self.index_keys(keys), into)

    def batched_get_scattered(
        self, keys: Sequence[bytes], into: Sequence[Sequence[Any]]
    ) -> list[bool]:
        return super().batched_get_scattered(self.index_keys(keys), into)

    def batched_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        blocks: Sequence[EngineBlock | None] | None = None,
    ) -> list[PutOutcome]:
        """``Store.batched_put``; ``blocks`` are taken and not sent: a tenant's values are
        told in the KV events by their index keys alone (docs/kv-events.md)."""
        return super().batched_put(self.index_keys(keys), values)

    def delete(self, keys: Sequence[bytes]) -> int:
        return super().delete(self.index_keys(keys))
