"""Requests as the user sees them: sampling parameters, outputs and per-request timings."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1  # the device step holds token counts, top_k and token ids as int32
FLOAT32_MAX = 3.4028234663852886e38  # temperature and top_p travel to the device as float32
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most alternatives a request may ask for


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as a Python int in [low, high]; bools and non-integers are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_real(name: str, value: object) -> float:
    """``value`` as a float that float32 holds; bools and non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large: {value!r}") from None
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names and defaults).

    temperature 0 is greedy; top_k 0 (or -1) and top_p 1 disable those filters. ``seed`` makes a
    request's samples reproducible whatever else is in the batch.

    Every field is checked at construction (type and range, including the int32 and float32
    bounds of the device step), so a request that reaches the engine cannot fail inside a step
    because of its parameters. A bad value raises ``ValueError`` naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Log-probabilities (vLLM's): ``logprobs=n`` returns, per generated token, the sampled
    # token's log-probability and the n most likely alternatives, each with its rank;
    # ``prompt_logprobs=n`` the same for every prompt token after the first. Both are of the
    # model's raw distribution (before temperature, top-k and top-p), as vLLM's default.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the params are hashable);
        # numpy scalars are stored as Python numbers.
        for name, value in self._checked().items():
            object.__setattr__(self, name, value)

    def validate(self) -> None:
        """Re-check every field (the engine calls this on each request it admits)."""
        checked = self._checked()
        for name, value in checked.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name} was changed after construction to {value!r}")

    def _checked(self) -> dict[str, object]:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be strings, got {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        seed = None if self.seed is None else check_int("seed", self.seed, -(2**63), 2**64 - 1)
        top_p = check_real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        temperature = check_real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        top_k = check_int("top_k", self.top_k, -1, INT32_MAX)
        return {
            "max_tokens": check_int("max_tokens", self.max_tokens, 1, INT32_MAX),
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop": tuple(stop),
            "stop_token_ids": tuple(check_int("stop_token_ids[]", t, 0, INT32_MAX) for t in ids),
            "ignore_eos": check_bool("ignore_eos", self.ignore_eos),
            "skip_special_tokens": check_bool("skip_special_tokens", self.skip_special_tokens),
            "logprobs": _check_logprobs("logprobs", self.logprobs),
            "prompt_logprobs": _check_logprobs("prompt_logprobs", self.prompt_logprobs),
        }

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_logprobs(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value < 0:
        raise ValueError(
            f"{name} must be in [0, {MAX_LOGPROBS}], got {value} (this engine does not return "
            "the whole vocabulary's log-probabilities)"
        )
    return check_int(name, value, 0, MAX_LOGPROBS)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability and its rank in the distribution (1 = most likely), with
    its text (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token's and the top alternatives').
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's ``CompletionOutput`` (this engine makes one per
    prompt: ``n=1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None  # when SamplingParams.logprobs is set

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the generated tokens' log-probabilities (None unless logprobs were asked)."""
        if self.logprobs is None:
            return None
        return float(sum(d[t].logprob for d, t in zip(self.logprobs, self.token_ids, strict=True)))


@dataclass
class RequestOutput:
    """The result of one prompt: generated text and ids, why it stopped, and its timings.
    ``outputs[0]`` is the vLLM view of the same completion; ``text``, ``token_ids``,
    ``finish_reason`` and ``stop_reason`` are kept on the request too, as a convenience."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    # "stop" (EOS, stop token or string) | "length" | "abort" | "error" | None (running)
    finish_reason: str | None
    metrics: RequestMetrics
    stop_reason: int | str | None = None
    # Gap between the two largest logits at each sampled position: near-ties show up here.
    top2_logit_gaps: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    logprobs: SampleLogprobs | None = None  # one dict per token_ids entry, if asked for
    # None for the first prompt token, then one dict per prompt token, if asked for.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: ``out.outputs[0].text``."""
        return [
            CompletionOutput(
                0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs
            )
        ]
