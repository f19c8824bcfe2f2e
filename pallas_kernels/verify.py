"""Every kernel configuration the engine can pick, verified and compiled offline for its GPU.

``python -m pallas_kernels.verify [--targets h200,gb10,fallback] [--no-compile] [--quick]``
lowers each configuration of ``pallas_kernels.tuning`` for CUDA (no GPU needed), runs the MLIR
verifier on its Triton module, checks that float32 dots run as IEEE float32 (not TF32) and that
every dot accumulates in float32, then compiles it with the triton package to PTX and cubin for
the target's architecture and prints registers, spills and shared memory against the target's
per-block limit. It exits non-zero if any configuration fails.

The default run covers every target: h200 (sm_90), gb10 (sm_121) and the fallback at each
architecture it stands for, sm_80, sm_86 and sm_89 (Ampere and Ada; fp8 on sm_89 only). The
compiles pin floating-point fusion on (``triton_ir.FP_FUSION``), whatever the environment says.

The configurations are the engine's: the attention shapes of the presets (SmolLM2-135M,
Qwen3-30B-A3B, Llama-3.3-70B, gpt-oss-120b) at block sizes 8 to 128, float32 / bfloat16 queries
with float, fp8 and int4 KV pages, and gpt-oss's sliding-window layers (window 128, sinks); the
grouped-experts kernel on Qwen3-30B-A3B's expert GEMMs and SmolLM2's linear layers, in every
weight format with float32 and bfloat16 activations, and on gpt-oss-120b's MXFP4 experts with
biases.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_experts import grouped_experts
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.triton_ir import (
    CompiledKernel,
    TritonModule,
    compile_offline,
    lower_triton_modules,
    triton_compiler_available,
)
from pallas_kernels.tuning import (
    FALLBACK,
    FALLBACK_CAPABILITIES,
    FP8_MIN_CAPABILITY,
    TARGETS,
    GpuTarget,
    fallback_for,
)
from research.quant import FORMATS, quantize
from research.quant.kv import kv_code_dtype, kv_code_shape
from research.quant.layout import awq_group_size

# (query heads, kv heads, head_dim) of the presets' attention.
ATTENTION_SHAPES = {
    "smollm2-135m": (9, 3, 64),
    "qwen3-30b-a3b": (32, 4, 128),
    "llama-3.3-70b": (64, 8, 128),
    "gpt-oss-120b": (64, 8, 64),
}
PAGE_SIZES = (8, 16, 32, 64, 128)
KV_DTYPES = ("auto", "fp8", "int4")
# (K, N) of the expert / linear GEMMs.
GEMM_SHAPES = {
    "qwen3-30b-a3b gate/up": (2048, 768),
    "qwen3-30b-a3b down": (768, 2048),
    "smollm2-135m gate/up": (576, 1536),
    "smollm2-135m down": (1536, 576),
}
WEIGHT_FORMATS = (None, *FORMATS)
# gpt-oss-120b: sliding-window layers (with sinks) and MXFP4 experts with biases.
GPT_OSS_WINDOW = 128
GPT_OSS_EXPERT_SHAPES = {"gpt-oss-120b gate/up/down": (2880, 2880)}
ACTIVATION_DTYPES = (jnp.float32, jnp.bfloat16)
BATCH, PAGES_PER_SEQ, NUM_PAGES = 8, 64, 1024  # the grid and pool size do not change the IR
ROWS, EXPERTS = 64, 8


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel call as the engine would make it on a target."""

    label: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]  # jax.ShapeDtypeStruct leaves: nothing is allocated
    kwargs: dict[str, Any]
    num_warps: int
    num_stages: int
    no_spills: bool = False  # a shipped configuration: any spill is a failure


