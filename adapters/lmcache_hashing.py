"""Whether LMCache's chunk keys agree between engine processes (checked at start-up).

Engines share a chunk through kvfabric only if they give it the same ``CacheEngineKey``, and
LMCache 0.5.6 names a chunk by a hash chain over its tokens. Which hash, as LMCache picks it:

- ``pre_caching_hash_algorithm`` (config key; env ``LMCACHE_PRE_CACHING_HASH_ALGORITHM``),
  default ``builtin``: Python's ``hash()``. Any other name (``sha256``, ``sha256_cbor``,
  ``xxhash``, ``xxhash_cbor``) is taken from vLLM, and is Python's ``hash()`` again where vLLM
  is not importable.
- Where vLLM is importable, the chain starts from vLLM's ``NONE_HASH``, the algorithm applied
  to ``PYTHONHASHSEED`` when set, else to a fixed seed (``sha256*``, ``builtin``) or to
  random bytes (``xxhash*``).

Python salts ``hash()`` of text per process unless ``PYTHONHASHSEED`` is set. In a vLLM
engine a ``builtin`` chain starts from ``hash()`` of a string, so without the seed every
process has its own keys (LMCache requires the seed for ``builtin`` anywhere), and ``xxhash*``
chains start from random bytes: each engine misses the others' chunks and stores its own
copy. ``sha256_cbor`` (taken from vLLM) or one ``PYTHONHASHSEED`` everywhere fixes it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Any

__all__ = ["chunk_hash_problem", "warn_if_chunk_hashes_unshared"]

log = logging.getLogger("kvfabric.lmcache")

_FROM_VLLM = frozenset({"sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash", "xxhash_cbor"})
"""The names LMCache takes from vLLM (``sha256_cbor_64bit`` is the old name of sha256_cbor)."""
_RANDOM_START_IN_VLLM = frozenset({"xxhash", "xxhash_cbor"})
"""Not collision resistant: vLLM starts their chains from random bytes without a seed."""


def chunk_hash_problem(
    algorithm: str, *, pythonhashseed: str | None, vllm_installed: bool
) -> str | None:
    """Why LMCache's chunk hashes may differ between processes; None when they agree."""
    if vllm_installed and algorithm in _FROM_VLLM:
        if algorithm in _RANDOM_START_IN_VLLM and pythonhashseed is None:
            return (
                f"vLLM starts LMCache's {algorithm} chunk hashes from random bytes in every "
                "process (PYTHONHASHSEED is not set)"
            )
        return None
    # Python's hash() from here on; `PYTHONHASHSEED=random` salts it like no seed at all.
    if pythonhashseed not in (None, "random"):
        return None
    if algorithm == "builtin":
        which = "pre_caching_hash_algorithm: builtin, LMCache's default"
    elif algorithm in _FROM_VLLM:
        which = f"{algorithm} is taken from vLLM, which is not installed here"
    else:
        which = f"LMCache does not know {algorithm!r}"
    if vllm_installed:
        why = "in a vLLM engine each chunk's hash chain starts from hash() of a string"
    else:
        why = "LMCache requires the same PYTHONHASHSEED in every process for it"
    return (
        f"LMCache hashes chunks with Python's hash() ({which}), salted per process "
        f"without PYTHONHASHSEED ({why})"
    )


def warn_if_chunk_hashes_unshared(config: Any) -> None:
    """Log, once per connector, whether other engine processes can find this one's chunks."""
    algorithm = str(getattr(config, "pre_caching_hash_algorithm", None) or "builtin")
    seed = os.environ.get("PYTHONHASHSEED")
    vllm_installed = _vllm_installed()
    problem = chunk_hash_problem(algorithm, pythonhashseed=seed, vllm_installed=vllm_installed)
    if problem is None:
        if seed is not None:
            log.info(
                "kvfabric: PYTHONHASHSEED=%s seeds LMCache's chunk hashes; only engine "
                "processes with the same value share chunks",
                seed,
            )
        return
    fix = "set the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0) on every engine process"
    if vllm_installed:
        fix = (
            "set pre_caching_hash_algorithm: sha256_cbor in LMCache's configuration "
            "(or LMCACHE_PRE_CACHING_HASH_ALGORITHM=sha256_cbor), or " + fix
        )
    log.warning(
        "kvfabric: %s, so no other engine process finds the chunks this one stores (each "
        "stores its own copy). To share chunks through kvfabric, %s.",
        problem,
        fix,
    )


def _vllm_installed() -> bool:
    """Whether LMCache can take hash functions from vLLM in this process."""
    if "vllm" in sys.modules:
        return True
    spec = importlib.util.find_spec("vllm")
    # A directory named vllm on the path is a namespace package, not vLLM (origin None).
    return spec is not None and spec.origin is not None
