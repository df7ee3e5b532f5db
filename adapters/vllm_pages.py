"""A worker's paged KV cache seen as one byte value per block (for the vLLM connector).

vLLM gives each attention layer its own cache tensor with blocks on dim 0 (on CPU
``[num_blocks, kv_heads, block_size, 2 * head_size]``, all layers in one allocation, layer
after layer). A block's pages are therefore spread over the layers, and kvfabric stores one
contiguous value per block: each layer's page of that block, in layer order. ``scatter``
copies values into the pages (loads land in a staging buffer first: see ``vllm_loads``)
and ``gather`` copies pages out into values (saves); ``host_pages_of`` gives a block's
host pages, where kvfabric's scattered read could land a value directly. A page is moved
whole, never interpreted (on CPU its inside is packed by the attention kernel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]

from kvfabric._runtime.native import copy_many

__all__ = ["PagedKV"]


@dataclass(frozen=True)
class _Layer:
    name: str
    description: str
    pages: torch.Tensor
    """The layer's cache as bytes, [num_blocks, *page shape]."""
    host_pages: np.ndarray | None
    """The same memory as a numpy array when it is in host memory."""

    @property
    def page_bytes(self) -> int:
        return int(self.pages[0].numel())


class PagedKV:
    """The per-layer KV caches of one worker; see the module docstring."""

    def __init__(self, caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """``caches``: layer name → cache tensor, in layer order (as vLLM registers them).

        Raises ``ValueError`` for a cache that cannot be seen as bytes with blocks on dim 0.
        """
        layers: list[_Layer] = []
        for name, cache in caches.items():
            if cache.shape[0] != num_blocks:
                if cache.shape[0] % num_blocks:
                    raise ValueError(
                        f"{name}: {tuple(cache.shape)} has no block dim of {num_blocks}"
                    )
                # Kernel blocks smaller than vLLM's blocks: group them back, as vLLM does.
                cache = cache.view(num_blocks, -1, *cache.shape[1:])
            try:
                pages = cache.view(torch.uint8)
            except RuntimeError as exc:
                raise ValueError(
                    f"{name}: cannot view {cache.dtype} cache as bytes: {exc}"
                ) from exc
            host = pages.numpy() if pages.device.type == "cpu" else None
            description = f"{name}:{cache.dtype}:{tuple(cache.shape[1:])}"
            layers.append(_Layer(name, description, pages, host))
        if not layers:
            raise ValueError("no KV cache layers")
        self._layers = layers
        self.device = layers[0].pages.device
        self.value_bytes = sum(layer.page_bytes for layer in layers)
        """Bytes of one block's value: its page of every layer."""

    def describe(self) -> str:
        """Each layer's name, dtype and page shape: what a value's bytes mean."""
        return ";".join(layer.description for layer in self._layers)

    def host_pages_of(self, block_id: int) -> list[np.ndarray] | None:
        """Block ``block_id``'s page of every layer, in layer order, as writable host arrays.

        A value can land straight in these (kvfabric's scattered read); None when the cache
        is in device memory.
        """
        if any(layer.host_pages is None for layer in self._layers):
            return None
        return [layer.host_pages[block_id] for layer in self._layers]  # type: ignore[index]

    def new_values(self, rows: int) -> torch.Tensor:
        """An uninitialised host buffer for ``rows`` block values ([rows, value_bytes])."""
        return torch.empty(
            (rows, self.value_bytes), dtype=torch.uint8, pin_memory=self.device.type == "cuda"
        )

    def scatter(self, values: torch.Tensor, rows: Sequence[tuple[int, int]]) -> None:
        """Copy ``values[row]`` into block ``block_id`` of every layer, per (row, block_id)."""
        self._copy(values, rows, into_pages=True)

    def gather(self, block_ids: Sequence[int], values: torch.Tensor) -> None:
        """Copy block ``block_ids[i]`` of every layer into ``values[i]``."""
        self._copy(values, list(enumerate(block_ids)), into_pages=False)

    def _copy(
        self, values: torch.Tensor, rows: Sequence[tuple[int, int]], *, into_pages: bool
    ) -> None:
        if self.device.type == "cpu":
            self._copy_host(values, rows, into_pages=into_pages)
            return
        offset = 0
        for layer in self._layers:
            size = layer.page_bytes
            shape = tuple(layer.pages.shape[1:])
            # Device pages: values are pinned host memory, so these copies are async.
            for row, block_id in rows:
                tensor_value = values[row, offset : offset + size].view(shape)
                tensor_page = layer.pages[block_id]
                if into_pages:
                    tensor_page.copy_(tensor_value, non_blocking=True)
                else:
                    tensor_value.copy_(tensor_page, non_blocking=True)
            offset += size
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _copy_host(
        self, values: torch.Tensor, rows: Sequence[tuple[int, int]], *, into_pages: bool
    ) -> None:
        # One native call for every page, which lets go of the GIL once: a copy per page
        # would wait for the GIL again after each page beside a busy engine thread, and
        # torch would split each copy over its thread pool, whose threads vLLM pins to the
        # cores the engine computes on.
        host_values = values.numpy()
        pairs: list[tuple[Any, Any]] = []  # numpy arrays: buffers to the native copy
        offset = 0
        for layer in self._layers:
            size = layer.page_bytes
            pages = layer.host_pages
            assert pages is not None
            for row, block_id in rows:
                value = host_values[row, offset : offset + size]
                page = pages[block_id].reshape(-1)
                pairs.append((page, value) if into_pages else (value, page))
            offset += size
        if pairs:
            copy_many(pairs)
