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

``f`` (``CostParams.moe_concentration``) is fitted on a single prompt's TTFT in
``research.perf.calibration``; ``f = 1`` makes ``sequence_locality`` and ``hot_set`` uniform.

Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

ROUTING_LAWS = ("sequence_locality", "uniform", "hot_set", "all")
DEFAULT_ROUTING = "sequence_locality"


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
    "ROUTING_LAWS",
    "distinct_experts",
    "expected_distinct_experts",
    "working_set",
]
