"""Multi-step scheduling (``num_scheduler_steps``): several decode steps in one call give the
tokens one step per call gives, stop where it stops, never preempt for their look-ahead slots
and lose nothing under memory pressure."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from research import SamplingParams
from research.config import CacheConfig, SchedulerConfig
from research.engine.args import EngineArgs
from research.engine.block_manager import BlockManager
from research.engine.engine import Engine
from research.engine.request import RequestMetrics
from research.engine.scheduler import Scheduler
from research.engine.sequence import Sequence
from research.engine.step import model_multi_step

PROMPTS = [
    "The river wound through the valley, past farms and orchards,",
    "A good recipe for bread needs flour, water, salt and yeast,",
    "Mountains form where tectonic plates collide,",
    "Programming languages such as Python, Rust and C differ in",
    "The history of the printing press begins",
]


def _engine(llm, steps: int, **kwargs) -> Engine:
    cache = CacheConfig(
        block_size=16,
        num_kv_blocks=kwargs.pop("num_kv_blocks", 64),
        enable_prefix_caching=kwargs.pop("enable_prefix_caching", True),
    )
    sched = SchedulerConfig(
        max_num_seqs=kwargs.pop("max_num_seqs", 8),
        max_num_batched_tokens=256,
        num_scheduler_steps=steps,
    )
    return Engine(
        llm.model_config,
        llm.params,
        llm.tokenizer,
        cache_config=cache,
        scheduler_config=sched,
        max_model_len=llm.max_model_len,
        **kwargs,
    )


def _requests(llm, stop_token: int | None = None):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    sps = [
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=15,
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=[] if stop_token is None else [stop_token],
        ),
    ]
    return prompts, sps


def _same(a, b, gap_atol: float = 0.0) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert x.text == y.text
        np.testing.assert_allclose(x.top2_logit_gaps, y.top2_logit_gaps, rtol=0, atol=gap_atol)


@pytest.mark.parametrize("attention", ["auto", pytest.param("xla", marks=pytest.mark.slow)])
def test_multi_step_gives_the_tokens_of_one_step_per_call(smollm2_llm, attention):
    """Greedy and seeded sampling, rows ending at different lengths (the steps are as many as
    the row nearest its max_tokens has left) and a stop token inside a burst: the same tokens,
    stops and gaps as one step per call, in fewer engine steps. ``xla`` attention stores the
    K/V after each step of the loop; the native kernel stores them itself."""
    prompts, sps = _requests(smollm2_llm)
    one = _engine(smollm2_llm, 1, attention_backend=attention)
    reference = one.generate(prompts, sps)
    # the last request stops at a token its 8th step samples (mid-burst for 4 steps a call)
    stop = reference[4].token_ids[7]
    assert stop not in reference[4].token_ids[:7]
    prompts, sps = _requests(smollm2_llm, stop_token=stop)
    one = _engine(smollm2_llm, 1, attention_backend=attention)
    reference = one.generate(prompts, sps)
    assert reference[4].finish_reason == "stop" and len(reference[4].token_ids) == 8
    multi = _engine(smollm2_llm, 4, attention_backend=attention)
    out = multi.generate(prompts, sps)
    _same(reference, out)
    assert multi.num_steps < one.num_steps
    for o in out:  # one timestamp per token
        assert len(o.metrics.token_times) == len(o.token_ids)
    assert multi.block_manager.num_free_blocks == multi.block_manager.num_blocks


@pytest.mark.slow  # two more compiles of SmolLM2's step; the XLA variant above is slow too
def test_multi_step_with_fp8_pages_gives_the_tokens_of_one_step_per_call(smollm2_llm):
    """fp8 pages: the loop stores each step's K/V quantized (the ``write_kv`` branch, as the
    step's own call does) and reads them back as one step a call would."""
    prompts, sps = _requests(smollm2_llm)
    reference = _engine(smollm2_llm, 1, kv_cache_dtype="fp8").generate(prompts, sps)
    multi = _engine(smollm2_llm, 4, kv_cache_dtype="fp8")
    _same(reference, multi.generate(prompts, sps))
    assert not multi.executor.writes_in_step


