"""The kernels' Triton modules, checked without a GPU: every configuration the engine can pick on
each configured GPU lowers to a module that passes the MLIR verifier, float32 dots run as IEEE
float32 and every dot accumulates in float32; a representative set compiles offline to cubin for
sm_90 (H200) and sm_121 (GB10) within each target's shared memory; and the per-device tuning
table picks the right target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import verify
from pallas_kernels.paged_attention import _split_plan, window_pages
from pallas_kernels.triton_ir import (
    compile_offline,
    lower_triton_modules,
    triton_compiler_available,
)
from pallas_kernels.tuning import (
    FALLBACK,
    INTERPRET,
    TARGETS,
    GroupedExpertsConfig,
    PagedAttentionConfig,
    target_for_backend,
    target_for_kind,
)

GPU_TARGETS = {**TARGETS, FALLBACK.name: FALLBACK}


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_every_engine_configuration_verifies(target: str):
    """Lowering for CUDA, then the MLIR verifier on the Triton module (not a text search)."""
    cases = verify.kernel_cases(GPU_TARGETS[target], quick=True)
    kernels = {case.fn.__name__ for case in cases}
    assert kernels == {"ragged_paged_attention", "grouped_experts"}
    failures = []
    f32_dots = 0
    for case in cases:
        module = verify.lower_case(case, GPU_TARGETS[target].compute_capability)
        if not module.verified:  # an invalid module prints in generic form: no dots to read
            failures.append(f"{case.label}: {module.error[:300]}")
            continue
        if problems := verify.dot_problems(module):
            failures.append(f"{case.label}: {'; '.join(problems)}")
        f32_dots += sum(operand == "f32" for operand, _, _ in module.dots())
        assert module.dots(), f"{case.label}: no tt.dot in the module"
    assert not failures, "\n".join(failures)
    assert f32_dots > 0  # the float32 cases were checked for IEEE dots, not skipped
    labels = [case.label for case in cases]
    assert any("window sinks" in label for label in labels)  # gpt-oss's sliding layers
    assert any("w=mxfp4" in label and " bias" in label for label in labels)


def test_gpt_oss_window_and_biased_mxfp4_experts_verify():
    """gpt-oss's kernels on their own: the windowed attention (window 128, per-query positions,
    sinks) and the MXFP4 experts with biases pass the MLIR verifier, and the windowed grid
    covers the 9 pages of 16 tokens the window can touch, not the table's 64 (e.g. 2 splits
    instead of 8 for bfloat16's 128-token tiles)."""
    target = TARGETS["h200"]
    gpt_oss = {"gpt-oss-120b": verify.ATTENTION_SHAPES["gpt-oss-120b"]}
    window = verify.GPT_OSS_WINDOW
    windowed = verify.paged_attention_cases(target, gpt_oss, (16,), window=window)
    full = verify.paged_attention_cases(target, gpt_oss, (16,))
    for case, full_case in zip(windowed, full, strict=True):
        if "kv=auto" not in case.label:
            continue
        module, full_module = verify.lower_case(case), verify.lower_case(full_case)
        assert module.verified, f"{case.label}: {module.error}"
        assert module.name.endswith("_window") and module.dots()
        assert not verify.dot_problems(module), case.label
        tile, splits = case.kwargs["pages_per_compute_block"], case.kwargs["k_splits"]
        window_splits = _split_plan(window_pages(window, 16), 16, tile, splits)[1]
        full_splits = _split_plan(verify.PAGES_PER_SEQ, 16, tile, splits)[1]
        assert module.grid == (verify.BATCH, 8, window_splits), case.label
        assert full_module.grid == (verify.BATCH, 8, full_splits) and window_splits < full_splits
    experts = verify.grouped_experts_cases(
        target, verify.GPT_OSS_EXPERT_SHAPES, ("mxfp4",), bias=True
    )
    for case in experts:
        module = verify.lower_case(case)
        assert module.verified, f"{case.label}: {module.error}"
        assert module.name == "grouped_experts_mxfp4_bias"
        assert not verify.dot_problems(module), case.label


def _loop_kernel(n_ref, x_ref, o_ref, *, typed: bool):
    """o = x * (number of loop trips): the loop bound comes from a jnp.where on two constants."""
    n = n_ref[0]
    # Python ints take the predicate's i1 type when lowered; int32 arrays keep theirs.
    four, zero = (jnp.int32(4), jnp.int32(0)) if typed else (4, 0)
    trips = jnp.where(n > 0, four, zero)
    o_ref[...] = jax.lax.fori_loop(0, trips, lambda i, acc: acc + x_ref[...], x_ref[...] * 0)


