"""Content addresses: 32-byte keys for chunks of a prompt.

``chain_key`` makes the key of a chunk from the key of the chunk before it, so a key names
the whole prefix up to and including its chunk: equal prefixes give equal keys and are
stored once. ``fold_key`` turns a hash an engine already computed (vLLM's block hash,
LMCache's chunk hash) into a key, mixing in a namespace (model, dtype, layout, tenant) so
that different models or layouts never share a key.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable, Sequence

__all__ = ["KEY_SIZE", "ROOT_KEY", "chain_key", "chain_keys", "fold_key", "namespace_bytes"]

KEY_SIZE = 32
ROOT_KEY = bytes(KEY_SIZE)
"""The ``prev`` of a prompt's first chunk."""

# Distinct personalisations keep the two key families apart even for equal inputs.
_CHAIN_PERSON = b"kvfabric.chain"
_FOLD_PERSON = b"kvfabric.fold"
_U32 = struct.Struct("<I")


def _tokens_bytes(tokens: Sequence[int] | bytes | bytearray | memoryview) -> bytes:
    if isinstance(tokens, bytes | bytearray | memoryview):
        return bytes(tokens)
    # Token ids are < 2**32 for every tokenizer in use; array packs them without a loop.
    try:
        return array("I", tokens).tobytes()
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2**32)") from exc


def chain_key(
    prev: bytes,
    tokens: Sequence[int] | bytes | bytearray | memoryview,
    namespace: bytes = b"",
) -> bytes:
    """H(prev ‖ namespace ‖ tokens): the key of a chunk given the key of the chunk before it.

    ``tokens`` is a sequence of token ids (or their packed bytes). Use :data:`ROOT_KEY` as
    ``prev`` for the first chunk. Lengths are part of the hash, so no two different
    (namespace, tokens) pairs collide by concatenation.
    """
    if len(prev) != KEY_SIZE:
        raise ValueError(f"prev must be {KEY_SIZE} bytes, got {len(prev)}")
    h = hashlib.blake2b(digest_size=KEY_SIZE, person=_CHAIN_PERSON)
    h.update(prev)
    h.update(_U32.pack(len(namespace)))
    h.update(namespace)
    h.update(_tokens_bytes(tokens))
    return h.digest()


def chain_keys(
    tokens: Sequence[int], chunk_size: int, namespace: bytes = b"", *, full_only: bool = False
) -> list[bytes]:
    """The keys of every chunk of a token sequence, each chained on the one before.

    The last chunk may be partial unless ``full_only`` is set.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    keys: list[bytes] = []
    prev = ROOT_KEY
    end = len(tokens) - len(tokens) % chunk_size if full_only else len(tokens)
    for start in range(0, end, chunk_size):
        prev = chain_key(prev, tokens[start : min(start + chunk_size, end)], namespace)
        keys.append(prev)
    return keys


def fold_key(
    engine_hash: bytes | int | str, namespace: bytes | Iterable[bytes | str] = b""
) -> bytes:
    """Fold a hash an engine computed into a 32-byte key within ``namespace``.

    ``namespace`` is bytes, or parts (model, dtype, layout, tenant salt, ...) that are joined
    unambiguously. Ints are taken as unsigned 64-bit or wider (little-endian, minimal length).
    """
    if isinstance(engine_hash, int):
        if engine_hash < 0:
            engine_hash &= (1 << 64) - 1
        raw = engine_hash.to_bytes(max(8, (engine_hash.bit_length() + 7) // 8), "little")
    elif isinstance(engine_hash, str):
        raw = engine_hash.encode()
    else:
        raw = bytes(engine_hash)
    h = hashlib.blake2b(digest_size=KEY_SIZE, person=_FOLD_PERSON)
    ns = namespace_bytes(namespace)
    h.update(_U32.pack(len(ns)))
    h.update(ns)
    h.update(raw)
    return h.digest()


def namespace_bytes(parts: bytes | Iterable[bytes | str]) -> bytes:
    """Join namespace parts so that ("ab", "c") and ("a", "bc") differ."""
    if isinstance(parts, bytes):
        return parts
    out = bytearray()
    for part in parts:
        raw = part.encode() if isinstance(part, str) else bytes(part)
        out += _U32.pack(len(raw))
        out += raw
    return bytes(out)
