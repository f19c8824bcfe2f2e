"""Golden parity with HF transformers on the real SmolLM2-135M weights (float32, same GGUF)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from research import SamplingParams
from research.models.transformer import ContiguousKVCache, compute_logits, forward
from tests.hf_oracle import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
]


def test_logits_match_hf_on_32_token_prompt(smollm2_llm, smollm2_hf):
    hf_model, _ = smollm2_hf
    cfg, params = smollm2_llm.model_config, smollm2_llm.params
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(1, 32))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()

    cache = ContiguousKVCache.create(cfg, 1, 32)
    hidden, _ = jax.jit(lambda p, t, pos, c: forward(p, cfg, t, pos, c))(
        params, jnp.asarray(ids), jnp.arange(32)[None], cache
    )
    ours = np.asarray(compute_logits(params, cfg, hidden))
    diff = np.abs(ours - ref).max()
    assert ours.shape == ref.shape == (1, 32, cfg.vocab_size)
    assert diff < 1e-3, f"max abs logit diff {diff}"


def test_greedy_generation_matches_hf_token_for_token(smollm2_llm, smollm2_hf):
    hf_model, hf_tok = smollm2_hf
    outs = smollm2_llm.generate(
        PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf_greedy(hf_model, ids, 32)
        assert out.token_ids == ref, prompt
        assert len(out.token_ids) == 32
        assert out.finish_reason == "length"


def test_chat_answers_paris(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=16, temperature=0.0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the answer before 16 tokens


def test_chat_template_matches_hf(smollm2_llm, smollm2_hf):
    _, hf_tok = smollm2_hf
    messages = [{"role": "user", "content": "Hello there"}]
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref_ids = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    ours = smollm2_llm.tokenizer.apply_chat_template(messages)
    assert ours == list(ref_ids)


def test_generate_accepts_strings_and_token_ids(smollm2_llm):
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    by_text = smollm2_llm.generate(["The capital of France is"], sp)[0]
    by_ids = smollm2_llm.generate([by_text.prompt_token_ids], sp)[0]
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.text == by_text.text
    assert len(smollm2_llm.generate([[1, 2, 3]], sp)[0].token_ids) >= 1


def test_stop_strings_and_stop_token_ids(smollm2_llm):
    base = smollm2_llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0)
    )[0]
    stop_tok = base.token_ids[3]
    out = smollm2_llm.generate(
        ["The capital of France is"],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok]),
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]

    word = base.text.split()[1]
    out = smollm2_llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0, stop=[word])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert word not in out.text and base.text.startswith(out.text)


def test_seeded_sampling_is_reproducible(smollm2_llm):
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a = smollm2_llm.generate(["Tell me a story"], sp)[0]
    b = smollm2_llm.generate(["Tell me a story"], sp)[0]
    c = smollm2_llm.generate(
        ["Tell me a story"],
        SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True),
    )[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_eos_is_kept_in_token_ids_as_vllm(smollm2_llm):
    """EOS ends the answer, stays in token_ids (stop_reason None) and is not in the text; when
    max_tokens falls on the EOS, the finish reason is "length" (vLLM checks the cap first)."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = smollm2_llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))[0]
    eos = smollm2_llm.tokenizer.eos_token_id
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    assert out.text == smollm2_llm.tokenizer.decode(out.token_ids[:-1])
    assert smollm2_llm.tokenizer.hf.decode([eos]) not in out.text
    capped = smollm2_llm.chat(
        messages, SamplingParams(max_tokens=len(out.token_ids), temperature=0.0)
    )[0]
    assert capped.token_ids == out.token_ids
    assert capped.finish_reason == "length" and capped.stop_reason is None


def test_logprobs_match_hf_log_softmax(smollm2_llm, smollm2_hf):
    """A vLLM user's snippet: ``logprobs=5`` gives, per generated token, the five most likely
    tokens ranked 1..5 plus the sampled one, equal to HF's log-softmax; ``prompt_logprobs``
    the same for every prompt token after the first."""
    hf_model, _ = smollm2_hf
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=5, prompt_logprobs=2)
    out = smollm2_llm.generate([PROMPTS[3]], sp)[0]
    completion = out.outputs[0]
    assert isinstance(completion.text, str) and len(completion.logprobs) == 6
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    n_prompt = len(out.prompt_token_ids)
    total = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        top5 = [t for t, lp in entry.items() if lp.rank <= 5]
        assert sorted(entry[t].rank for t in top5) == [1, 2, 3, 4, 5]
        assert set(top5) == set(np.argsort(-row)[:5].tolist())
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t]) < 2e-3, (i, t, lp.logprob, row[t])
            assert lp.decoded_token == smollm2_llm.tokenizer.decode([t], False)
        assert token in entry and entry[token].rank == int((row >= row[token]).sum())
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for p in range(1, n_prompt):
        entry, row = out.prompt_logprobs[p], ref[p - 1]
        assert ids[p] in entry and len(entry) in (2, 3)
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t]) < 2e-3


def test_logprobs_do_not_change_tokens(smollm2_llm):
    """Asking for log-probabilities changes nothing else: same tokens, greedy and seeded."""
    for sp in (
        SamplingParams(max_tokens=8, temperature=0.0),
        SamplingParams(max_tokens=8, temperature=1.0, seed=5),
    ):
        plain = smollm2_llm.generate(PROMPTS[:2], sp)
        with_lp = smollm2_llm.generate(
            PROMPTS[:2], dataclasses.replace(sp, logprobs=0, prompt_logprobs=0)
        )
        for a, b in zip(plain, with_lp, strict=True):
            assert a.token_ids == b.token_ids
            assert a.outputs[0].logprobs is None and len(b.outputs[0].logprobs) == len(b.token_ids)
            assert all(len(d) == 1 for d in b.outputs[0].logprobs)  # logprobs=0: the sample only
