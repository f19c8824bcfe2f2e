"""From a measured concurrency curve to a number of people one box serves (docs/reference.md section 1).

1. Pick a per-user speed floor (15 tok/s comfortable, 10 tok/s minimum) and read the number of
   concurrent streams at which per-user tok/s falls to it off the measured curve, interpolating
   linearly between measured concurrency points (``streams_at_floor``).
2. A user is not streaming all the time: asking every ``period_s`` for an ``answer_tokens`` answer
   at ``tok_s`` with ``ttft_s`` to the first token keeps a stream busy a fraction
   ``duty = (answer_tokens / tok_s + ttft_s) / period_s`` of the time (``duty_cycle``; 400 tokens
   at 15 tok/s, 1 s TTFT, every 2 min: 23%).
3. N users keep on average a = N * duty streams busy; the busy count is ~Poisson, so keep a 99th
   percentile margin, a + 2.33 * sqrt(a) <= streams, and take the largest such N
   (``max_users_for_streams``).

``python -m research.perf.sizing RESULTS [--floor 15] [--floor 10]`` runs this on a results file
(ours or a ``vllm bench serve --save-result`` JSON), one curve per configuration: each named by
what varies between the curves (``model=qwen3-coder-30b-a3b``, ``quantization=awq``), the
values they all share on one line under the table (``shared: hardware=gb10, engine=vllm, ...``).
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from research.bench.stats import SERIES_AXES, series_caption, series_of

POISSON_P99_Z = 2.33  # one-sided 99th percentile of the normal approximation to Poisson


def _sorted_curve(curve: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    points = sorted((float(c), float(v)) for c, v in curve)
    if not points:
        raise ValueError("the curve has no points")
    for c, v in points:
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"concurrency must be a finite number > 0, got {c}")
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"per-user tok/s must be a finite number >= 0, got {v} at {c}")
    concurrencies = [c for c, _ in points]
    if len(set(concurrencies)) != len(concurrencies):
        raise ValueError(
            f"the curve repeats a concurrency {concurrencies}; average the repeats first "
            "(curve_from_points does)"
        )
    return points


def floor_crossing(curve: Iterable[tuple[float, float]], floor_tok_s: float) -> tuple[float, bool]:
    """``(streams, lower_bound)``: see ``streams_at_floor``; ``lower_bound`` is True when the
    curve never falls below the floor, so the returned largest measured concurrency only bounds
    the answer from below."""
    if not (math.isfinite(floor_tok_s) and floor_tok_s > 0):
        raise ValueError(f"floor_tok_s must be a finite number > 0, got {floor_tok_s}")
    points = _sorted_curve(curve)
    if points[0][1] < floor_tok_s:
        return 0.0, False
    for (c0, v0), (c1, v1) in itertools.pairwise(points):
        if v1 < floor_tok_s:  # v0 >= floor > v1: the first crossing lies in [c0, c1)
            return c0 + (v0 - floor_tok_s) * (c1 - c0) / (v0 - v1), False
    return points[-1][0], True


def streams_at_floor(curve: Iterable[tuple[float, float]], floor_tok_s: float) -> float:
    """Concurrent streams at which per-user tok/s falls to ``floor_tok_s``.

    ``curve`` is (concurrency, per_user_tok_s) points, in any order. Walking them by increasing
    concurrency, at the first pair (c0, v0), (c1, v1) with v0 >= floor > v1 the answer is the
    linear interpolation ``c0 + (v0 - floor) * (c1 - c0) / (v0 - v1)``. Edge cases:

    - the lowest measured concurrency is already below the floor: 0 (no stream meets it);
    - the curve never falls below the floor: the largest measured concurrency, a lower bound
      (``floor_crossing`` returns the flag; ``size_users`` records it).
    """
    return floor_crossing(curve, floor_tok_s)[0]


def duty_cycle(
    answer_tokens: float = 400, tok_s: float = 15.0, ttft_s: float = 1.0, period_s: float = 120.0
) -> float:
    """Fraction of the time one user keeps a stream busy: ``(answer_tokens / tok_s + ttft_s) /
    period_s``; (400 / 15 + 1) / 120 = 0.2306 (docs/reference.md section 1's 23%). Can exceed 1 (a user
    who asks again before the last answer ends keeps more than one stream busy on average)."""
    if answer_tokens < 0 or ttft_s < 0:
        raise ValueError(f"answer_tokens ({answer_tokens}) and ttft_s ({ttft_s}) must be >= 0")
    if tok_s <= 0 or period_s <= 0:
        raise ValueError(f"tok_s ({tok_s}) and period_s ({period_s}) must be > 0")
    return (answer_tokens / tok_s + ttft_s) / period_s


def _fits(users: int, streams: float, duty: float, z: float) -> bool:
    a = users * duty
    # A relative tolerance keeps an exact fit (a + z sqrt(a) == streams) on the right side.
    return a + z * math.sqrt(a) <= streams * (1 + 1e-12)


def max_users_for_streams(streams: float, duty: float, z: float = POISSON_P99_Z) -> int:
    """Largest N with a + z * sqrt(a) <= streams, a = N * duty (Poisson 99th-percentile margin for
    z = 2.33). With s = sqrt(a) the condition is s^2 + z s - streams <= 0, so
    a <= ((sqrt(z^2 + 4 streams) - z) / 2)^2 and N = floor(that / duty)."""
    if not (math.isfinite(streams) and streams >= 0):
        raise ValueError(f"streams must be a finite number >= 0, got {streams}")
    if not (math.isfinite(duty) and duty > 0):
        raise ValueError(f"duty must be a finite number > 0, got {duty}")
    if z < 0:
        raise ValueError(f"z must be >= 0, got {z}")
    a_max = ((math.sqrt(z * z + 4 * streams) - z) / 2) ** 2
    users = math.floor(a_max / duty)
    # The closed form is exact in reals; step across float rounding at the boundary.
    while _fits(users + 1, streams, duty, z):
        users += 1
    while users > 0 and not _fits(users, streams, duty, z):
        users -= 1
    return users


@dataclass(frozen=True)
class SizingResult:
    """People one box serves at one speed floor.

    ``streams`` is read off the curve (``streams_lower_bound``: the curve never fell below the
    floor, so the box can do at least that many); ``duty_cycle`` uses the floor as the user's
    speed (every user gets at least it); ``users`` is the largest N whose average busy streams
    ``average_streams = N * duty_cycle`` plus the margin, ``peak_streams = a + z sqrt(a)``, fits
    in ``streams``.
    """

    floor_tok_s: float
    streams: float
    streams_lower_bound: bool
    duty_cycle: float
    users: int
    average_streams: float
    peak_streams: float
    answer_tokens: float
    period_s: float
    ttft_s: float
    z: float


def size_users(
    curve: Iterable[tuple[float, float]],
    floor_tok_s: float = 15.0,
    answer_tokens: float = 400,
    period_s: float = 120.0,
    ttft_s: float = 1.0,
    z: float = POISSON_P99_Z,
) -> SizingResult:
    """The sizing method of docs/reference.md section 1 on one measured curve at one floor."""
    streams, lower_bound = floor_crossing(curve, floor_tok_s)
    duty = duty_cycle(answer_tokens, floor_tok_s, ttft_s, period_s)
    users = max_users_for_streams(streams, duty, z)
    average = users * duty
    return SizingResult(
        floor_tok_s=floor_tok_s,
        streams=streams,
        streams_lower_bound=lower_bound,
        duty_cycle=duty,
        users=users,
        average_streams=average,
        peak_streams=average + z * math.sqrt(average),
        answer_tokens=answer_tokens,
        period_s=period_s,
        ttft_s=ttft_s,
        z=z,
    )


# ------------------------------------------------------------------------------------------ CLI

# Keys that tell one curve from another in a results file, when present.
# Every swept axis (research.bench.stats.SERIES_AXES), so two configurations never share a
# curve; the request rate is the load shape, not a configuration.
GROUP_KEYS = tuple(a for a in SERIES_AXES if a != "request_rate")


def curve_from_points(points: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(max_concurrency, per_user_tok_s) of result points (``research.bench.read_results``),
    sorted; points without either are skipped, repeats of a concurrency averaged."""
    by_concurrency: dict[float, list[float]] = {}
    for p in points:
        c, v = p.get("max_concurrency"), p.get("per_user_tok_s")
        if c is None or v is None:
            continue
        by_concurrency.setdefault(float(c), []).append(float(v))
    return [(c, sum(vs) / len(vs)) for c, vs in sorted(by_concurrency.items())]


