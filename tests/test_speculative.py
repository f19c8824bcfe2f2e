"""Speculative decoding: the n-gram proposer, the rejection sampler's output distribution, and
the engine verifying drafts in its step (greedy outputs unchanged, rollback of rejected slots,
preemption under a small pool, metrics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from research.config import SpeculativeConfig
from research.engine.proposer import NgramProposer
from research.engine.rejection_sampler import rejection_sample
from research.engine.sampler import SamplingTensors

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
        ({"model": "tiny-llama", "num_speculative_tokens": 2}, "draft model"),
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
