"""The native CPU matrix products (``research.native.gemm``): packing, the vector kernel against an
exact emulation of its float32 arithmetic (any CPU, no AMX needed), AMX against a float64
reference where the CPU has it, batch invariance, the engine through them, and the build that
refuses instruction sets the CPU lacks."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research import native
from research.native import gemm

built = pytest.mark.skipif(
    not gemm.available(), reason=f"native gemm unavailable: {native.build_error('gemm')}"
)
amx = pytest.mark.skipif(
    not gemm.amx_available(), reason=f"AMX kernel unavailable here: {gemm.describe()}"
)
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march names")
ROOT = Path(__file__).resolve().parents[1]


def product(x, w, kernel="auto", out_dtype=jnp.float32):
    """x @ packed w through ``kernel``, jitted."""
    return np.asarray(jax.jit(lambda a, b: gemm.matmul(a, b, out_dtype, kernel=kernel))(x, w))


def vector_reference(x, w, dot=None):
    """The vector kernel's bfloat16 arithmetic, exactly: per output, a float32 sum of the even-k
    products and one of the odd-k products, each in k order (a product of two bf16 values is
    exact in float32, so each fused multiply-add rounds once, as here), then even + odd; or,
    where the kernel takes ``vdpbf16ps`` (``dot``, default ``gemm.bf16_dot()``), one sum per
    output, each k pair adding its odd product and then its even one (no denormals arise
    here, so the instruction's flush to zero does not show)."""
    dot = gemm.bf16_dot() if dot is None else dot
    x32 = np.asarray(x, np.float32)
    w32 = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
    even = np.zeros((x32.shape[0], w32.shape[1]), np.float32)
    odd = np.zeros_like(even)
    for k in range(0, x32.shape[1], 2):
        if dot:
            even = even + np.outer(x32[:, k + 1], w32[k + 1]).astype(np.float32)
            even = even + np.outer(x32[:, k], w32[k]).astype(np.float32)
        else:
            even = even + np.outer(x32[:, k], w32[k]).astype(np.float32)
            odd = odd + np.outer(x32[:, k + 1], w32[k + 1]).astype(np.float32)
    return even + odd


@pytest.mark.parametrize("transposed", [False, True])
def test_pack_round_trips_and_rejects_shapes_that_do_not_tile(transposed):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((96, 64)), jnp.bfloat16)
    packed = gemm.pack(w.T if transposed else w, transposed=transposed)
    assert packed.shape == (96, 64) and packed.packed.shape == (2, 3, 16, 2, 32)
    np.testing.assert_array_equal(np.asarray(gemm.unpack(packed)), np.asarray(w))
    # The layout the kernels read: packed[g, kb, r, t, 2c + j] = W[32 kb + 2 r + j, 32 g + 16 t + c]
    # (a k pair's 32 columns consecutive: the vector kernel reads a panel front to back).
    p, wn = np.asarray(packed.packed), np.asarray(w)
    g, kb, r, t, c, j = np.meshgrid(*map(np.arange, (2, 3, 16, 2, 16, 2)), indexing="ij")
    np.testing.assert_array_equal(
        p[g, kb, r, t, 2 * c + j], wn[32 * kb + 2 * r + j, 32 * g + 16 * t + c]
    )
    with pytest.raises(ValueError, match=r"\[96, 48\] weight does not tile"):
        gemm.pack(w[:, :48])


@built
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 64, 65, 130])
def test_vector_kernel_is_its_exact_float32_arithmetic(m):
    """Row counts across the kernel's row blocks (4 or 2), tails and 64-row units, and k
    across its steps (4 blocks of 32); every output bit equals the emulation's, on whatever
    instruction set this build targets."""
    rng = np.random.default_rng(m)
    k, n = 224, 160
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    y = product(x, gemm.pack(w), "vector")
    assert y.dtype == np.float32 and y.shape == (m, n)
    np.testing.assert_array_equal(y, vector_reference(x, w))