def test_multi_step_under_memory_pressure_loses_nothing(smollm2_llm):
    """A pool too small for every request at once: preemption by recompute, look-ahead slots
    only where the pool has room, freed blocks refilled with NaN (a read of one would poison a
    row). Every request finishes with the tokens of one step per call; its gaps agree to
    1e-4 (a preempted request's recompute computes its generated tokens' K/V in a
    prefill chunk, not one decode at a time, which moves the last bits)."""
    prompts = [smollm2_llm.tokenizer.encode(p * 2) for p in PROMPTS] * 2
    sps = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    reference = _engine(smollm2_llm, 1, num_kv_blocks=64).generate(prompts, sps)
    tight = _engine(smollm2_llm, 8, num_kv_blocks=14, poison_freed_blocks=True)
    out = tight.generate(prompts, sps)
    assert tight.scheduler.num_preemptions > 0
    _same(reference, out, gap_atol=1e-4)


def _seq(rid: str, n: int, max_tokens: int) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(range(1, n + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        seed=0,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def _decoding(num_blocks: int, lengths: list[int], max_tokens: int = 100):
    """A scheduler whose sequences have been prefilled and sampled once: the next plan is
    decodes only."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(num_blocks, 4, False))
    seqs = [_seq(f"r{i}", n, max_tokens) for i, n in enumerate(lengths)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    sched.commit(plan)
    for s in seqs:
        s.output_token_ids.append(5)
    return sched, seqs


def test_look_ahead_takes_free_blocks_only_and_respects_lengths():
    sched, seqs = _decoding(8, [4, 4])  # after the decode's own slot: 2 blocks each, 4 free
    plan = sched.schedule()
    assert [item.seq for item in plan.decodes] == seqs
    # 8 steps: positions 4 .. 11, 3 blocks each: 1 more each, the free blocks suffice
    assert sched.extend_decodes(plan, 8, max_model_len=64) == 8
    assert [len(s.block_ids) for s in seqs] == [3, 3]

    sched, seqs = _decoding(4, [4, 4])  # every block held: 8 steps need 2 more
    plan = sched.schedule()
    used = [list(s.block_ids) for s in seqs]
    assert sched.extend_decodes(plan, 8, max_model_len=64) == 1  # one step, nobody preempted
    assert [s.block_ids for s in seqs] == used and sched.num_preemptions == 0

    sched, seqs = _decoding(16, [4, 6], max_tokens=4)  # 1 token out, 3 left each
    plan = sched.schedule()
    assert sched.extend_decodes(plan, 8, max_model_len=64) == 3
    sched, seqs = _decoding(16, [4, 6])
    plan = sched.schedule()
    assert sched.extend_decodes(plan, 8, max_model_len=9) == 2  # 7 tokens: 2 more fit

    sched, seqs = _decoding(16, [4, 4])
    seqs[1].sampling_params = SamplingParams(max_tokens=100, logprobs=2)
    plan = sched.schedule()
    assert sched.extend_decodes(plan, 8, max_model_len=64) == 1  # its logprobs, every step


def test_num_scheduler_steps_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(num_scheduler_steps=0).create_config()
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(executor="simulated", hardware="gb10", num_scheduler_steps=4).create_config()
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=True)


def test_multi_step_refuses_speculative_decoding(smollm2_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="num_scheduler_steps=4: speculative"):
        _engine(smollm2_llm, 4, speculative_config=spec)


def test_bf16_multi_step_reads_the_embedding_as_stored():
    """bfloat16 on the native path: the tokens of one step per call, and the loop's compiled
    buffers hold no float32 copy of the embedding. XLA:CPU gathers bfloat16 rows through
    float32 and hoisted that conversion of the whole table out of the loop, so each step read
    113 MB more than it needs; ``pack_params`` keeps a lookup-only table as its codes."""
    from research import LLM

    kw = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=2, num_kv_blocks=24)
    llm = LLM("smollm2-135m", num_scheduler_steps=4, **kw)
    ex = llm.engine.executor
    if ex.gemm_backend != "native":
        pytest.skip("the native kernels do not serve bfloat16 here")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = llm.engine.generate(prompts, [sp] * 2)
    one = LLM("smollm2-135m", **kw).engine
    _same(one.generate(prompts, [sp] * 2), out)
    assert llm.engine.num_steps < one.num_steps

    host = ex.batch.padding(ex.compiler.shape_for([]))
    compiled = model_multi_step.lower(
        ex._call_params, ex.pool, host.inputs, host.slot_mapping, np.int32(1),
        **ex._static(), writes=ex.writes_in_step, max_steps=4, block_size=ex.block_size,
        pad_slot=ex.batch.pad_slot,
    ).compile()  # fmt: skip
    vocab, dim = llm.model_config.vocab_size, llm.model_config.hidden_size
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < vocab * dim * 2, f"{temp / 2**20:.0f} MiB of temporaries"
    del compiled
    jax.clear_caches()


def test_serving_runs_single_steps_while_the_loop_compiles(smollm2_llm, monkeypatch):
    """When serving (``compile_in_background``) a loop not compiled yet compiles in the
    background and the steps run one a call meanwhile (the same tokens); once it is ready the
    calls run several steps."""
    import threading

    prompts, sps = _requests(smollm2_llm)
    reference = _engine(smollm2_llm, 1).generate(prompts, sps)
    engine = _engine(smollm2_llm, 4)
    compiler = engine.executor.compiler
    compiler.compile_in_background = True
    release = threading.Event()
    compile_multi = compiler._compile_multi

    def held(shape, lower):
        release.wait(timeout=600)
        compile_multi(shape, lower)

    monkeypatch.setattr(compiler, "_compile_multi", held)
    single = _engine(smollm2_llm, 1)
    _same(single.generate(prompts, sps), reference)
    _same(engine.generate(prompts, sps), reference)
    assert engine.num_steps == single.num_steps and not compiler.multi  # one step a call
    release.set()
    assert engine.executor.wait_for_background_compiles(600)
    assert compiler.multi
    steps = engine.num_steps
    _same(engine.generate(prompts, sps), reference)
    assert engine.num_steps - steps < single.num_steps


def test_precompile_compiles_the_loops(smollm2_llm):
    """``precompile`` of a workload's step shapes compiles the multi-step loop of each shape a
    step of decodes only takes, so the timed run traces nothing."""
    from research.engine.step import STEP_TRACES

    prompts, sps = _requests(smollm2_llm)
    first = _engine(smollm2_llm, 4)
    reference = first.generate(prompts, sps)
    shapes = first.executor.compiler.shapes | set(first.executor.compiler.multi)
    assert first.executor.compiler.multi
    engine = _engine(smollm2_llm, 4)
    engine.executor.precompile(shapes)
    assert set(engine.executor.compiler.multi) >= set(first.executor.compiler.multi)
    traces, compiles = STEP_TRACES[0], engine.executor.compiler.step_compiles
    _same(engine.generate(prompts, sps), reference)
    assert STEP_TRACES[0] == traces and engine.executor.compiler.step_compiles == compiles


def test_executor_config_takes_num_scheduler_steps_on_the_real_executor_only():
    from research.config import ExecutorConfig

    assert ExecutorConfig(num_scheduler_steps=8).num_scheduler_steps == 8
    with pytest.raises(ValueError, match="real executor"):
        ExecutorConfig(kind="simulated", num_scheduler_steps=8)
    with pytest.raises(ValueError, match="integer >= 1"):
        ExecutorConfig(num_scheduler_steps=0)
