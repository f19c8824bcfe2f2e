"""Speculative decoding: the n-gram proposer, the rejection sampler's output distribution (alone
and through the engine, against the target's exact distribution), and the engine verifying
drafts in its step (greedy outputs unchanged, rollback of rejected slots,
preemption under a small pool, metrics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from research.config import SpeculativeConfig
from research.engine.sampler import SamplingTensors
from research.engine.spec.ngram import NgramProposer
from research.engine.spec.rejection import rejection_sample

# ---------------------------------------------------------------------- config and proposer


def test_speculative_config_from_vllm_dict():
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 1)
    assert SpeculativeConfig.from_dict(None) is None
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (6, 6)


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, r"unknown key.*'lookup'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs .model."),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no"),
        ([1, 2], "must be a dict"),
    ],
)
def test_speculative_config_refuses_bad_dicts(d, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(d)


def test_ngram_proposer_prefers_longest_then_latest_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3))
    # "7 8 9" occurred once, followed by 1 2 3; "9" alone occurred later, followed by 5.
    assert proposer.propose([7, 8, 9, 1, 2, 3, 9, 5, 6, 7, 8, 9]) == [1, 2, 3]
    assert proposer.propose([4, 9, 5, 6, 9]) == [5, 6, 9]
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert proposer.propose([1, 2, 1, 2, 1, 2], max_drafts=2) == [1, 2]
    assert proposer.propose([5]) == []
    # A short period: the latest match with k tokens after it.
    assert proposer.propose([3, 3, 3, 3, 3, 3]) == [3, 3, 3]
    strict = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)
    )
    assert strict.propose([4, 9, 5, 6, 9]) == []  # only a 1-gram matches


# ---------------------------------------------------------------------- rejection sampler

ALPHA = 1e-3  # significance level of every chi-square test below


def _reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """The distribution the plain sampler draws from, in numpy: temperature, then top-k, then
    top-p (the smallest most-likely set whose mass reaches p)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    keep[order[: top_k or len(z)]] = True
    probs = np.exp(z - z.max()) * keep
    probs /= probs.sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = np.zeros(len(z), bool)
    nucleus[order[(mass_before < top_p) | (top_p >= 1.0)]] = True
    nucleus[order[0]] = True
    probs = probs * nucleus
    return probs / probs.sum()


