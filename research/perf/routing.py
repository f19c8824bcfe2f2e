"""MoE routing laws: how many DISTINCT experts per layer a step's tokens route to.

The bytes an expert GEMM reads are the distinct experts the step touches times one expert's
stored bytes, so the law matters wherever a step is memory bound. The law is a parameter of the
cost model (``CostModel(moe_routing=...)``); none is measured on the machines we model, so the
simulator draws a prediction band between the plausible ones (``research.perf.bands``).

Each law maps the new-token counts of the step's sequences ``(n_1, ..., n_S)``, the layer's
``E`` experts, top-``k`` routing and a concentration ``f`` in (0, 1] to the expected number of
distinct experts:

- ``"uniform"``: every token picks k of E experts uniformly and independently (a perfectly
  load-balanced router with no memory):  ``E * (1 - (1 - k/E)**T)``, ``T = sum(n_i)``.
- ``"sequence_locality"`` (the default): each sequence has its own working set of
  ``w = f * E`` experts, drawn independently of other sequences; its tokens pick k of those ``w``
  uniformly. An expert is missed by sequence i with probability
  ``1 - (w/E) * (1 - (1 - k/w)**n_i)``, independently across sequences, so
  ``distinct = E * (1 - prod_i [1 - (w/E) * (1 - (1 - k/w)**n_i)])``.
  One long prompt touches at most ``w`` experts (tokens of one text concentrate); a single
  token touches k; ``B`` independent decodes touch ``E * (1 - (1 - k/E)**B)``, exactly the
  uniform law (load balancing spreads independent requests over every expert). Adding a
  sequence can only multiply the miss probability by a factor <= 1, so the count never
  decreases with batch.
- ``"hot_set"``: one GLOBAL hot set of ``w = f * E`` experts shared by all sequences:
  ``w * (1 - (1 - k/w)**T)``. It caps every step at ``w`` experts whatever the batch, which
  independent requests under a load-balancing loss contradict; kept as the low end of the band.
- ``"all"``: every expert every step (an upper bound on bytes).
- ``"lognormal"``: experts are not equally popular. Expert e is picked by a token with
  probability ``pi_e = k * w_e / E``, the popularity ``w`` lognormal with mean 1 and shape
  ``LOAD_SIGMA``, tokens independent:  ``E * (1 - E_w[(1 - k w / E)**T])`` (exact for any
  within-token correlation of the top-k, by linearity over experts). ``LOAD_SIGMA`` is not
  fitted on any throughput: it is the shape that reproduces the distinct-expert counts measured
  on gpt-oss-20b's router (``MEASURED_DISTINCT``: per-layer, per-expert selection frequencies of
  generated tokens, from which E[distinct] at B independent tokens follows exactly); a model
  whose own router has a published load statistic takes the shape that statistic gives
  (``LOAD_SIGMAS``: Qwen3-30B-A3B's expert coverage); gpt-oss-120b, with none published, takes
  the shape its llama.cpp batch-32 decode rates imply (``INFERRED_SIGMA_GPT_OSS_120B``).

``f`` (``CostParams.moe_concentration``) is fitted on a single prompt's TTFT in
``research.perf.calibration``; ``f = 1`` makes ``sequence_locality`` and ``hot_set`` uniform.

Pure Python: JAX is not imported.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence

ROUTING_LAWS = ("sequence_locality", "uniform", "hot_set", "lognormal", "all")
DEFAULT_ROUTING = "sequence_locality"

# gpt-oss-20b (E=32, top-4): expected distinct experts per layer (mean of 24 layers) when B
# independent tokens are routed, computed from the per-layer per-expert selection frequencies of
# generated tokens (greedy decoding, HF transformers; GPQA-diamond, Polyglot-or-Not and
# Tulu-3 persona-IF prompts) published in github.com/AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting
# (raw/*.json, think_expert_analytics.layer_L.<e>.count_frequency): sum_e 1 - (1 - pi_e)**B.
# Its expert loads have a coefficient of variation of 0.90 on average over layers (0.50 to 1.31).
MEASURED_DISTINCT = {
    "model": "gpt-oss-20b",
    "experts": 32,
    "top_k": 4,
    "distinct": {2: 7.08, 4: 11.49, 8: 16.66, 16: 21.47, 32: 25.36, 64: 28.27, 128: 30.20},
}
_QUADRATURE_POINTS = 48


def lognormal_distinct(num_experts: float, top_k: int, num_tokens: int, sigma: float) -> float:
    """E[distinct experts] of ``num_tokens`` independent tokens when expert popularity is
    lognormal (mean 1, shape ``sigma``): ``E * (1 - E_w[(1 - min(1, c k w / E))**T])``, the
    expectation over w by Gauss-Hermite quadrature, ``c >= 1`` keeping k picks per token where
    the cap bites."""
    import numpy as np

    if num_tokens <= 0:
        return 0.0
    if sigma <= 0:
        return expected_distinct_experts(num_experts, top_k, num_tokens)
    weights, pick = _lognormal_picks(float(num_experts), int(top_k), float(sigma))
    miss = float(np.sum(weights * (1.0 - pick) ** num_tokens))
    return float(num_experts * (1.0 - miss))


def mmq_tile(num_tokens: int) -> int:
    """The column-tile width llama.cpp's MMQ kernels pick for a GEMM of ``num_tokens`` token
    columns (``mul_mat_q_case``, tensor-core builds): the narrowest of 8, 16, ..., 40, 48, 64,
    80, ..., 128 (multiples of 16 from 48) that needs the fewest tiles. For the grouped expert
    GEMM the count is the ubatch's tokens (``ncols_max``), and every expert's rows are cut in
    tiles of that width."""
    best, tiles = 8, math.inf
    for width in range(8, 129, 8):
        if width >= 48 and width % 16:
            continue
        n = -(-num_tokens // width)
        if n < tiles:
            best, tiles = width, n
    return best


@functools.lru_cache(maxsize=4096)
def lognormal_padded_rows(
    num_experts: float, top_k: int, num_tokens: int, sigma: float, tile: int
) -> float:
    """E[sum over experts of ceil(rows_e / tile) * tile]: the token rows a grouped expert GEMM
    computes when each expert's routed rows are padded to whole tiles. Rows of expert e are
    Poisson with mean ``num_tokens * pi_e`` (the ``lognormal`` law's pick probabilities; sigma
    0 is the uniform router); E[ceil(n / t)] = sum_j P(n > j t)."""
    import numpy as np
    from scipy.stats import poisson

    if num_tokens <= 0:
        return 0.0
    if sigma > 0:
        weights, pick = _lognormal_picks(float(num_experts), int(top_k), float(sigma))
    else:
        weights, pick = np.ones(1), np.full(1, top_k / num_experts)
    lam = num_tokens * pick
    jmax = int(np.ceil((lam.max() + 10 * np.sqrt(lam.max() + 1)) / tile)) + 1
    thresholds = np.arange(jmax)[:, None] * tile  # P(n > j t) for j = 0..jmax-1
    tiles = poisson.sf(thresholds, lam[None, :]).sum(axis=0)
    return float(num_experts * np.sum(weights * tiles) * tile)


@functools.lru_cache(maxsize=256)
def _lognormal_picks(num_experts: float, top_k: int, sigma: float) -> tuple:
    """Quadrature weights and the per-node pick probabilities of ``lognormal_distinct``."""
    import numpy as np

    z, weights = np.polynomial.hermite_e.hermegauss(_QUADRATURE_POINTS)
    weights = weights / weights.sum()
    w = np.exp(sigma * z - sigma**2 / 2)
    # A token picks exactly k experts: probabilities are capped at 1 and the rest rescaled so
    # that they still sum to k (bisection on the scale).
    lo, hi = 1.0, 1.0 + num_experts / top_k
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.sum(weights * np.minimum(1.0, mid * top_k * w / num_experts)) < top_k / num_experts:
            lo = mid
        else:
            hi = mid
    return weights, np.minimum(1.0, hi * top_k * w / num_experts)


def fit_load_sigma(measured: dict = MEASURED_DISTINCT) -> float:
    """The lognormal shape whose distinct-expert counts best match ``measured`` (least squares
    on the log of each count)."""
    from scipy.optimize import minimize_scalar

    e, k = measured["experts"], measured["top_k"]

    def loss(sigma: float) -> float:
        return sum(
            math.log(lognormal_distinct(e, k, b, sigma) / d) ** 2
            for b, d in measured["distinct"].items()
        )

    return float(minimize_scalar(loss, bounds=(0.0, 3.0), method="bounded").x)


# fit_load_sigma() of the measurement above (tests/test_gb10_validation.py recomputes it).
LOAD_SIGMA = 1.0

# Qwen3-30B-A3B (E=128, top-8): llama-imatrix expert counts of its ffn_down_exps over ~1k tokens
# of mixed text: 65 of 128 experts carry 90% of the routing (the 1 - normalised entropy 0.111
# of the same counts gives a shape of ~1.05; the coverage is the statistic used). Source:
# mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/ (measured on the real router,
# prompt tokens, one small sample: a weak measurement).
MEASURED_COVERAGE = {"model": "qwen3-30b-a3b", "experts": 128, "mass": 0.9, "covering": 65}


def coverage_sigma(measured: dict = MEASURED_COVERAGE) -> float:
    """The lognormal shape under which the most popular ``covering`` of ``experts`` carry
    ``mass`` of the routing: the top fraction q of a mean-1 lognormal(sigma) carries
    ``1 - Phi(Phi^-1(1 - q) - sigma)``."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    q = measured["covering"] / measured["experts"]
    return float(brentq(lambda s: 1 - norm.cdf(norm.ppf(1 - q) - s) - measured["mass"], 1e-3, 5))


