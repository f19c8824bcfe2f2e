"""Shared fixtures. SmolLM2 (ours and HF's) loads once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Four host devices, for the tensor- and expert-parallel tests; everything else runs on the
# first one, as on a one-device machine.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import pytest


@pytest.fixture(scope="session")
def smollm2_llm():
    from research import LLM

    return LLM("smollm2-135m", max_model_len=1024, dtype="float32")  # as the HF oracle


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