@built
@pytest.mark.parametrize("m", [1, 3, 6, 11, 64, 70])
def test_float32_weights_match_a_float64_reference(m):
    """float32 panels [K, 32]: fused multiply-adds in k order (even and odd k apart), so within
    a few float32 roundings of the float64 product, and exact on integer-valued operands. Row
    counts across the float32 row blocks (6 rows on AVX-512, else 2) and their tails."""
    rng = np.random.default_rng(m)
    k, n = 128, 96
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    packed = gemm.pack(w)
    assert packed.packed.dtype == jnp.float32 and packed.packed.shape == (3, 128, 32)
    np.testing.assert_array_equal(np.asarray(gemm.unpack(packed)), np.asarray(w))
    y = product(x, packed)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    bound = 4 * np.finfo(np.float32).eps * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)))
    assert (np.abs(y - ref) <= bound).all()
    xi = jnp.asarray(rng.integers(-8, 8, (m, k)), jnp.float32)
    wi = jnp.asarray(rng.integers(-8, 8, (k, n)), jnp.float32)
    np.testing.assert_array_equal(product(xi, gemm.pack(wi)), np.asarray(xi) @ np.asarray(wi))


@amx
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32, 33, 64, 130, 300])
def test_amx_products_match_a_float64_reference(m):
    """Row counts across the AMX kernel's 16-row tails, 32-row pairs and 128-row units."""
    rng = np.random.default_rng(m)
    k, n = 96, 160
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    y = product(x, gemm.pack(w), "amx")
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert y.dtype == np.float32 and y.shape == (m, n)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.fixture(scope="module")
def emulated_amx(tmp_path_factory):
    """``gemm.cc`` built with its AMX instructions emulated (``tests/amx_emulated.cc``), its
    bfloat16 product registered as an XLA target: the AMX kernel's code on any x86-64 CPU."""
    import ctypes

    compiler = native._compiler()[0]
    flags = native._flags(compiler)
    if "-mamx-tile" not in flags:
        pytest.skip(f"{compiler} cannot target AMX")
    lib = tmp_path_factory.mktemp("amx") / "amx_emulated.so"
    cmd = [compiler, *flags, "-I", jax.ffi.include_dir(), "-o", str(lib)]
    proc = subprocess.run([*cmd, str(ROOT / "tests" / "amx_emulated.cc")], capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    handle = ctypes.cdll.LoadLibrary(str(lib))
    target = "research_gemm_bf16_amx_emulated"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handle.GemmBf16), platform="cpu")

    def run(x, w, out_dtype=jnp.float32):
        call = jax.ffi.ffi_call(
            target, jax.ShapeDtypeStruct((x.shape[0], w.out_features), out_dtype)
        )
        epilogue = np.int32(1 if w.epilogue == "swiglu" else 0)
        fn = jax.jit(
            lambda a, b: call(a, b, epilogue=epilogue, kernel=np.int32(2), layer=np.int32(0))
        )
        return np.asarray(fn(x, w.packed))

    return run


@x86
@pytest.mark.parametrize("m", [1, 16, 17, 33, 130])
def test_the_amx_kernel_with_emulated_tiles_reads_the_packed_layout(emulated_amx, m):
    """The AMX kernel's tiling and the panel layout it loads its B tiles from, on any x86-64 CPU
    (its tile instructions emulated): products within float32 rounding of a float64 reference,
    bfloat16 output and the swiglu epilogue as the vector kernel's."""
    rng = np.random.default_rng(m)
    k, n = 96, 160
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    y = emulated_amx(x, gemm.pack(w))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    fused = gemm.pack_gate_up(w[:, :64], w[:, 64:128])
    h = emulated_amx(x, fused, jnp.bfloat16)
    gate, up = ref[:, :64], ref[:, 64:128]
    swiglu = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(np.asarray(h, np.float32), swiglu, rtol=1e-2, atol=1e-2)


