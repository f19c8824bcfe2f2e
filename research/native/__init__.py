"""Native CPU kernels, compiled from C++ on first use and called from XLA through its FFI.

XLA:CPU has no paged attention: the reference path (``research.engine.kv_cache``) gathers every
row's pages into a padded copy per layer, then runs masked attention over it, and XLA:CPU moves
gathered bytes at a fraction of its streaming bandwidth. ``paged_attention`` reads the pages in
place through the block tables instead (``paged_attention.cc``), as vLLM's CPU backend does, for
decode and verification rows; ``packed_attention`` runs a call's prefill chunks in one causal
pass over the packed tokens (each over its row's pages and the row's own new tokens). ``gemm``
(``gemm.cc``) multiplies bfloat16 projections on the CPU's AMX tiles.

The library is built with the system C++ compiler (``$CXX`` or ``g++``) against the FFI headers
that jaxlib ships, once per source, jaxlib version and CPU, into ``$RESEARCH_NATIVE_CACHE``
(default ``~/.cache/research-native``). ``available()`` says whether it built; callers fall back
to the XLA path when it did not, and ``build_error()`` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "paged_attention.cc", _HERE / "gemm.cc"]
_HEADERS = [_HERE / "parallel.h", _HERE / "vec_math.h"]
_TARGET = "research_paged_attention"
_GEMM_TARGET = "research_gemm_bf16"
_PACKED_TARGET = "research_packed_attention"
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    import jax
    import jaxlib

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w"]
    if platform.machine() in ("x86_64", "AMD64"):  # 512-bit vectors; AMX where the compiler can
        x86 = ["-mprefer-vector-width=512", "-mamx-tile", "-mamx-bf16"]
        probe = subprocess.run(
            [compiler, *x86, "-x", "c++", "-fsyntax-only", "-"],
            input="",
            capture_output=True,
            text=True,
        )
        flags += x86 if probe.returncode == 0 else []
    texts = [p.read_text() for p in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256(
        "\n".join(
            [*texts, jaxlib.__version__, compiler, " ".join(flags), _cpu_signature()]
        ).encode()
    ).hexdigest()[:16]
    cache = Path(
        os.environ.get("RESEARCH_NATIVE_CACHE", Path.home() / ".cache" / "research-native")
    )
    lib = cache / f"paged_attention-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *flags, "-I", jax.ffi.include_dir(), "-o", str(out)]
        cmd += [str(p) for p in _SOURCES]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: concurrent builders each install a whole library
    return lib


def _load() -> bool:
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            import jax

            lib = ctypes.cdll.LoadLibrary(str(_build()))
            jax.ffi.register_ffi_target(
                _TARGET, jax.ffi.pycapsule(lib.PagedAttention), platform="cpu"
            )
            jax.ffi.register_ffi_target(
                _PACKED_TARGET, jax.ffi.pycapsule(lib.PackedAttention), platform="cpu"
            )
            jax.ffi.register_ffi_target(
                _GEMM_TARGET, jax.ffi.pycapsule(lib.GemmBf16), platform="cpu"
            )
            _state["ok"], _state["lib"] = True, lib
        except Exception as exc:  # no compiler, headers or loader: the XLA path serves instead
            _state["ok"], _state["error"] = False, str(exc)
            log.warning("native CPU kernels unavailable, using the XLA path: %s", exc)
        return _state["ok"]


def available() -> bool:
    """True once the native library is built and registered with XLA (built on first call)."""
    return _load()


def build_error() -> str | None:
    """Why the native library is unavailable (None when it is, or was never tried)."""
    return _state.get("error")


def paged_attention(
    q: Any, k_pages: Any, v_pages: Any, block_tables: Any, lengths: Any, scale: float
) -> tuple[Any, Any]:
    """Attention of each query over the first ``lengths[i]`` tokens of its pages, in place.

    q [N, H, E] (any float dtype; computed in float32), k_pages / v_pages [K, B, P, E] float32
    or bfloat16 (also as uint16 bits), block_tables [N, M] int32, lengths [N] int32 ->
    (out [N, H, E] float32, lse [N, H] float32); out 0 and lse -inf where lengths is 0, the
    contract of ``pallas_kernels.paged_attention`` with ``return_lse=True``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if not _load():
        raise RuntimeError(f"native paged attention unavailable: {build_error()}")
    n, h, e = q.shape
    call = jax.ffi.ffi_call(
        _TARGET,
        (
            jax.ShapeDtypeStruct((n, h, e), jnp.float32),
            jax.ShapeDtypeStruct((n, h), jnp.float32),
        ),
    )
    return call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        block_tables.astype(jnp.int32),
        lengths.astype(jnp.int32),
        scale=np.float32(scale),
    )


def packed_attention(
    q: Any,
    k_new: Any,
    v_new: Any,
    k_pages: Any,
    v_pages: Any,
    block_tables: Any,
    row_start: Any,
    row_first: Any,
    row_count: Any,
    scale: float,
) -> Any:
    """Causal attention of a call's packed tokens over their rows' cached context and the rows'
    own new tokens, in one pass (prefill chunks; ``paged_attention.cc``).

    q [N, H, E], k_new / v_new [N, K, E] (any float dtype; computed in float32), k_pages /
    v_pages [K, B, P, E] float32 or bfloat16, block_tables [R, M] int32, row_start [R] (cached
    tokens per row), row_first [R] (packed index of each row's first token; a row's tokens are
    contiguous), row_count [R] (0: an empty row) -> out [N, H, E] float32, 0 for tokens of no
    row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if not _load():
        raise RuntimeError(f"native packed attention unavailable: {build_error()}")
    f32, i32 = jnp.float32, jnp.int32
    call = jax.ffi.ffi_call(_PACKED_TARGET, jax.ShapeDtypeStruct(q.shape, f32))
    return call(
        q.astype(f32),
        k_new.astype(f32),
        v_new.astype(f32),
        k_pages,
        v_pages,
        block_tables.astype(i32),
        row_start.astype(i32),
        row_first.astype(i32),
        row_count.astype(i32),
        scale=np.float32(scale),
    )


__all__ = ["available", "build_error", "packed_attention", "paged_attention"]