def _loop_call(n, x, *, typed: bool):
    return pl.pallas_call(
        functools.partial(_loop_kernel, typed=typed),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    )(n, x)


def test_verifier_rejects_python_int_where_loop_bound():
    """The check can fail: the pattern that broke grouped_experts lowers, but does not verify."""
    args = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.float32))
    (bad,) = lower_triton_modules(_loop_call, *args, typed=False)
    assert not bad.verified
    assert "scf.for" in bad.error and "same type" in bad.error
    (good,) = lower_triton_modules(_loop_call, *args, typed=True)
    assert good.verified, good.error


def test_float32_attention_dots_are_ieee_and_bf16_accumulates_in_float32():
    cases = verify.paged_attention_cases(
        TARGETS["h200"], {"qwen3-30b-a3b": verify.ATTENTION_SHAPES["qwen3-30b-a3b"]}, (16,)
    )
    for case in cases:
        dots = verify.lower_case(case).dots()
        q_f32 = "q=float32" in case.label
        assert {operand for operand, _, _ in dots} == {"f32" if q_f32 else "bf16"}
        assert {accumulator for _, _, accumulator in dots} == {"f32"}
        if q_f32:
            assert {precision for _, precision, _ in dots} == {"ieee"}, case.label


# ---- offline compilation to cubin ------------------------------------------------------------

needs_triton = pytest.mark.skipif(
    triton_compiler_available() is not None, reason=str(triton_compiler_available())
)


def _compile_set(target) -> list[verify.KernelCase]:
    """Per target: the ragged attention kernel as shipped at Qwen3-30B-A3B's shape (head dim
    128, group 8) in bfloat16 with every KV format, decode-sized (split-KV) and mixed steps,
    and gpt-oss's windowed layers with sinks; every expert weight format at its gate/up GEMM,
    and gpt-oss-120b's biased MXFP4 experts."""
    attention = [
        c
        for c in verify.ragged_attention_cases(target)
        if "q=bfloat16" in c.label
        and ("d=128" in c.label or ("window" in c.label and "kv=auto" in c.label))
    ]
    experts = [
        c
        for c in verify.tuned_experts_cases(target)
        if "m=decode" in c.label and ("qwen3-30b-a3b gate/up" in c.label or "gpt-oss" in c.label)
    ]
    return [c for c in attention if "q=bfloat16" in c.label or "S=16" in c.label] + experts


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("target", ["h200", "gb10"])
def test_offline_compile_to_cubin_within_shared_memory(target: str):
    gpu = TARGETS[target]
    results = []
    for case in _compile_set(gpu):
        result = verify.check_case(case, gpu, compile=True)
        assert not result.problems, f"{case.label}: {result.problems}"
        compiled = result.compiled
        assert compiled.ptx_target.startswith(f"sm_{gpu.compute_capability}")
        assert 0 < compiled.registers <= 255 and compiled.cubin_bytes > 0
        assert 0 < compiled.shared_bytes <= gpu.max_shared_bytes
        results.append(compiled)
    assert {r.name.split("_")[0] for r in results} == {"ragged", "grouped"}


@needs_triton
@needs_triton
def test_fp8_compiles_from_sm_89_and_is_refused_below():
    """Triton lowers float8_e4m3fn (fp8 KV pages, fp8 weights, NVFP4 scales) for sm_89+ only:
    on sm_80 its own pipeline fails. The verifier reports that, the fallback target lists no
    fp8 configuration, and the engine refuses fp8 there with a ValueError that says why."""
    fp8 = [c for c in verify.kernel_cases(TARGETS["h200"], quick=True) if verify.uses_fp8(c)]
    assert {c.fn.__name__ for c in fp8} == {"ragged_paged_attention", "grouped_experts"}
    assert not [c for c in verify.kernel_cases(FALLBACK, quick=True) if verify.uses_fp8(c)]
    assert not verify.check_case(fp8[0], TARGETS["h200"], compile=True).problems
    failed = verify.check_case(fp8[0], FALLBACK, compile=True)
    # lowered for sm_80 (each target its own lowering), Pallas' own lowering refuses the cast
    assert any("lowering failed" in p or "offline compile failed" in p for p in failed.problems), (
        failed.problems
    )
    with pytest.raises(ValueError, match="sm_89 or newer; this GPU is sm_80"):
        FALLBACK.require_fp8("the KV cache")
    TARGETS["gb10"].require_fp8("the KV cache")
    INTERPRET.require_fp8("the KV cache")


