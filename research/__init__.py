"""LLM serving research on small boxes: functional JAX models, paged KV cache, continuous
batching, 4-bit weights and Pallas kernels.

``from research import LLM, SamplingParams`` is the offline API. The heavy imports (JAX,
transformers) happen on first use, so host-side modules such as the scheduler stay JAX-free.
"""

from typing import Any

__all__ = ["LLM", "CompletionOutput", "ModelConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from research.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from research.engine import request

        return getattr(request, name)
    if name == "ModelConfig":
        from research.config import ModelConfig

        return ModelConfig
    raise AttributeError(f"module 'research' has no attribute {name!r}")
