"""Every step shape compiled before the clock starts: a shadow run of the scheduler predicts the
calls a workload makes, ``precompile`` compiles them, and the real run then traces nothing."""

from __future__ import annotations

import random

import jax
import pytest

from research import LLM
from research.bench import BenchRequest, run_benchmark
from research.engine import executor as executor_module
from research.engine.shapes import predict_step_shapes


def _requests(n: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(3, vocab) for _ in range(rng.randint(4, 90))], rng.randint(1, 24)
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "num_kv_blocks", [None, 14], ids=["roomy pool", "pool that forces preemption"]
)
def test_predicted_shapes_are_the_runs_and_nothing_compiles_inside_it(num_kv_blocks):
    llm = LLM(
        "tiny-llama",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_kv_blocks=num_kv_blocks,
    )
    engine = llm.engine
    requests = _requests(20, llm.model_config.vocab_size, seed=1)
    shapes = predict_step_shapes(engine, requests, max_concurrency=6)
    # (N, R, M): decode-only steps (N = R) and steps with prefill chunks (N > R)
    assert any(n == r for n, r, _ in shapes) and any(n > r for n, r, _ in shapes)
    assert engine.executor.precompile(shapes) == len(shapes)
    assert engine.executor.precompile(shapes) == 0  # already compiled

    traces, steps = executor_module.STEP_TRACES[0], engine.num_steps
    result = run_benchmark(engine, requests, max_concurrency=6)
    assert all(r.success for r in result.records)
    assert [len(r.token_times) for r in result.records] == [r.output_len for r in requests]
    assert executor_module.STEP_TRACES[0] == traces  # not one trace (so no compile) in the run
    assert engine.executor.step_shapes == shapes  # and every predicted shape was used
    assert engine.stats()["num_forward_passes"] == engine.num_steps  # one per step
    if num_kv_blocks is not None:
        assert engine.stats()["num_preemptions"] > 0
    assert engine.num_steps > steps


def test_precompiled_padding_leaves_the_outputs_unchanged():
    """All-padding batches write nothing: greedy tokens are the same with and without them."""
    prompts = [[5 + i, 9, 11, 13 + i] for i in range(3)]

    def generate(precompile: bool) -> list[list[int]]:
        from research import SamplingParams

        llm = LLM("tiny-llama", max_model_len=128, num_kv_blocks=32)
        if precompile:
            m = llm.engine.executor.max_blocks_per_seq
            llm.engine.executor.precompile([(16, 4, m), (4, 4, m), (1, 1, m)])
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
        return [o.token_ids for o in outs]

    assert generate(True) == generate(False)


def test_serving_on_covers_never_compiles_in_a_step_and_keeps_the_tokens():
    """After ``precompile_covers`` a call of a new shape runs padded to a compiled cover while its
    own shape compiles in the background: no step traces (compiles) the model, and the greedy
    tokens equal those of an engine that compiled every shape in the step."""
    from research import SamplingParams

    def make() -> LLM:
        return LLM("tiny-llama", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128)

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 100))] for _ in range(12)]
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    jax.clear_caches()  # shapes traced by earlier tests would not be traced again

    llm = make()
    executor = llm.engine.executor
    covers = executor.cover_shapes()
    assert executor.precompile_covers() == len(covers)
    traces = executor_module.STEP_TRACES[0]
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    executor.compiler._compiler.shutdown(wait=True)  # let the background compiles finish
    expected = [o.token_ids for o in make().generate(prompts, sp)]
    assert got == expected
    assert executor.covered_calls > 0
    # every trace since the covers came from a background compile, none from a step (the covers
    # themselves were compiled ahead of time, as the background shapes are)
    background = len(executor.compiler.compiled) - len(covers)
    assert executor_module.STEP_TRACES[0] - traces == background > 0
    # Again, now with prefix-cache hits (new shapes) and the background shapes compiled.
    assert [o.token_ids for o in llm.generate(prompts, sp)] == expected


def test_a_second_start_reads_compiled_steps_from_the_persistent_cache(tmp_path):
    """Two processes with one cache directory: the first writes the step executables, the
    second finds every one of them there (JAX counts persistent-cache misses)."""
    import json
    import subprocess
    import sys

    script = f"""
import json
from jax._src import monitoring
from research.engine.compile_cache import enable_compilation_cache
misses = []
monitoring.register_event_listener(
    lambda name, **kw: misses.append(name) if name.endswith("cache_misses") else None)
enable_compilation_cache({str(tmp_path)!r})
from research import LLM, SamplingParams
llm = LLM("tiny-llama", max_model_len=128, num_kv_blocks=16)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
print(json.dumps(len(misses)))
"""
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}

    def run() -> int:
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert run() > 0  # cold: every executable compiled and written
    assert any(tmp_path.iterdir())
    assert run() == 0  # warm: none missed


@pytest.mark.slow
def test_speculative_serving_on_covers_never_compiles_a_verification_in_a_step():
    """With n-gram drafts, verification rows run in the same step as every other row, so
    ``precompile_covers`` covers them too: a step of a new shape runs padded to its cover while
    its own shape compiles in the background. No step traces (compiles) the model, and the
    greedy tokens equal those of an engine that compiled every shape in the step."""
    from research import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3}

    def make() -> LLM:
        return LLM(
            "tiny-llama",
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            speculative_config=spec,
        )

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randint(3, 12))] * 3 for _ in range(10)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    jax.clear_caches()  # shapes traced by earlier tests would not be traced again

    llm = make()
    executor = llm.engine.executor
    covers = executor.cover_shapes()
    assert executor.compiler.num_scored == 4  # the last token and three drafts per row
    assert executor.precompile_covers() == len(covers)
    compilations = llm.engine.num_compilations
    step_traces = executor_module.STEP_TRACES[0]
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    executor.compiler._compiler.shutdown(wait=True)  # let the background compiles finish
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["num_forward_passes"] == stats["num_steps"]
    # every trace since the covers came from a background compile, none from a step
    background = len(executor.compiler.compiled) - len(covers)
    assert background > 0 and executor.covered_calls > 0
    assert executor_module.STEP_TRACES[0] - step_traces == background
    assert llm.engine.num_compilations - compilations == background
    expected = [o.token_ids for o in make().generate(prompts, sp)]
    assert got == expected
    # Again, now on the shapes compiled in the background.
    assert [o.token_ids for o in llm.generate(prompts, sp)] == expected
