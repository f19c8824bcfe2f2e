"""Choose the kernels' blocks per target and shape, and write them to ``tuning_table.json``.

``python -m pallas_kernels.tune [--targets h200,gb10] [--time]``

For every target and every shape the engine runs (``TUNED_SHAPES``: query dtype, KV format,
head dim, query heads per kv head; decode-sized and mixed steps), candidates are tried in order
of preference (biggest tiles first): each is lowered for the target, compiled offline to cubin
(``pallas_kernels.triton_ir``) and kept only if ptxas reports no spills and its shared memory
fits the target's per-block limit, for both the one-split and the split-KV variant.

- Without ``--time`` (no GPU needed) the first candidate that compiles clean is the entry; its
  ``source`` says it was chosen offline, not timed.
- With ``--time`` on a GPU, every clean candidate for the local device's target is timed on a
  step of that kind (``TIMING_STEPS``) and the fastest is the entry; ``source`` names the
  device and the time.

Entries for other targets are kept; a shape without an entry falls back to the rules in
``pallas_kernels.tuning`` (``ragged_attention_config`` says which applied).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_attention import ragged_paged_attention
from pallas_kernels.triton_ir import compile_offline, lower_triton_modules
from pallas_kernels.tuning import (
    FALLBACK,
    TABLE_PATH,
    TARGETS,
    GpuTarget,
    RaggedAttentionConfig,
    table_key,
    target_for_kind,
)
from research.quant.kv import kv_code_dtype, kv_code_shape

# (head_dim, query heads per kv head) of the presets: SmolLM2-135M (64, 3), Qwen3-30B-A3B and
# Llama-3.3-70B (128, 8), gpt-oss (64, 8).
ATTENTION_SHAPES = ((64, 3), (128, 8), (64, 8))
Q_DTYPES = ("bfloat16", "float32")
KV_FORMATS = ("auto", "fp8", "int4")
PAGE_SIZE = 16  # the engine's default block size; tiles are whole pages
# The lowering's array sizes (the IR does not depend on them, only on the blocks).
TOKENS, ROWS, TABLE_WIDTH, POOL_PAGES = 256, 64, 128, 4096
DECODE_SPLITS = 4
WINDOWED_SHAPES = ((64, 8),)  # gpt-oss's (head dim, group): its sliding layers are checked too
WINDOW = 128  # gpt-oss's sliding window


def _sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def attention_args(q: str, kv: str, head_dim: int, group: int, kv_heads: int = 8):
    """ShapeDtypeStructs of a ragged step for the kernel (nothing allocated)."""
    q_dtype = jnp.dtype(q)
    code = kv_code_dtype(kv, q_dtype)
    (code_dim,) = kv_code_shape(head_dim, kv)
    pages = _sds((kv_heads, POOL_PAGES, PAGE_SIZE, code_dim), code)
    args = (
        _sds((TOKENS, kv_heads * group, head_dim), q_dtype),
        _sds((TOKENS, kv_heads, head_dim), q_dtype),
        _sds((TOKENS, kv_heads, head_dim), q_dtype),
        pages,
        pages,
        _sds((ROWS, TABLE_WIDTH), jnp.int32),
        _sds((ROWS + 1,), jnp.int32),
        _sds((ROWS,), jnp.int32),
    )
    scales = {}
    if kv != "auto":
        scale = _sds((kv_heads, POOL_PAGES, PAGE_SIZE), jnp.float32)
        scales = dict(k_scales=scale, v_scales=scale)
    return args, scales


def candidates(step: str, q: str, head_dim: int) -> Iterator[RaggedAttentionConfig]:
    """In order of preference: the most work per program first. Decode-sized steps keep the
    smallest tile rows (a decode fills one group) and split the context."""
    rows = (16,) if step == "decode" else (64, 32, 16)
    tiles = (128, 64, 32, 16)
    warps = (4, 8)
    if q == "float32":  # IEEE float32 dots hold their operands in registers: T x D <= 2048
        tiles = tuple(t for t in tiles if t * head_dim <= 2048) or (16,)
        warps = (8,)
    for block_rows in rows:
        for tile in tiles:
            for num_warps in warps:
                yield RaggedAttentionConfig(
                    block_rows=block_rows,
                    tile_tokens=tile,
                    new_block=16,
                    kv_splits=DECODE_SPLITS if step == "decode" else 1,
                    num_warps=num_warps,
                    num_stages=2,
                )


@dataclasses.dataclass(frozen=True)
class Compiled:
    registers: int
    shared_bytes: int
    spills: int
    ptx_target: str


def compile_attention(
    target: GpuTarget, config: RaggedAttentionConfig, *, q: str, kv: str, head_dim: int, group: int
) -> list[Compiled]:
    """The configuration lowered for ``target`` and compiled offline: one result per variant
    the engine runs with it (one split and, when it splits, the split-KV variant; for gpt-oss's
    shape, each also with a sliding window and sinks)."""
    args, scales = attention_args(q, kv, head_dim, group)
    out = []
    variants = [{}]
    if (head_dim, group) in WINDOWED_SHAPES:  # gpt-oss: sliding-window layers with sinks
        sinks = _sds((args[0].shape[1],), jnp.float32)
        variants.append(dict(window=WINDOW, sinks=sinks))
    for splits in sorted({1, config.kv_splits}):
        for extra in variants:
            kwargs = dict(config.kwargs(page_size=PAGE_SIZE, group=group), kv_splits=splits)
            (module,) = lower_triton_modules(
                ragged_paged_attention,
                *args,
                compute_capability=target.compute_capability,
                **scales,
                **extra,
                **kwargs,
            )
            if not module.verified:
                raise ValueError(f"the Triton module does not verify: {module.error}")
            c = compile_offline(
                module,
                target.compute_capability,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
            out.append(Compiled(c.registers, c.shared_bytes, c.spills, c.ptx_target))
    return out


def clean(target: GpuTarget, results: list[Compiled]) -> bool:
    return all(r.spills == 0 and r.shared_bytes <= target.max_shared_bytes for r in results)


def attention_keys() -> Iterator[dict[str, Any]]:
    for q in Q_DTYPES:
        for kv in KV_FORMATS:
            for head_dim, group in ATTENTION_SHAPES:
                for step in ("decode", "mixed"):
                    yield dict(q=q, kv=kv, d=head_dim, g=group, step=step)


def tune_offline(target: GpuTarget, log=print) -> list[dict[str, Any]]:
    entries = []
    for key in attention_keys():
        if key["kv"] == "fp8" and not target.supports_fp8:
            continue
        tried = 0
        chosen = None
        for config in candidates(key["step"], key["q"], key["d"]):
            tried += 1
            results = compile_attention(
                target, config, q=key["q"], kv=key["kv"], head_dim=key["d"], group=key["g"]
            )
            if clean(target, results):
                chosen = config, results
                break
        name = table_key(target.name, "ragged_attention", **key)
        if chosen is None:
            log(f"{name}: no candidate compiles without spills ({tried} tried); rules apply")
            continue
        config, results = chosen
        worst = max(results, key=lambda r: r.registers)
        log(
            f"{name}: {config} ({tried} tried; {worst.registers} registers, "
            f"{worst.shared_bytes // 1024} KiB shared)"
        )
        entries.append(
            dict(
                key=name,
                config=config.to_json(),
                source=(
                    f"offline for sm_{target.compute_capability}: first of {tried} candidates "
                    "(biggest tiles first) with no spills and shared memory within the limit; "
                    "not timed"
                ),
            )
        )
    return entries


def tune_timed(target: GpuTarget, device_kind: str, iters: int) -> list[dict[str, Any]]:
    """On this GPU: time every clean candidate of each bfloat16 key on a step of its kind
    (``pallas_kernels.bench.RAGGED_STEPS`` with the key's head shape) and keep the fastest.
    float32 keys keep the offline choice (``tune_offline``)."""
    from pallas_kernels.bench import RAGGED_STEPS, ragged_attention_bench

    entries = [e for e in tune_offline(target) if "|q=float32|" in e["key"]]
    for key in attention_keys():
        if key["q"] != "bfloat16" or (key["kv"] == "fp8" and not target.supports_fp8):
            continue
        configs = {}
        for config in candidates(key["step"], key["q"], key["d"]):
            results = compile_attention(
                target, config, q=key["q"], kv=key["kv"], head_dim=key["d"], group=key["g"]
            )
            if clean(target, results):
                configs[repr(config)] = config
        step_name = next(n for n in RAGGED_STEPS if n.startswith(key["step"]))
        step = dict(RAGGED_STEPS[step_name], heads=8 * key["g"], kv_heads=8, head_dim=key["d"])
        if key["step"] == "decode":
            step["decodes"] = 8  # few rows: where the split variant is used
        rows = ragged_attention_bench(
            iters,
            configs={name: c.kwargs(page_size=16, group=key["g"]) for name, c in configs.items()},
            steps={step_name: step},
            kv_formats=("bf16" if key["kv"] == "auto" else key["kv"],),
        )
        if not rows:
            continue
        best = min(rows, key=lambda r: r["seconds"])
        entries.append(
            dict(
                key=table_key(target.name, "ragged_attention", **key),
                config=configs[best["config"]].to_json(),
                source=(
                    f"timed on {device_kind}: fastest of {len(rows)} spill-free candidates on "
                    f"'{step_name}' ({best['seconds'] * 1e6:.0f} us, "
                    f"{100 * best['measured_fraction']:.0f}% of measured bandwidth)"
                ),
            )
        )
    return entries


# ---- grouped experts --------------------------------------------------------------------------

# (experts, K, N, bias) of the engine's expert and linear GEMMs, the activation dtypes tuned and
# the weight formats: Qwen3-30B-A3B's experts, gpt-oss-120b's MXFP4 experts (with biases),
# SmolLM2-135M's and Llama-3.3-70B's MLPs (dense models: one group).
EXPERT_SHAPES = {
    "qwen3-30b-a3b gate/up": (128, 2048, 768, False),
    "qwen3-30b-a3b down": (128, 768, 2048, False),
    "gpt-oss-120b gate/up/down": (128, 2880, 2880, True),
    "smollm2-135m gate/up": (1, 576, 1536, False),
    "smollm2-135m down": (1, 1536, 576, False),
    "llama-3.3-70b gate/up": (1, 8192, 28672, False),
    "llama-3.3-70b down": (1, 28672, 8192, False),
}
EXPERT_FORMATS = {"gpt-oss-120b gate/up/down": ("mxfp4",)}
EXPERT_DTYPES = {"smollm2-135m gate/up": Q_DTYPES, "smollm2-135m down": Q_DTYPES}
M_ROWS = {"decode": 64, "mixed": 512, "prefill": 2048}  # rows lowered per bucket


def experts_keys() -> Iterator[tuple[str, dict[str, Any], bool]]:
    from research.quant import FORMATS

    for name, (experts, k, n, bias) in EXPERT_SHAPES.items():
        for fmt in EXPERT_FORMATS.get(name, ("plain", *FORMATS)):
            for x in EXPERT_DTYPES.get(name, ("bfloat16",)):
                for m in M_ROWS:
                    yield name, dict(x=x, w=fmt, e=experts, k=k, n=n, m=m), bias


def experts_candidates(key: dict[str, Any], stages: int) -> Iterator[dict[str, int]]:
    """Most rows per tile first for the bucket, then the biggest weight tiles; float32 keeps
    its weight tile within 4,096 elements (IEEE float32 dots hold operands in registers)."""
    from pallas_kernels.grouped_experts import fitting_block_k

    rows = {"decode": (16,), "mixed": (32, 16), "prefill": (64, 32, 16)}[key["m"]]
    warps = (8,) if key["x"] == "float32" else (4, 8)
    seen = set()
    for block_m in rows:
        for block_n in (128, 64, 32):
            for block_k in (128, 64, 32):
                bk = fitting_block_k(key["k"], block_k)
                if key["x"] == "float32" and block_n * bk > 4096:
                    continue
                for num_warps in warps:
                    for num_stages in sorted({stages, 2}, reverse=True):
                        c = dict(block_m=block_m, block_n=block_n, block_k=bk,
                                 num_warps=num_warps, num_stages=num_stages)  # fmt: skip
                        if tuple(c.values()) not in seen:
                            seen.add(tuple(c.values()))
                            yield c


def compile_experts(target: GpuTarget, key: dict[str, Any], bias: bool, config: dict[str, int]):
    from pallas_kernels.grouped_experts import grouped_experts
    from pallas_kernels.verify import _weight

    x = jnp.dtype(key["x"])
    fmt = None if key["w"] == "plain" else key["w"]
    e, k, n = key["e"], key["k"], key["n"]
    weight = _weight(fmt, k, n, x, experts=e)
    extra = {"bias": _sds((e, n), jnp.float32)} if bias else {}
    (module,) = lower_triton_modules(
        grouped_experts,
        _sds((M_ROWS[key["m"]], k), x),
        weight,
        _sds((e,), jnp.int32),
        compute_capability=target.compute_capability,
        **extra,
        **config,
    )
    if not module.verified:
        raise ValueError(f"the Triton module does not verify: {module.error}")
    c = compile_offline(
        module, target.compute_capability, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip
    return Compiled(c.registers, c.shared_bytes, c.spills, c.ptx_target)


def tune_experts_offline(target: GpuTarget, log=print) -> list[dict[str, Any]]:
    entries = []
    stages = target.grouped_experts.num_stages
    for name, key, bias in experts_keys():
        if key["w"] in ("fp8", "nvfp4") and not target.supports_fp8:
            continue
        tried, chosen = 0, None
        for config in experts_candidates(key, stages):
            tried += 1
            if clean(target, [compile_experts(target, key, bias, config)]):
                chosen = config
                break
        table = table_key(target.name, "grouped_experts", **key)
        if chosen is None:
            log(f"{table}: no candidate compiles without spills ({tried} tried); rules apply")
            continue
        log(f"{table} ({name}): {chosen} ({tried} tried)")
        entries.append(
            dict(
                key=table,
                config=chosen,
                source=(
                    f"offline for sm_{target.compute_capability}: first of {tried} candidates "
                    "(most rows for the M bucket, then the biggest weight tiles) with no spills "
                    "and shared memory within the limit; not timed"
                ),
            )
        )
    return entries


def write_table(
    entries: list[dict[str, Any]], targets: set[str], kernels: set[str] | None = None
) -> None:
    """Replace the table's entries of ``targets`` (and ``kernels``, default all) by ``entries``."""

    def replaced(key: str) -> bool:
        target, kernel = key.split("|")[:2]
        return target in targets and (kernels is None or kernel in kernels)

    kept = []
    if TABLE_PATH.exists():
        kept = [e for e in json.loads(TABLE_PATH.read_text())["entries"] if not replaced(e["key"])]
    table = dict(
        note="written by `python -m pallas_kernels.tune`; see pallas_kernels/tuning.py",
        entries=sorted(kept + entries, key=lambda e: e["key"]),
    )
    TABLE_PATH.write_text(json.dumps(table, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--time", action="store_true", help="time the candidates on this GPU")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per candidate")
    parser.add_argument(
        "--kernel", choices=("all", "ragged_attention", "grouped_experts"), default="all"
    )
    args = parser.parse_args(argv)
    if args.time:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            print("--time needs a GPU; none here (the offline choice runs without --time)")
            return 0
        target = target_for_kind(gpus[0].device_kind)
        entries = tune_timed(target, gpus[0].device_kind, args.iters)
        write_table(entries, {target.name}, {"ragged_attention"})
        print(f"wrote {len(entries)} timed entries for {target.name} to {TABLE_PATH}")
        return 0
    all_targets = {**TARGETS, FALLBACK.name: FALLBACK}
    names = args.targets.split(",")
    entries = []
    for name in names:
        start = time.perf_counter()
        if args.kernel in ("all", "ragged_attention"):
            entries += tune_offline(all_targets[name])
        if args.kernel in ("all", "grouped_experts"):
            entries += tune_experts_offline(all_targets[name])
        print(f"({name}: {time.perf_counter() - start:.0f} s)")
    kernels = None if args.kernel == "all" else {args.kernel}
    write_table(entries, set(names), kernels)
    print(f"wrote {len(entries)} entries to {TABLE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
