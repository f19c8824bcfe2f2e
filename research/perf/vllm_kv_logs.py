"""The vLLM KV arithmetic and memory profile against public GB10 log lines.

``python -m research.perf.vllm_kv_logs`` checks each record of
research/perf/data/gb10_vllm_kv_logs.json (docs/experiments/kv_capacity_gb10.md) two ways: vLLM's
startup arithmetic (``research.perf.vllm_kv``) on the logged "Available KV cache memory", and our
own ``research.perf.vllm_memory`` (the byte budget from first principles) from the launch settings
alone. The top layer of the two: it imports both. Pure Python: JAX is not imported.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from research.perf.hardware import GiB
from research.perf.vllm_kv import (
    vllm_estimated_max_model_len,
    vllm_kv_bytes_needed,
    vllm_kv_cache_tokens,
    vllm_requested_bytes,
)
from research.perf.vllm_memory import (
    GB10_DRIVER,
    GB10_REPORTED_TOTAL,
    NON_TORCH_BYTES,
    NON_TORCH_RECORD,
    check_record,
)

GB10_VLLM_LOGS = Path(__file__).parent / "data" / "gb10_vllm_kv_logs.json"
# vLLM prints GiB figures rounded to two decimals.
VLLM_GIB_PRINT_HALF_STEP = 0.005


def load_gb10_vllm_logs(path: str | Path = GB10_VLLM_LOGS) -> list[dict[str, Any]]:
    """The published DGX Spark (GB10) vLLM KV-cache log records
    (research/perf/data/gb10_vllm_kv_logs.json)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))["records"]


def _vllm_pool_tokens(record: dict[str, Any], available_bytes: float) -> int:
    """The logged quantity of ``record`` (``record["compare"]``) recomputed from a pool of
    ``available_bytes`` with the record's model, block size, KV dtype and tensor parallelism."""
    common = dict(
        block_size=record["block_size"],
        kv_cache_dtype=record["kv_cache_dtype"],
        dtype=record["dtype"],
        tensor_parallel_size=record["tensor_parallel_size"],
    )
    if record.get("max_num_batched_tokens"):
        common["max_num_batched_tokens"] = record["max_num_batched_tokens"]
    if record["compare"] == "gpu_kv_cache_tokens":
        return vllm_kv_cache_tokens(
            record["preset"],
            available_bytes,
            max_model_len=record["max_model_len"],
            token_report=record["token_report"],
            **common,
        ).num_tokens
    if record["compare"] == "estimated_max_model_len":
        return vllm_estimated_max_model_len(
            record["preset"], available_bytes, max_model_len=record["max_model_len"], **common
        )
    raise ValueError(f"{record['id']}: unknown compare {record['compare']!r}")


def check_vllm_log(record: dict[str, Any]) -> dict[str, Any]:
    """One log record checked three ways:

    - ``reproduced``: vLLM's arithmetic on the logged "Available KV cache memory" (taken from
      the log) with the model's shapes (our preset) and the record's block size, KV dtype,
      tensor parallelism and max_model_len: the number the log should print;
    - ``reproduced_range``: the same for the two ends of the 0.01 GiB the printed figure
      rounds, so a raw log line must fall inside it;
    - ``predicted``: vLLM's memory profile (``research.perf.vllm_memory``: the driver's
      reported total, our weight and forward-peak terms, the one fitted non-torch term) from
      nothing in the log but the launch settings (None when no block is left).

    Where the log prints them, the budget (ceil(total * utilization)) and the KV bytes one
    max_model_len request needs are recomputed too."""
    logged = record["logged"]
    target = logged[record["compare"]]
    available = logged["available_kv_cache_gib"] * GiB
    reproduced = _vllm_pool_tokens(record, available)
    half = VLLM_GIB_PRINT_HALF_STEP * GiB
    reproduced_range = (
        _vllm_pool_tokens(record, available - half),
        _vllm_pool_tokens(record, available + half),
    )
    try:  # vLLM's memory profile from the launch settings alone (research.perf.vllm_memory)
        profile = check_record(record)
        predicted: int | None = profile["predicted"]
        predicted_available: float | None = profile["available_gib"]
    except ValueError:  # our terms leave nothing for the KV cache
        predicted = predicted_available = None
    out: dict[str, Any] = {
        "id": record["id"],
        "compare": record["compare"],
        "logged": target,
        "reproduced": reproduced,
        "reproduced_error": reproduced / target - 1,
        "reproduced_range": reproduced_range,
        "within_print_rounding": reproduced_range[0] <= target <= reproduced_range[1],
        "predicted": predicted,
        "predicted_error": None if predicted is None else predicted / target - 1,
        "predicted_available_gib": predicted_available,
    }
    if "total_memory_gib" in logged and "requested_memory_gib" in logged:
        requested = vllm_requested_bytes(
            logged["total_memory_gib"] * GiB, record["gpu_memory_utilization"]
        )
        out["requested_gib"] = requested / GiB
        if "consumed_memory_gib" in logged:
            # What the log leaves out of its abridged line: transient peak + CUDA-graph estimate.
            out["unlogged_non_kv_gib"] = (
                requested / GiB - logged["consumed_memory_gib"] - logged["available_kv_cache_gib"]
            )
    if "kv_cache_needed_gib" in logged:
        out["needed_gib"] = (
            vllm_kv_bytes_needed(
                record["preset"],
                record["max_model_len"],
                block_size=record["block_size"],
                kv_cache_dtype=record["kv_cache_dtype"],
                dtype=record["dtype"],
                tensor_parallel_size=record["tensor_parallel_size"],
            )
            / GiB
        )
    return out


