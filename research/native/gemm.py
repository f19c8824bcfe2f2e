"""CPU matrix products for a model's projections (``gemm.cc``), weights packed once at load.

A decode step multiplies a few rows by every weight once, so it is as fast as the weights
stream from memory; XLA:CPU's dots read them at a fraction of that (bfloat16 at 40% of the read
roof on an AVX-512 CPU without AMX, ``benchmarks.bench_gemm``), and its bf16 dots ran at
0.2-0.5 TFLOP/s where AMX gives 2-2.5. ``pack_params`` rewrites a model's 2-D projection
weights into ``PackedWeight`` leaves, each 32 output columns one contiguous panel;
``layers.linear`` and ``layers.matmul`` send a product with one to the native kernels:

- bfloat16: AMX's tile units where the CPU has them and the OS grants the tile state, else the
  vector kernel, which the compiler builds for whatever this CPU has (AVX2, AVX-512, ARM
  NEON/SVE): each output a float32 sum of its even-k products and one of its odd-k products,
  the same bits on every instruction set; on AMD CPUs with AVX512-BF16, ``vdpbf16ps``'s own
  arithmetic instead (twice the two-FMA rate on Zen 4: ``bf16_dot``). AMX rounds its own way.
  Whichever runs, a row's result never depends on which other rows share its call;
- float32: the vector kernel;
- 4-bit and 8-bit weights as stored (``BlockWeight``): GGUF's Q4_1 and Q8_0 blocks
  (``quantization="gguf"``) and AWQ int4 (``awq_layer``), widened in registers.

``stack_layers`` then keeps every layer's weight of one kind in one buffer [L, ...] (each
layer's weight a view the kernels offset into), so that a step passes it once.

``$RESEARCH_GEMM_KERNEL=vector`` makes bfloat16 products skip AMX (what a CPU without it runs).
Everything else (norms, RoPE, attention, sampling) stays in XLA. Where the library did not
build, the model is in another dtype, or a weight's shape does not tile (in and out features
multiples of 32), weights stay as they are and XLA multiplies them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from research import native

# Per-layer projection weights the packed path serves ([in, out] matrices multiplied by
# ``layers.linear``; q/k/v and gate/up are fused first where they tile); anything else in a
# layer (biases, sinks, MoE expert stacks, the router) stays as it is, but for its norms.
PACKED_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# A layer's RMSNorm weights that the native kernel applies (``NormWeight``; the model's final
# norm too).
NORM_KEYS = ("attn_norm", "mlp_norm")
GEMM_BACKENDS = ("auto", "xla", "native")
DTYPES = (jnp.bfloat16, jnp.float32)  # what the packed path multiplies
# $RESEARCH_GEMM_KERNEL -> the kernel attribute of the bfloat16 product (``gemm.cc``)
KERNELS = {"auto": 0, "vector": 1, "amx": 2}


class _Panels:
    """What a packed weight (``PackedWeight``, ``BlockWeight``) answers whether or not its
    ``packed`` stacks every layer's (``layer`` set)."""

    packed: jax.Array
    layer: int | None

    @property
    def panels(self) -> jax.Array:
        """This weight's own panels (one layer of a stack, sliced)."""
        return self.packed if self.layer is None else self.packed[self.layer]

    @property
    def nbytes(self) -> int:
        """Bytes of this weight's panels (one layer's share of a stack)."""
        stack = 1 if self.layer is None else self.packed.shape[0]
        return self.packed.nbytes // stack


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight(_Panels):
    """A weight W [K, N], each 32-column panel contiguous. bfloat16: [N/32, K/32, 16, 2, 32],
    packed[g, kb, r, t, 2c + j] = W[32 kb + 2 r + j, 32 g + 16 t + c] (a k pair per 32-bit
    word; a k pair's 32 columns are 128 consecutive bytes, and its two 16-column halves are the
    rows of AMX's B tiles at a 128-byte stride); float32: [N/32, K, 32], packed[g, k, c] =
    W[k, 32 g + c]. Either way a panel is read front to back."""

    packed: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    # "swiglu": a gate/up pair (``pack_gate_up``) whose product is silu(gate) * up, [K, N / 2]
    epilogue: str = dataclasses.field(default="", metadata=dict(static=True))
    # "float": x multiplies the codes in float32 (the dequantized weights' products, rearranged);
    # "int8": each row's 32-k block is quantized to int8 first and multiplies the codes as
    # integers (llama.cpp's arithmetic for these formats: ``gemm.cc``).
    activations: str = dataclasses.field(default="float", metadata=dict(static=True))
    # Where ``packed`` stacks every decoder layer's weight of this kind ([L, ...]: one buffer
    # for a step's call to pass instead of L, ``stack_layers``), the layer this one reads.
    layer: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def out_features(self) -> int:
        return self.shape[1] // 2 if self.epilogue == "swiglu" else self.shape[1]

    @property
    def dtype(self) -> Any:
        return self.packed.dtype

    @property
    def ndim(self) -> int:
        return 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormWeight:
    """An RMSNorm's weight [D] that the native kernel applies (``add_rms_norm``), with the
    residual add before it: one call instead of the five XLA fusions of the add and the norm."""

    weight: jax.Array
    # Where ``weight`` stacks every decoder layer's norm of this kind ([L, D], ``stack_layers``),
    # the layer this one reads.
    layer: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def dtype(self) -> Any:
        return self.weight.dtype

    @property
    def own(self) -> jax.Array:
        """This norm's weight [D] (its layer's row of a stack)."""
        return self.weight if self.layer is None else self.weight[self.layer]


