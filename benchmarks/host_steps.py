"""Where the host model misses, step by step: one concurrency of ``experiment=validate_host``
with every step timed and priced.

    python -m benchmarks.host_steps 64 [hydra overrides, e.g. executor.attention_backend=xla]

Fits the host model on the single-stream runs exactly as ``experiment=validate_host`` does,
compiles every step shape the point will use, then runs ``concurrency`` requests in a closed
loop, timing each engine step (wall clock, host work included) and pricing its shape with the
fitted model (``CostModel.breakdown``). Prints each step that carries a prefill chunk, and per
kind of step (decode-only, with a prefill chunk) the measured and predicted mean and their
error. A benchmark: its figures depend on the machine and what else runs on it.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


def step_errors(concurrency: int, overrides: list[str]) -> dict[str, Any]:
    """{kind: (steps, measured mean s, predicted mean s)} and the prefill-carrying steps."""
    from hydra import compose, initialize_config_dir

    from experiments.backends import EngineBackend
    from experiments.sweep import _requests
    from experiments.validate_host import describe_fit, fit_single_stream
    from research.bench import run_benchmark
    from research.config import register_configs, run_config_from

    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(config_name="config", overrides=["experiment=validate_host", *overrides])
    run = run_config_from(cfg)
    backend = EngineBackend(run)
    measured, model = fit_single_stream(run, backend, backend)
    print(describe_fit(measured, model))
    engine = backend.engine
    requests = _requests(run, backend, concurrency, run.workload.seed + concurrency)
    backend.precompile(requests, concurrency)

    steps: list[tuple[Any, float]] = []
    step = engine.step
    with backend.recording_steps() as shapes:

        def timed() -> Any:
            before = len(shapes)
            t = time.perf_counter()
            out = step()
            dt = time.perf_counter() - t
            if len(shapes) > before and shapes[-1].seqs:  # a step that ran tokens
                steps.append((shapes[-1], dt))
            return out

        engine.step = timed
        try:
            run_benchmark(engine, requests, max_concurrency=concurrency)
        finally:
            del engine.step
    kinds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    prefills = []
    for shape, seconds in steps:
        predicted = model.breakdown(shape)["total_s"]
        kind = "with a prefill chunk" if any(k > 1 for k, _ in shape.seqs) else "decode-only"
        kinds[kind].append((seconds, predicted))
        if kind != "decode-only":
            tokens = sum(k for k, _ in shape.seqs)
            prefills.append((len(shape.seqs), tokens, seconds, predicted))
    summary = {
        kind: (len(rows), sum(m for m, _ in rows) / len(rows), sum(p for _, p in rows) / len(rows))
        for kind, rows in kinds.items()
    }
    return {"kinds": summary, "prefill_steps": prefills}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].isdigit():
        print(__doc__)
        return 2
    result = step_errors(int(argv[0]), argv[1:])
    for rows, tokens, measured, predicted in result["prefill_steps"]:
        print(
            f"  step with a prefill chunk: {rows} rows, {tokens} tokens: measured "
            f"{measured * 1e3:.0f} ms, predicted {predicted * 1e3:.0f} ms "
            f"({100 * (predicted - measured) / measured:+.0f}%)"
        )
    print("| steps | count | measured mean ms | predicted mean ms | error |")
    print("|---|---|---|---|---|")
    for kind, (n, measured, predicted) in result["kinds"].items():
        print(
            f"| {kind} | {n} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} | "
            f"{100 * (predicted - measured) / measured:+.0f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
