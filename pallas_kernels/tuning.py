"""Per-GPU block configurations for the kernels: a table of tuned entries, and rules as the fallback.

``tuning_table.json`` (written by ``python -m pallas_kernels.tune``) holds one entry per target,
kernel, dtype and shape: for the ragged attention kernel, keyed by query dtype, KV format, head
dim and query heads per kv head, a configuration for decode-sized steps and one for mixed steps;
every entry says where it came from (chosen offline from candidates that compile without spills
for the target, or timed on a GPU). A shape the table does not hold gets the rules below, and
``ragged_attention_config`` says so in its ``source``.

Every configuration here is a set of power-of-two blocks that Triton accepts (dot operands >= 16
in every dimension) and whose shared memory fits the target's per-block limit. That is checked
without a GPU by compiling each configuration offline for its target (``pallas_kernels.verify``
and tests/test_triton_ir.py): H200 is sm_90 with up to 227 KiB of shared memory per block, GB10
is sm_121 with 99 KiB (100 KB per SM). An unknown GPU gets the conservative ``FALLBACK``, sized
to the 48 KiB every CUDA GPU gives a block without opting in; it has no table entries, and its
rules are compiled for each GPU it stands for (``FALLBACK_CAPABILITIES``: sm_80, sm_86, sm_89).

The numbers are chosen to fit, not yet tuned for speed on the hardware: fewer pipeline stages
where shared memory is small (GB10), and the larger tiles where it is not. float32 operands run
as IEEE float32 dots on FMA units with their operands in registers, so float32 tiles are smaller
and get 8 warps (the sizes that ptxas compiles without spills). One case still spills: float32
attention over 128-token pages, because a page is the kernel's smallest tile (bf16 does not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    compute_block_tokens: int = 128  # tokens per inner-loop tile (a whole number of pages)
    k_splits: int = 16  # programs per sequence and kv head (capped at the compute blocks)
    num_warps: int = 4
    num_stages: int = 2
    max_tile_bytes: int | None = None  # K + V tile bytes in shared memory; None: no limit
    # float32 compute (IEEE float32 dots run on FMA units, not tensor cores, and hold their
    # operands in registers): tiles of at most this many tokens x head_dim elements, with
    # ``float32_num_warps`` warps. Compiled offline, T x D = 2048 with 8 warps spills nothing
    # at D = 64 and 128, while 4096 spills at D = 128. None: the bf16 rules apply.
    float32_tile_elements: int | None = 2048
    float32_num_warps: int = 8

    def kwargs(
        self, *, page_size: int, head_dim: int, code_dim: int, q_dtype: Any, page_dtype: Any
    ) -> dict[str, int]:
        """Kernel keyword arguments for pages [.., page_size, code_dim] of ``page_dtype`` read
        by queries of ``q_dtype`` (the kernel computes in float32 when either is float32 and
        the pages are not quantized, or when q is float32).

        The tile is ``compute_block_tokens`` tokens, halved while its K and V tiles exceed
        ``max_tile_bytes`` (or, in float32, while T x D exceeds ``float32_tile_elements``),
        never below one page (the kernel's unit) or 16 tokens (Triton's smallest dot)."""
        page_dtype, q_dtype = jnp.dtype(page_dtype), jnp.dtype(q_dtype)
        quantized = page_dtype in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn))
        compute = q_dtype if quantized else jnp.promote_types(q_dtype, page_dtype)
        float32 = compute == jnp.float32 and self.float32_tile_elements is not None
        code_bytes = code_dim * page_dtype.itemsize
        floor = max(page_size, 16)
        tokens = self.compute_block_tokens

        def too_big(tokens: int) -> bool:
            if float32 and tokens * head_dim > self.float32_tile_elements:
                return True
            return self.max_tile_bytes is not None and 2 * tokens * code_bytes > self.max_tile_bytes

        while tokens > floor and too_big(tokens):
            tokens //= 2
        return dict(
            pages_per_compute_block=max(1, tokens // page_size),
            k_splits=self.k_splits,
            num_warps=self.float32_num_warps if float32 else self.num_warps,
            num_stages=self.num_stages,
        )


@dataclasses.dataclass(frozen=True)
class GroupedExpertsConfig:
    block_m: int = 16  # routed rows per tile (decode: few rows per expert)
    block_n: int = 128
    block_k: int = 128  # an upper bound: the kernel call uses the largest power of two dividing K
    num_warps: int = 4
    num_stages: int = 3
    # float32 activations (IEEE float32 dots, operands in registers): weight tiles of at most
    # this many block_k x block_n elements, with ``float32_num_warps`` warps. Compiled offline
    # for sm_90, 64 x 64 and 32 x 128 with 8 warps spill nothing, 64 x 128 spills. None: the
    # bf16 rules apply.
    float32_tile_elements: int | None = 4096
    float32_num_warps: int = 8

    def kwargs(self, k: int, lhs_dtype: Any = jnp.bfloat16) -> dict[str, int]:
        """Kernel keyword arguments for a reduction width ``k`` and activations of
        ``lhs_dtype``."""
        from pallas_kernels.grouped_experts import MIN_BLOCK, fitting_block_k

        block_n, block_k = self.block_n, fitting_block_k(k, self.block_k)
        num_warps = self.num_warps
        if jnp.dtype(lhs_dtype) == jnp.float32 and self.float32_tile_elements is not None:
            num_warps = self.float32_num_warps
            while block_n * block_k > self.float32_tile_elements:
                if block_k >= block_n and block_k > MIN_BLOCK:
                    block_k //= 2
                elif block_n > MIN_BLOCK:
                    block_n //= 2
                else:
                    break
        return dict(
            block_m=self.block_m,
            block_n=block_n,
            block_k=block_k,
            num_warps=num_warps,
            num_stages=self.num_stages,
        )


@dataclasses.dataclass(frozen=True)
class RaggedAttentionConfig:
    """Blocks of ``pallas_kernels.ragged_attention`` for one kind of step."""

    block_rows: int = 16  # tile rows: query tokens x padded query heads of a kv head
    tile_tokens: int = 64  # context tokens per inner-loop tile (whole pages)
    new_block: int = 16  # new tokens per tile of the second loop
    kv_splits: int = 1  # context splits (decode-sized steps with few rows)
    num_warps: int = 4
    num_stages: int = 2

    def kwargs(self, *, page_size: int, group: int) -> dict[str, int]:
        """Kernel keyword arguments for pages of ``page_size`` tokens and ``group`` query heads
        per kv head (the tile holds at least the padded group)."""
        from jax.experimental.pallas import next_power_of_2

        return dict(
            block_rows=max(self.block_rows, next_power_of_2(group)),
            pages_per_compute_block=max(1, self.tile_tokens // page_size),
            new_block=self.new_block,
            kv_splits=self.kv_splits,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# The rules when the table has no entry: 16-row tiles (a decode's group fills one), 64-token
# context tiles; float32 dots run as IEEE float32 on FMA units with operands in registers, so
# float32 gets 16-token tiles and 8 warps. Decode-sized steps with at most
# ``SPLIT_MAX_ROWS`` rows split the context 4 ways (few rows leave SMs idle otherwise).
RAGGED_RULES = {
    "bfloat16": RaggedAttentionConfig(),
    "float32": RaggedAttentionConfig(tile_tokens=16, num_warps=8),
}
SPLIT_MAX_ROWS = 16
RAGGED_SPLITS = 4
# The fallback's rules (it has no table entries): bf16 with 8 warps. With 4 warps, ptxas spills
# 8-12 B at 96-128 registers per thread on Ampere and Ada: at gpt-oss's shape (head dim 64,
# group 8, window and sinks) on sm_80, at head dim 128 and SmolLM2's group 3 on sm_86 and
# sm_89, and with fp8 pages on sm_89. With 8 warps each thread holds half as much of the tile:
# 64-128 registers and no spill for every key on sm_80, sm_86 and sm_89
# (``pallas_kernels.verify``).
FALLBACK_RAGGED_RULES = {
    "bfloat16": RaggedAttentionConfig(num_warps=8),
    "float32": RAGGED_RULES["float32"],
}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU the kernels are configured for."""

    name: str
    device_kinds: tuple[str, ...]  # substrings of ``jax.Device.device_kind`` (upper case)
    compute_capability: int  # e.g. 90 for sm_90
    max_shared_bytes: int  # dynamic shared memory a block may use
    paged_attention: PagedAttentionConfig
    grouped_experts: GroupedExpertsConfig
    # the ragged attention kernel's blocks by compute dtype where the table has no entry
    ragged_attention_rules: dict[str, RaggedAttentionConfig] = dataclasses.field(
        default_factory=lambda: RAGGED_RULES, hash=False
    )

    @property
    def supports_fp8(self) -> bool:
        """Whether Triton lowers float8_e4m3fn here: sm_89 or newer (its fp8e4nv type; on sm_80
        the conversion to LLVM fails). The interpreter runs everything."""
        return self.compute_capability == 0 or self.compute_capability >= FP8_MIN_CAPABILITY

    def require_fp8(self, what: str) -> None:
        """Refuse an fp8 operand where Triton cannot compile one, saying what to use instead."""
        if not self.supports_fp8:
            raise ValueError(
                f"{what} is fp8, which the Pallas Triton kernels compile only for sm_"
                f"{FP8_MIN_CAPABILITY} or newer; this GPU is sm_{self.compute_capability}: use "
                'another KV cache dtype or weight format, or attention_backend="xla"'
            )