def _tensors(rows: int, temperature: float, top_k: int, top_p: float) -> SamplingTensors:
    def col(value, dtype):
        return jnp.asarray(np.full(rows, value, dtype))

    return SamplingTensors(
        temperature=col(temperature, np.float32),
        top_k=col(top_k, np.int32),
        top_p=col(top_p, np.float32),
        seed=jnp.asarray(np.arange(rows, dtype=np.uint32) * 7919 + 13),
        step=col(5, np.int32),
        logprobs=col(False, bool),
    )


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert np.all(support[samples]), "a token outside the target's support was emitted"
    counts = np.bincount(samples, minlength=len(probs))[support]
    expected = probs[support] / probs[support].sum() * counts.sum()
    return stats.chisquare(counts, expected).pvalue


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "proposal"),
    [
        (1.0, 0, 1.0, "ngram"),
        (0.7, 0, 0.8, "ngram"),
        (1.3, 5, 1.0, "ngram"),
        (0.9, 6, 0.9, "draft"),
    ],
)
def test_rejection_sampler_keeps_the_target_distribution(temperature, top_k, top_p, proposal):
    """Rows of fixed target logits (vocabulary 8, two drafts each): the first emitted token is
    distributed as p_0, and, where the first draft was accepted, the second as p_1, whether the
    drafts come from a point mass (n-gram) or are sampled from a draft distribution q."""
    rows, vocab = 40_000, 8
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (3, vocab)).astype(np.float32)
    p = [_reference_probs(row, temperature, top_k, top_p) for row in logits]
    if proposal == "ngram":
        # Drafts: the target's second-most likely token at position 0 (often rejected), its
        # most likely at position 1.
        drafts = np.tile([np.argsort(-p[0])[1], np.argmax(p[1])], (rows, 1))
        q = None
    else:
        q_rows = rng.dirichlet(np.ones(vocab), size=2)
        drafts = np.stack([rng.choice(vocab, rows, p=q_rows[j]) for j in range(2)], axis=1)
        q = jnp.asarray(np.broadcast_to(q_rows, (rows, 2, vocab)).astype(np.float32))
    tokens, accepted = jax.jit(rejection_sample)(
        jnp.asarray(np.broadcast_to(logits, (rows, 3, vocab))),
        jnp.asarray(drafts, jnp.int32),
        jnp.full(rows, 2, jnp.int32),
        _tensors(rows, temperature, top_k, top_p),
        q,
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert (accepted == 0).any() and (accepted > 0).any()
    assert _chi2_pvalue(tokens[:, 0], p[0]) > ALPHA
    first_accepted = accepted >= 1
    assert _chi2_pvalue(tokens[first_accepted, 1], p[1]) > ALPHA
    # The layout: accepted drafts, one sampled token, then -1.
    for row in range(100):
        a = accepted[row]
        assert list(tokens[row, :a]) == list(drafts[row, :a])
        assert tokens[row, a] >= 0 and all(tokens[row, a + 1 :] == -1)


def test_rejection_sampler_greedy_accepts_while_drafts_are_the_argmax():
    logits = np.full((3, 4, 6), -1.0, np.float32)
    argmax = np.array([[2, 3, 4, 5], [2, 3, 4, 5], [1, 1, 1, 1]])
    for r in range(3):
        logits[r, np.arange(4), argmax[r]] = 2.0
    drafts = np.array([[2, 3, 0], [2, 0, 4], [1, 1, 1]])
    num_drafts = np.array([3, 3, 2])
    st = _tensors(3, 0.0, 0, 1.0)
    tokens, accepted = rejection_sample(
        jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_drafts), st
    )
    assert list(np.asarray(accepted)) == [2, 1, 2]
    assert np.asarray(tokens).tolist() == [[2, 3, 4, -1], [2, 3, -1, -1], [1, 1, 1, -1]]


# ---------------------------------------------------------------------- rollback (host only)


def test_rollback_releases_blocks_across_a_block_boundary():
    """A verified chunk of 1 + 5 drafts reaches into two new blocks; with every draft rejected
    the sequence shrinks back and both blocks return to the pool; only accepted tokens are
    hashed for the prefix cache."""
    from research.config import SchedulerConfig
    from research.engine.block_manager import BlockManager
    from research.engine.request import RequestMetrics, SamplingParams
    from research.engine.scheduler import Scheduler
    from research.engine.sequence import Sequence

    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), bm)
    seq = Sequence("r", list(range(1, 8)), SamplingParams(max_tokens=20), 0, RequestMetrics(0.0))
    scheduler.add(seq)
    plan = scheduler.schedule()  # the 7-token prompt: 2 blocks
    assert scheduler.commit(plan) == [seq]
    seq.output_token_ids.append(8)  # 8 tokens, 7 computed
    assert len(seq.block_ids) == 2

    seq.spec_token_ids = [9, 10, 11, 12, 13]
    plan = scheduler.schedule()
    (item,) = plan.verifies
    assert (item.start, item.num_new_tokens, item.draft_token_ids) == (7, 6, [9, 10, 11, 12, 13])
    assert not plan.decodes and not plan.prefills
    assert len(seq.block_ids) == 4  # positions 7..12 reach the fourth block
    free_before = bm.num_free_blocks

    seq.output_token_ids.append(42)  # all five rejected: the residual's token
    released = scheduler.commit_verified(item, num_accepted=0)
    assert released == 2
    assert seq.num_computed_tokens == 8 and seq.num_tokens == 9
    assert len(seq.block_ids) == 2
    assert bm.num_free_blocks == free_before + 2
    bm.check_invariants([seq])
    # Two full computed blocks hashed, over the accepted tokens 1..8 only.
    assert seq.num_cached_blocks == 2 and len(seq.block_hashes) == 2

    # Next round: three of four accepted (slots 9..11 kept, one block released).
    seq.spec_token_ids = [43, 44, 45, 46]
    plan = scheduler.schedule()
    (item,) = plan.verifies
    assert len(seq.block_ids) == 4  # positions 8..12
    seq.output_token_ids += [43, 44, 45, 7]
    assert scheduler.commit_verified(item, num_accepted=3) == 1
    assert seq.num_computed_tokens == 12 and len(seq.block_ids) == 3
    bm.check_invariants([seq])
    scheduler.finish(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_drafts_share_the_token_budget_with_plain_sequences():
    from research.config import SchedulerConfig
    from research.engine.block_manager import BlockManager
    from research.engine.request import RequestMetrics, SamplingParams
    from research.engine.scheduler import Scheduler
    from research.engine.sequence import Sequence

    bm = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), bm)
    seqs = [
        Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20), 0, RequestMetrics(0.0))
        for i in range(3)
    ]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.commit(scheduler.schedule())
    for seq in seqs:
        seq.output_token_ids.append(4)
        seq.spec_token_ids = [5, 6, 7, 8]
    plan = scheduler.schedule()
    # 5 tokens for the first, then the remaining budget of 3: 1 + 2 drafts, then 0 left.
    assert [(i.seq.request_id, i.num_new_tokens) for i in plan.verifies] == [("r0", 5), ("r1", 3)]
    assert plan.num_batched_tokens == 8
    assert not seqs[0].spec_token_ids and not seqs[1].spec_token_ids  # used up