@built
@pytest.mark.parametrize("kernel", ["vector", pytest.param("amx", marks=amx)])
@pytest.mark.parametrize("m", [1, 17, 40])
def test_bfloat16_output_and_the_swiglu_epilogue(m, kernel):
    """bfloat16 output is the float32 product rounded to nearest even; a gate/up pair gives
    silu(x W_gate) * (x W_up) in one product; q/k/v packed together give their concatenation."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 64)), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.standard_normal((64, 64)) * 0.2, jnp.bfloat16) for _ in range(2))
    f32 = product(x, gemm.pack(wg), kernel)
    bf16 = product(x, gemm.pack(wg), kernel, jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bf16, np.asarray(jnp.asarray(f32, jnp.bfloat16)))
    fused = gemm.pack_gate_up(wg, wu)
    assert fused.out_features == 64
    h = product(x, fused, kernel)
    gate, up = (np.asarray(x, np.float64) @ np.asarray(w, np.float64) for w in (wg, wu))
    ref = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    wk = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    qkv = product(x, gemm.pack_qkv(wg, wk, wu), kernel)
    np.testing.assert_array_equal(qkv[:, :64], f32)


@built
@pytest.mark.parametrize("kernel", ["vector", pytest.param("amx", marks=amx)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_rows_product_does_not_depend_on_its_batch(kernel, dtype):
    """Each output is one dot product in a fixed order: a row gives the same bits alone, at
    another offset, or among 200 others (the engine's batch invariance rests on it)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((200, 576)), dtype)
    w = gemm.pack(jnp.asarray(rng.standard_normal((576, 192)), dtype))
    full = product(x, w, kernel)
    for rows in (slice(7, 8), slice(0, 33), slice(150, 200)):
        np.testing.assert_array_equal(product(x[rows], w, kernel), full[rows])


@built
def test_products_called_from_several_threads_at_once_stay_exact():
    """The kernels share one process-wide pool of helper threads: products that run at the same
    time (XLA runs independent kernels concurrently; so do threads) never take each other's
    pieces of work."""
    import concurrent.futures

    rng = np.random.default_rng(5)
    cases = []
    for m, k, n in ((1, 576, 960), (3, 96, 1536), (64, 192, 320), (9, 1536, 576)):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        cases.append((x, gemm.pack(w), vector_reference(x, w)))
    calls = [jax.jit(lambda a, b: gemm.matmul(a, b, kernel="vector")) for _ in cases]

    def hammer(i):
        x, w, want = cases[i]
        for _ in range(40):
            np.testing.assert_array_equal(np.asarray(calls[i](x, w)), want)

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        for f in [pool.submit(hammer, i) for i in range(len(cases))]:
            f.result()


def test_resolve_picks_xla_where_the_kernels_cannot_serve(monkeypatch):
    assert gemm.resolve("auto", jnp.float16) == "xla"
    assert gemm.resolve("xla", jnp.bfloat16) == "xla"
    assert gemm.resolve("auto", jnp.bfloat16, sharded=True) == "xla"
    with pytest.raises(ValueError, match=r'gemm_backend="native" cannot serve float16'):
        gemm.resolve("native", jnp.float16)
    with pytest.raises(ValueError, match="gemm_backend must be one of"):
        gemm.resolve("amx", jnp.bfloat16)
    if gemm.available():
        assert gemm.resolve("auto", jnp.bfloat16) == "native"
        assert gemm.resolve("auto", jnp.float32) == "native"
    monkeypatch.setenv("RESEARCH_GEMM_KERNEL", "tiles")
    with pytest.raises(ValueError, match="RESEARCH_GEMM_KERNEL must be one of"):
        gemm.kernel_name()


@built
@built
def test_bf16_dot_zero_keeps_the_two_fma_arithmetic():
    """``RESEARCH_GEMM_BF16_DOT=0`` (an ablation) makes the vector kernel take the two-FMA
    even/odd sums even where it would take ``vdpbf16ps``: its bits are that reference's."""
    code = textwrap.dedent(
        """
        import json, numpy as np, jax, jax.numpy as jnp
        from research.native import gemm
        rng = np.random.default_rng(2)
        x = jnp.asarray(rng.standard_normal((6, 96)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
        y = np.asarray(jax.jit(lambda a, b: gemm.matmul(a, b, kernel="vector"))(x, gemm.pack(w)))
        print(json.dumps([gemm.bf16_dot(), gemm.describe(), y.tolist()]))
        """
    )
    env = {**os.environ, "RESEARCH_GEMM_BF16_DOT": "0", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    dot, described, y = json.loads(proc.stdout.splitlines()[-1])
    assert dot is False and "vdpbf16ps" not in described
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((6, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), vector_reference(x, w, dot=False))


def test_describe_names_the_kernel_and_its_instruction_set(monkeypatch):
    monkeypatch.setenv("RESEARCH_GEMM_KERNEL", "vector")
    assert gemm.describe(jnp.bfloat16).startswith("vector (")
    assert f"-march={native.march()}" in gemm.describe(jnp.float32)
    assert gemm.describe(jnp.float16).startswith("xla (float16 weights")
    assert ("vdpbf16ps" in gemm.describe(jnp.bfloat16)) == gemm.bf16_dot()
    assert "vdpbf16ps" not in gemm.describe(jnp.float32)  # float32 never takes it
    monkeypatch.setenv("RESEARCH_GEMM_KERNEL", "auto")
    vector = gemm.describe(jnp.float32).replace(" (avx512,", " (avx512, vdpbf16ps,")
    assert gemm.describe(jnp.bfloat16) == (
        "amx" if gemm.amx_available() else vector if gemm.bf16_dot() else gemm.describe(jnp.float32)
    )


@x86
def test_a_build_for_instructions_the_cpu_lacks_falls_back_to_native(monkeypatch, caplog):
    """-march=x86-64-v4 assumes AVX-512; on a CPU whose flags lack it the library is built for
    -march=native instead, with a warning naming what was missing (never an illegal
    instruction at load or call time)."""
    compiler = native._compiler()[0]
    avx2_cpu = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
    monkeypatch.setattr(native, "_cpu_flags", lambda: avx2_cpu)
    assert "avx512f" in native.missing_isa(compiler, "x86-64-v4")
    assert native.missing_isa(compiler, "x86-64-v3") == []
    monkeypatch.setenv("RESEARCH_NATIVE_MARCH", "x86-64-v4")
    with caplog.at_level("WARNING", logger="research.native"):
        assert native.resolve_march(compiler) == "native"
    assert "RESEARCH_NATIVE_MARCH=x86-64-v4 assumes" in caplog.text and "avx512f" in caplog.text
    monkeypatch.setenv("RESEARCH_NATIVE_MARCH", "x86-64-v3")
    assert native.resolve_march(compiler) == "x86-64-v3"
    monkeypatch.setattr(native, "_cpu_flags", lambda: None)  # flags unknown: trust the request
    assert native.missing_isa(compiler, "x86-64-v4") == []


# -march -> the vector kernel's instruction set (alderlake: AVX2 with AVX-VNNI's vpdpbusd)
ISA_BUILDS = {
    "x86-64-v3": "avx2",
    "x86-64-v2": "generic",
    "x86-64-v4": "avx512",
    "alderlake": "avx2",
}


@x86
@pytest.mark.parametrize("arch", sorted(ISA_BUILDS))
def test_avx2_and_sse_builds_give_the_same_bits(tmp_path, arch):
    """The library built for AVX2 (x86-64-v3), SSE only (x86-64-v2, no FMA), AVX-512 without
    VNNI (x86-64-v4) and AVX2 with AVX-VNNI (alderlake, where this CPU has it) in a fresh
    process: the vector kernel names its instruction set and its
    bf16 products equal the exact emulation, bit for bit, as the native build's do (the same
    source on every CPU); the block kernel's int8 dot products (AVX2's and AVX-512's
    vpmaddubsw, AVX-VNNI's 256-bit vpdpbusd, plain vector code on SSE) give the
    integers of ``int8_reference`` for Q4_1 and Q8_0 blocks. A target this CPU cannot run is
    skipped (the build would fall back to native)."""
    if missing := native.missing_isa(native._compiler()[0], arch):
        pytest.skip(f"-march={arch} assumes {', '.join(missing)}, which this CPU lacks")
    code = textwrap.dedent(
        """
        import json, sys, dataclasses, numpy as np, jax, jax.numpy as jnp
        from research import native
        from research.native import gemm
        from tests.test_gguf_blocks import blocks
        rng = np.random.default_rng(5)
        x = jnp.asarray(rng.standard_normal((7, 96)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
        y = np.asarray(jax.jit(gemm.matmul)(x, gemm.pack(w)))
        xb = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
        int8 = {}
        for fmt in ("q4_1", "q8_0"):
            bw = dataclasses.replace(blocks(fmt, 64, 128, seed=9), activations="int8")
            int8[fmt] = np.asarray(jax.jit(gemm.block_matmul)(xb, bw)).tolist()
        from tests.test_native_attention import packed_case
        attention = []
        for head_dim in (64, 40):
            inputs, scale, _, _ = packed_case("bfloat16", head_dim, 16)
            call = jax.jit(lambda *a: native.packed_attention(*a, scale))
            attention.append(np.asarray(call(*inputs)).tolist())
        print(json.dumps([native.built_march("gemm"), native.built_march("attention"),
                          gemm.describe(), y.tolist(), int8, attention, gemm.bf16_dot()]))
        """
    )
    env = {**os.environ, "RESEARCH_NATIVE_MARCH": arch, "RESEARCH_GEMM_KERNEL": "vector",
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    built_for, attention_built_for, described, y, int8, attention, dot = json.loads(
        proc.stdout.splitlines()[-1]
    )
    assert built_for == attention_built_for == arch
    assert described.startswith(f"vector ({ISA_BUILDS[arch]}")
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((7, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), vector_reference(x, w, dot))
    from tests.test_gguf_blocks import blocks, int8_reference

    xb = rng.standard_normal((3, 128)).astype(np.float32)
    for fmt, got in int8.items():
        bw = dataclasses.replace(blocks(fmt, 64, 128, seed=9), activations="int8")
        ref = int8_reference(xb, bw, fused=arch != "x86-64-v2")
        np.testing.assert_array_equal(np.asarray(got, np.float32), ref, err_msg=fmt)
    from tests.test_native_attention import packed_case

    for head_dim, got in zip((64, 40), attention, strict=True):
        _, _, ref, _ = packed_case("bfloat16", head_dim, 16)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5, err_msg=head_dim)


def test_stream_sums_every_word_of_the_buffer():
    """``gemm.stream`` (the yardstick ``bench_gemm --chain`` reads weights with): the wrapping
    uint32 sum of every 32-bit word, tails shorter than a vector and a thread's piece included,
    plus ``start``; it fails if any word is skipped or read twice."""
    rng = np.random.default_rng(3)
    for words in (1, 17, 4096 * 3 + 5, 300_001):
        raw = rng.integers(0, 2**32, words, dtype=np.uint32)
        expect = (int(raw.astype(np.uint64).sum()) + 7) % 2**32
        x = jnp.asarray(raw.view(np.uint8))
        assert int(jax.jit(gemm.stream)(x, 7)) == expect, words
    with pytest.raises(ValueError, match="32-bit words"):
        gemm.stream(jnp.zeros(6, jnp.uint8))


def test_greedy_kernel_matches_the_xla_sampler():
    """``gemm.greedy`` (a CPU step's argmax and top-2 gap in one native pass) against
    ``sampler.greedy``'s XLA reductions, bit for bit: random rows, rows of many ties, all -inf,
    all equal, the maximum at both ends, vocabularies shorter than a vector and with tails. A row
    holding a NaN takes its first NaN (as ``np.argmax``) and a NaN gap: XLA:CPU's max drops NaNs
    in its vector loop and answers 163 for a row whose NaNs sit at 500 and 999."""
    from research.engine.sampler import greedy

    rng = np.random.default_rng(0)
    xla, ours = jax.jit(greedy), jax.jit(gemm.greedy)
    for vocab in (1, 3, 15, 16, 17, 33, 1000, 49152):
        x = rng.standard_normal((8, vocab)).astype(np.float32)
        x[1] = np.round(x[1])
        x[2] = -np.inf
        x[4] = 5.0
        x[5, 0] = x[5, -1] = 100.0
        x[6] = rng.integers(0, 3, vocab)
        x[7, rng.integers(vocab)] = 7.0  # one clear maximum anywhere
        if vocab > 2:
            x[3, vocab // 2] = x[3, -1] = np.nan
        nan = np.isnan(x).any(axis=1)
        want_ids, want_gap = (np.asarray(a) for a in xla(jnp.asarray(x)))
        ids, gap = (np.asarray(a) for a in ours(jnp.asarray(x)))
        np.testing.assert_array_equal(ids[~nan], want_ids[~nan], err_msg=f"vocab {vocab}")
        np.testing.assert_array_equal(gap[~nan], want_gap[~nan], err_msg=f"vocab {vocab}")
        np.testing.assert_array_equal(ids[nan], np.argmax(x[nan], axis=1))
        assert np.isnan(gap[nan]).all()
    with pytest.raises(ValueError, match="float32 logits"):
        gemm.greedy(jnp.zeros((2, 8), jnp.bfloat16))


def test_kernel_seconds_counts_each_librarys_kernels_once():
    """``native.kernel_seconds``: the kernels' wall time summed over the loaded libraries (gemm
    and attention, each with its own counter). Over calls of ``gemm.stream`` it is most of
    their wall time and never more: it fails if the calls go uncounted, or if the libraries
    share one counter (read once per library, so counted twice)."""
    import time

    from research import native

    assert native.available("attention") and native.available("gemm")
    x = jnp.ones(16 << 20, jnp.uint32)  # 64 MiB
    stream = jax.jit(gemm.stream)
    stream(x).block_until_ready()
    before, t0 = native.kernel_seconds(), time.perf_counter()
    for _ in range(3):
        stream(x).block_until_ready()
    wall, counted = time.perf_counter() - t0, native.kernel_seconds() - before
    assert 0.5 * wall < counted <= wall, (counted, wall)


def test_pack_params_fuses_and_packs_projections_only():
    """q/k/v fuse into wqkv (q, then k, then v) and a dense MLP's gate/up into w_gate_up (per
    16-column panel: gate, then up) where they tile; wo and w_down are packed alone; the norms
    become ``NormWeight`` of the same array; 3-D expert stacks, the router and the embedding
    stay; a tied embedding gains a packed lm_head
    (its transpose); a projection that does not tile stays unfused. Random weights and the
    exact inverse (``unpack``): a swapped q/k/v or gate/up order, or a wrong transpose, fails
    here, on any CPU (no AMX needed)."""
    bf = jnp.bfloat16
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape), bf)

    dense = {"attn_norm": w(64), "w_down": w(96, 64)}
    dense |= {key: w(64, 96) for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up")}
    moe = {
        "wq": w(64, 96),
        "wk": w(64, 40),  # 40 outputs: does not tile, so no wqkv
        "wv": w(64, 96),
        "w_gate": w(4, 64, 32),  # experts: not 2-D projections
        "w_up": w(4, 64, 32),
        "router": w(64, 32),
    }
    params = {"embed": w(128, 64), "layers": [dense, moe]}
    packed = gemm.pack_params(params, tie_word_embeddings=True)
    d, m = packed["layers"]
    assert sorted(d) == ["attn_norm", "w_down", "w_gate_up", "wo", "wqkv"]
    assert d["wqkv"].shape == (64, 288) and d["w_gate_up"].out_features == 96

    def same(a, b):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    same(gemm.unpack(d["wqkv"]), jnp.concatenate([dense["wq"], dense["wk"], dense["wv"]], 1))
    panels = np.asarray(gemm.unpack(d["w_gate_up"]), np.float32).reshape(64, 6, 2, 16)
    same(panels[:, :, 0].reshape(64, 96), dense["w_gate"])
    same(panels[:, :, 1].reshape(64, 96), dense["w_up"])
    same(gemm.unpack(d["wo"]), dense["wo"])
    same(gemm.unpack(d["w_down"]), dense["w_down"])
    assert isinstance(d["attn_norm"], gemm.NormWeight)
    assert d["attn_norm"].weight is dense["attn_norm"] and d["attn_norm"].layer is None
    assert "wqkv" not in m and m["wk"] is moe["wk"]
    same(gemm.unpack(m["wq"]), moe["wq"])
    for key in ("w_gate", "w_up", "router"):
        assert m[key] is moe[key]
    # with its head packed, the bfloat16 embedding is read by the lookup only: its codes
    assert params["embed"].dtype == jnp.bfloat16 and packed["embed"].dtype == jnp.uint16
    codes = np.asarray(params["embed"]).view(np.uint16)
    np.testing.assert_array_equal(np.asarray(packed["embed"]), codes)
    same(gemm.unpack(packed["lm_head"]), params["embed"].T)
    untied = gemm.pack_params(params, tie_word_embeddings=False)
    assert "lm_head" not in untied and untied["embed"] is params["embed"]  # the head reads it


def random_q4_1(n: int, k: int, rng) -> gemm.BlockWeight:
    """A Q4_1 weight of random blocks: float16 scales and minima, random 4-bit codes."""
    kbs = k // 32
    d = rng.uniform(0.01, 0.1, (n, kbs)).astype(np.float16).view(np.uint8).reshape(n, kbs, 2)
    m = rng.uniform(-0.5, 0.5, (n, kbs)).astype(np.float16).view(np.uint8).reshape(n, kbs, 2)
    codes = rng.integers(0, 256, (n, kbs, 16), dtype=np.uint8)
    return gemm.pack_blocks(np.concatenate([d, m, codes], -1).reshape(n, kbs * 20), "q4_1")


@built
@pytest.mark.parametrize("kind", ["bfloat16", "float32", "q4_1"])
def test_a_stacked_layer_weight_multiplies_as_its_own_layer(kind):
    """``stack_layers`` puts every layer's weight of one form into one buffer [L, ...], each
    layer's weight a view of it: each view's product is its own weight's, bit for bit (the
    kernel reads the layer's panels, not another's), as are ``unpack`` and ``nbytes``; a key
    whose layers differ in form stays per layer; a layer past the stack is an error."""
    rng = np.random.default_rng(3)
    k, n, layers = 64, 96, 3

    def weight(cols):
        if kind == "q4_1":
            return random_q4_1(cols, k, rng)
        dtype = jnp.float32 if kind == "float32" else jnp.bfloat16
        return gemm.pack(jnp.asarray(rng.standard_normal((k, cols)), dtype))

    ws = [weight(n) for _ in range(layers)]
    odd = [weight(n if i != 1 else 32) for i in range(layers)]
    params = {"layers": [{"w": ws[i], "odd": odd[i]} for i in range(layers)]}
    stacked = gemm.stack_layers(params)["layers"]
    mul = jax.jit(gemm.block_matmul if kind == "q4_1" else gemm.matmul)
    unpack = gemm.unpack_blocks if kind == "q4_1" else gemm.unpack
    x = jnp.asarray(rng.standard_normal((5, k)), jnp.float32)
    for i, lp in enumerate(stacked):
        view = lp["w"]
        assert view.layer == i and view.packed is stacked[0]["w"].packed
        assert view.packed.shape == (layers, *ws[i].packed.shape)
        np.testing.assert_array_equal(np.asarray(mul(x, view)), np.asarray(mul(x, ws[i])))
        np.testing.assert_array_equal(np.asarray(unpack(view)), np.asarray(unpack(ws[i])))
        assert view.nbytes == ws[i].nbytes == ws[i].packed.nbytes
        assert lp["odd"] is odd[i]
    with pytest.raises(Exception, match="layer"):
        jax.block_until_ready(mul(x, dataclasses.replace(stacked[0]["w"], layer=layers)))


@built
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 64), (300, 96), (2, 37)])
def test_add_rms_norm_is_the_residual_add_and_the_models_norm(dtype, shape):
    """The native add + RMSNorm against XLA's ``x + delta`` and ``rms_norm`` on random rows
    (decode-sized, batched, many rows over the cores, a width with a tail past 16 lanes): the
    sum bit for bit; the normed rows bit for bit in bfloat16 (every rounding where XLA rounds)
    and to float32 rounding in float32 (the mean of squares summed in another order); without
    delta the norm of x; each layer of a stack reads its own row; a row's result does not
    depend on the others."""
    from research.models import layers

    rng = np.random.default_rng(11)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(3 * rng.standard_normal(shape), dt)
    delta = jnp.asarray(rng.standard_normal(shape), dt)
    weights = jnp.asarray(rng.standard_normal((3, shape[-1])), dt)
    eps = 1e-5
    norm = jax.jit(gemm.add_rms_norm, static_argnums=3)
    f = functools.partial(np.asarray, dtype=np.float32)

    def close(got, want):
        if dt == jnp.bfloat16:
            np.testing.assert_array_equal(f(got), f(want))
        else:
            np.testing.assert_allclose(f(got), f(want), rtol=2e-6, atol=2e-6)

    for layer in range(3):
        w = gemm.NormWeight(weights, layer=layer)
        s, normed = norm(x, delta, w, eps)
        np.testing.assert_array_equal(f(s), f(x + delta))
        close(normed, layers._rms_norm(x + delta, weights[layer], eps))
        same, alone = norm(x, None, w, eps)
        np.testing.assert_array_equal(f(same), f(x))
        close(alone, layers._rms_norm(x, weights[layer], eps))
    one = gemm.NormWeight(weights[1])
    first = norm(x.reshape(-1, shape[-1])[:1], delta.reshape(-1, shape[-1])[:1], one, eps)[1]
    np.testing.assert_array_equal(
        f(first), f(norm(x, delta, one, eps)[1]).reshape(-1, shape[-1])[:1]
    )
    with pytest.raises(Exception, match="layer"):
        jax.block_until_ready(norm(x, delta, gemm.NormWeight(weights, layer=3), eps))
    with pytest.raises(ValueError, match="one dtype"):
        norm(x, delta.astype(jnp.float16), one, eps)


