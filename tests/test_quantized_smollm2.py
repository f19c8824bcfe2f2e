"""SmolLM2-135M through the engine with quantized weights, a quantized KV cache and the Pallas
kernels (interpreted on CPU): it still answers, and the kernel path agrees with XLA."""

from __future__ import annotations

import pytest

from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine
from research.engine.request import SamplingParams
from research.quant import quantize_params

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _engine(llm, params=None, **kw) -> Engine:
    return Engine(
        llm.model_config,
        llm.params if params is None else params,
        llm.tokenizer,
        cache_config=CacheConfig(num_kv_blocks=16),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128),
        max_model_len=128,
        **kw,
    )


def _answer(engine: Engine, tokenizer) -> tuple[str, list[int]]:
    ids = tokenizer.apply_chat_template(QUESTION)
    out = engine.generate([ids], [GREEDY])[0]
    return out.text, out.token_ids


@pytest.mark.parametrize("fmt", ["awq", "nvfp4", "mxfp4", "fp8"])
def test_quantized_weights_still_answer_paris(smollm2_llm, fmt):
    params = quantize_params(smollm2_llm.params, fmt)
    text, _ = _answer(_engine(smollm2_llm, params), smollm2_llm.tokenizer)
    assert "Paris" in text, f"{fmt}: {text!r}"


@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_quantized_kv_cache_still_answers_paris(smollm2_llm, kv):
    text, _ = _answer(_engine(smollm2_llm, kv_cache_dtype=kv), smollm2_llm.tokenizer)
    assert "Paris" in text, f"kv {kv}: {text!r}"


def test_pallas_interpret_backend_matches_xla_greedy(smollm2_llm):
    """The paged-attention kernel (interpreted) reads the cached context and is merged with the
    new tokens by log-sum-exp; greedy tokens must equal the XLA gather path's."""
    tok = smollm2_llm.tokenizer
    _, xla = _answer(_engine(smollm2_llm, attention_backend="xla"), tok)
    _, pallas = _answer(_engine(smollm2_llm, attention_backend="pallas_interpret"), tok)
    assert pallas == xla


def test_pallas_interpret_with_int4_kv_matches_xla(smollm2_llm):
    """int4 KV codes dequantized inside the attention kernel vs outside it by XLA."""
    tok = smollm2_llm.tokenizer
    _, xla = _answer(_engine(smollm2_llm, kv_cache_dtype="int4"), tok)
    pallas_engine = _engine(
        smollm2_llm, kv_cache_dtype="int4", attention_backend="pallas_interpret"
    )
    _, pallas = _answer(pallas_engine, tok)
    assert pallas == xla


@pytest.mark.parametrize(
    "model, fmt",
    [
        ("tiny-llama", "awq"),
        ("tiny-llama", "mxfp4"),
        ("tiny-qwen3-moe", "nvfp4"),
        ("tiny-qwen3-moe", "fp8"),
    ],
)
def test_quantized_weights_through_the_kernels_match_xla(model, fmt):
    """Every linear (dense: quantized_matmul) and expert (MoE: grouped_experts) weight read by
    the Pallas kernels in interpret mode, against XLA dequantizing the same codes: identical
    greedy tokens on a random-weight model (fp8 KV as well, through the attention kernel)."""
    import numpy as np

    from research.llm import LLM

    prompts = [np.random.default_rng(n).integers(0, 256, size=n).tolist() for n in (3, 21)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("xla", "pallas_interpret"):
        llm = LLM(
            model,
            quantization=fmt,
            kv_cache_dtype="fp8",
            attention_backend=backend,
            max_model_len=64,
            max_num_seqs=2,
            num_kv_blocks=16,
        )
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs["pallas_interpret"] == outs["xla"]