def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, w: NormWeight, eps: float
) -> tuple[jax.Array, jax.Array]:
    """(s, rms_norm(s)) for s = x + delta (x itself where ``delta`` is None) in one native
    call: ``research.models.layers.rms_norm``'s arithmetic, rounded to x's dtype where that
    code rounds (the sum, the normalized value, the weight's product; inside a step XLA fuses
    the add into the norm and squares the unrounded sum); the mean of squares a float32
    sum in a fixed order per row (rows are batch-invariant). x, delta and the weight share one
    dtype, bfloat16 or float32."""
    _require_native()
    weight = w.weight
    if weight.ndim != (1 if w.layer is None else 2) or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x {x.shape} does not end in the norm's {weight.shape[-1]} features")
    if (
        x.dtype != weight.dtype
        or x.dtype not in DTYPES
        or (delta is not None and (delta.dtype != x.dtype or delta.shape != x.shape))
    ):
        raise ValueError(
            f"add_rms_norm takes x, delta and weight of one dtype, bfloat16 or float32; got "
            f"x {x.dtype}{x.shape}, delta "
            f"{None if delta is None else f'{delta.dtype}{delta.shape}'}, weight {weight.dtype}"
        )
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    attrs = dict(eps=np.float32(eps), layer=np.int32(0 if w.layer is None else w.layer))
    if delta is None:
        return x, jax.ffi.ffi_call(native._RMS_NORM_TARGET, out)(x, weight, **attrs)
    s, normed = jax.ffi.ffi_call(native._ADD_RMS_NORM_TARGET, (out, out))(x, delta, weight, **attrs)
    return s, normed


def tiles(k: int, n: int) -> bool:
    """Whether a [k, n] weight fits the kernel's tiles."""
    return k % 32 == 0 and n % 32 == 0 and k > 0 and n > 0