# ---------------------------------------------------------------------- the engine (tiny-llama)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# Repetitive prompts (so drafts are proposed), and one the lookup rarely matches.
TINY_PROMPTS = [[5, 6, 7, 8, 9] * 4, [10, 11, 12] * 6, list(range(20, 50)), [3] * 17]


@pytest.fixture(scope="module")
def tiny():
    from research.models.presets import get_preset
    from research.models.transformer import init_params

    cfg = get_preset("tiny-llama")
    return cfg, init_params(cfg, jax.random.key(0))


def _tiny_engine(tiny, speculative_config=None, **kwargs):
    from research.config import CacheConfig, SchedulerConfig
    from research.engine.engine import Engine

    cfg, params = tiny
    return Engine(
        cfg,
        params,
        cache_config=CacheConfig(
            block_size=4,
            num_kv_blocks=kwargs.pop("num_kv_blocks", 96),
            enable_prefix_caching=kwargs.pop("enable_prefix_caching", True),
        ),
        scheduler_config=SchedulerConfig(max_num_seqs=kwargs.pop("max_num_seqs", 4)),
        max_model_len=128,
        speculative_config=speculative_config,
        **kwargs,
    )


def _greedy(max_tokens=40):
    from research import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    return _tiny_engine(tiny).generate(TINY_PROMPTS, [_greedy()] * len(TINY_PROMPTS))


def test_greedy_outputs_identical_with_ngram_speculation(tiny, tiny_reference):
    engine = _tiny_engine(tiny, NGRAM)
    outputs = engine.generate(TINY_PROMPTS, [_greedy()] * len(TINY_PROMPTS))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in tiny_reference]
    assert all(len(o.top2_logit_gaps) == len(o.token_ids) for o in outputs)
    s = engine.stats()
    print(
        f"\ntiny-llama n-gram k=3: {s['spec_num_accepted_tokens']} of "
        f"{s['spec_num_draft_tokens']} drafts accepted (rate {s['spec_acceptance_rate']:.2f}, "
        f"mean acceptance length {s['spec_mean_acceptance_length']:.2f}), "
        f"{s['num_steps']} steps, {s['spec_rollback_blocks']} blocks rolled back"
    )
    assert s["spec_num_accepted_tokens"] > 0  # drafts accepted ...
    assert s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"]  # ... and rejected
    assert s["spec_rollback_blocks"] > 0
    assert s["num_steps"] < sum(len(o.token_ids) for o in outputs) // len(outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])