@built
def test_stacked_norms_and_the_native_norm_keep_the_models_logits():
    """A layer's norms stack like its projections (``stack_layers``: one [L, D] buffer, each
    layer's ``NormWeight`` its row), and the model with the native add + RMSNorm gives the
    logits of the same packed model with XLA's norms (random norm weights: a layer reading
    another's row, or a lost residual add, fails). To bf16 rounding, not bit for bit: XLA fuses
    each residual add into the norm after it and squares the sum before rounding it to bf16,
    where the kernel, like the model's code and HF, rounds the sum first (the test above holds
    the kernel to a sum XLA rounds)."""
    from research.models.presets import get_preset
    from research.models.transformer import (
        ContiguousKVCache,
        compute_logits,
        forward,
        init_params,
    )

    cfg = get_preset("tiny-llama")
    bf = jnp.bfloat16
    params = init_params(cfg, jax.random.key(0), bf)
    rng = np.random.default_rng(5)
    for lp in params["layers"]:
        for key in gemm.NORM_KEYS:
            lp[key] = jnp.asarray(rng.uniform(0.5, 1.5, lp[key].shape), bf)
    packed = gemm.stack_layers(gemm.pack_params(params, cfg.tie_word_embeddings))
    norms = [lp["attn_norm"] for lp in packed["layers"]]
    assert [n.layer for n in norms] == list(range(cfg.num_layers))
    assert all(n.weight is norms[0].weight for n in norms)
    for i, lp in enumerate(params["layers"]):
        np.testing.assert_array_equal(np.asarray(norms[i].own), np.asarray(lp["attn_norm"]))
    plain = jax.tree.map(
        lambda w: w.own if isinstance(w, gemm.NormWeight) else w,
        packed,
        is_leaf=lambda w: isinstance(w, gemm.NormWeight),
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))

    @jax.jit
    def logits(p):
        hidden, _ = forward(p, cfg, tokens, positions, ContiguousKVCache.create(cfg, 2, 7, bf))
        return compute_logits(p, cfg, hidden)

    got, want = np.asarray(logits(packed), np.float32), np.asarray(logits(plain), np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * np.abs(want).max())


