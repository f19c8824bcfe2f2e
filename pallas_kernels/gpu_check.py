"""The kernels on a real GPU, in one command: ``python -m pallas_kernels.gpu_check``.

On a GPU it runs, and prints as one table:

1. the kernel test files compiled (not interpreted: the tests interpret only on CPU) and the
   Triton-module checks;
2. the kernel benchmarks (``pallas_kernels.bench``), each kernel's achieved bandwidth as a
   fraction of the device's measured copy bandwidth: the ragged attention kernel on a decode
   step of 64 rows x 2k context (aim 70%) and a mixed step; grouped experts at decode sizes,
   8 to 64 tokens (aim 50%);
3. the engine end to end on SmolLM2-135M with ``attention_backend="pallas"`` against ``"xla"``
   (float weights, then AWQ weights through the quantized-matmul kernel): greedy tokens must be
   identical; then the main job (``experiments.run executor=pallas``).

It exits non-zero if a check fails. On a machine without a GPU it says so and exits 0: the CPU
evidence is ``pytest tests/test_triton_ir.py`` and ``python -m pallas_kernels.verify``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import jax

TEST_FILES = (
    "test_ragged_attention.py",
    "test_paged_attention.py",
    "test_grouped_experts.py",
    "test_triton_ir.py",
)
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
)


def _gpu() -> jax.Device | None:
    return next((d for d in jax.devices() if d.platform == "gpu"), None)


def run_kernel_tests() -> tuple[bool, str]:
    tests = Path(__file__).resolve().parents[1] / "tests"
    files = [str(tests / name) for name in TEST_FILES if (tests / name).exists()]
    if not files:
        return False, f"no kernel tests under {tests} (run from a source checkout)"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        capture_output=True,
        text=True,
        cwd=tests.parent,
    )
    summary = next(
        (
            line.strip("= ")
            for line in reversed(proc.stdout.splitlines())
            if re.search(r"\d+ (passed|failed|error)", line)
        ),
        proc.stdout[-300:] + proc.stderr[-300:],
    )
    return proc.returncode == 0, summary


def run_benchmarks(iters: int) -> list[tuple[str, bool, str]]:
    """Each kernel's best achieved bandwidth as a fraction of the device's measured copy
    bandwidth: the ragged attention kernel (aim 70%) on a decode step of 64 rows x 2k context
    and on a mixed step; the grouped experts (aim 50%) at decode sizes (<= 64 tokens)."""
    from pallas_kernels.bench import (
        grouped_experts_bench,
        measured_peak_bandwidth,
        ragged_attention_bench,
    )

    rows = []
    for r in ragged_attention_bench(iters):
        aim = 0.7 if r["step"].startswith("decode") else None
        rows.append(
            (
                f"ragged attention {r['kv']} KV, {r['step']}",
                aim is None or r["measured_fraction"] >= aim,
                f"{r['gb_per_s']:.0f} GB/s = {100 * r['measured_fraction']:.0f}% of measured"
                + (f" (aim {100 * aim:.0f}%)" if aim else ""),
            )
        )
    measured = measured_peak_bandwidth(jax.devices()[0])
    experts = grouped_experts_bench(iters)
    for fmt in sorted({r["format"] for r in experts}):
        cases = [r for r in experts if r["format"] == fmt and r["tokens"] <= 64]
        best = max(cases, key=lambda r: r["gb_per_s"])
        frac = best["gb_per_s"] * 1e9 / measured
        rows.append(
            (
                f"grouped experts {fmt}, <= 64 tokens (best of {len(cases)})",
                frac >= 0.5 and best["rel_err"] < 2e-2,
                f"{best['gb_per_s']:.0f} GB/s = {100 * frac:.0f}% of measured (aim 50%), "
                f"max rel err {max(r['rel_err'] for r in cases):.1e}",
            )
        )
    return rows


def run_main_job() -> tuple[bool, str]:
    """The main job (``experiments.run``) with the Pallas backends on this GPU."""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "executor=pallas"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return proc.returncode == 0, " | ".join(tail)[-300:]


def run_engine(max_tokens: int) -> list[tuple[str, bool, str]]:
    from research import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows = []
    for quantization in (None, "awq"):
        tokens = {}
        for backend in ("xla", "pallas"):
            llm = LLM("smollm2-135m", quantization=quantization, attention_backend=backend)
            tokens[backend] = [o.token_ids for o in llm.generate(list(PROMPTS), params)]
            del llm
        same = sum(a == b for a, b in zip(tokens["xla"], tokens["pallas"], strict=True))
        rows.append(
            (
                f"engine smollm2-135m {quantization or 'float'} weights, pallas vs xla",
                same == len(PROMPTS),
                f"{same}/{len(PROMPTS)} prompts with identical greedy tokens ({max_tokens} each)",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per benchmark case")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per engine prompt")
    parser.add_argument("--skip", default="", help="comma list of: tests,bench,engine,main")
    args = parser.parse_args(argv)
    gpu = _gpu()
    if gpu is None:
        print(
            f"no GPU on this machine (JAX backend: {jax.default_backend()}); nothing to run. "
            "Without a GPU, `pytest tests/test_triton_ir.py` and `python -m "
            "pallas_kernels.verify` check the kernels' Triton modules and compile them offline."
        )
        return 0
    skip = set(filter(None, args.skip.split(",")))
    print(f"GPU: {gpu.device_kind} (compute capability {gpu.compute_capability})")
    rows: list[tuple[str, bool, str]] = []
    if "tests" not in skip:
        ok, summary = run_kernel_tests()
        rows.append(("kernel tests, compiled", ok, summary))
    if "bench" not in skip:
        rows += run_benchmarks(args.iters)
    if "engine" not in skip:
        rows += run_engine(args.max_tokens)
    if "main" not in skip:
        ok, tail = run_main_job()
        rows.append(("main job (experiments.run executor=pallas)", ok, tail))
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'check':<{width}}  {'ok':<4}  result")
    for name, ok, result in rows:
        print(f"{name:<{width}}  {'yes' if ok else 'NO':<4}  {result}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