# Sixteen requests of 47 to 60 tokens (prompt + 30 generated): the repetitive prompts (drafts
# from n-gram lookup) and others, each shifted so no two are the same.
PRESSURE_PROMPTS = [[t + 40 * (i // 4) for t in p] for i, p in enumerate(TINY_PROMPTS * 4)]
PRESSURE_TOKENS = 30
PRESSURE_POOL = 20  # blocks of 4 tokens: one request (15 blocks at most) fits, sixteen do not


@pytest.fixture(scope="module")
def pressure_reference(tiny):
    engine = _tiny_engine(tiny, max_num_seqs=16, num_kv_blocks=512)
    sps = [_greedy(PRESSURE_TOKENS)] * len(PRESSURE_PROMPTS)
    return engine.generate(PRESSURE_PROMPTS, sps)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_memory_pressure_loses_nothing(tiny, pressure_reference, method):
    """A pool ten times smaller than the demand: 20 blocks for sixteen concurrent requests that
    need 208 (a pool can be no smaller than one request, so the requests are sized to fit one
    at a time while the sixteen together ask for more than ten pools). Preemption by
    recompute (prefix-cache hits on the accepted tokens' blocks when a request resumes), in a
    pool whose freed blocks are refilled with NaN; greedy outputs equal the unconstrained
    run's, with drafts from n-gram lookup or from a draft model with perturbed weights."""
    from research.models.transformer import init_params

    cfg, params = tiny
    block_size = 4
    demand = sum(-(-(len(p) + PRESSURE_TOKENS) // block_size) for p in PRESSURE_PROMPTS)
    assert demand >= 10 * PRESSURE_POOL
    assert max(len(p) + PRESSURE_TOKENS for p in PRESSURE_PROMPTS) <= PRESSURE_POOL * block_size
    if method == "ngram":
        spec, draft = NGRAM, None
    else:
        spec = {"model": "tiny-llama", "num_speculative_tokens": 3}
        # The target's weights plus a little of another seed's: drafts often accepted, not always.
        other = init_params(cfg, jax.random.key(7))
        draft = (cfg, jax.tree_util.tree_map(lambda a, b: a + 0.5 * b, params, other))
    engine = _tiny_engine(
        tiny,
        spec,
        max_num_seqs=16,
        num_kv_blocks=PRESSURE_POOL,
        poison_freed_blocks=True,
        draft_model=draft,
    )
    sps = [_greedy(PRESSURE_TOKENS)] * len(PRESSURE_PROMPTS)
    outputs = engine.generate(PRESSURE_PROMPTS, sps)
    s = engine.stats()
    print(
        f"\nmemory pressure ({method}, pool {PRESSURE_POOL} blocks, demand {demand}): "
        f"{s['num_preemptions']} preemptions, prefix-cache hit rate "
        f"{s['prefix_cache_hit_rate']:.2f}, {s['spec_num_accepted_tokens']} of "
        f"{s['spec_num_draft_tokens']} drafts accepted, {s['num_steps']} steps"
    )
    assert s["num_preemptions"] > 0
    assert s["prefix_cache_hit_rate"] > 0  # resumed requests reuse their accepted blocks
    assert s["spec_num_accepted_tokens"] > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in pressure_reference]
    assert all(o.finish_reason == "length" for o in outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])
    if draft is not None:
        assert not engine.proposer.shadows
        draft_pool = engine.proposer.block_manager
        assert draft_pool.num_free_blocks == draft_pool.num_blocks


def test_sampled_speculation_stops_and_logprob_requests_decode_plainly(tiny):
    from research import SamplingParams

    engine = _tiny_engine(tiny, NGRAM)
    sps = [
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[8]),
        SamplingParams(max_tokens=7, temperature=1.2, top_k=5, seed=3, ignore_eos=True),
    ]
    outputs = engine.generate(TINY_PROMPTS, sps)
    vocab = tiny[0].vocab_size
    assert len(outputs[0].token_ids) == 30 and len(outputs[3].token_ids) == 7
    assert all(0 <= t < vocab for o in outputs for t in o.token_ids)
    assert len(outputs[1].logprobs) == 13
    plain_engine = _tiny_engine(tiny)
    plain = plain_engine.generate([TINY_PROMPTS[1]], [sps[1]])[0]
    assert outputs[1].token_ids == plain.token_ids
    assert plain_engine.executor.compiler.num_scored == 1  # no speculation: one position a row
    stop = outputs[2]
    assert stop.finish_reason == "length" or stop.token_ids[-1] == 8
    assert 8 not in stop.token_ids[:-1]
    # Same seed, same tokens: the sampled run is reproducible.
    again = _tiny_engine(tiny, NGRAM).generate(TINY_PROMPTS[:1], sps[:1])[0]
    assert again.token_ids == outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_llm_accepts_vllms_speculative_config():
    from research import LLM, SamplingParams

    llm = LLM("tiny-llama", max_model_len=128, num_kv_blocks=64, speculative_config=NGRAM)
    out = llm.generate([[5, 6, 7, 8] * 5], SamplingParams(max_tokens=16, temperature=0.0))
    assert len(out[0].token_ids) <= 16
    assert "spec_acceptance_rate" in llm.engine.stats()
    with pytest.raises(ValueError, match="unknown key"):
        LLM(
            "tiny-llama",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "x": 1},
        )
    draft = LLM(
        "tiny-qwen3",
        max_model_len=128,
        num_kv_blocks=64,
        speculative_config={"model": "tiny-llama", "num_speculative_tokens": 2},
    )
    assert draft.engine.proposer.model_config.name == "tiny-llama"
    with pytest.raises(ValueError, match="simulated"):
        LLM("tiny-llama", executor="simulated", hardware="gb10", speculative_config=NGRAM)


# ---------------------------------------------------------------------- SmolLM2 (real weights)

SMOLLM2_TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog",
]


