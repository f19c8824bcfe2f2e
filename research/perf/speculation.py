"""Where speculative decoding's step time goes, concurrency by concurrency.

A plain decode step prices ``B`` rows of ``(1, context)``; a speculative one ``B`` rows of
``(1 + k, context)`` with ``k`` extra logits rows each (``CostModel.speculative_decode_time_per_token``),
and emits ``(1 - a^(k+1)) / (1 - a)`` tokens per row at acceptance ``a``. Both are priced by the
same ``CostModel``; this module only reads its per-operator terms, to say which one binds:

- the operator class (``cost_model.OPERATORS``) or the host ``overhead`` with the most seconds,
  and whether that operator is limited by its bytes (``memory``) or its FLOPs (``compute``);
- the per-token gain ``(plain step / 1) / (speculative step / emitted)``;
- the break-even acceptance: the ``a`` at which the gain is 1, i.e. at which the tokens a step
  emits equal the ratio of the two step times.

    python -m research.perf.speculation [--model qwen3-coder-30b-a3b] [--quantization awq]
        [--hardware gb10] [--k 4] [--acceptance 0.7] [--context 640]
        [--concurrency 1 8 32 64 128 256 512 1024]

Pure Python: JAX is not imported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from research.perf.cost_model import OPERATORS, CostModel, StepShape

# Host seconds of one sequence's n-gram lookup per step (as ``simulated.NGRAM_LOOKUP_S``, which
# this module does not import: the simulated executor pulls in the engine).
NGRAM_LOOKUP_S = 20e-6


def tokens_per_step(k: int, acceptance: float) -> float:
    """Tokens a verified row emits per step: accepted drafts (each accepted with probability
    ``acceptance`` until the first rejection) plus the one sampled token."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if acceptance >= 1.0:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def break_even_acceptance(k: int, step_ratio: float) -> float:
    """The acceptance at which a speculative step (``step_ratio`` times a plain one) emits as
    many tokens per second as plain decoding: 0 when it costs no more than a plain step, 1 (never
    reached below k + 1) when it costs ``k + 1`` plain steps or more."""
    if step_ratio <= 1.0:
        return 0.0
    if step_ratio >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # tokens_per_step rises with acceptance: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_step(k, mid) < step_ratio else (lo, mid)
    return (lo + hi) / 2


def terms(cm: CostModel, shape: StepShape) -> dict[str, tuple[float, str]]:
    """Seconds of each operator class of the step and what limits it (``memory`` or
    ``compute``), plus the host ``overhead`` and the ``allreduce`` collectives."""
    out = {op: [0.0, 0.0, 0.0] for op in OPERATORS}  # seconds, memory_s, compute_s
    for w in cm.work(shape):
        for op, v in cm.price(w).items():
            out[op] = [
                a + b for a, b in zip(out[op], (v["s"], v["memory_s"], v["compute_s"]), strict=True)
            ]
    result = {op: (s, "memory" if m >= c else "compute") for op, (s, m, c) in out.items()}
    b = cm.breakdown(shape)
    return result | {"overhead": (b["overhead_s"], "host"), "allreduce": (b["allreduce_s"], "link")}


def binding_term(cm: CostModel, shape: StepShape) -> str:
    """The term with the most seconds in the step, as ``"<term> (<limit>)"``."""
    name, (_, limit) = max(terms(cm, shape).items(), key=lambda item: item[1][0])
    return f"{name} ({limit})"


@dataclass(frozen=True)
class SpeculationPoint:
    """One concurrency: both steps' times and binding terms, the gain and the break-even."""

    concurrency: int
    plain_step_s: float
    spec_step_s: float
    plain_binding: str
    spec_binding: str
    tokens_per_step: float
    gain: float  # tokens per second with speculation / without
    break_even_acceptance: float
    plain_terms: dict[str, tuple[float, str]]
    spec_terms: dict[str, tuple[float, str]]


def speculation_points(
    cm: CostModel,
    k: int,
    acceptance: float,
    concurrencies: list[int],
    context: int = 640,
    proposer_s_per_seq: float = NGRAM_LOOKUP_S,
) -> list[SpeculationPoint]:
    """Plain and speculative decode steps of ``B`` rows at ``context`` cached tokens, for each
    ``B`` of ``concurrencies`` (``context`` 640: the middle of a 512-in / 256-out request)."""
    emitted = tokens_per_step(k, acceptance)
    points = []
    for b in concurrencies:
        if b < 1:
            raise ValueError(f"concurrency must be >= 1, got {b}")
        plain = StepShape(((1, context),) * b)
        spec = StepShape(((1 + k, context),) * b, k * b)
        plain_s = cm.step_time(plain)
        spec_s = cm.step_time(spec) + proposer_s_per_seq * b
        points.append(
            SpeculationPoint(
                concurrency=b,
                plain_step_s=plain_s,
                spec_step_s=spec_s,
                plain_binding=binding_term(cm, plain),
                spec_binding=binding_term(cm, spec),
                tokens_per_step=emitted,
                gain=plain_s * emitted / spec_s,
                break_even_acceptance=break_even_acceptance(k, spec_s / plain_s),
                plain_terms=terms(cm, plain),
                spec_terms=terms(cm, spec),
            )
        )
    return points


def format_table(points: list[SpeculationPoint]) -> str:
    """A Markdown table of ``points`` (as docs/experiments/speculative.md shows it)."""
    lines = [
        "| concurrency | plain step | binds | speculative step | binds | gain | break-even a |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.concurrency} | {p.plain_step_s * 1e3:.1f} ms | {p.plain_binding} | "
            f"{p.spec_step_s * 1e3:.1f} ms | {p.spec_binding} | {p.gain:.2f}x | "
            f"{p.break_even_acceptance:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-coder-30b-a3b")
    parser.add_argument("--quantization", default="awq")
    parser.add_argument("--hardware", default="gb10")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--acceptance", type=float, default=0.7)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024]
    )
    args = parser.parse_args(argv)
    quantization: Any = None if args.quantization == "none" else args.quantization
    cm = CostModel(args.model, quantization, args.hardware)
    points = speculation_points(cm, args.k, args.acceptance, args.concurrency, args.context)
    print(
        f"{args.model} {args.quantization} on {args.hardware}, k={args.k}, acceptance "
        f"{args.acceptance} ({points[0].tokens_per_step:.2f} tokens per verified step), "
        f"context {args.context}"
    )
    print(format_table(points))


if __name__ == "__main__":
    main()