# gpt-oss-120b: no router statistic was found. Its shape is inferred from throughput instead:
# the mean, over the three revisions of llama.cpp's DGX Spark page, of the shape at which the
# llama.cpp profile meets the published B=32 pp=512 decode rate (2.20, 2.16, 2.36:
# ``research.perf.validation.implied_sigma``; those three points are marked fitted in the
# validation report, and tests/test_gb10_validation.py recomputes the mean). It is checked on
# what it was not fitted on: vLLM's continuous-batching curve of the same model on natural text
# (``research.perf.validation_vllm``). gpt-oss-20b's measured shape (1.0) does not carry over:
# with it the 120b's batch-32 decode is predicted 36-45% too slow.
INFERRED_SIGMA_GPT_OSS_120B = 2.24

# Per model family: the shape its own router's measurement gives (coverage_sigma() = 1.26 for
# Qwen3-30B-A3B; the Coder variant shares its shapes and is assumed to share its router's
# skew), gpt-oss-120b's inferred one; other models take gpt-oss-20b's LOAD_SIGMA.
LOAD_SIGMAS = {
    "qwen3-30b-a3b": 1.26,
    "qwen3-coder-30b-a3b": 1.26,
    "gpt-oss-20b": LOAD_SIGMA,
    "gpt-oss-120b": INFERRED_SIGMA_GPT_OSS_120B,
}