def test_compile_refuses_an_unverified_module():
    args = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.float32))
    (bad,) = lower_triton_modules(_loop_call, *args, typed=False)
    with pytest.raises(ValueError, match="does not verify"):
        compile_offline(bad, 90)


# ---- the tuning table ------------------------------------------------------------------------


def test_targets_by_device_kind():
    assert target_for_kind("NVIDIA H200").name == "h200"
    assert target_for_kind("NVIDIA GB10").name == "gb10"
    assert target_for_kind("Tesla T4") is FALLBACK
    assert target_for_backend("pallas_interpret") is INTERPRET
    with pytest.raises(ValueError, match="no kernel configuration"):
        target_for_backend("xla")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU-only refusal")
def test_pallas_backend_without_a_gpu_is_refused():
    target_for_backend.cache_clear()
    with pytest.raises(ValueError, match="needs a GPU"):
        target_for_backend("pallas")


@pytest.mark.parametrize("target", [*GPU_TARGETS.values(), INTERPRET], ids=lambda t: t.name)
def test_blocks_are_powers_of_two_triton_accepts(target):
    def power_of_two(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    ge = target.grouped_experts
    for k in (576, 768, 1536, 2048):
        for lhs_dtype in (jnp.float32, jnp.bfloat16):
            blocks = ge.kwargs(k, lhs_dtype)
            for name in ("block_m", "block_n", "block_k"):
                assert power_of_two(blocks[name]) and blocks[name] >= 16, (name, blocks)
            assert k % blocks["block_k"] == 0
            if lhs_dtype == jnp.float32 and ge.float32_tile_elements is not None:
                assert blocks["block_n"] * blocks["block_k"] <= ge.float32_tile_elements
    for page_size in (8, 16, 32, 64, 128):
        for head_dim, code_dim, page_dtype in ((64, 64, jnp.bfloat16), (128, 64, jnp.uint8)):
            for q_dtype in (jnp.float32, jnp.bfloat16):
                kw = target.paged_attention.kwargs(
                    page_size=page_size,
                    head_dim=head_dim,
                    code_dim=code_dim,
                    q_dtype=q_dtype,
                    page_dtype=page_dtype,
                )
                assert power_of_two(kw["pages_per_compute_block"])
                assert power_of_two(kw["num_warps"])
                tile_tokens = kw["pages_per_compute_block"] * page_size
                limit = target.paged_attention.max_tile_bytes
                code_bytes = code_dim * jnp.dtype(page_dtype).itemsize
                if limit is not None and tile_tokens > max(page_size, 16):
                    assert 2 * tile_tokens * code_bytes <= limit


def test_attention_tile_shrinks_to_the_shared_memory_and_register_budgets():
    config = PagedAttentionConfig(compute_block_tokens=128, max_tile_bytes=64 * 1024)

    def pages(page_size, head_dim, q_dtype, page_dtype=jnp.bfloat16):
        code_dim = head_dim // 2 if page_dtype == jnp.uint8 else head_dim
        return config.kwargs(
            page_size=page_size,
            head_dim=head_dim,
            code_dim=code_dim,
            q_dtype=q_dtype,
            page_dtype=page_dtype,
        )

    assert pages(16, 128, jnp.bfloat16)["pages_per_compute_block"] == 8  # 64 KiB of K+V fits
    assert pages(16, 128, jnp.bfloat16, jnp.float32)["pages_per_compute_block"] == 1  # f32
    assert pages(16, 128, jnp.bfloat16, jnp.float32)["num_warps"] == 8
    assert pages(16, 64, jnp.float32, jnp.uint8)["pages_per_compute_block"] == 2  # 32 x 64
    assert pages(128, 128, jnp.bfloat16)["pages_per_compute_block"] == 1  # never below a page
    assert pages(8, 128, jnp.float32, jnp.float32)["pages_per_compute_block"] == 2  # >= 16 tokens
    assert GroupedExpertsConfig(block_k=128).kwargs(576)["block_k"] == 64
    f32 = GroupedExpertsConfig(block_n=128, block_k=128).kwargs(2048, jnp.float32)
    assert (f32["block_n"], f32["block_k"], f32["num_warps"]) == (64, 64, 8)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU answer")
def test_gpu_check_without_a_gpu_says_so_and_succeeds(capsys):
    from pallas_kernels import gpu_check

    assert gpu_check.main([]) == 0
    assert "no GPU on this machine" in capsys.readouterr().out
