"""Engine arguments, validated once into one configuration (vLLM's ``EngineArgs`` ->
``VllmConfig``).

``LLM(model, **kwargs)`` passes its keyword arguments here: ``EngineArgs(...).create_config()``
checks the type and range of every one before anything is loaded or allocated, and returns an
``EngineConfig``; once the model's config is known, ``EngineConfig.for_model`` checks what
depends on it (the context length, whether a KV block fits). The engine and its executor then
read their settings from that one object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from research.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from research.engine.request import check_bool, check_int, check_real

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_BIG = 2**31 - 1  # the device step holds positions, block ids and counts as int32


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is configured with, validated (``EngineArgs.create_config``)."""

    model: str
    dtype: str  # "float32" | "bfloat16" (resolved from "auto")
    seed: int
    max_model_len: int | None  # None: the model's context length (``for_model``)
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None
    quantization: str | None
    kv_cache_dtype: str
    attention_backend: str
    gemm_backend: str
    block_activations: str  # "float" | "int8" (resolved from "auto")
    executor: str  # "real" | "simulated"
    hardware: str | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    enable_expert_parallel: bool
    poison_freed_blocks: bool
    cost_model_options: dict[str, Any] | None
    speculative_acceptance_rate: float | None

    @property
    def jnp_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def for_model(self, cfg: ModelConfig) -> EngineConfig:
        """This configuration checked against the loaded model, ``max_model_len`` resolved."""
        max_model_len = (
            cfg.max_position_embeddings if self.max_model_len is None else self.max_model_len
        )
        if not 1 < max_model_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} must be in [2, "
                f"{cfg.max_position_embeddings}] (the model's context length)"
            )
        cache, sched = self.cache, self.scheduler
        if self.executor == "real" and cache.num_kv_blocks is None:
            from research.engine.kv_cache import kv_pool_bytes_per_block

            per_block = kv_pool_bytes_per_block(
                cfg, cache.block_size, self.jnp_dtype, self.kv_cache_dtype
            )
            if cache.kv_cache_memory_bytes < per_block:
                raise ValueError(
                    f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds no KV block: one "
                    f"block of {cache.block_size} tokens takes {per_block} bytes for {cfg.name}"
                )
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({sched.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len})"
            )
        if self.enable_expert_parallel and not cfg.is_moe:
            raise ValueError(f"enable_expert_parallel: {cfg.name} has no experts")
        return dataclasses.replace(self, max_model_len=max_model_len)


