"""Shared fixtures. SmolLM2 (ours and HF's) loads once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture(scope="session")
def smollm2_llm():
    from research import LLM

    return LLM("smollm2-135m", max_model_len=1024)


@pytest.fixture(scope="session")
def smollm2_hf():
    """HF transformers' model and tokenizer read from the same GGUF file (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from research.models.weights import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_executables():
    """Drop JAX's compiled executables after each module. XLA:CPU maps a few memory regions per
    executable and the kernel caps a process at vm.max_map_count (65,530 by default) mappings:
    the whole suite in one process compiles enough step shapes to reach it, and LLVM's JIT then
    crashes (SIGSEGV) inside the next compile. Shapes a module needs again recompile."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
