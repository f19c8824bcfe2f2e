"""Replica routing policies, apart from HTTP and devices: the decision the OpenAI router
(``research.serve.router``) and the simulator's replicas (``research.perf.simulated``) share.

- ``random``: a seeded uniform choice;
- ``least_loaded``: the replica with the fewest requests in flight (ties to the one that has had
  fewest requests, then the lowest index);
- ``prefix_aware``: the replica a rendezvous hash of the prompt's first ``prefix_chars``
  characters picks, so requests sharing a prefix meet that replica's prefix cache, unless its
  load exceeds the least loaded replica's by more than ``balance_threshold`` (then least
  loaded), as SGLang's cache-aware router balances.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROUTING = ("random", "least_loaded", "prefix_aware")


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    routed: int = 0


@dataclass
class Router:
    """The routing decision, apart from HTTP (a pure function of the replicas' loads)."""

    replicas: list[Replica]
    policy: str = "least_loaded"
    seed: int = 0
    prefix_chars: int = 256
    balance_threshold: int = 4
    # (time, in-flight count per replica) after every change: the load over the run
    history: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if self.policy not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {self.policy!r}")
        if not self.replicas:
            raise ValueError("a router needs at least one replica")
        self._rng = random.Random(self.seed)

    def choose(self, prefix: str) -> Replica:
        # ties go to the replica that has had fewest requests, then the lowest index
        least = min(self.replicas, key=lambda r: (r.in_flight, r.routed))
        if self.policy == "random":
            return self._rng.choice(self.replicas)
        if self.policy == "least_loaded":
            return least
        key = prefix[: self.prefix_chars].encode()
        best = max(self.replicas, key=lambda r: hashlib.sha256(key + r.url.encode()).digest())
        if best.in_flight - least.in_flight > self.balance_threshold:
            return least
        return best

    def start(self, replica: Replica) -> None:
        replica.in_flight += 1
        replica.routed += 1
        self._record()

    def done(self, replica: Replica) -> None:
        replica.in_flight -= 1
        self._record()

    def _record(self) -> None:
        self.history.append((self.clock(), tuple(r.in_flight for r in self.replicas)))

    def reset(self) -> None:
        """Start the counters and the load history afresh (between benchmark points)."""
        for r in self.replicas:
            r.routed = 0
        self.history = []
        self._record()

    def mean_in_flight(self) -> list[float]:
        """Each replica's requests in flight, averaged over the time since the first request."""
        if len(self.history) < 2:
            return [float(r.in_flight) for r in self.replicas]
        total = [0.0] * len(self.replicas)
        for (t0, loads), (t1, _) in zip(self.history, self.history[1:], strict=False):
            for i, load in enumerate(loads):
                total[i] += load * (t1 - t0)
        span = self.history[-1][0] - self.history[0][0]
        return [x / span if span > 0 else 0.0 for x in total]

    def balanced_fraction(self, within: int = 1, min_in_flight: int = 0) -> float:
        """The share of the time since the first request (or ``reset``) during which the busiest
        replica had at most ``within`` more requests in flight than the least busy one, counting
        only the time with at least ``min_in_flight`` requests in flight in all (a closed loop's
        steady state, without its ramp-up and drain)."""
        total = balanced = 0.0
        for (t0, loads), (t1, _) in zip(self.history, self.history[1:], strict=False):
            if sum(loads) < min_in_flight:
                continue
            total += t1 - t0
            if max(loads) - min(loads) <= within:
                balanced += t1 - t0
        return balanced / total if total > 0 else 1.0

    def stats(self, min_in_flight: int = 0) -> dict:
        means = self.mean_in_flight()
        return {
            "routing": self.policy,
            "balanced_fraction": self.balanced_fraction(1, min_in_flight),
            "replicas": [
                {"url": r.url, "in_flight": r.in_flight, "routed": r.routed, "mean_in_flight": m}
                for r, m in zip(self.replicas, means, strict=True)
            ],
        }
