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

import tempfile

# Every cache the code under test writes goes under one temporary folder per test run, never the
# home directory: the native kernels' build cache, the measured host peaks and JAX's persistent
# compilation cache (subprocesses inherit the variables).
_RUN_CACHE = tempfile.mkdtemp(prefix="research-tests-")
os.environ.setdefault("RESEARCH_NATIVE_CACHE", os.path.join(_RUN_CACHE, "native"))
os.environ.setdefault("RESEARCH_HOST_PEAKS_CACHE", os.path.join(_RUN_CACHE, "host_peaks.json"))
os.environ.setdefault("RESEARCH_JAX_CACHE_DIR", os.path.join(_RUN_CACHE, "jax"))

import pytest  # noqa: E402 (after the environment the code reads at import)
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run and machine (no example database).
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# JAX options a test may switch on (the persistent compilation cache) and that must not leak
# into the tests after it.
_JAX_OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


def pytest_sessionstart(session):
    """JAX's persistent compilation cache on for the whole session, in the run's temporary
    folder: every module sees the same setting (none turns it on for the ones after it), and a
    step shape compiled by one module is read back by the next (``_free_compiled_executables``
    drops the in-memory executables between modules).

    ``RESEARCH_REQUIRE_NATIVE=1`` (CI): a native kernel family that does not build fails the
    run instead of skipping its tests and leaving the engine on the XLA path unnoticed."""
    from research.engine.compile_cache import enable_compilation_cache

    enable_compilation_cache(os.environ["RESEARCH_JAX_CACHE_DIR"])
    if os.environ.get("RESEARCH_REQUIRE_NATIVE") != "1":
        return
    import platform

    from research import native

    families = ["attention"] + (["gemm"] if platform.machine() in ("x86_64", "AMD64") else [])
    failed = {f: native.build_error(f) for f in families if not native.available(f)}
    if failed:
        pytest.exit(
            "RESEARCH_REQUIRE_NATIVE=1 and native kernels did not build: "
            + "; ".join(f"{f}: {e}" for f, e in failed.items()),
            returncode=1,
        )


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count, after pytest's own list."""
    from collections import Counter

    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_line(
            f"skipped {sum(reasons.values())}: "
            + "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common())
        )


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
    import jax

    before = {name: getattr(jax.config, name) for name in _JAX_OPTIONS}
    yield
    import gc

    for name, value in before.items():
        if getattr(jax.config, name) != value:
            jax.config.update(name, value)
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
    jax.clear_caches()
    gc.collect()
