"""Resolve a model name or path to (config, params, tokenizer)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from research.config import ModelConfig
from research.models.presets import PRESETS, get_preset
from research.models.transformer import Params, init_params
from research.models.weights import (
    checkpoint_dtype,
    is_checkpoint,
    load_gguf,
    load_hf_safetensors,
    restore_checkpoint,
    smollm2_gguf_path,
)
from research.tokenizer import Tokenizer

# Presets whose real weights ship with a Python package.
_BUNDLED_GGUF = {"smollm2-135m": smollm2_gguf_path}


def gguf_file(model: str | os.PathLike) -> Path | None:
    """The GGUF file ``model`` loads from (a bundled preset's or a .gguf path), else None."""
    name = str(model)
    if name in _BUNDLED_GGUF:
        return _BUNDLED_GGUF[name]()
    path = Path(name)
    return path if path.suffix == ".gguf" and path.is_file() else None


def auto_dtype(model: str | os.PathLike) -> str:
    """vLLM's ``dtype="auto"`` on this CPU backend: the checkpoint's dtype, with float32 and
    float16 checkpoints served in bfloat16 (vLLM maps float32 models to a 16-bit type, and
    XLA:CPU has no fast float16). So: bfloat16 for the bundled GGUF (Q4_1, dequantized) and for
    HF directories; an orbax checkpoint keeps the dtype it was saved in; random-init ``tiny-*``
    presets, which have no checkpoint, use float32."""
    name = str(model)
    if name in PRESETS and name not in _BUNDLED_GGUF:
        return "float32"
    path = Path(name)
    if path.is_dir() and is_checkpoint(path):
        return checkpoint_dtype(path)
    return "bfloat16"


def load_model(
    model: str | os.PathLike, dtype: Any = jnp.float32, seed: int = 0
) -> tuple[ModelConfig, Params, Tokenizer | None]:
    """``model`` is a preset name, a .gguf file, an HF directory or an orbax checkpoint.

    Presets with bundled weights load them; ``tiny-*`` presets are random-initialized from
    ``seed``; full-size presets are shapes only and cannot be loaded for the real executor.
    """
    name = str(model)
    if name in _BUNDLED_GGUF:
        path = _BUNDLED_GGUF[name]()
        cfg, params = load_gguf(path, dtype=dtype, name=name)
        return cfg, params, Tokenizer.from_gguf(path)
    if name in PRESETS:
        cfg = get_preset(name)
        if not name.startswith("tiny-"):
            raise ValueError(
                f"preset {name!r} is shapes only: its weights are not bundled; pass an HF "
                "directory with its safetensors, or a bundled preset such as 'smollm2-135m'"
            )
        return cfg, init_params(cfg, jax.random.key(seed), dtype), None
    path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        cfg, params = load_gguf(path, dtype=dtype)
        return cfg, params, Tokenizer.from_gguf(path)
    if path.is_dir() and is_checkpoint(path):
        cfg, params = restore_checkpoint(path)
        params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
        return cfg, params, None
    if path.is_dir() and (path / "config.json").exists():
        cfg, params = load_hf_safetensors(path, dtype=dtype)
        tok = None
        if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
            tok = Tokenizer.from_pretrained(path)
        return cfg, params, tok
    if path.exists():
        raise ValueError(
            f"{name} is neither a .gguf file, an HF directory (config.json + *.safetensors) "
            "nor an orbax checkpoint (model_config.json + params/)"
        )
    get_preset(name)  # raises the "unknown model preset" ValueError with the known names
    raise AssertionError("unreachable")
