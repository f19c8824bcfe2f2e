"""Native CPU kernels, compiled from C++ on first use and called from XLA through its FFI.

XLA:CPU has no paged attention: the reference path (``research.engine.kv_cache``) gathers every
row's pages into a padded copy per layer, then runs masked attention over it, and XLA:CPU moves
gathered bytes at a fraction of its streaming bandwidth. ``paged_attention`` reads the pages in
place through the block tables instead (``paged_attention.cc``), as vLLM's CPU backend does, for
decode and verification rows; ``packed_attention`` runs a call's prefill chunks in one causal
pass over the packed tokens (each over its row's pages and the row's own new tokens). ``gemm``
(``gemm.cc``) multiplies a model's projections: bfloat16 on the CPU's AMX tiles where it has them,
else, and float32 always, on a vector kernel the compiler builds for whatever the CPU has; and
GGUF's Q4_1 / Q8_0 blocks as stored.

Each kernel family is its own library (``FAMILIES``: ``attention``, ``gemm``), so a compile
failure in one loses only its own kernels. A library is built with the system C++ compiler
(``$CXX`` or ``g++``) against the FFI headers jaxlib ships, into ``$RESEARCH_NATIVE_CACHE``
(default ``~/.cache/research-native``), under a name keyed by its sources and headers, the
jaxlib version, the compiler and its version, the flags, the CPU architecture and the CPU's
feature flags: a cache shared between machines, compilers or CPUs never hands one the other's
library. Builders take a file lock in the cache (one process builds, the others wait and load
its result) and the compile has a timeout (``$RESEARCH_NATIVE_BUILD_TIMEOUT``, default 600 s).
``available(family)`` says whether a family built (callers fall back to the XLA path when not,
with a warning that names the family and the error); ``build_error(family)`` says why;
``build_events()`` says, per family, whether this process compiled it or found it built.

Libraries are built for ``-march=native`` unless ``$RESEARCH_NATIVE_MARCH`` names another target
(``x86-64-v3``: AVX2; ``x86-64-v2``: SSE only). Before a library is built or loaded, the
instruction sets its ``-march`` assumes (the compiler's predefined macros) are checked against the
CPU's flags: a requested target this CPU cannot run falls back to ``native`` with a warning
naming what was missing, so no process dies of an illegal instruction; ``built_march(family)``
says what a loaded library targets.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_HEADERS = [_HERE / "parallel.h", _HERE / "vec_math.h"]
# family -> (sources, FFI targets: registered name -> exported symbol)
FAMILIES: dict[str, tuple[list[Path], dict[str, str]]] = {
    "attention": (
        [_HERE / "paged_attention.cc"],
        {
            "research_paged_attention": "PagedAttention",
            "research_packed_attention": "PackedAttention",
            "research_packed_attention_write": "PackedAttentionWrite",
        },
    ),
    "gemm": (
        [_HERE / "gemm.cc"],
        {
            "research_gemm_bf16": "GemmBf16",
            "research_gemm_f32": "GemmF32",
            "research_gemm_blocks": "GemmBlocks",
            "research_stream": "Stream",
            "research_greedy": "Greedy",
            "research_add_rms_norm": "AddRmsNorm",
            "research_rms_norm": "RmsNorm",
        },
    ),
}
_TARGET = "research_paged_attention"
_GEMM_TARGET = "research_gemm_bf16"
_GEMM_F32_TARGET = "research_gemm_f32"
_GEMM_BLOCKS_TARGET = "research_gemm_blocks"
_STREAM_TARGET = "research_stream"
_GREEDY_TARGET = "research_greedy"
_ADD_RMS_NORM_TARGET = "research_add_rms_norm"
_RMS_NORM_TARGET = "research_rms_norm"
_PACKED_TARGET = "research_packed_attention"
_PACKED_WRITE_TARGET = "research_packed_attention_write"
BUILD_TIMEOUT_S = 600.0
_lock = threading.Lock()
_state: dict[str, dict[str, Any]] = {}


def _cpu_signature() -> str:
    """The CPU's architecture, model and feature flags (what ``-march=native`` compiles for):
    x86's ``model name`` and ``flags``, ARM's implementer, part and ``Features``, and on
    aarch64 the kernel's HWCAP feature names."""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU architecture")
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(keys)]
    except OSError:
        lines = [platform.processor()]
    hwcaps = _arm_hwcaps()
    if hwcaps is not None:
        lines.append("hwcaps: " + " ".join(sorted(hwcaps)))
    return "\n".join([platform.machine(), *sorted(set(lines))])


