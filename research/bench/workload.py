"""Benchmark workloads as `vllm bench serve` builds them: a random dataset and arrival schedules.

The random dataset draws each request's prompt and output lengths uniformly from the integers in
[floor(L(1-r)), ceil(L(1+r))] (vLLM's ``--random-input-len``, ``--random-output-len`` and
``--random-range-ratio``). Prompts are i.i.d. uniform token ids that avoid the special ids given;
vLLM instead takes a run of consecutive ids from a random offset, which on a small vocabulary can
give two prompts the same prefix. Either way there is nothing for a prefix cache to share.

Arrival schedules follow vLLM's ``--request-rate`` and ``--burstiness``: an infinite rate sends
everything at t=0; a finite one spaces requests by gamma-distributed gaps with shape
``burstiness`` and mean ``1 / rate`` (burstiness 1 is a Poisson process; below 1 is burstier,
above 1 more regular). The first request goes at t=0, as in vLLM's ``benchmark_serving.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int
    # seconds from the start of the run at which a trace sends it (None: the run's arrival
    # process, ``arrival_times``)
    arrival_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive integer range [floor(L(1-r)), ceil(L(1+r))] of lengths, at least 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = math.ceil(length * (1.0 + range_ratio))
    return low, high


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int] = ()) -> np.ndarray:
    """Token ids in [0, vocab_size) a synthetic prompt may use: every id but the special ones."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("every token id in the vocabulary is special; nothing to draw from")
    return allowed


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 32000,
    seed: int = 0,
    special_ids: Iterable[int] = (),
) -> list[BenchRequest]:
    """``num_prompts`` requests with random lengths around ``input_len`` / ``output_len`` and
    random prompt token ids in [0, vocab_size) that avoid ``special_ids``; the same seed gives the
    same requests."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    allowed = allowed_token_ids(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high, size=num_prompts, endpoint=True)
    output_lens = rng.integers(out_low, out_high, size=num_prompts, endpoint=True)
    return [
        BenchRequest(
            prompt_token_ids=rng.choice(allowed, size=int(n_in)).tolist(), output_len=int(n_out)
        )
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


@dataclass(frozen=True)
class RandomDataset:
    """vLLM's random dataset as a config object: ``sample(num_prompts, seed)`` draws requests."""

    input_len: int = 512
    output_len: int = 256
    range_ratio: float = 0.0
    vocab_size: int = 32000
    special_ids: tuple[int, ...] = ()

    def sample(self, num_prompts: int, seed: int = 0) -> list[BenchRequest]:
        return random_requests(
            num_prompts,
            self.input_len,
            self.output_len,
            self.range_ratio,
            self.vocab_size,
            seed,
            self.special_ids,
        )


def arrival_times(
    n: int, request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send offsets in seconds from the start of the benchmark, non-decreasing, first at 0."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:
        raise ValueError(
            f"request_rate must be > 0 (math.inf sends all at once), got {request_rate}"
        )
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    # Gamma(shape=k, scale=theta) has mean k * theta; theta = 1 / (rate * k) keeps the mean gap
    # at 1 / rate while the variance, k * theta^2 = 1 / (k * rate^2), shrinks as k grows.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