@pytest.mark.slow
def test_smollm2_greedy_outputs_identical_with_ngram_speculation(smollm2_llm):
    """Real weights and tokenizer: the same greedy tokens with and without n-gram drafts (up
    to near-ties of the top-2 logits, where a different packing may round either way)."""
    from research.config import CacheConfig, SchedulerConfig
    from research.engine.engine import Engine

    def engine(spec):
        return Engine(
            smollm2_llm.model_config,
            smollm2_llm.params,
            smollm2_llm.tokenizer,
            cache_config=CacheConfig(block_size=16, num_kv_blocks=64),
            scheduler_config=SchedulerConfig(max_num_seqs=2),
            max_model_len=smollm2_llm.max_model_len,
            speculative_config=spec,
        )

    prompts = [smollm2_llm.tokenizer.encode(t) for t in SMOLLM2_TEXTS]
    sp = _greedy(24)
    plain = engine(None).generate(prompts, [sp] * len(prompts))
    spec_engine = engine({"method": "ngram", "num_speculative_tokens": 4})
    spec = spec_engine.generate(prompts, [sp] * len(prompts))
    s = spec_engine.stats()
    print(
        f"\nSmolLM2 n-gram k=4: {s['spec_num_accepted_tokens']} of {s['spec_num_draft_tokens']} "
        f"drafts accepted, {s['num_steps']} steps for {len(prompts)} x {sp.max_tokens} tokens"
    )
    for a, b in zip(plain, spec, strict=True):
        if a.token_ids != b.token_ids:
            i = next(
                i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y
            )
            gap = max(a.top2_logit_gaps[i], b.top2_logit_gaps[i])
            assert gap < 1e-4, f"outputs differ at token {i} where the top-2 gap is {gap:.3g}"
    assert s["spec_num_accepted_tokens"] > 0
    assert spec_engine.block_manager.num_free_blocks == spec_engine.block_manager.num_blocks


# ---------------------------------------------------------------------- draft-model proposer


def test_draft_model_greedy_outputs_identical(tiny, tiny_reference):
    """The target as its own draft accepts every draft; a draft with other weights is mostly
    rejected; greedy outputs are the target's either way, and the draft's pool is returned."""
    from research.models.transformer import init_params

    cfg, params = tiny
    spec = {"model": "tiny-llama", "num_speculative_tokens": 3}
    stranger = init_params(cfg, jax.random.key(7))
    for draft, rate, n in (((cfg, params), 1.0, 40), ((cfg, stranger), None, 16)):
        engine = _tiny_engine(tiny, spec, draft_model=draft)
        outputs = engine.generate(TINY_PROMPTS, [_greedy(n)] * len(TINY_PROMPTS))
        assert [o.token_ids for o in outputs] == [o.token_ids[:n] for o in tiny_reference]
        s = engine.stats()
        print(
            f"\ndraft model k=3: {s['spec_num_accepted_tokens']} of "
            f"{s['spec_num_draft_tokens']} accepted, {s['num_steps']} steps"
        )
        if rate is not None:
            assert s["spec_acceptance_rate"] == rate
        else:
            assert s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"]
        draft_pool = engine.proposer.block_manager
        assert not engine.proposer.shadows
        assert draft_pool.num_free_blocks == draft_pool.num_blocks
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_draft_model_vocabulary_must_match(tiny):
    from research.models.presets import get_preset

    small = get_preset("smollm2-135m")
    with pytest.raises(ValueError, match="vocabulary"):
        _tiny_engine(
            tiny, {"model": "smollm2-135m", "num_speculative_tokens": 2}, draft_model=(small, {})
        )