def cache_dir() -> Path:
    return Path(os.environ.get("RESEARCH_NATIVE_CACHE", Path.home() / ".cache" / "research-native"))


def _compiler() -> tuple[str, str]:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    return compiler, (version[0] if version else "")


# Compiler macros for instruction sets a build may assume -> the /proc/cpuinfo flag each needs
# (AMX is not here: the AMX path checks CPUID and asks the OS for the tile state at run time).
_ISA_MACROS = {
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__BMI2__": "bmi2", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512FP16__": "avx512_fp16", "__AVXVNNI__": "avx_vnni",
    "__ARM_NEON": "asimd", "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp",
    "__ARM_FEATURE_SVE": "sve", "__ARM_FEATURE_SVE2": "sve2", "__ARM_FEATURE_DOTPROD": "asimddp",
    "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16", "__ARM_FEATURE_MATMUL_INT8": "i8mm",
}  # fmt: skip


def march() -> str:
    """The ``-march`` the libraries are built for: ``$RESEARCH_NATIVE_MARCH`` (e.g. ``x86-64-v3``
    for an AVX2 build, ``x86-64-v2`` for SSE only), default ``native`` (this CPU)."""
    return os.environ.get("RESEARCH_NATIVE_MARCH", "native")


def _flags(compiler: str, arch: str | None = None) -> list[str]:
    arch = arch or march()
    flags = ["-O3", f"-march={arch}", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w"]
    if platform.machine() in ("x86_64", "AMD64"):  # 512-bit vectors; AMX where the compiler can
        x86 = ["-mprefer-vector-width=512", "-mamx-tile", "-mamx-bf16"]
        probe = subprocess.run(
            [compiler, *x86, "-x", "c++", "-fsyntax-only", "-"],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
        flags += x86 if probe.returncode == 0 else []
    return flags


# Linux arm64's AT_HWCAP and AT_HWCAP2 bits, in order (arch/arm64/include/uapi/asm/hwcap.h),
# named as /proc/cpuinfo's Features line names them.
_ARM_HWCAP = (
    "fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp",
    "asimdhp", "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "sm3", "sm4",
    "asimddp", "sha512", "sve", "asimdfhm", "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb",
    "paca", "pacg",
)  # fmt: skip
_ARM_HWCAP2 = (
    "dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2", "frint",
    "svei8mm", "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16", "dgh", "rng", "bti", "mte",
    "ecv", "afp", "rpres", "mte3", "sme",
)  # fmt: skip
_AT_HWCAP, _AT_HWCAP2 = 16, 26


def hwcap_names(auxv: bytes) -> set[str] | None:
    """The aarch64 feature names set in an auxiliary vector's ``AT_HWCAP`` / ``AT_HWCAP2``
    (``auxv``: native-endian 64-bit key, value pairs, as /proc/self/auxv holds them); None
    where it has no ``AT_HWCAP``."""
    words = struct.unpack(f"={len(auxv) // 8}Q", auxv[: len(auxv) // 8 * 8])
    aux = dict(zip(words[0::2], words[1::2], strict=False))
    if _AT_HWCAP not in aux:
        return None
    names: set[str] = set()
    for key, table in ((_AT_HWCAP, _ARM_HWCAP), (_AT_HWCAP2, _ARM_HWCAP2)):
        bits = aux.get(key, 0)
        names |= {name for i, name in enumerate(table) if bits >> i & 1}
    return names


def _arm_hwcaps() -> set[str] | None:
    """On aarch64 Linux, the features the kernel says this CPU runs (``hwcap_names`` of
    /proc/self/auxv; /proc/cpuinfo's Features line is printed from the same bits); None
    elsewhere. Unlike /proc/cpuinfo, an emulator (qemu-user) reports its own CPU here."""
    if platform.machine() not in ("aarch64", "arm64"):
        return None
    try:
        return hwcap_names(Path("/proc/self/auxv").read_bytes())
    except OSError:
        return None


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags: on aarch64 Linux the kernel's HWCAPs (``_arm_hwcaps``), else
    /proc/cpuinfo's (x86 ``flags``, ARM ``Features``); None where neither is known."""
    hwcaps = _arm_hwcaps()
    if hwcaps is not None:
        return hwcaps
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return None


def missing_isa(compiler: str, arch: str) -> list[str]:
    """The instruction sets a ``-march=arch`` build assumes (the compiler's predefined macros)
    that this CPU lacks (empty where it has them all, or where the CPU's flags are unknown):
    a library that assumes one would die of an illegal instruction here."""
    cpu = _cpu_flags()
    if cpu is None:
        return []
    proc = subprocess.run(
        [compiler, f"-march={arch}", "-dM", "-E", "-x", "c++", "-"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} does not know -march={arch}: {proc.stderr.strip()[-300:]}")
    defined = {ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("#define ")}
    return sorted(
        flag for macro, flag in _ISA_MACROS.items() if macro in defined and flag not in cpu
    )


def resolve_march(compiler: str) -> str:
    """``march()`` where this CPU runs what it assumes; else ``native`` (this CPU's own
    instruction sets), with a warning naming what the requested build would have needed."""
    arch = march()
    if arch == "native":
        return arch
    missing = missing_isa(compiler, arch)
    if missing:
        log.warning(
            "RESEARCH_NATIVE_MARCH=%s assumes %s, which this CPU lacks: building the native "
            "kernels for -march=native instead",
            arch,
            ", ".join(missing),
        )
        return "native"
    return arch


def library_path(family: str, arch: str | None = None) -> Path:
    """Where ``family``'s library for this machine, compiler, ``-march`` (default ``march()``)
    and source lives in the cache."""
    import jaxlib

    sources, _ = FAMILIES[family]
    compiler, version = _compiler()
    arch = arch or march()
    texts = [p.read_text() for p in (*sources, *_HEADERS)]
    key = hashlib.sha256(
        "\n".join(
            [
                *texts,
                jaxlib.__version__,
                compiler,
                version,
                " ".join(_flags(compiler, arch)),
                _cpu_signature(),
            ]
        ).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"{family}-{platform.machine()}-{key}.so"


def _build(family: str, arch: str) -> tuple[Path, str]:
    """``family``'s library for ``-march=arch``, built under the cache's file lock unless already
    there: (path, "built" or "cached")."""
    import jax

    lib = library_path(family, arch)
    if lib.exists():
        return lib, "cached"
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get("RESEARCH_NATIVE_BUILD_TIMEOUT", BUILD_TIMEOUT_S))
    with (cache / f"{lib.stem}.lock").open("w") as lock:
        deadline = time.monotonic() + timeout
        while True:  # another process may be building the same library: wait for it
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"timed out after {timeout:.0f} s waiting for another process to build "
                        f"{lib.name} (lock {lock.name})"
                    ) from None
                time.sleep(0.2)
        try:
            if lib.exists():  # built by the process we waited for
                return lib, "cached"
            compiler, _ = _compiler()
            sources, _ = FAMILIES[family]
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                out = Path(tmp) / lib.name
                cmd = [
                    compiler,
                    *_flags(compiler, arch),
                    "-I",
                    jax.ffi.include_dir(),
                    "-o",
                    str(out),
                ]
                cmd += [str(p) for p in sources]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        f"compiling {family} timed out after {timeout:.0f} s: {' '.join(cmd)}"
                    ) from None
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
                os.replace(out, lib)  # atomic: a reader never sees half a library
            return lib, "built"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(family: str = "attention") -> bool:
    with _lock:
        state = _state.setdefault(family, {})
        if "ok" in state:
            return state["ok"]
        try:
            import jax

            compiler = _compiler()[0]
            arch = resolve_march(compiler)  # a requested target is checked there
            missing = missing_isa(compiler, arch) if arch == "native" else []
            if missing:  # -march=native assuming what /proc/cpuinfo does not list
                raise RuntimeError(
                    f"a -march={arch} build assumes {', '.join(missing)}, which this CPU lacks"
                )
            path, event = _build(family, arch)
            lib = ctypes.cdll.LoadLibrary(str(path))
            lib.research_kernel_ns.restype = ctypes.c_int64  # parallel.h's counter
            for target, symbol in FAMILIES[family][1].items():
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
                )
            state.update(ok=True, lib=lib, event=event, path=path, march=arch)
        except Exception as exc:  # no compiler, headers or loader: the XLA path serves instead
            state.update(ok=False, error=str(exc), event="failed")
            log.warning(
                "native CPU %s kernels unavailable (%s), using the XLA path for them: %s",
                family,
                ", ".join(FAMILIES[family][1]),
                exc,
            )
        return state["ok"]


def available(family: str = "attention") -> bool:
    """True once ``family``'s library is built and registered with XLA (built on first call)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown native kernel family {family!r}; one of {sorted(FAMILIES)}")
    return _load(family)


def build_error(family: str = "attention") -> str | None:
    """Why ``family``'s library is unavailable (None when it is, or was never tried)."""
    return _state.get(family, {}).get("error")


def build_events() -> dict[str, str]:
    """Per family tried in this process: "built" (compiled here), "cached" (found built, maybe
    after waiting for another process's build) or "failed"."""
    return {f: s["event"] for f, s in _state.items() if "event" in s}


def built_march(family: str) -> str | None:
    """The ``-march`` ``family``'s loaded library was built for (None when not loaded)."""
    return _state.get(family, {}).get("march")


def kernel_seconds() -> float:
    """Seconds the loaded native libraries' kernels have spent working (wall clock on the calling
    thread, summed over calls) since they were loaded; 0.0 when none is loaded. The difference
    over a step, taken from the step's time in its jitted calls, is XLA's own work between the
    kernels."""
    libs = [state["lib"] for state in list(_state.values()) if "lib" in state]
    return sum(lib.research_kernel_ns() for lib in libs) / 1e9


def library(family: str) -> Any:
    """The loaded ``ctypes`` library of ``family`` (after ``available(family)``)."""
    return _state[family]["lib"]


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
    write: bool = False,
) -> Any:
    """Causal attention of a call's packed tokens over their rows' cached context and the rows'
    own new tokens, in one pass (prefill chunks; ``paged_attention.cc``).

    q [N, H, E], k_new / v_new [N, K, E] (any float dtype; computed in float32), k_pages /
    v_pages [K, B, P, E] float32 or bfloat16, block_tables [R, M] int32, row_start [R] (cached
    tokens per row), row_first [R] (packed index of each row's first token; a row's tokens are
    contiguous), row_count [R] (0: an empty row) -> out [N, H, E] float32, 0 for tokens of no
    row.

    ``write``: also store the new K/V in the pages, each row's t-th token at position
    ``row_start + t`` of its block table (``write_kv``'s scatter; positions past the table or
    blocks outside the pool are dropped), and return ``(out, k_pages, v_pages)``. The pages are
    updated in place where the caller donates them (the outputs alias the inputs); otherwise
    XLA copies them first."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if not _load():
        raise RuntimeError(f"native packed attention unavailable: {build_error()}")
    f32, i32 = jnp.float32, jnp.int32
    out = jax.ShapeDtypeStruct(q.shape, f32)
    if write:
        pages = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k_pages, v_pages)]
        call = jax.ffi.ffi_call(
            _PACKED_WRITE_TARGET, (out, *pages), input_output_aliases={3: 1, 4: 2}
        )
    else:
        call = jax.ffi.ffi_call(_PACKED_TARGET, out)
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


__all__ = [
    "FAMILIES",
    "available",
    "build_error",
    "build_events",
    "built_march",
    "cache_dir",
    "library",
    "library_path",
    "march",
    "missing_isa",
    "packed_attention",
    "paged_attention",
]