def pack(w: jax.Array, transposed: bool = False) -> PackedWeight:
    """W [K, N] (``transposed``: given as [N, K], e.g. a tied embedding), bfloat16 or float32
    (other dtypes are packed as bfloat16) -> PackedWeight in that dtype's layout."""
    w = jnp.asarray(w)
    if w.dtype != jnp.float32:
        w = w.astype(jnp.bfloat16)
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    if not tiles(k, n):
        raise ValueError(f"a [{k}, {n}] weight does not tile (in and out % 32 must be 0)")
    if w.dtype == jnp.float32:  # [g, k, c]
        wkn = w.T if transposed else w
        return PackedWeight(wkn.reshape(k, n // 32, 32).transpose(1, 0, 2), (k, n))
    if transposed:  # [g, t, c, kb, r, j] -> [g, kb, r, t, c, j]
        packed = w.reshape(n // 32, 2, 16, k // 32, 16, 2).transpose(0, 3, 4, 1, 2, 5)
    else:  # [kb, r, j, g, t, c] -> [g, kb, r, t, c, j]
        packed = w.reshape(k // 32, 16, 2, n // 32, 2, 16).transpose(3, 0, 1, 4, 5, 2)
    return PackedWeight(packed.reshape(n // 32, k // 32, 16, 2, 32), (k, n))


def pack_gate_up(w_gate: jax.Array, w_up: jax.Array) -> PackedWeight:
    """W_gate, W_up [K, F] -> one PackedWeight whose product is silu(x W_gate) * (x W_up) [.., F]:
    each 32-column panel holds 16 gate columns then the same 16 up columns, and the kernel's
    epilogue combines them."""
    k, f = w_gate.shape
    if w_up.shape != (k, f) or f % 16:
        raise ValueError(f"gate {w_gate.shape} and up {w_up.shape} must match, F % 16 == 0")
    both = jnp.stack([w_gate.reshape(k, f // 16, 16), w_up.reshape(k, f // 16, 16)], axis=2)
    return dataclasses.replace(pack(both.reshape(k, 2 * f)), epilogue="swiglu")


def pack_qkv(wq: jax.Array, wk: jax.Array, wv: jax.Array) -> PackedWeight:
    """Wq, Wk, Wv [K, *] -> one PackedWeight over their concatenated columns (q, then k, v)."""
    return pack(jnp.concatenate([wq, wk, wv], axis=1))


def unpack(w: PackedWeight) -> jax.Array:
    """PackedWeight -> W [K, N] in its dtype (the inverse of ``pack``; a gate/up pair comes
    back with its panels' columns interleaved as packed)."""
    k, n = w.shape
    if w.packed.dtype == jnp.float32:
        return w.panels.transpose(1, 0, 2).reshape(k, n)
    six = w.panels.reshape(n // 32, k // 32, 16, 2, 16, 2)  # [g, kb, r, t, c, j]
    return six.transpose(1, 2, 5, 0, 3, 4).reshape(k, n)


def available() -> bool:
    """The library built (its vector kernel serves any CPU it was built on)."""
    return native.available("gemm")


def amx_available() -> bool:
    """The library built and this CPU has AMX-BF16 with the tile state granted."""
    return available() and bool(native.library("gemm").ResearchAmxReady())


def fused_multiply_add() -> bool:
    """Whether the loaded library's kernels fuse each multiply-add (one rounding): wherever its
    target has FMA (x86-64-v3 and later, 64-bit ARM)."""
    return available() and bool(native.library("gemm").ResearchGemmFma())


def bf16_dot() -> bool:
    """Whether the vector kernel's bfloat16 products take AVX512-BF16's ``vdpbf16ps`` here (AMD
    CPUs with it; its arithmetic, per lane and k pair: acc += x_odd w_odd, then x_even w_even,
    each a float32 fused multiply-add) rather than the two-FMA even/odd sums."""
    return available() and bool(native.library("gemm").ResearchGemmBf16Dot())


def kernel_name() -> str:
    """$RESEARCH_GEMM_KERNEL: "auto" (AMX where granted, else the vector kernel), "vector" or
    "amx"; a clear error for anything else."""
    name = os.environ.get("RESEARCH_GEMM_KERNEL", "auto")
    if name not in KERNELS:
        raise ValueError(f"RESEARCH_GEMM_KERNEL must be one of {sorted(KERNELS)}, got {name!r}")
    return name


def describe(dtype: Any = jnp.bfloat16) -> str:
    """Which kernel multiplies ``dtype`` here and the instruction set it was built for, e.g.
    "amx" or "vector (avx512bf16, -march=native)"; why not where the packed path cannot."""
    why = unavailable_reason(dtype)
    if why:
        return f"xla ({why})"
    isa = native.library("gemm").ResearchGemmVectorIsa
    isa.restype = __import__("ctypes").c_char_p
    dot = ", vdpbf16ps" if jnp.dtype(dtype) == jnp.bfloat16 and bf16_dot() else ""
    vector = f"vector ({isa().decode()}{dot}, -march={native.built_march('gemm')})"
    if jnp.dtype(dtype) == jnp.bfloat16 and kernel_name() != "vector" and amx_available():
        return "amx"
    return vector


def unavailable_reason(dtype: Any) -> str | None:
    """Why the packed path cannot serve a model in ``dtype`` here (None: it can)."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        return f"{jnp.dtype(dtype).name} weights (the kernels multiply bfloat16 and float32)"
    if jax.default_backend() != "cpu":
        return f"the {jax.default_backend()} backend (the kernels are for CPU)"
    if not native.available("gemm"):
        return f"the native gemm library did not build: {native.build_error('gemm')}"
    if kernel_name() == "amx" and jnp.dtype(dtype) == jnp.bfloat16 and not amx_available():
        return "RESEARCH_GEMM_KERNEL=amx, and this CPU has no AMX-BF16 (or no tile state)"
    return None


def resolve(backend: str, dtype: Any, sharded: bool = False) -> str:
    """``"auto"``: "native" where the packed path serves (bfloat16 or float32 on a CPU where the
    library built, one device), else "xla". An explicit "native" that cannot serve is an error
    naming why."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm_backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    why = "tensor/expert parallel plans" if sharded else unavailable_reason(dtype)
    if backend == "auto":
        return "xla" if why else "native"
    if backend == "native" and why:
        raise ValueError(f'gemm_backend="native" cannot serve {why}; use "xla"')
    return backend


def pack_params(params: dict, tie_word_embeddings: bool, awq_blocks: bool = True) -> dict:
    """A model's params with its bfloat16 or float32 projections packed: q, k and v as one
    ``wqkv``, a dense MLP's gate and up as one ``w_gate_up`` (silu(gate) * up in the kernel's
    epilogue), the others one by one; weights that do not tile stay. The layers' norms and the
    final norm become ``NormWeight`` (the native RMSNorm, with the residual add before it). A
    tied embedding gains a packed ``lm_head`` beside it; a bfloat16 ``embed`` that only the
    lookup reads then is kept as its uint16 codes (the model reads them as bfloat16).
    ``awq_blocks``: AWQ int4 projections (``research.quant.QTensor``) become ``BlockWeight``
    blocks of the same codes, scales and zero points (``awq_rows``), fused the same way, read
    as stored."""

    def fits(*ws: Any, transposed: bool = False) -> bool:
        for w in ws:
            if not isinstance(w, jax.Array) or w.ndim != 2 or w.dtype not in DTYPES:
                return False
            k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
            if not tiles(k, n):
                return False
        return True

    def layer(lp: dict) -> dict:
        out = dict(lp)
        if awq_blocks:
            out = awq_layer(out)
        qkv = [out.get(key) for key in ("wq", "wk", "wv")]
        if fits(*qkv):
            out["wqkv"] = pack_qkv(*qkv)
            for key in ("wq", "wk", "wv"):
                del out[key]
        gate, up = out.get("w_gate"), out.get("w_up")
        if fits(gate, up):
            out["w_gate_up"] = pack_gate_up(gate, up)
            del out["w_gate"], out["w_up"]
        for key in PACKED_KEYS:
            if key in out and fits(out[key]):
                out[key] = pack(out[key])
        return out

    def norm(w: Any) -> Any:  # applied by the native kernel, with the residual add before it
        ok = isinstance(w, jax.Array) and w.ndim == 1 and w.dtype in DTYPES
        return NormWeight(w) if ok else w

    out = dict(params)
    out["layers"] = [
        {**lp, **{k: norm(lp[k]) for k in NORM_KEYS if k in lp}}
        for lp in (layer(lp) for lp in params["layers"])
    ]
    if "final_norm" in params:
        out["final_norm"] = norm(params["final_norm"])
    if "lm_head" in params and fits(params["lm_head"]):
        out["lm_head"] = pack(params["lm_head"])
    elif "lm_head" not in params and tie_word_embeddings and fits(params["embed"], transposed=True):
        out["lm_head"] = pack(params["embed"], transposed=True)
    embed = params.get("embed")
    if "lm_head" in out and isinstance(embed, jax.Array) and embed.dtype == jnp.bfloat16:
        # Only the lookup reads it now: kept as its 16-bit codes, the same bits. XLA:CPU
        # gathers bfloat16 rows through float32, and inside a loop of decode steps it hoisted
        # that conversion of the whole table out of the loop: each step then read a float32
        # copy of it (SmolLM2: 113 MB more a step, where a step reads 270 MB).
        out["embed"] = jax.lax.bitcast_convert_type(embed, jnp.uint16)
    return out


def stack_layers(params: dict) -> dict:
    """``params`` with each packed layer weight (``PackedWeight``, ``BlockWeight``, and the norms'
    ``NormWeight``) that every decoder layer holds in the same form (shape, dtype, epilogue,
    format) stacked into one buffer [L, ...], each layer's weight a view of it (``layer``): the
    same panels and products, and a jitted step takes one buffer per kind of weight instead of
    one per layer (``research.engine.call_params``). The stacks are new arrays: until the
    caller drops the per-layer ones, both are held."""
    layers = params.get("layers")
    if not isinstance(layers, list) or len(layers) < 2:
        return params
    out = [dict(lp) for lp in layers]
    for key in NORM_KEYS:  # each layer's norm a row of one [L, D] stack
        ws = [lp.get(key) for lp in layers]
        if all(isinstance(w, NormWeight) and w.layer is None for w in ws) and (
            len({(w.weight.shape, w.weight.dtype) for w in ws}) == 1
        ):
            stack = jnp.stack([w.weight for w in ws])
            for i, lp in enumerate(out):
                lp[key] = NormWeight(stack, layer=i)
    for key, first in layers[0].items():
        if not isinstance(first, (PackedWeight, BlockWeight)) or first.layer is not None:
            continue
        ws = [lp.get(key) for lp in layers]
        form = dataclasses.replace(first, packed=None)
        if not all(
            type(w) is type(first)
            and dataclasses.replace(w, packed=None) == form
            and w.packed.shape == first.packed.shape
            and w.packed.dtype == first.packed.dtype
            for w in ws
        ):
            continue
        stack = jnp.stack([w.packed for w in ws])
        for i, lp in enumerate(out):
            lp[key] = dataclasses.replace(ws[i], packed=stack, layer=i)
    return dict(params, layers=out)


def awq_tiles(w: Any) -> bool:
    """Whether ``w`` is a 2-D AWQ int4 ``QTensor`` the block kernel reads as stored: in and out
    features multiples of 32, groups a multiple of 32 input channels."""
    from research.quant import QTensor

    return (
        isinstance(w, QTensor)
        and w.fmt == "awq"
        and len(w.shape) == 2
        and tiles(*w.shape)
        and w.group_size % 32 == 0
    )


def awq_rows(w: Any) -> np.ndarray:
    """An AWQ ``QTensor`` W [K, N] as block rows [N, K/32 * 20] uint8 in Q4_1's block layout
    (``pack_blocks``), one row per output column: per 32 k, the group's float16 scale, its zero
    point as a float16 (in Q4_1's m slot), and the 4-bit codes (k = j in byte j's low nibble,
    k = j + 16 in its high one), so each weight is scale * (code - zero) exactly."""
    from research.quant.formats import awq_unpack

    if not awq_tiles(w):
        raise ValueError(f"{w!r} is not a 2-D AWQ weight that tiles in 32 x 32 blocks")
    k, n = w.shape
    kbs = k // 32
    q = np.asarray(awq_unpack(w.codes)).T.reshape(n, kbs, 32)  # [N, K/32, 32 k]
    group = np.arange(kbs) * 32 // w.group_size  # each k block's group
    scale = np.ascontiguousarray(np.asarray(w.scales, np.float16)[group].T)  # [N, K/32]
    zero = np.ascontiguousarray(np.asarray(awq_unpack(w.zeros))[group].T.astype(np.float16))
    codes = q[..., :16] | (q[..., 16:] << 4)
    rows = np.concatenate(
        [scale.view(np.uint8).reshape(n, kbs, 2), zero.view(np.uint8).reshape(n, kbs, 2), codes],
        axis=-1,
    )
    return rows.reshape(n, kbs * 20)


def awq_layer(lp: dict) -> dict:
    """A layer's AWQ projections as ``BlockWeight`` blocks: q, k and v fused as ``wqkv``, gate
    and up as ``w_gate_up`` (the swiglu epilogue), the rest one by one; others stay."""
    out = dict(lp)
    if all(awq_tiles(lp.get(key)) for key in ("wq", "wk", "wv")):
        rows = np.concatenate([awq_rows(lp[key]) for key in ("wq", "wk", "wv")])
        out["wqkv"] = pack_blocks(rows, "awq")
        for key in ("wq", "wk", "wv"):
            del out[key]
    if awq_tiles(lp.get("w_gate")) and awq_tiles(lp.get("w_up")):
        rows = gate_up_rows(awq_rows(lp["w_gate"]), awq_rows(lp["w_up"]))
        out["w_gate_up"] = pack_blocks(rows, "awq", "swiglu")
        del out["w_gate"], out["w_up"]
    for key in PACKED_KEYS:
        if awq_tiles(out.get(key)):
            out[key] = pack_blocks(awq_rows(out[key]), "awq")
    return out


def _require_native() -> None:
    """Builds and registers the native gemm library on first use; raises where it cannot."""
    if not native.available("gemm"):
        raise RuntimeError(f"native gemm unavailable: {native.build_error('gemm')}")


def matmul(
    x: jax.Array, w: PackedWeight, out_dtype: Any = jnp.float32, kernel: str | None = None
) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in ``out_dtype`` (float32 or bfloat16; accumulated in
    float32) through the native kernels, x cast to W's dtype; a gate/up pair gives
    silu(gate) * up [..., N / 2]. ``kernel`` (bfloat16): "auto", "vector" or "amx"; None reads
    ``$RESEARCH_GEMM_KERNEL`` when the call is traced."""
    _require_native()
    k = w.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; the packed weight takes {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(w.packed.dtype)
    out = jax.ShapeDtypeStruct((x2.shape[0], w.out_features), jnp.dtype(out_dtype))
    epilogue = np.int32(1 if w.epilogue == "swiglu" else 0)
    layer = np.int32(0 if w.layer is None else w.layer)
    if w.packed.dtype == jnp.float32:
        call = jax.ffi.ffi_call(native._GEMM_F32_TARGET, out)
        y = call(x2, w.packed, epilogue=epilogue, layer=layer)
    else:
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
        code = np.int32(KERNELS[kernel or kernel_name()])
        call = jax.ffi.ffi_call(native._GEMM_TARGET, out)
        y = call(x2, w.packed, epilogue=epilogue, kernel=code, layer=layer)
    return y.reshape(*lead, w.out_features)


# ---------------------------------------------------------------- GGUF blocks as stored

# Block formats the kernel reads as stored: bytes of one 32-weight block (GGUF's, in the file),
# of one (32 columns x 32 k) tile of a panel (``gemm.cc``: scales, then codes k-major), and the
# kernel's format code. "awq" is Q4_1's layout with the zero point where Q4_1 keeps m.
BLOCK_FORMATS = {"q4_1": (20, 640, 0), "q8_0": (34, 1088, 1), "awq": (20, 640, 2)}
# How block weights take their activations (the kernel's code is the index).
BLOCK_ACTIVATIONS = ("float", "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockWeight(_Panels):
    """A weight W [K, N] kept as stored (GGUF's Q4_1: w = d q + m, q 4-bit; Q8_0: w = d q, q
    int8; AWQ: w = d (q - z), q 4-bit; float16 d, m and z per 32 k of one column), re-tiled
    into 32-column panels: packed [N/32, K/32, panel bytes] uint8 (``gemm.cc`` gives the tile
    layout)."""

    packed: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    fmt: str = dataclasses.field(default="q4_1", metadata=dict(static=True))
    epilogue: str = dataclasses.field(default="", metadata=dict(static=True))
    # "float": x multiplies the codes in float32 (the dequantized weights' products, rearranged);
    # "int8": each row's 32-k block is quantized to int8 first and multiplies the codes as
    # integers (llama.cpp's arithmetic for these formats: ``gemm.cc``).
    activations: str = dataclasses.field(default="float", metadata=dict(static=True))
    # Where ``packed`` stacks every decoder layer's weight of this kind ([L, ...]: one buffer
    # for a step's call to pass instead of L, ``stack_layers``), the layer this one reads.
    layer: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def out_features(self) -> int:
        return self.shape[1] // 2 if self.epilogue == "swiglu" else self.shape[1]

    @property
    def ndim(self) -> int:
        return 2


def pack_blocks(
    rows: np.ndarray, fmt: str, epilogue: str = "", activations: str = "float"
) -> BlockWeight:
    """The blocks of a weight with N output columns ([N, K/32 * block bytes] uint8, one column
    per row, as ``GGUFReader`` gives them, or ``awq_rows``) -> BlockWeight (W [K, N]);
    ``activations``: one of ``BLOCK_ACTIVATIONS``."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"block format {fmt!r} is not one of {sorted(BLOCK_FORMATS)}")
    if activations not in BLOCK_ACTIVATIONS:
        raise ValueError(f"activations must be one of {BLOCK_ACTIVATIONS}, got {activations!r}")
    block = BLOCK_FORMATS[fmt][0]
    rows = np.ascontiguousarray(rows, np.uint8)
    n, width = rows.shape
    if width % block or n % 32:
        raise ValueError(f"{fmt} rows of {width} bytes x {n} columns do not tile (32 x 32)")
    kbs = width // block
    tiles = rows.reshape(n // 32, 32, kbs, block).transpose(0, 2, 1, 3)  # [g, kb, c, bytes]
    d = tiles[..., 0:2].reshape(n // 32, kbs, 64)
    if fmt != "q8_0":  # codes [g, kb, c, 32 k] -> words [g, kb, 4, c]: 8 k per 32-bit word
        m = tiles[..., 2:4].reshape(n // 32, kbs, 64)
        packed4 = tiles[..., 4:20]  # byte j: k = j (low nibble), k = j + 16 (high nibble)
        codes = np.concatenate([packed4 & 15, packed4 >> 4], axis=-1)  # [g, kb, c, k]
        pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [g, kb, c, 16]: k pairs per byte
        words = pairs.reshape(n // 32, kbs, 32, 4, 4).transpose(0, 1, 3, 2, 4)
        parts = [d, m, words.reshape(n // 32, kbs, 512)]
    else:  # int8 codes [g, kb, c, 32 k] -> words [g, kb, 8, c]: 4 k per 32-bit word
        codes = tiles[..., 2:34].reshape(n // 32, kbs, 32, 8, 4).transpose(0, 1, 3, 2, 4)
        parts = [d, codes.reshape(n // 32, kbs, 1024)]
    packed = np.concatenate(parts, axis=-1)
    return BlockWeight(jnp.asarray(packed), (kbs * 32, n), fmt, epilogue, activations)


def gate_up_rows(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Two weights' rows (F columns each) interleaved 16 by 16 (16 gate columns, then the same
    16 up columns), the panel order of the swiglu epilogue."""
    f = gate.shape[0]
    if up.shape != gate.shape or f % 16:
        raise ValueError(f"gate {gate.shape} and up {up.shape} must match, F % 16 == 0")
    both = np.stack([gate.reshape(f // 16, 16, -1), up.reshape(f // 16, 16, -1)], axis=1)
    return both.reshape(2 * f, -1)


def with_activations(params: Any, activations: str) -> Any:
    """``params`` with every ``BlockWeight`` taking ``activations`` (``BLOCK_ACTIVATIONS``)."""
    if activations not in BLOCK_ACTIVATIONS:
        raise ValueError(f"activations must be one of {BLOCK_ACTIVATIONS}, got {activations!r}")
    return jax.tree.map(
        lambda w: (
            dataclasses.replace(w, activations=activations) if isinstance(w, BlockWeight) else w
        ),
        params,
        is_leaf=lambda w: isinstance(w, BlockWeight),
    )


def unpack_blocks(w: BlockWeight) -> np.ndarray:
    """BlockWeight -> W [K, N] float32, each weight d q + m (Q4_1), d q (Q8_0) or d (q - z)
    (AWQ) in float32."""
    k, n = w.shape
    p = np.asarray(w.panels)
    g, kbs = p.shape[0], p.shape[1]
    d = p[..., 0:64].copy().view(np.float16).astype(np.float32)  # [g, kb, c]
    if w.fmt != "q8_0":
        m = p[..., 64:128].copy().view(np.float16).astype(np.float32)
        pairs = p[..., 128:].reshape(g, kbs, 4, 32, 4)  # [g, kb, word, c, byte]
        q = np.stack([pairs & 15, pairs >> 4], axis=-1)  # [g, kb, word, c, byte, nibble]
        q = q.transpose(0, 1, 2, 4, 5, 3).reshape(g, kbs, 32, 32).astype(np.float32)  # [.., k, c]
        if w.fmt == "awq":  # m holds the zero point
            vals = d[:, :, None, :] * (q - m[:, :, None, :])
        else:
            vals = d[:, :, None, :] * q + m[:, :, None, :]
    else:
        q = p[..., 64:].reshape(g, kbs, 8, 32, 4).transpose(0, 1, 2, 4, 3).reshape(g, kbs, 32, 32)
        vals = d[:, :, None, :] * q.view(np.int8).astype(np.float32)
    return vals.transpose(1, 2, 0, 3).reshape(k, n)


def block_matmul(x: jax.Array, w: BlockWeight, out_dtype: Any = jnp.float32) -> jax.Array:
    """x [..., K] (float32 or bfloat16; others cast to float32) @ W [K, N] -> [..., N] in
    ``out_dtype``, the GGUF blocks read as stored; a gate/up pair gives silu(gate) * up."""
    _require_native()
    k = w.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; the {w.fmt} weight takes {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype not in (jnp.float32, jnp.bfloat16):
        x2 = x2.astype(jnp.float32)
    out = jax.ShapeDtypeStruct((x2.shape[0], w.out_features), jnp.dtype(out_dtype))
    call = jax.ffi.ffi_call(native._GEMM_BLOCKS_TARGET, out)
    y = call(
        x2,
        w.packed,
        format=np.int32(BLOCK_FORMATS[w.fmt][2]),
        epilogue=np.int32(1 if w.epilogue == "swiglu" else 0),
        activations=np.int32(BLOCK_ACTIVATIONS.index(w.activations)),
        layer=np.int32(0 if w.layer is None else w.layer),
    )
    return y.reshape(*lead, w.out_features)


def greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's argmax and top-2 logit gap, as ``research.engine.sampler.greedy`` (the same
    values: lowest index among ties, a row's first NaN, gap 0 for a repeated maximum), in one
    native pass per row. logits [R, V] float32 -> ([R] int32, [R] float32)."""
    _require_native()
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"greedy takes float32 logits [R, V], got {logits.dtype}{logits.shape}")
    r = logits.shape[0]
    out = (jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.float32))
    return tuple(jax.ffi.ffi_call(native._GREEDY_TARGET, out)(logits))


def stream(x: jax.Array, start: Any = 0) -> jax.Array:
    """``start`` plus the wrapping uint32 sum of ``x``'s bytes read as 32-bit words, streamed
    on the native kernels' threads: a plain read of the buffer, the yardstick ``bench_gemm
    --chain`` holds a step's projections against (``gemm.cc``). Calls chained through
    ``start`` run one after another."""
    _require_native()
    if x.nbytes % 4:
        raise ValueError(f"stream reads 32-bit words; x has {x.nbytes} bytes")
    out = jax.ShapeDtypeStruct((), jnp.uint32)
    return jax.ffi.ffi_call(native._STREAM_TARGET, out)(x, jnp.asarray(start, jnp.uint32))