FP8_MIN_CAPABILITY = 89

TARGETS: dict[str, GpuTarget] = {
    "h200": GpuTarget(
        name="h200",
        device_kinds=("H200", "H100"),
        compute_capability=90,
        max_shared_bytes=227 * 1024,
        paged_attention=PagedAttentionConfig(num_stages=3, max_tile_bytes=160 * 1024),
        grouped_experts=GroupedExpertsConfig(block_n=128, block_k=128, num_stages=3),
    ),
    "gb10": GpuTarget(
        name="gb10",
        device_kinds=("GB10",),
        compute_capability=121,
        max_shared_bytes=99 * 1024,
        paged_attention=PagedAttentionConfig(num_stages=2, max_tile_bytes=80 * 1024),
        grouped_experts=GroupedExpertsConfig(block_n=64, block_k=128, num_stages=2),
    ),
}

# Unknown GPUs: small tiles and two stages, within the 48 KiB every CUDA GPU allows a block.
# Compiled offline for sm_80 (the oldest target with bf16 MMAs), sm_86 and sm_89.
FALLBACK = GpuTarget(
    name="fallback",
    device_kinds=(),
    compute_capability=80,
    max_shared_bytes=48 * 1024,
    paged_attention=PagedAttentionConfig(
        compute_block_tokens=64, num_stages=2, max_tile_bytes=32 * 1024
    ),
    grouped_experts=GroupedExpertsConfig(block_n=64, block_k=64, num_stages=2),
    ragged_attention_rules=FALLBACK_RAGGED_RULES,
)

