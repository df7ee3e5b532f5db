"""The served model's shape, what it costs per prompt token, and the random model the bench makes.

Whether loading a prefix beats recomputing it depends on one ratio: the FLOPs a prefill spends
per token against the bytes of KV that token leaves in the cache. :class:`ModelShape` computes
both from a Llama-style ``config.json`` (the random model's, or a real checkpoint's), and the
named real models and GPUs below are what the projection is made for. Their figures are
datasheet values (shapes from the models' published configs, dense BF16 peak FLOP/s), not
measurements.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["GPUS", "REAL_MODELS", "Gpu", "ModelShape", "make_random_model"]

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer with grouped-query attention and a gated MLP (Llama, Qwen)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, path: Path, dtype: str, name: str | None = None) -> ModelShape:
        """The shape in a checkpoint's ``config.json`` (``dtype``: the KV cache's)."""
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
        config = config.get("text_config", config)  # multimodal checkpoints nest it
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                name=name or path.name,
                layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
            )
        except KeyError as exc:
            raise ValueError(
                f"{path / 'config.json'} has no {exc.args[0]!r}: the bench knows Llama-style "
                "configs (num_hidden_layers, hidden_size, num_attention_heads, "
                "num_key_value_heads, intermediate_size, vocab_size)"
            ) from None

    @property
    def dense_params(self) -> int:
        """Weights every token multiplies through: attention projections and the MLP."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    def prefill_flops_per_token(self, prompt_tokens: int) -> float:
        """FLOPs per token of a prefill of ``prompt_tokens`` (averaged over the prompt).

        ``2 * dense_params`` for the matrix multiplies, plus causal attention: the token at
        position p spends ``4 * heads * head_dim * p`` per layer on QK^T and AV, which
        averages to ``2 * layers * heads * head_dim * prompt_tokens``. The LM head runs for
        the last token only and is left out.
        """
        attention = 2 * self.layers * self.heads * self.head_dim * prompt_tokens
        return 2.0 * self.dense_params + attention

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        """One layer's page of one block (K and V), as vLLM's paged cache holds it."""
        return block_size * self.kv_bytes_per_token // self.layers

    def flops_per_kv_byte(self, prompt_tokens: int) -> float:
        return self.prefill_flops_per_token(prompt_tokens) / self.kv_bytes_per_token

    def describe(self, prompt_tokens: int) -> dict[str, Any]:
        return {
            **asdict(self),
            "dense_params": self.dense_params,
            "at_prompt_tokens": prompt_tokens,
            "prefill_flops_per_token": self.prefill_flops_per_token(prompt_tokens),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "flops_per_kv_byte": self.flops_per_kv_byte(prompt_tokens),
        }


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float
    """Dense BF16 tensor-core peak (datasheet)."""
    host_link_bytes_per_s: float
    """Host-to-device copy bandwidth a load through pinned memory can reach (nominal)."""


REAL_MODELS = {
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": ModelShape("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256),
}
"""Shapes from the models' published ``config.json`` files, BF16 KV."""

GPUS = {
    "h100-sxm": Gpu("H100 SXM", 989e12, 50e9),
    "h200": Gpu("H200", 989e12, 50e9),
    "a100-sxm": Gpu("A100 SXM", 312e12, 25e9),
    "l40s": Gpu("L40S", 362e12, 25e9),
}
"""Peak: NVIDIA datasheets (dense, no sparsity). Host link: PCIe 5.0 x16 (H100, H200) or
4.0 x16 at roughly 80 % of its nominal rate."""


def make_random_model(directory: Path, shape: ModelShape, dtype: str, seed: int = 0) -> Path:
    """A seeded random-weight Llama of ``shape`` in ``directory`` (reused when it exists).

    Nothing is downloaded. Random weights (``initializer_range`` 0.05, as the connector's
    tests use) cost exactly what trained ones do per token; only the text is meaningless,
    and the bench sends token ids.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=32768,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    marker = directory / "kvfabric-bench-shape.json"
    wanted = json.dumps({**asdict(shape), "dtype": dtype, "seed": seed}, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))  # type: ignore[no-untyped-call]
    model.save_pretrained(directory, safe_serialization=True)
    marker.write_text(wanted)
    return directory