def test_metrics_endpoint_reports_speculative_counters(tiny):
    from types import SimpleNamespace

    from research.serve.metrics import prometheus_text

    engine = _tiny_engine(tiny, NGRAM)
    engine.spec_stats.num_drafts, engine.spec_stats.num_draft_tokens = 4, 12
    engine.spec_stats.num_accepted_tokens = 5
    counters = SimpleNamespace(
        requests=0, rejected=0, prompt_tokens=0, generation_tokens=0, finished={}
    )
    loop = SimpleNamespace(stats=engine.stats(), counters=counters, num_unscheduled=0)
    text = prometheus_text(loop, "tiny")
    assert 'research:spec_decode_num_draft_tokens_total{model_name="tiny"} 12' in text
    assert 'research:spec_decode_num_accepted_tokens_total{model_name="tiny"} 5' in text
    assert engine.stats()["spec_acceptance_rate"] == pytest.approx(5 / 12)


# ---------------------------------------------------------------------- the simulator


def test_simulated_speculation_prices_verification_and_acceptance():
    """GB10, Qwen3-Coder-30B-A3B AWQ, one user: n-gram drafts at 80% acceptance cut the time
    per token; at 0% they cost (k + 1 tokens verified to emit one); the engine's measured
    acceptance is the parameter's; the cost model's closed form agrees."""
    from research import LLM, SamplingParams

    def run(spec, rate):
        llm = LLM(
            "qwen3-coder-30b-a3b",
            executor="simulated",
            hardware="gb10",
            quantization="awq",
            max_model_len=2048,
            speculative_config=spec,
            speculative_acceptance_rate=rate,
        )
        sp = SamplingParams(max_tokens=600, ignore_eos=True)
        (out,) = llm.generate([list(range(10, 522))], sp)
        assert len(out.token_ids) == 600
        m = out.metrics
        return (m.finished_time - m.first_token_time) / 599, llm.engine.stats(), llm

    k4 = {"method": "ngram", "num_speculative_tokens": 4}
    plain, _, llm = run(None, None)
    fast, stats, _ = run(k4, 0.8)
    slow, _, _ = run(k4, 0.0)
    print(
        f"\nGB10 TPOT: plain {plain * 1e3:.2f} ms, k=4 at 80% {fast * 1e3:.2f} ms, at 0% "
        f"{slow * 1e3:.2f} ms"
    )
    assert fast < 0.75 * plain  # 3.4 tokens per step; a 5-token step routes to more experts
    assert slow > plain
    # Expected accepted drafts per step: 0.8 + 0.8^2 + 0.8^3 + 0.8^4 = 2.36.
    assert stats["spec_mean_acceptance_length"] == pytest.approx(1 + 2.36, abs=0.3)
    cm = llm.engine.executor.cost_model
    predicted = cm.speculative_decode_time_per_token(4, 0.8, context=812)
    assert predicted == pytest.approx(fast, rel=0.15)
    with pytest.raises(ValueError, match="speculative_acceptance_rate"):
        LLM("tiny-llama", speculative_config=k4, speculative_acceptance_rate=0.5)


