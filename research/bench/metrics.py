"""Serving metrics from per-request records, with `vllm bench serve`'s definitions and names.

A ``RequestRecord`` holds what a client sees of one request: when it was sent, when each token
arrived, when it finished. The in-process driver fills them from the engine's timestamps; an HTTP
client can fill the same records from a stream. ``compute_metrics`` turns records into the numbers
``vllm bench serve`` prints and saves (as its ``calculate_metrics``):

- TTFT = first token - send; E2EL = finish - send.
- TPOT per request = (E2EL - TTFT) / (output_len - 1), only for requests with more than one token.
- ITL = every gap between successive tokens, pooled over all requests.
- Throughputs divide by the benchmark duration: requests, generated tokens (output) and
  prompt + generated tokens (total).
- Goodput counts the requests within every SLO given ("ttft", "tpot", "e2el" in ms, like
  ``--goodput``); a one-token request's TPOT counts as 0 there, as in vLLM.
- Latencies are reported in ms as mean, median, std and percentiles (numpy's linear
  interpolation); per-user tok/s = 1000 / median TPOT.

Failed requests count in ``failed`` and are left out of every latency and token count. A metric
with no samples reports 0, as vLLM does; ``per_user_tok_s`` is then None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request as a client saw it; times in seconds on one clock.

    ``output_len`` is the number of tokens actually generated. ``finish_time`` is when the request
    finished (for a failed request: when it failed).
    """

    prompt_len: int
    output_len: int
    send_time: float
    first_token_time: float | None
    token_times: list[float]
    finish_time: float
    success: bool = True
    error: str = ""
    num_preemptions: int = 0

    @property
    def ttft(self) -> float:
        if self.first_token_time is None:
            raise ValueError("request produced no token, so it has no TTFT")
        return self.first_token_time - self.send_time

    @property
    def e2el(self) -> float:
        return self.finish_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist()


def _percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _summary(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"{_percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _check_slos(goodput_slos: Mapping[str, float]) -> None:
    for key, bound in goodput_slos.items():
        if key not in SLO_METRICS:
            raise ValueError(f"unknown goodput SLO {key!r}; expected some of {SLO_METRICS}")
        if not bound > 0:
            raise ValueError(f"goodput SLO {key!r} must be > 0 ms, got {bound!r}")


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    *,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput_slos: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """`vllm bench serve`'s metrics for ``records`` over a benchmark of ``duration`` seconds.

    Returns ``completed``, ``failed``, ``duration``, ``total_input_tokens``,
    ``total_output_tokens``, ``request_throughput``, ``request_goodput`` (None without SLOs),
    ``output_throughput``, ``total_token_throughput``, ``per_user_tok_s`` and, for each of ttft,
    tpot, itl and e2el, ``mean/median/std_<metric>_ms`` and ``p<P>_<metric>_ms`` per percentile.
    """
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    if goodput_slos:
        _check_slos(goodput_slos)
    ok = [r for r in records if r.success]
    samples: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    tpot_for_slo = []  # 0 for one-token requests, aligned with ttft / e2el for the SLO check
    for r in ok:
        samples["ttft"].append(r.ttft)
        samples["e2el"].append(r.e2el)
        samples["itl"].extend(r.itls)
        tpot = r.tpot
        if tpot is not None:
            samples["tpot"].append(tpot)
        tpot_for_slo.append(0.0 if tpot is None else tpot)

    good = None
    if goodput_slos:
        per_request = {"ttft": samples["ttft"], "tpot": tpot_for_slo, "e2el": samples["e2el"]}
        good = sum(
            all(per_request[key][i] * 1000.0 <= bound for key, bound in goodput_slos.items())
            for i in range(len(ok))
        )

    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": None if good is None else good / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name in LATENCY_METRICS:
        metrics |= _summary(name, samples[name], percentiles)
    median_tpot_ms = metrics["median_tpot_ms"]
    metrics["per_user_tok_s"] = 1000.0 / median_tpot_ms if median_tpot_ms > 0 else None
    return metrics