@built
def test_smollm2_bf16_through_the_kernel_matches_xla():
    """SmolLM2 in bfloat16 with packed weights: logits agree with XLA's bf16 products to bf16
    rounding, and greedy chat answers through the engine are XLA's, token for token."""
    from research import LLM, SamplingParams
    from research.models.transformer import compute_logits

    outs = {}
    for backend in ("native", "xla"):
        llm = LLM("smollm2-135m", dtype="bfloat16", max_model_len=256, gemm_backend=backend)
        ex = llm.engine.executor
        assert ex.gemm_backend == backend
        if backend == "native":
            assert isinstance(ex.params["layers"][0]["wqkv"], gemm.PackedWeight)
            # Each step passes 9 buffers, not 183: the embedding, the packed head, the final
            # norm, one stack of each layer norm and one of each of the 4 layer weights.
            assert len(jax.tree.leaves(ex._call_params)) == 9
            assert all(isinstance(lp["mlp_norm"], gemm.NormWeight) for lp in ex.params["layers"])
            hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, 576)), jnp.bfloat16)
            packed = compute_logits(ex.params, ex.cfg, hidden)
            plain = compute_logits(llm.params, ex.cfg, hidden)
            np.testing.assert_allclose(np.asarray(packed), np.asarray(plain), atol=0.05, rtol=0.02)
        tok = llm.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": text}])
            for text in ("What is the capital of France?", "Name three prime numbers.")
        ]
        sp = SamplingParams(max_tokens=16, temperature=0.0)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        if backend == "native":  # the kernels' share of the steps: some, never all of it
            stats = llm.engine.stats()
            assert 0.0 < stats["kernel_time_s"] < stats["device_time_s"], stats
    assert outs["native"] == outs["xla"]