def test_speculative_experiment_composes_and_runs_one_simulated_point(tmp_path):
    """The Hydra group (``speculative=none|ngram``) and configs/experiment/speculative.yaml:
    one small point with speculation writes its acceptance into results.jsonl."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from experiments.sweep import run_experiment
    from research.bench import read_results
    from research.config import register_configs, run_config_from

    configs = str(Path(__file__).resolve().parents[1] / "configs")
    register_configs()
    with initialize_config_dir(config_dir=configs, version_base=None):
        plain = run_config_from(compose(config_name="config", overrides=["experiment=speculative"]))
        run = run_config_from(
            compose(
                config_name="config",
                overrides=[
                    "experiment=speculative",
                    "speculative=ngram",
                    "speculative.acceptance_rate=0.9",
                    "experiment.concurrencies=[2]",
                    "experiment.prompts_per_concurrency=1",
                    "workload.output_len=32",
                    "tracking=disabled",
                ],
            )
        )
    assert plain.speculative.method is None and plain.hardware.name == "gb10"
    assert run.speculative.speculative_config()["num_speculative_tokens"] == 4
    run_experiment(run, str(tmp_path))
    (point,) = read_results(tmp_path / "results.jsonl")
    assert point["speculative_method"] == "ngram"
    assert point["spec_mean_acceptance_length"] > 2
    assert "ngram-k4-a0.9" in point["label"]
    with pytest.raises(ValueError, match="acceptance_rate"):
        from research.config import SpeculationConfig

        SpeculationConfig(method="ngram", acceptance_rate=1.5)


def test_serve_cli_takes_vllms_speculative_config_json(capsys):
    from research.serve.__main__ import main

    bad = '{"method": "eagle", "num_speculative_tokens": 2}'
    with pytest.raises(SystemExit):
        main(["tiny-llama", "--speculative-config", bad])
    assert "method must be one of" in capsys.readouterr().err


# ---------------------------------------------------------------------- exactness through the engine

STAT_VOCAB = 16
STAT_SETTINGS = {"temperature": 0.9, "top_k": 5, "top_p": 0.85}
# Every token appears in the prompt, so n-gram lookup always finds a match to draft from.
STAT_PROMPT = [9, 4, 13, 0, 6, 11, 2, 15, 7, 1, 12, 5, 10, 3, 14, 8]
STAT_TOKENS = 4  # the first comes from the prefill; the next three pass through verification


def _stat_models(noise: float):
    """tiny-llama with a 16-token vocabulary, its head scaled so the next-token distributions
    are far from uniform (random init gives logits of std ~0.2), and a draft model: the same
    weights plus ``noise`` times those of another seed, so its drafts are often rejected but
    not always."""
    import dataclasses

    from research.models.presets import get_preset
    from research.models.transformer import init_params

    cfg = dataclasses.replace(get_preset("tiny-llama"), vocab_size=STAT_VOCAB)

    def peaked(params):
        return {**params, "lm_head": params["lm_head"] * 10.0}

    target = init_params(cfg, jax.random.key(0))
    other = init_params(cfg, jax.random.key(7))
    draft = jax.tree_util.tree_map(lambda a, b: a + noise * b, target, other)
    return (cfg, peaked(target)), (cfg, peaked(draft))


def _exact_joint(
    model, settings, length: int, margin: float | None = 1e-4
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` generated tokens) after STAT_PROMPT, from the model's own logits: a
    plain forward pass over every prefix in the support, each next-token distribution
    processed by ``_reference_probs``. Refuses a setup where a cumulative mass sits within
    ``margin`` of top_p (float32 and float64 could then keep different nuclei); None skips
    that check (for the deliberately wrong distributions)."""
    from research.models.transformer import ContiguousKVCache, compute_logits, forward

    cfg, params = model
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        seqs = np.array([STAT_PROMPT + list(p) for p in prefixes], np.int32)
        b, t = seqs.shape
        hidden, _ = forward(
            params,
            cfg,
            jnp.asarray(seqs),
            jnp.broadcast_to(jnp.arange(t), (b, t)),
            ContiguousKVCache.create(cfg, b, t),
        )
        logits = np.asarray(compute_logits(params, cfg, hidden[:, -1]))
        nxt = {}
        for prefix, row in zip(prefixes, logits, strict=True):
            probs = _reference_probs(row, **settings)
            if margin is not None:
                z = np.sort(np.exp((row - row.max()) / settings["temperature"]))[::-1]
                top = z[: settings["top_k"]] / z[: settings["top_k"]].sum()
                assert np.abs(np.cumsum(top) - settings["top_p"]).min() > margin
            for token in np.flatnonzero(probs):
                nxt[(*prefix, int(token))] = joint[prefix] * probs[token]
        joint = nxt
    return joint