def _sds(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def paged_attention_cases(
    target: GpuTarget,
    shapes: dict[str, tuple[int, int, int]] = ATTENTION_SHAPES,
    page_sizes: tuple[int, ...] = PAGE_SIZES,
    window: int | None = None,
) -> list[KernelCase]:
    """With a ``window``: gpt-oss's sliding layers (window, per-query positions and sinks)."""
    cases = []
    for model, (heads, kv_heads, head_dim) in shapes.items():
        for page_size in page_sizes:
            for kv in KV_DTYPES:
                for q_dtype in ACTIVATION_DTYPES:
                    code_dtype = kv_code_dtype(kv, q_dtype)
                    (code_dim,) = kv_code_shape(head_dim, kv)
                    pages = _sds((kv_heads, NUM_PAGES, page_size, code_dim), code_dtype)
                    scales = {}
                    if kv != "auto":
                        scale = _sds((kv_heads, NUM_PAGES, page_size), jnp.float32)
                        scales = dict(k_scales=scale, v_scales=scale)
                    blocks = target.paged_attention.kwargs(
                        page_size=page_size,
                        head_dim=head_dim,
                        code_dim=code_dim,
                        q_dtype=q_dtype,
                        page_dtype=code_dtype,
                    )
                    windowed = {}
                    if window is not None:
                        windowed = dict(
                            window=window,
                            query_positions=_sds((BATCH,), jnp.int32),
                            sinks=_sds((heads,), jnp.float32),
                        )
                    cases.append(
                        KernelCase(
                            label=(
                                f"paged_attention {model} S={page_size} kv={kv} "
                                f"q={jnp.dtype(q_dtype).name} "
                                f"tile={blocks['pages_per_compute_block'] * page_size}"
                                + ("" if window is None else f" window={window} sinks")
                            ),
                            fn=paged_attention,
                            args=(
                                _sds((BATCH, heads, head_dim), q_dtype),
                                pages,
                                pages,
                                _sds((BATCH, PAGES_PER_SEQ), jnp.int32),
                                _sds((BATCH,), jnp.int32),
                            ),
                            kwargs=dict(**scales, **windowed, return_lse=True, **blocks),
                            num_warps=blocks["num_warps"],
                            num_stages=blocks["num_stages"],
                        )
                    )
    return cases


@functools.cache
def _weight(fmt: str | None, k: int, n: int, dtype, experts: int = EXPERTS) -> Any:
    """The weight's storage as ShapeDtypeStructs (``quantize`` traced, never run)."""
    w = _sds((experts, k, n), jnp.float32)
    if fmt is None:
        return _sds(w.shape, dtype)
    group_size = awq_group_size(k) if fmt == "awq" else None  # as the engine's quantizer picks
    return jax.eval_shape(functools.partial(quantize, fmt=fmt, group_size=group_size), w)


def grouped_experts_cases(
    target: GpuTarget,
    shapes: dict[str, tuple[int, int]] = GEMM_SHAPES,
    formats: tuple[str | None, ...] = WEIGHT_FORMATS,
    bias: bool = False,
) -> list[KernelCase]:
    """``bias``: with a per-expert float32 bias [G, N] (gpt-oss's experts)."""
    cases = []
    for name, (k, n) in shapes.items():
        for fmt in formats:
            for dtype in ACTIVATION_DTYPES:
                blocks = target.grouped_experts.kwargs(k, dtype)
                dname = jnp.dtype(dtype).name
                biased = dict(bias=_sds((EXPERTS, n), jnp.float32)) if bias else {}
                cases.append(
                    KernelCase(
                        label=(
                            f"grouped_experts {name} w={fmt or dname} x={dname} "
                            f"bm={blocks['block_m']} bn={blocks['block_n']} bk={blocks['block_k']}"
                            + (" bias" if bias else "")
                        ),
                        fn=grouped_experts,
                        args=(
                            _sds((ROWS, k), dtype),
                            _weight(fmt, k, n, dtype),
                            _sds((EXPERTS,), jnp.int32),
                        ),
                        kwargs=dict(**biased, **blocks),
                        num_warps=blocks["num_warps"],
                        num_stages=blocks["num_stages"],
                    )
                )
    return cases


def ragged_attention_cases(target: GpuTarget, quick: bool = False) -> list[KernelCase]:
    """The engine's attention kernel as the table (or the rules) configure it on ``target``:
    every tuned key (query dtype, KV format, head dim, group) for decode-sized steps (with
    their split-KV variant) and mixed steps; gpt-oss's sliding-window layers with sinks."""
    from pallas_kernels.ragged_attention import ragged_paged_attention
    from pallas_kernels.tune import PAGE_SIZE, attention_args, attention_keys
    from pallas_kernels.tuning import ragged_attention_config

    cases = []
    for key in attention_keys():
        if quick and (key["q"] == "float32" or key["d"] == 128):
            continue
        config, source = ragged_attention_config(
            target, q_dtype=key["q"], kv=key["kv"], head_dim=key["d"], group=key["g"],
            decode=key["step"] == "decode", num_rows=1,
        )  # fmt: skip
        args, scales = attention_args(key["q"], key["kv"], key["d"], key["g"])
        windowed = [False, True] if (key["d"], key["g"]) == (64, 8) else [False]
        # decode-sized steps run the split-KV variant with few rows, one split with many
        for splits in sorted({1, config.kv_splits}):
            for window in windowed:
                extra = {}
                if window:
                    sinks = _sds((args[0].shape[1],), jnp.float32)
                    extra = dict(window=GPT_OSS_WINDOW, sinks=sinks)
                kwargs = dict(config.kwargs(page_size=PAGE_SIZE, group=key["g"]), kv_splits=splits)
                cases.append(
                    KernelCase(
                        label=(
                            f"ragged_attention {key['step']} q={key['q']} kv={key['kv']} "
                            f"d={key['d']} g={key['g']} rows={kwargs['block_rows']} "
                            f"tile={config.tile_tokens} splits={splits} "
                            f"w={config.num_warps}"
                            + (" window sinks" if window else "")
                            + (" [rule]" if source.startswith("rule") else "")
                        ),
                        fn=ragged_paged_attention,
                        args=args,
                        kwargs=dict(**scales, **extra, **kwargs),
                        num_warps=config.num_warps,
                        num_stages=config.num_stages,
                        no_spills=True,
                    )
                )
    return cases


def tuned_experts_cases(target: GpuTarget, quick: bool = False) -> list[KernelCase]:
    """The grouped-experts kernel as the table (or the rules) configure it on ``target``, for
    every tuned key (activation dtype, weight format, experts, K, N, M bucket)."""
    from pallas_kernels.grouped_experts import grouped_experts
    from pallas_kernels.tune import M_ROWS, experts_keys
    from pallas_kernels.tuning import grouped_experts_config

    cases = []
    for name, key, bias in experts_keys():
        if quick and (key["m"] != "decode" or name.startswith("llama")):
            continue
        x = jnp.dtype(key["x"])
        fmt = None if key["w"] == "plain" else key["w"]
        rows = M_ROWS[key["m"]]
        blocks, source = grouped_experts_config(
            target, x_dtype=x, fmt=fmt, experts=key["e"], k=key["k"], n=key["n"], m=rows
        )
        extra = {"bias": _sds((key["e"], key["n"]), jnp.float32)} if bias else {}
        cases.append(
            KernelCase(
                label=(
                    f"grouped_experts {name} w={key['w']} x={key['x']} m={key['m']} "
                    f"bm={blocks['block_m']} bn={blocks['block_n']} bk={blocks['block_k']} "
                    f"w={blocks['num_warps']} s={blocks['num_stages']}"
                    + (" bias" if bias else "")
                    + (" [rule]" if source.startswith("rule") else "")
                ),
                fn=grouped_experts,
                args=(
                    _sds((rows, key["k"]), x),
                    _weight(fmt, key["k"], key["n"], x, experts=key["e"]),
                    _sds((key["e"],), jnp.int32),
                ),
                kwargs=dict(**extra, **blocks),
                num_warps=blocks["num_warps"],
                num_stages=blocks["num_stages"],
                no_spills=True,
            )
        )
    return cases


def kernel_cases(
    target: GpuTarget, quick: bool = False, decode_kernel: bool = False
) -> list[KernelCase]:
    """The engine's configurations on ``target``: the ragged attention kernel and the grouped
    experts; ``decode_kernel`` adds the standalone decode kernel (``paged_attention``, which the
    engine no longer runs); ``quick`` is the tests' smaller set."""
    cases = ragged_attention_cases(target, quick) + tuned_experts_cases(target, quick)
    if decode_kernel:
        gpt_oss = {"gpt-oss-120b": ATTENTION_SHAPES["gpt-oss-120b"]}
        page_sizes = (8, 16, 128) if quick else PAGE_SIZES
        cases += paged_attention_cases(target, page_sizes=page_sizes)
        cases += paged_attention_cases(target, gpt_oss, window=GPT_OSS_WINDOW)
    return [c for c in cases if target.supports_fp8 or not uses_fp8(c)]


def uses_fp8(case: KernelCase) -> bool:
    """Whether an operand is float8_e4m3fn (fp8 KV pages, fp8 weights, NVFP4's scales): the
    engine refuses those below sm_89 (``GpuTarget.require_fp8``), so they are not configurations
    there."""
    return any(a.dtype == jnp.float8_e4m3fn for a in jax.tree_util.tree_leaves(case.args))


def lower_case(case: KernelCase, compute_capability: int | None = None) -> TritonModule:
    """The case's Triton module, lowered for ``compute_capability`` (each target its own)."""
    (module,) = lower_triton_modules(
        case.fn, *case.args, compute_capability=compute_capability, **case.kwargs
    )
    return module


def dot_problems(module: TritonModule) -> list[str]:
    """Precision rules: float32 operands multiply as IEEE float32; everything accumulates in
    float32."""
    problems = []
    for operand, precision, accumulator in module.dots():
        if operand == "f32" and precision != "ieee":
            problems.append(f"f32 dot runs as {precision}")
        if accumulator != "f32":
            problems.append(f"{operand} dot accumulates in {accumulator}")
    return problems


@dataclasses.dataclass(frozen=True)
class CaseResult:
    case: KernelCase
    module: TritonModule
    compiled: CompiledKernel | None
    problems: tuple[str, ...]


def check_case(case: KernelCase, target: GpuTarget, compile: bool) -> CaseResult:
    try:
        module = lower_case(case, target.compute_capability)
    except Exception as e:  # the lowering for this target refused it (e.g. fp8 below sm_89)
        failed = TritonModule(case.label, "", f"lowering for sm_{target.compute_capability}", ())
        return CaseResult(case, failed, None, (f"lowering failed: {e}"[:300],))
    problems = [] if module.verified else [f"MLIR verification failed: {module.error}"]
    problems += dot_problems(module)
    compiled = None
    if compile and module.verified:
        try:
            compiled = compile_offline(
                module,
                target.compute_capability,
                num_warps=case.num_warps,
                num_stages=case.num_stages,
            )
        except Exception as e:  # Triton's own pipeline refused the module: report, go on
            return CaseResult(case, module, None, (*problems, f"offline compile failed: {e}"))
        if case.no_spills and compiled.spills:
            problems.append(f"{compiled.spills} B spilled (a shipped configuration)")
        if compiled.shared_bytes > target.max_shared_bytes:
            problems.append(
                f"{compiled.shared_bytes} B shared memory > {target.max_shared_bytes} B on "
                f"{target.name}"
            )
    return CaseResult(case, module, compiled, tuple(problems))


def verify_targets() -> dict[str, list[GpuTarget]]:
    """What each ``--targets`` name compiles for: H200 (sm_90), GB10 (sm_121), and the fallback
    at every capability it stands for (``FALLBACK_CAPABILITIES``: sm_80, sm_86, sm_89)."""
    return {
        **{name: [target] for name, target in TARGETS.items()},
        FALLBACK.name: [fallback_for(cc) for cc in FALLBACK_CAPABILITIES],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    all_targets = verify_targets()
    parser.add_argument("--targets", default=",".join(all_targets))
    parser.add_argument("--no-compile", action="store_true", help="verify the IR only")
    parser.add_argument("--quick", action="store_true", help="the tests' smaller set")
    parser.add_argument(
        "--decode-kernel", action="store_true", help="also the standalone decode kernel"
    )
    args = parser.parse_args(argv)
    compile = not args.no_compile
    if compile and (reason := triton_compiler_available()):
        print(f"offline compilation skipped: {reason}")
        compile = False
    failures, summary = 0, []
    for target in [t for name in args.targets.split(",") for t in all_targets[name]]:
        print(
            f"\n== {target.name}: sm_{target.compute_capability}, shared memory limit "
            f"{target.max_shared_bytes // 1024} KiB per block =="
        )
        if not target.supports_fp8:
            print(f"(no fp8 operands: sm_{target.compute_capability} < sm_{FP8_MIN_CAPABILITY})")
        print(f"{'configuration':<78} {'IR':>3} {'regs':>4} {'smem KiB':>8} {'spill':>5}  notes")
        start = time.perf_counter()
        cases = kernel_cases(target, quick=args.quick, decode_kernel=args.decode_kernel)
        failed = 0
        for case in cases:
            result = check_case(case, target, compile)
            failed += bool(result.problems)
            c = result.compiled
            regs = (
                f"{c.registers:>4} {c.shared_bytes / 1024:>8.1f} {c.spills:>5}" if c else " " * 19
            )
            ok = "ok" if result.module.verified else "BAD"
            print(f"{case.label:<78} {ok:>3} {regs}  {'; '.join(result.problems)[:200]}")
        print(f"({time.perf_counter() - start:.0f} s)")
        summary.append(
            f"{target.name} sm_{target.compute_capability}: {len(cases)} configurations, "
            f"{failed} failed"
        )
        failures += failed
    print("", *summary, f"{failures} configuration(s) failed", sep="\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
