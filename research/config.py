"""Frozen configuration dataclasses, one per concern.

These are the single schema of the project: presets are instances of them, loaders build them
from HF ``config.json`` / GGUF metadata, and the Hydra config groups (``configs/``) are backed by
them through Hydra's ConfigStore. No environment variable configures library code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

Architecture = Literal["llama", "qwen3", "qwen3_moe", "gpt_oss"]
# Architectures whose forward pass exists in research.models; the others are shapes only
# (used by the cost model and the KV-capacity formula).
RUNNABLE_ARCHITECTURES = ("llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of a decoder-only transformer. Sizes are data, not code.

    Dense models have ``num_experts == 0``; MoE models (Qwen3-MoE, gpt-oss) route every token
    to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``.
    """

    name: str
    architecture: Architecture
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # gpt-oss alternates sliding-window (this many tokens) and full attention layers.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"{self.name}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if not self.is_moe and self.intermediate_size <= 0:
            raise ValueError(f"{self.name}: a dense model needs intermediate_size > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def runnable(self) -> bool:
        return self.architecture in RUNNABLE_ARCHITECTURES

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """K and V bytes one token occupies across all layers (bf16 by default)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: ``num_kv_blocks`` blocks of ``block_size`` tokens, shared by all
    sequences. ``num_kv_blocks=None`` sizes the pool from ``kv_cache_memory_bytes``."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling (vLLM's names).

    ``continuous`` rebuilds the batch every step; ``static`` admits a new batch only when every
    request of the previous one has finished (the baseline continuous batching is compared to).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    scheduling_policy: Literal["continuous", "static"] = "continuous"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(
                f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}"
            )