@dataclass(frozen=True)
class EngineArgs:
    """``LLM``'s keyword arguments, with vLLM's names and defaults (see ``LLM``)."""

    model: Any = "smollm2-135m"
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "continuous"
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    gemm_backend: str = "auto"
    quantization: str | None = None
    # 4-bit and 8-bit weights read as stored (quantization="gguf", or "awq" on the native
    # path): "float" multiplies float32 activations, "int8" quantizes each row's 32-k blocks
    # to int8 first (llama.cpp's arithmetic); "auto": int8 for GGUF files, float for AWQ.
    block_activations: str = "auto"
    kv_cache_dtype: str = "auto"
    executor: str = "real"
    hardware: str | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    poison_freed_blocks: bool = False
    cost_model_options: dict[str, Any] | None = None
    speculative_config: dict[str, Any] | None = None
    speculative_acceptance_rate: float | None = None

    def create_config(self) -> EngineConfig:
        """Every argument checked (ValueError naming it), before anything is loaded."""
        import os

        from research.models.load import auto_dtype
        from research.quant import QUANTIZATIONS
        from research.quant.kv import KV_DTYPES

        executor = self.executor
        if executor not in ("real", "simulated"):
            raise ValueError(f"executor must be 'real' or 'simulated', got {executor!r}")
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
        rate = self.speculative_acceptance_rate
        if speculative is not None and executor == "simulated":
            if speculative.method != "ngram":
                raise ValueError(
                    "the simulated executor prices n-gram speculation only (method 'ngram')"
                )
            if rate is None:
                raise ValueError(
                    "simulated speculative decoding needs speculative_acceptance_rate (the "
                    "fraction of drafts the target accepts, e.g. 0.7)"
                )
        if rate is not None:
            if speculative is None or executor != "simulated":
                raise ValueError(
                    "speculative_acceptance_rate is for executor='simulated' with a "
                    "speculative_config (a real run measures its acceptance)"
                )
            if not 0.0 <= check_real("speculative_acceptance_rate", rate) <= 1:
                raise ValueError(f"speculative_acceptance_rate must be in [0, 1], got {rate}")
        model = os.fspath(self.model) if isinstance(self.model, os.PathLike) else self.model
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a preset name or a path, got {model!r}")
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if executor == "simulated" else auto_dtype(model)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2, _BIG)
        check_int("seed", self.seed, 0, 2**32 - 1)  # the key of random-init weights
        check_int("max_num_seqs", self.max_num_seqs, 1, _BIG)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, _BIG)
        check_int("block_size", self.block_size, 1, _BIG)
        check_int("num_scheduler_steps", self.num_scheduler_steps, 1, 1024)
        if self.num_scheduler_steps > 1 and executor == "simulated":
            raise ValueError(
                "num_scheduler_steps > 1 runs on the real engine; the simulator prices one "
                "step per token (leave it at 1)"
            )
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 1, _BIG)
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, 2**63 - 1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1 << 16)
        utilization = check_real("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        for name in (
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "poison_freed_blocks",
            "enable_expert_parallel",
        ):
            check_bool(name, getattr(self, name))
        allowed = (*QUANTIZATIONS, "gguf")  # "gguf": a GGUF's blocks kept as stored
        if executor == "simulated":  # llama.cpp's files are priced as stored, not run
            from research.perf.cost_model import GGUF_FORMATS

            allowed = (*QUANTIZATIONS, *GGUF_FORMATS)
        if self.quantization == "gguf":
            from research.models.load import gguf_file

            if executor == "simulated" or gguf_file(model) is None:
                raise ValueError(
                    'quantization="gguf" keeps a GGUF file\'s Q4_1 and Q8_0 blocks as stored for '
                    f"the real engine; {model!r} is not a .gguf file or a bundled GGUF preset"
                    + (
                        ' (the simulator prices GGUF formats as "q8_0" / "gguf_mxfp4")'
                        if executor == "simulated"
                        else ""
                    )
                )
            if self.tensor_parallel_size > 1 or self.enable_expert_parallel:
                raise ValueError('quantization="gguf" runs on one device (no TP/EP plans)')
            if self.gemm_backend == "xla":
                raise ValueError(
                    'quantization="gguf" runs through the native kernels; gemm_backend="xla" '
                    "dequantizes instead (leave quantization unset)"
                )
        if self.quantization not in allowed:
            raise ValueError(f"quantization must be one of {allowed}, got {self.quantization!r}")
        if self.block_activations not in ("auto", "float", "int8"):
            raise ValueError(
                "block_activations must be 'auto', 'float' or 'int8', got "
                f"{self.block_activations!r}"
            )
        if self.block_activations != "auto" and self.quantization not in ("gguf", "awq"):
            raise ValueError(
                f"block_activations={self.block_activations!r} applies to weights read as stored "
                f"(quantization='gguf' or 'awq'), not quantization={self.quantization!r}"
            )
        block_activations = self.block_activations
        if block_activations == "auto":
            block_activations = "int8" if self.quantization == "gguf" else "float"
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if executor == "simulated" and self.hardware is None:
            raise ValueError('executor="simulated" needs hardware= (e.g. "gb10" or "h200")')
        return EngineConfig(
            model=model,
            dtype=dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                scheduling_policy=self.scheduling_policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
                num_scheduler_steps=self.num_scheduler_steps,
            ),
            speculative=speculative,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            attention_backend=self.attention_backend,
            gemm_backend=self.gemm_backend,
            block_activations=block_activations,
            executor=executor,
            hardware=self.hardware,
            gpu_memory_utilization=utilization,
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            poison_freed_blocks=self.poison_freed_blocks,
            cost_model_options=self.cost_model_options,
            speculative_acceptance_rate=rate,
        )