def _g_test_pvalue(samples: list[tuple[int, ...]], joint: dict) -> float:
    """G-test of sampled sequences against ``joint``: cells expecting fewer than 5 samples are
    pooled into one bin; a sequence outside the support gives p = 0."""
    from collections import Counter

    counts = Counter(samples)
    if set(counts) - set(joint):
        return 0.0
    n = len(samples)
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = np.array([joint[c] * n for c in cells])
    observed = np.array([counts[c] for c in cells], float)
    big = expected >= 5
    expected = np.append(expected[big], expected[~big].sum())
    observed = np.append(observed[big], observed[~big].sum())
    keep = expected > 0
    return stats.power_divergence(
        observed[keep],
        expected[keep] * observed.sum() / expected[keep].sum(),
        lambda_="log-likelihood",
    ).pvalue


@pytest.fixture(scope="module")
def stat_models():
    return _stat_models(noise=1.0)


@pytest.mark.parametrize("method", [pytest.param("draft_model", marks=pytest.mark.slow), "ngram"])
def test_engine_speculation_samples_the_target_distribution(stat_models, method):
    """Through the real engine: 8,000 requests with their own seeds, one prompt, the target
    sampling at temperature 0.9, top-k 5, top-p 0.85, drafts from a draft model (the target's
    weights plus another seed's: 13% of its drafts are accepted) or from n-gram lookup (6%).
    The joint distribution of the
    first four tokens (the first from the prefill, the other three through verification:
    accepted drafts, residual draws after a rejection, bonus tokens) is the exact one computed
    from the target's logits (G-test, alpha = 1e-3). The same samples reject the target at
    temperature 1.0 and the draft model's distribution: the test has the power to see a
    wrong sampler (and a rejection sampler that accepts every draft inside the target's
    support fails it with p = 0). The draft-model run takes about a minute on two cores,
    most of it compiling the draft's catch-up shapes."""
    from research import SamplingParams
    from research.config import CacheConfig, SchedulerConfig
    from research.engine.engine import Engine

    target, draft = stat_models
    spec = (
        {"model": "tiny-llama", "num_speculative_tokens": 3}
        if method == "draft_model"
        else {"method": "ngram", "num_speculative_tokens": 3}
    )
    engine = Engine(
        *target,
        cache_config=CacheConfig(block_size=8, num_kv_blocks=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=2048),
        max_model_len=64,
        speculative_config=spec,
        draft_model=draft if method == "draft_model" else None,
    )
    exact = _exact_joint(target, STAT_SETTINGS, STAT_TOKENS)
    n = 8000
    sps = [
        SamplingParams(max_tokens=STAT_TOKENS, seed=1000 + i, ignore_eos=True, **STAT_SETTINGS)
        for i in range(n)
    ]
    outputs = engine.generate([STAT_PROMPT] * n, sps)
    samples = [tuple(o.token_ids) for o in outputs]
    assert all(len(s) == STAT_TOKENS for s in samples)
    s = engine.stats()
    print(
        f"\n{method}: {s['spec_num_accepted_tokens']} of {s['spec_num_draft_tokens']} drafts "
        f"accepted, {s['num_steps']} steps"
    )
    # Drafts were verified, and both outcomes (accepted, rejected) are frequent.
    accepted = s["spec_num_accepted_tokens"]
    assert accepted > n // 20 and s["spec_num_draft_tokens"] - accepted > n // 20
    assert set(samples) <= set(exact), "a sequence outside the target's support was emitted"
    pvalues = {
        "target": _g_test_pvalue(samples, exact),
        "target at 1.0": _g_test_pvalue(
            samples, _exact_joint(target, {**STAT_SETTINGS, "temperature": 1.0}, STAT_TOKENS, None)
        ),
        "draft model": _g_test_pvalue(
            samples, _exact_joint(draft, STAT_SETTINGS, STAT_TOKENS, None)
        ),
    }
    print("G-test p-values: " + ", ".join(f"{k} {v:.3g}" for k, v in pvalues.items()))
    assert pvalues.pop("target") > ALPHA
    assert all(p < ALPHA for p in pvalues.values())