# What the tokens are decides how skewed the router's choices are. ``random``: token ids drawn
# uniformly (vllm bench serve --dataset-name random, llama-batched-bench, llama-benchy); their
# hidden states look alike to the router, which sends them to a few experts far more often than
# natural text does. One shape for every model, FITTED on gpt-oss-120b's llama-batched-bench
# B=32 pp=512 decode points (the three revisions of llama.cpp's DGX Spark page; the mean of
# 2.20, 2.16, 2.36) and PREDICTED everywhere else: Qwen3-Coder-30B-A3B's and gpt-oss-20b's
# batched decodes on the same page (their own points imply 2.03-2.09 and 1.37-1.82), and vLLM's
# gpt-oss-120b concurrency curve (research.perf.validation_vllm). ``text``: natural text takes
# the shape its model's router statistic gives (``LOAD_SIGMAS``).
TOKEN_SOURCES = ("random", "text")
RANDOM_TOKEN_SIGMA = INFERRED_SIGMA_GPT_OSS_120B
# The spread of shapes the page's MoE batch-32 decode points imply (validation.implied_sigma
# over three revisions: gpt-oss-20b 1.37-1.82, Qwen3-Coder 2.03-2.09, gpt-oss-120b 2.14-2.36):
# the prediction band's corners under the lognormal law (research.perf.bands).
RANDOM_TOKEN_SIGMA_RANGE = (1.37, 2.36)
RANDOM_TOKEN_FIT = {"model": "gpt-oss-120b", "points": "llama-batched-bench tg B=32 pp=512"}