def _short_version(version: str) -> str:
    """ "0.29.1rc1.dev17+gd2d649e67.d20260913" -> "0.29.1rc1"."""
    return version.split("+")[0].split(".dev")[0]


def format_kv_validation(
    records: list[dict[str, Any]] | None = None,
) -> str:
    """A table of every GB10 log record: the logged pool in tokens, vLLM's arithmetic on the
    logged available memory ("reproduced"), and vLLM's memory profile's prediction, with their
    errors; then the per-record checks of the budget and the needed-memory line."""
    records = load_gb10_vllm_logs() if records is None else records
    rows = [check_vllm_log(r) for r in records]
    by_id = {r["id"]: r for r in records}
    header = (
        f"{'record':<32} {'vLLM':<10} {'util':>4} {'TP':>2} {'avail GiB':>9} "
        f"{'logged':>9} {'reproduced':>10} {'err':>7} {'predicted':>9} {'err':>7} "
        f"{'pred avail':>10} {'err':>7}"
    )
    lines = [
        "vLLM KV-cache size on DGX Spark (GB10): logged vs reproduced from the logged available "
        "memory vs predicted by vLLM's memory profile from the launch settings "
        f"(research.perf.vllm_memory; reported total {GB10_REPORTED_TOTAL[GB10_DRIVER] / GiB:.2f} "
        f"GiB, non-torch {NON_TORCH_BYTES / GiB:.2f} GiB fitted on {NON_TORCH_RECORD})",
        header,
        "-" * len(header),
    ]
    for row in rows:
        rec = by_id[row["id"]]
        if row["predicted"] is None:
            predicted = f"{'none fit':>9} {'':>7} {'':>10} {'':>7}"
        else:
            avail = row["predicted_available_gib"]
            logged_avail = rec["logged"]["available_kv_cache_gib"]
            predicted = (
                f"{row['predicted']:>9,} {row['predicted_error']:>+7.1%} {avail:>10.2f} "
                f"{avail / logged_avail - 1:>+7.1%}"
            )
        lines.append(
            f"{row['id']:<32} {_short_version(rec['vllm_version']):<10} "
            f"{rec['gpu_memory_utilization']:>4.2f} {rec['tensor_parallel_size']:>2} "
            f"{rec['logged']['available_kv_cache_gib']:>9.2f} {row['logged']:>9,} "
            f"{row['reproduced']:>10,} {row['reproduced_error']:>+7.2%} {predicted}"
        )
    lines.append("")
    for row in rows:
        rec = by_id[row["id"]]
        lo, hi = row["reproduced_range"]
        notes = [
            f"{row['compare']}; printed available rounds to {lo:,}..{hi:,} "
            f"({'inside' if row['within_print_rounding'] else 'outside'})"
        ]
        if "requested_gib" in row:
            notes.append(
                f"budget ceil({rec['logged']['total_memory_gib']} GiB x "
                f"{rec['gpu_memory_utilization']}) = {row['requested_gib']:.2f} GiB "
                f"(logged {rec['logged']['requested_memory_gib']})"
            )
        if "unlogged_non_kv_gib" in row:
            notes.append(
                f"transient peak + CUDA graphs not in the line: {row['unlogged_non_kv_gib']:.2f} GiB"
            )
        if "needed_gib" in row:
            notes.append(
                f"KV for one {rec['max_model_len']:,}-token request {row['needed_gib']:.2f} GiB "
                f"(logged {rec['logged']['kv_cache_needed_gib']})"
            )
        lines.append(f"  {row['id']}: " + "; ".join(notes))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m research.perf.vllm_kv_logs [--validate]``: the GB10 log check."""
    parser = argparse.ArgumentParser(
        prog="python -m research.perf.vllm_kv_logs", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="(the default) check vLLM's KV arithmetic and memory profile against GB10 logs",
    )
    parser.add_argument("--logs", default=str(GB10_VLLM_LOGS), help="log records (JSON)")
    args = parser.parse_args(argv)
    print(format_kv_validation(load_gb10_vllm_logs(args.logs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