# The GPUs the fallback stands for, each compiled for by ``pallas_kernels.verify``: Ampere
# (sm_80: A100; sm_86: A10, A40, RTX 30) and Ada (sm_89: L4, L40S, RTX 40). On such a GPU the
# engine runs ``FALLBACK`` at the device's own compute capability (``fallback_for``).
FALLBACK_CAPABILITIES = (80, 86, 89)


def fallback_for(compute_capability: int) -> GpuTarget:
    """``FALLBACK`` on a GPU of ``compute_capability``: the same blocks and table entries (its
    name is the table's key); the lowering and fp8 follow the capability."""
    return dataclasses.replace(FALLBACK, compute_capability=compute_capability)


# Pallas' interpreter on CPU (tests): block sizes only change how many grid points run.
INTERPRET = GpuTarget(
    name="interpret",
    device_kinds=(),
    compute_capability=0,
    max_shared_bytes=0,
    paged_attention=PagedAttentionConfig(float32_tile_elements=None),
    grouped_experts=GroupedExpertsConfig(float32_tile_elements=None),
)


TABLE_PATH = Path(__file__).with_name("tuning_table.json")


@functools.cache
def tuning_table(path: Path = TABLE_PATH) -> dict[str, dict[str, Any]]:
    """The tuned entries by key (``table_key``); empty when the file is absent."""
    if not path.exists():
        return {}
    return {entry["key"]: entry for entry in json.loads(path.read_text())["entries"]}


def table_key(target: str, kernel: str, **shape: Any) -> str:
    return "|".join([target, kernel, *(f"{k}={shape[k]}" for k in sorted(shape))])


