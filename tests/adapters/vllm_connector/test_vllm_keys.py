"""The vLLM connector's keys: every part of the namespace separates keys (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvfabric.adapters.vllm_keys import VALUE_FORMAT, KeySpace, block_keys, engine_parts
from kvfabric.keys import fold_key

HASHES = [bytes([i]) * 32 for i in range(4)]


def vllm_config_stand_in(**changes: Any) -> Any:
    """Stands in for vLLM's VllmConfig: the attributes engine_parts reads, nothing else."""
    values: dict[str, Any] = {
        "model": "org/model",
        "revision": "main",
        "dtype": "torch.float32",
        "cache_dtype": "auto",
        "block_size": 32,
        "prefix_caching_hash_algo": "sha256_cbor",
        "pipeline_parallel_size": 1,
        "tensor_parallel_size": 2,
        **changes,
    }
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=values["model"], revision=values["revision"], dtype=values["dtype"]
        ),
        cache_config=SimpleNamespace(
            cache_dtype=values["cache_dtype"],
            block_size=values["block_size"],
            prefix_caching_hash_algo=values["prefix_caching_hash_algo"],
        ),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=values["pipeline_parallel_size"],
            tensor_parallel_size=values["tensor_parallel_size"],
        ),
    )


def keys_of(config: Any, *, model_id: str | None = None, version: str = "0.32.0") -> list[bytes]:
    space = KeySpace(
        engine_parts=engine_parts(config, "NHD", vllm_version=version, model_id=model_id)
    )
    return space.keys(HASHES, rank=(0, 0), layout="device=cpu", cache_salt=None)


def test_engine_parts_name_the_value_format_version_model_and_geometry() -> None:
    parts = engine_parts(vllm_config_stand_in(), "NHD", vllm_version="0.32.0")
    assert parts[0] == VALUE_FORMAT
    assert "vllm=0.32.0" in parts
    assert "model=org/model" in parts
    assert "block_size=32" in parts
    assert "hash=sha256_cbor" in parts
    assert "kv_cache_layout=NHD" in parts
    assert "pp=1,tp=2" in parts


def test_every_engine_part_separates_keys_and_equal_engines_agree() -> None:
    base = keys_of(vllm_config_stand_in())
    assert keys_of(vllm_config_stand_in()) == base
    assert len(set(base)) == len(HASHES)
    changes: list[dict[str, Any]] = [
        {"model": "org/other"},
        {"revision": "v2"},
        {"dtype": "torch.bfloat16"},
        {"cache_dtype": "fp8"},
        {"block_size": 16},
        {"prefix_caching_hash_algo": "sha256"},
        {"tensor_parallel_size": 4},
    ]
    for change in changes:
        assert set(keys_of(vllm_config_stand_in(**change))).isdisjoint(base), change
    assert set(keys_of(vllm_config_stand_in(), version="0.33.0")).isdisjoint(base)


def test_model_id_names_the_weights_instead_of_their_path() -> None:
    at_a = keys_of(vllm_config_stand_in(model="/mnt/a/llama"), model_id="llama-3-8b")
    at_b = keys_of(vllm_config_stand_in(model="/srv/b/llama"), model_id="llama-3-8b")
    assert at_a == at_b
    assert set(at_a).isdisjoint(keys_of(vllm_config_stand_in(model="/mnt/a/llama")))


def test_rank_layout_and_salt_separate_keys_within_one_engine() -> None:
    space = KeySpace(engine_parts=("e",))

    def keys(rank: tuple[int, int] = (0, 0), layout: str = "L", salt: str | None = None) -> Any:
        return space.keys(HASHES, rank=rank, layout=layout, cache_salt=salt)

    base = keys()
    for other in (keys(rank=(0, 1)), keys(rank=(1, 0)), keys(layout="M"), keys(salt="t1")):
        assert set(other).isdisjoint(base)
    assert keys(salt="t1") == keys(salt="t1")
    # A salt is never confused with no salt, even an empty one.
    assert set(keys(salt="")).isdisjoint(base)


def test_keys_are_vllms_block_hashes_folded_into_the_namespace() -> None:
    space = KeySpace(engine_parts=("e",))
    namespace = space.namespace((0, 0), "L", None)
    assert len(namespace) == 32
    expected = [fold_key(h, namespace) for h in HASHES]
    assert block_keys(namespace, HASHES) == expected
    assert space.keys(HASHES, rank=(0, 0), layout="L", cache_salt=None) == expected