def group_points(points: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Points split into curves, one per configuration (the ``GROUP_KEYS`` they carry), each
    named by the keys that vary between the curves as ``key=value``
    (``research.bench.stats.series_of``); ``research.bench.stats.series_caption`` gives the
    values they share."""
    return series_of(points, axes=GROUP_KEYS)


def format_sizing_table(rows: Sequence[tuple[str, SizingResult]]) -> str:
    lines = [
        "| curve | floor tok/s | streams | duty | users | avg streams | p99 streams |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        streams = f">= {r.streams:.1f}" if r.streams_lower_bound else f"{r.streams:.1f}"
        lines.append(
            f"| {label} | {r.floor_tok_s:g} | {streams} | {r.duty_cycle:.1%} | {r.users} | "
            f"{r.average_streams:.1f} | {r.peak_streams:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m research.perf.sizing",
        description="Streams and users per speed floor from measured concurrency curves.",
    )
    parser.add_argument(
        "results",
        nargs="+",
        help="results.jsonl, vLLM --save-result JSON, or a run / sweep directory (every "
        "results.jsonl below it)",
    )
    parser.add_argument(
        "--floor",
        type=float,
        action="append",
        help="per-user tok/s floor (repeatable; default 15 and 10)",
    )
    parser.add_argument("--answer-tokens", type=float, default=400)
    parser.add_argument("--period", type=float, default=120.0, help="seconds between questions")
    parser.add_argument("--ttft", type=float, default=1.0, help="time to first token, seconds")
    parser.add_argument("--z", type=float, default=POISSON_P99_Z, help="margin in Poisson sigmas")
    args = parser.parse_args(argv)

    from research.bench.report import read_results, result_files

    try:
        files = result_files(args.results)
    except ValueError as e:
        parser.error(str(e))
    points = [p for path in files for p in read_results(path)]
    floors = args.floor or [15.0, 10.0]
    rows = []
    curves = group_points(points)
    for label, group in curves.items():
        curve = curve_from_points(group)
        if not curve:
            print(f"{label}: no points with max_concurrency and per_user_tok_s; skipped")
            continue
        for floor in floors:
            rows.append(
                (
                    label,
                    size_users(curve, floor, args.answer_tokens, args.period, args.ttft, args.z),
                )
            )
    if not rows:
        parser.error("no curve with max_concurrency and per_user_tok_s in the results")
    print(format_sizing_table(rows))
    if shared := series_caption(curves, GROUP_KEYS):
        print(f"\n{shared}")
    if any(r.streams_lower_bound for _, r in rows):
        print("\n'>=': the curve never fell below the floor; streams is a lower bound.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