def ragged_attention_config(
    target: GpuTarget,
    *,
    q_dtype: Any,
    kv: str,
    head_dim: int,
    group: int,
    decode: bool,
    num_rows: int | None = None,
) -> tuple[RaggedAttentionConfig, str]:
    """(configuration, where it came from) for a step of ``num_rows`` rows on ``target``.
    ``decode``: a decode-sized step (one query token per row, N = R)."""
    if target is INTERPRET:  # the interpreter runs grid points one by one: fewer, bigger
        return RaggedAttentionConfig(block_rows=64, tile_tokens=64, new_block=32), "interpret"
    dtype = "float32" if jnp.dtype(q_dtype) == jnp.float32 else "bfloat16"
    step = "decode" if decode else "mixed"
    key = table_key(target.name, "ragged_attention", q=dtype, kv=kv, d=head_dim, g=group, step=step)
    entry = tuning_table().get(key)
    if entry is not None:
        config, source = RaggedAttentionConfig(**entry["config"]), f"table: {entry['source']}"
    else:
        config = target.ragged_attention_rules[dtype]
        source = f"rule: no table entry for {key}"
        if decode:
            config = dataclasses.replace(config, kv_splits=RAGGED_SPLITS)
    # Splitting pays where few rows leave the GPU idle; with many rows, one split.
    if not decode or num_rows is None or num_rows > SPLIT_MAX_ROWS:
        config = dataclasses.replace(config, kv_splits=1)
    return config, source


# Routed rows (tokens x top-k) of a grouped-experts call, bucketed: decode-sized steps, mixed
# steps, long prefills.
M_BUCKETS = {"decode": 64, "mixed": 512}


def m_bucket(rows: int) -> str:
    """The M bucket of a call with ``rows`` routed rows."""
    for name, limit in M_BUCKETS.items():
        if rows <= limit:
            return name
    return "prefill"


def grouped_experts_config(
    target: GpuTarget,
    *,
    x_dtype: Any,
    fmt: str | None,
    experts: int,
    k: int,
    n: int,
    m: int,
) -> tuple[dict[str, int], str]:
    """(kernel keyword arguments, where they came from) for a grouped-experts call of ``m``
    routed rows over ``experts`` weights [K, N] in ``fmt`` (None: plain) on ``target``."""
    from pallas_kernels.grouped_experts import fitting_block_k

    if target is INTERPRET:
        return target.grouped_experts.kwargs(k, x_dtype), "interpret"
    dtype = "float32" if jnp.dtype(x_dtype) == jnp.float32 else "bfloat16"
    key = table_key(
        target.name, "grouped_experts", x=dtype, w=fmt or "plain", e=experts, k=k, n=n,
        m=m_bucket(m),
    )  # fmt: skip
    entry = tuning_table().get(key)
    if entry is None:
        return target.grouped_experts.kwargs(k, x_dtype), f"rule: no table entry for {key}"
    config = dict(entry["config"])
    config["block_k"] = fitting_block_k(k, config["block_k"])
    return config, f"table: {entry['source']}"


def target_for_kind(device_kind: str) -> GpuTarget:
    """The configured target whose name appears in ``device_kind``, else ``FALLBACK``."""
    kind = device_kind.upper()
    for target in TARGETS.values():
        if any(name in kind for name in target.device_kinds):
            return target

    return FALLBACK


_LOWERING_FOR: list[GpuTarget] = []


@contextlib.contextmanager
def lowering_for(target: GpuTarget) -> Iterator[GpuTarget]:
    """Inside the block, ``"pallas"`` means ``target`` whether or not a GPU is here: for
    lowering the engine's step for CUDA on a CPU machine (launch counts, offline checks)."""
    _LOWERING_FOR.append(target)
    try:
        yield target
    finally:
        _LOWERING_FOR.pop()


def target_for_backend(backend: str) -> GpuTarget:
    """Where the engine's kernels run: ``"pallas"`` -> the local GPU's target (by its device
    kind; inside ``lowering_for``, that target), ``"pallas_interpret"`` -> ``INTERPRET``."""
    if backend == "pallas" and _LOWERING_FOR:
        return _LOWERING_FOR[-1]
    return _local_target(backend)


@functools.cache
def _local_target(backend: str) -> GpuTarget:
    if backend == "pallas_interpret":
        return INTERPRET
    if backend != "pallas":
        raise ValueError(f"no kernel configuration for backend {backend!r}")
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        raise ValueError(
            'attention_backend="pallas" needs a GPU; use "pallas_interpret" to run the kernels '
            'on CPU or "xla" for the reference path'
        )
    target = target_for_kind(gpus[0].device_kind)
    if target is FALLBACK:  # an unlisted GPU: its own compute capability decides fp8
        cc = getattr(gpus[0], "compute_capability", None)
        if isinstance(cc, str) and "." in cc:
            major, minor = cc.split(".")[:2]
            target = fallback_for(int(major) * 10 + int(minor))
    return target


target_for_backend.cache_clear = _local_target.cache_clear  # type: ignore[attr-defined]