def routing_for(model: str, token_source: str) -> tuple[str, float]:
    """(routing law, lognormal shape) of ``model``'s MoE layers on tokens from
    ``token_source`` (``TOKEN_SOURCES``)."""
    if token_source not in TOKEN_SOURCES:
        raise ValueError(f"unknown token source {token_source!r}; expected one of {TOKEN_SOURCES}")
    if token_source == "random":
        return "lognormal", RANDOM_TOKEN_SIGMA
    return "lognormal", load_sigma(model)


def load_sigma(model: str) -> float:
    """The lognormal popularity shape of ``model``'s router (``LOAD_SIGMAS``, else
    ``LOAD_SIGMA``)."""
    return LOAD_SIGMAS.get(model, LOAD_SIGMA)


def expected_distinct_experts(num_experts: float, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts hit when ``num_tokens`` tokens each pick ``top_k`` of
    ``num_experts`` uniformly at random: ``E * (1 - (1 - k/E)**T)`` (each expert is missed by a
    token with probability 1 - k/E, independently across tokens)."""
    if num_tokens <= 0:
        return 0.0
    if not 0 < top_k <= num_experts:
        raise ValueError(f"need 0 < top_k ({top_k}) <= num_experts ({num_experts})")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def working_set(num_experts: int, top_k: int, concentration: float) -> float:
    """Experts one sequence (``sequence_locality``) or the whole machine (``hot_set``) routes
    to: ``concentration * E``, never fewer than k."""
    if not 0.0 < concentration <= 1.0:
        raise ValueError(f"concentration must be in (0, 1], got {concentration}")
    return max(float(top_k), concentration * num_experts)


def distinct_experts(
    law: str,
    num_experts: int,
    top_k: int,
    tokens_per_seq: Sequence[int],
    concentration: float = 1.0,
    sigma: float = LOAD_SIGMA,
) -> float:
    """Expected distinct experts per layer for a step whose sequences bring ``tokens_per_seq``
    new tokens each, under ``law`` (module docstring)."""
    if law not in ROUTING_LAWS:
        raise ValueError(f"routing law must be one of {ROUTING_LAWS}, got {law!r}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"need 0 < top_k ({top_k}) <= num_experts ({num_experts})")
    total = sum(tokens_per_seq)
    if total <= 0:
        return 0.0
    if law == "all":
        return float(num_experts)
    if law == "uniform":
        return expected_distinct_experts(num_experts, top_k, total)
    if law == "lognormal":
        return lognormal_distinct(num_experts, top_k, total, sigma)
    w = working_set(num_experts, top_k, concentration)
    if law == "hot_set":
        return expected_distinct_experts(w, top_k, total)
    # sequence_locality: product of per-sequence miss probabilities, grouped by chunk length.
    log_miss = 0.0
    for n, count in Counter(int(n) for n in tokens_per_seq if n > 0).items():
        hit = (w / num_experts) * (1.0 - (1.0 - top_k / w) ** n)
        if hit >= 1.0:
            return float(num_experts)
        log_miss += count * math.log1p(-hit)
    return num_experts * -math.expm1(log_miss)


__all__ = [
    "DEFAULT_ROUTING",
    "LOAD_SIGMA",
    "LOAD_SIGMAS",
    "MEASURED_COVERAGE",
    "MEASURED_DISTINCT",
    "RANDOM_TOKEN_SIGMA",
    "ROUTING_LAWS",
    "TOKEN_SOURCES",
    "coverage_sigma",
    "distinct_experts",
    "expected_distinct_experts",
    "fit_load_sigma",
    "load_sigma",
    "lognormal_distinct",
    "lognormal_padded_rows",
    "mmq_tile",
    "routing_for",
    "working_set",
]
