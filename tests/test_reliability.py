"""A failing request fails alone: faults injected into the engine's step hit only their request.

The executor is wrapped so that a step raises whenever it runs a marked request (or every time,
or once). The engine must find the culprit, finish it with ``finish_reason="error"``, and give
every other request exactly the tokens it gets when no fault happens."""

from __future__ import annotations

import pytest

from research import LLM, SamplingParams
from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine

PROMPTS = [[3 + i, 10 + i, 20 + i, 30 + i, 40 + (i % 3)] for i in range(8)]
POISON = [5, 6, 7, 8]


def _params(i: int) -> SamplingParams:
    """Greedy and seeded random sampling mixed, so exactness covers both."""
    if i % 2:
        return SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=100 + i)
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_model_len=64)


def _engine(llm) -> Engine:
    return Engine(
        llm.model_config,
        llm.params,
        cache_config=CacheConfig(block_size=4, num_kv_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
        max_model_len=64,
    )


class Faulty:
    """Wraps an executor: ``execute`` raises when ``should_fail(plan)`` says so."""

    def __init__(self, executor, should_fail):
        self.inner, self.should_fail, self.calls = executor, should_fail, 0

    def execute(self, plan):
        self.calls += 1
        if self.should_fail(plan):
            raise RuntimeError("injected fault")
        return self.inner.execute(plan)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _runs(request_id):
    return lambda plan: any(item.seq.request_id == request_id for item in plan.scheduled)


def _run(engine: Engine, poisoned_at_step: int | None = None) -> dict[str, object]:
    """Add the 8 requests (and the poisoned one after ``poisoned_at_step`` steps); step until
    done; returns each request's final output."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, _params(i), request_id=f"r{i}")
    final = {}
    step = 0
    while engine.has_unfinished_requests() or (poisoned_at_step is not None and step <= 3):
        if step == poisoned_at_step:
            engine.add_request(POISON, _params(0), request_id="poison")
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
        step += 1
    return final


@pytest.fixture(scope="module")
def reference(llm):
    final = _run(_engine(llm))
    return {rid: out.token_ids for rid, out in final.items()}


@pytest.mark.parametrize("poisoned_at_step", [0, 2])
def test_the_culprit_fails_alone_and_the_others_get_their_exact_tokens(
    llm, reference, poisoned_at_step
):
    engine = _engine(llm)
    engine.executor = Faulty(engine.executor, _runs("poison"))
    final = _run(engine, poisoned_at_step)
    assert final["poison"].finish_reason == "error"
    assert "injected fault" in final["poison"].error
    for rid, tokens in reference.items():
        assert final[rid].finish_reason in ("length", "stop"), rid
        assert final[rid].token_ids == tokens, rid
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests


def test_a_transient_fault_fails_nobody(llm, reference):
    engine = _engine(llm)
    engine.executor = Faulty(engine.executor, lambda plan: engine.executor.calls == 3)
    final = _run(engine)
    assert {rid: out.token_ids for rid, out in final.items()} == reference
    assert all(out.error is None for out in final.values())


def test_a_fault_in_every_step_fails_everyone_and_the_engine_recovers(llm, reference):
    engine = _engine(llm)
    faulty = Faulty(engine.executor, lambda plan: True)
    engine.executor = faulty
    final = _run(engine)
    assert sorted(final) == sorted(reference)
    assert all(out.finish_reason == "error" for out in final.values())
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    engine.executor = faulty.inner
    final = _run(engine)
    assert {rid: out.token_ids for rid, out in final.items()} == reference


def test_a_request_whose_state_went_bad_is_found_without_rerunning(llm, reference):
    """A request whose params became invalid after admission is failed by re-validation."""
    engine = _engine(llm)
    engine.executor = Faulty(engine.executor, _runs("poison"))
    engine.add_request(POISON, _params(0), request_id="poison")
    object.__setattr__(engine.requests["poison"].sampling_params, "top_k", 2**31)
    final = _run(engine)
    assert final["poison"].finish_reason == "error" and "top_k" in final["poison"].error
    assert {rid: final[rid].token_ids for rid in reference} == reference


def test_offline_generate_raises_for_a_failing_request_and_stays_usable(llm, reference):
    engine = _engine(llm)
    faulty = Faulty(
        engine.executor, lambda plan: any(i.seq.prompt_token_ids == POISON for i in plan.scheduled)
    )
    engine.executor = faulty
    with pytest.raises(RuntimeError, match=r"prompt 1 failed in the engine: .*injected fault"):
        engine.generate([PROMPTS[0], POISON, PROMPTS[2]], [_params(0), _params(0), _params(2)])
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_used_blocks == 0
    outs = engine.generate(PROMPTS[:2], [_params(0), _params(1)])
    assert [o.token_ids for o in outs] == [reference["r0"], reference["r1"]]
