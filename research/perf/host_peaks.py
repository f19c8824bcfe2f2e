"""Peaks of the machine at hand, measured once and cached, for the roofline columns of results.

Microbenchmarks with JAX on this machine's CPU: a large float32 GEMM (FLOP/s), a large bfloat16
GEMM (the faster of XLA's dot and the AMX kernel of ``research.native.gemm``, the peak of bf16
runs), and over a 256 MiB array a stream copy (bytes read plus written per second) and a
read-only sum; the bandwidth peak is the larger of the two. They are the ceilings our engine's steps are
measured against; no vendor figure exists for an arbitrary host. Results are cached in
``~/.cache/research/host_peaks.json`` per machine (CPU model and core count), so a sweep pays
for them once.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

CACHE_PATH = "~/.cache/research/host_peaks.json"


def _machine_key() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cpu} x{os.cpu_count()}"


def median_seconds(fn: Any, repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` after one untimed call."""
    fn()  # compile and warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bf16_gemm_seconds(a: Any, b: Any, repeats: int) -> float:
    """The faster bfloat16 product of a @ b: XLA's dot (float32 accumulation) or, where the
    library built, the native kernel on the packed weight (AMX where the CPU has it)."""
    import jax
    import jax.numpy as jnp

    from research.native import gemm

    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    dot = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32))
    best = median_seconds(lambda: dot(a, b).block_until_ready(), repeats)
    if gemm.available():
        packed = gemm.pack(b)
        amx = jax.jit(gemm.matmul)
        best = min(best, median_seconds(lambda: amx(a, packed).block_until_ready(), repeats))
    return best


def measure_host_peaks(gemm_size: int = 2048, copy_mib: int = 256, repeats: int = 5) -> dict:
    """``{"flops": float32 GEMM FLOP/s, "bf16_flops": bfloat16 GEMM FLOP/s, "bandwidth":
    max(copy, read) bytes/s, ...}`` now."""
    import jax
    import jax.numpy as jnp

    n = gemm_size
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    gemm_s = median_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
    bf16_s = _bf16_gemm_seconds(a, b, repeats)
    x = jnp.ones((copy_mib << 20) // 4, jnp.float32)
    scale = jax.jit(lambda v: v * 1.0001)  # one read and one write of every element
    copy_s = median_seconds(lambda: scale(x).block_until_ready(), repeats)
    total = jax.jit(jnp.sum)  # reads only, as a step reads its weights
    read_s = median_seconds(lambda: total(x).block_until_ready(), repeats)
    copy, read = 2.0 * x.nbytes / copy_s, x.nbytes / read_s
    return {
        "flops": 2.0 * n**3 / gemm_s,
        "bf16_flops": 2.0 * n**3 / bf16_s,
        "bandwidth": max(copy, read),
        "copy_bandwidth": copy,
        "read_bandwidth": read,
        "gemm_size": n,
        "stream_bytes": int(x.nbytes),
    }


def host_peaks(cache_path: str | os.PathLike | None = CACHE_PATH, refresh: bool = False) -> dict:
    """This machine's peaks from the cache, measured (and cached) when absent or ``refresh``.
    The default cache file yields to ``$RESEARCH_HOST_PEAKS_CACHE``."""
    if cache_path is not None and os.fspath(cache_path) == CACHE_PATH:
        cache_path = os.environ.get("RESEARCH_HOST_PEAKS_CACHE", CACHE_PATH)
    path = Path(os.path.expanduser(os.fspath(cache_path))) if cache_path else None
    key = _machine_key()
    cached: dict[str, Any] = {}
    if path is not None and path.exists():
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    if key in cached and "bf16_flops" in cached[key] and not refresh:
        return cached[key]
    peaks = measure_host_peaks() | {"machine": key}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached | {key: peaks}, indent=1))
    return peaks


def device_peaks(dtype: str) -> dict[str, float] | None:
    """Peak FLOP/s and bytes/s of the device JAX runs on: measured on a CPU (``host_peaks``; the
    bfloat16 GEMM peak for bfloat16 runs),
    the published figures of a named GPU (``research.perf.hardware``) for ``dtype``; None where
    no figure exists."""
    import jax

    if jax.default_backend() == "cpu":
        peaks = host_peaks()
        flops = peaks["bf16_flops"] if dtype == "bfloat16" else peaks["flops"]
        return peaks | {"flops": flops}
    from pallas_kernels.tuning import TARGETS, target_for_kind
    from research.perf.hardware import get_hardware

    target = target_for_kind(jax.devices()[0].device_kind)
    if target.name not in TARGETS:
        return None
    hw = get_hardware(target.name)
    flops = hw.tensor_flops.get("bf16" if dtype == "bfloat16" else "fp32")
    return None if flops is None else {"flops": flops, "bandwidth": hw.peak_bandwidth}
