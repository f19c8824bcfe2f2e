"""Kernel launches of one engine step on a GPU, counted without one.

``python -m pallas_kernels.launches [--model tiny-qwen3-moe] [--target h200] [--tokens 64 --rows 8]``
lowers the engine's jitted step (``research.engine.step.model_step``: one forward pass over a
ragged batch of N tokens in R rows) for CUDA with ``attention_backend="pallas"`` as it would
run on ``target`` (``pallas_kernels.tuning.lowering_for``), and counts the Triton kernels in it:
every ``pallas_call`` the step reaches is one ``__gpu$xla.gpu.triton`` launch, counted from the
step's jaxpr (through nested jits, as often as they are called).
The shape fixes the lowering; the mix of decodes and prefill chunks inside it is data (the
kernel finds each program's row from ``query_start_loc``), so one count holds for every mix
of that shape. It prints launches per kernel and per layer.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

import jax

from pallas_kernels.triton_ir import capture_triton_modules
from pallas_kernels.tuning import FALLBACK, TARGETS, lowering_for


def step_launches(
    model: str = "tiny-qwen3-moe",
    target: str = "h200",
    tokens: int = 64,
    rows: int = 8,
    **engine: Any,
) -> dict[str, Any]:
    """{"kernels": Counter of Triton module names, "custom_calls": Triton custom calls in the
    lowered step, "layers": the model's layers, "shape": (N, R, M)}."""
    from research import LLM
    from research.engine.step import model_step

    options = dict(max_model_len=256, num_kv_blocks=128, block_size=16, max_num_seqs=rows)
    options.update(engine)
    llm = LLM(model, attention_backend="pallas_interpret", **options)
    executor = llm.engine.executor
    shape = (tokens, rows, executor.max_blocks_per_seq)
    inputs = executor.batch.padding(shape).inputs
    static = dict(executor._static(), backend="pallas")
    gpu = {**TARGETS, FALLBACK.name: FALLBACK}[target]
    with lowering_for(gpu), capture_triton_modules() as modules:
        traced = model_step.trace(executor.params, executor.pool, inputs, **static)
        traced.lower(lowering_platforms=("cuda",))  # the kernels lower for CUDA
    return dict(
        kernels=pallas_calls(traced.jaxpr),
        modules=len(modules),
        layers=llm.model_config.num_layers,
        shape=shape,
    )


def pallas_calls(jaxpr: Any) -> collections.Counter[str]:
    """Launches per kernel name: every ``pallas_call`` equation reached from ``jaxpr``, through
    nested jits as often as they are called (a jitted kernel called by two layers is two
    launches, though it lowers to one function). Loops would repeat launches a data-dependent
    number of times, so a kernel inside one is refused rather than miscounted."""
    counts: collections.Counter[str] = collections.Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            counts[str(eqn.params["name"])] += 1
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found = pallas_calls(inner)
                    if found and name in ("while", "scan"):
                        raise ValueError(f"kernels inside a {name}: launches depend on its trips")
                    counts += found
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3-moe")
    parser.add_argument("--target", default="h200", choices=[*TARGETS, FALLBACK.name])
    parser.add_argument("--tokens", type=int, default=64, help="N: packed tokens of the step")
    parser.add_argument("--rows", type=int, default=8, help="R: rows (decodes + prefill chunks)")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    got = step_launches(args.model, args.target, args.tokens, args.rows)
    n, r, m = got["shape"]
    layers = got["layers"]
    print(
        f"{args.model} on {args.target}: one step of N={n} tokens in R={r} rows (M={m}), "
        f"{layers} layers; {sum(got['kernels'].values())} kernel launches "
        f"({got['modules']} distinct Triton modules lowered)"
    )
    print(f"{'kernel':<48} {'launches':>8} {'per layer':>9}")
    for name, count in sorted(got["kernels"].items()):
        print(f"{name:<48} {count:>8} {count / layers:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
