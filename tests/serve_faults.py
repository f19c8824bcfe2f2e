"""Helpers for the server's reliability tests: executors that fail or slow down on demand, and
``/metrics`` parsing."""

from __future__ import annotations

import time

import httpx


class FaultyExecutor:
    """Wraps an executor: ``execute`` raises when ``should_fail(plan)`` says so, sleeps
    ``delay`` seconds per step (a model slow enough to watch the engine between steps) and,
    with a ``gate`` (a ``threading.Event``), runs a step only while the gate is open: a test
    holds the engine mid-step for as long as it needs, whatever the machine's speed."""

    def __init__(self, executor, should_fail=lambda plan: False, delay: float = 0.0, gate=None):
        self.inner, self.should_fail, self.delay, self.calls = executor, should_fail, delay, 0
        self.gate = gate

    def execute(self, plan):
        self.calls += 1
        if self.gate is not None and not self.gate.wait(timeout=300):
            raise RuntimeError("the test never opened the executor's gate")
        if self.delay:
            time.sleep(self.delay)
        if self.should_fail(plan):
            raise RuntimeError("injected fault")
        return self.inner.execute(plan)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def runs_prompt(prompt: list[int]):
    """A ``should_fail`` that fails every step running a request with this prompt."""
    return lambda plan: any(item.seq.prompt_token_ids == prompt for item in plan.scheduled)


def metrics(url: str, model: str) -> dict[str, float]:
    """``/metrics`` samples as {name (plus labels other than model_name): value}."""
    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.replace(f'model_name="{model}"', "").replace("{,", "{").replace("{}", "")
            samples[name] = float(value)
    return samples
