"""Bad input to LLM / SamplingParams raises a ValueError with a reason; the LLM keeps working."""

from __future__ import annotations

import math

import numpy as np
import pytest

from research import LLM, SamplingParams

MAX_MODEL_LEN = 64
VOCAB = 256  # tiny-llama
GOOD_PROMPT = [1, 2, 3]
GOOD_PARAMS = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference_tokens(llm):
    """Greedy tokens for GOOD_PROMPT before any bad call was made."""
    out = llm.generate([GOOD_PROMPT], GOOD_PARAMS)
    assert len(out) == 1 and len(out[0].token_ids) == 4
    return out[0].token_ids


def _assert_still_works(llm, reference_tokens):
    out = llm.generate([GOOD_PROMPT], GOOD_PARAMS)
    assert len(out) == 1
    assert len(out[0].token_ids) == 4
    assert out[0].token_ids == reference_tokens
    assert out[0].finish_reason == "length"


# ----------------------------------------------------------------------------- model loading


def test_unknown_preset_lists_known_presets():
    with pytest.raises(ValueError, match="unknown model preset") as excinfo:
        LLM("no-such-model")
    message = str(excinfo.value)
    assert "'no-such-model'" in message
    for known in ("tiny-llama", "tiny-qwen3-moe", "smollm2-135m", "llama-3.3-70b"):
        assert known in message


def test_full_size_preset_is_shapes_only():
    with pytest.raises(ValueError, match="shapes only"):
        LLM("llama-3.3-70b")


def test_bad_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny-llama", dtype="float16")


@pytest.mark.parametrize("max_model_len", [1, 513, 100_000])
def test_max_model_len_outside_the_context_is_rejected(max_model_len):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM("tiny-llama", max_model_len=max_model_len)


def test_existing_path_that_is_no_model_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"neither a \.gguf file"):
        LLM(str(tmp_path))


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ["ok", ""]}, "stop strings"),
    ],
)
def test_bad_sampling_params_raise_at_construction(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        SamplingParams(**kwargs)


def test_sampling_params_edge_values_are_accepted():
    sp = SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=1, stop="x")
    assert sp.greedy
    assert sp.stop == ("x",)
    assert SamplingParams(top_p=1e-6, top_k=1, stop_token_ids=[np.int64(5)]).stop_token_ids == (5,)


# ----------------------------------------------------------------------------- prompts


def _long_prompt(n: int) -> list[int]:
    return [(i % (VOCAB - 3)) + 3 for i in range(n)]


BAD_GENERATE_CALLS = {
    "empty_prompt": ([[]], GOOD_PARAMS, "empty"),
    "empty_prompt_dict": ({"prompt_token_ids": []}, GOOD_PARAMS, "empty"),
    "no_prompts": ([], GOOD_PARAMS, "no prompts"),
    "prompt_longer_than_max_model_len": (
        [_long_prompt(100)],
        GOOD_PARAMS,
        "max_model_len",
    ),
    "prompt_exactly_max_model_len": (
        [_long_prompt(MAX_MODEL_LEN)],
        GOOD_PARAMS,
        "max_model_len",
    ),
    "prompt_plus_max_tokens_too_long": (
        [_long_prompt(60)],
        SamplingParams(max_tokens=8, temperature=0),
        "exceeds max_model_len",
    ),
    "negative_token_id": ([[1, -1, 3]], GOOD_PARAMS, "outside the vocabulary"),
    "token_id_equal_to_vocab_size": ([[1, VOCAB, 3]], GOOD_PARAMS, "outside the vocabulary"),
    "huge_token_id": ([[10**12]], GOOD_PARAMS, "outside the vocabulary"),
    "float_token_id": ([[1, 2.5, 3]], GOOD_PARAMS, "outside the vocabulary"),
    "string_prompt_without_tokenizer": (["hello"], GOOD_PARAMS, "no tokenizer"),
    "bare_string_prompt_without_tokenizer": ("hello", GOOD_PARAMS, "no tokenizer"),
    "string_in_dict_without_tokenizer": ({"prompt": "hello"}, GOOD_PARAMS, "no tokenizer"),
    "dict_without_prompt_keys": ({"text": "hello"}, GOOD_PARAMS, "prompt_token_ids"),
    "prompt_of_wrong_type": ([3.5], GOOD_PARAMS, "a prompt is"),
    "too_few_sampling_params": (
        [[1, 2], [3, 4]],
        [GOOD_PARAMS],
        "1 SamplingParams for 2 prompts",
    ),
}


@pytest.mark.parametrize(
    ("prompts", "sampling_params", "reason"),
    list(BAD_GENERATE_CALLS.values()),
    ids=list(BAD_GENERATE_CALLS),
)
def test_bad_generate_call_raises_and_llm_keeps_working(
    llm, reference_tokens, prompts, sampling_params, reason
):
    with pytest.raises(ValueError, match=reason):
        llm.generate(prompts, sampling_params)
    _assert_still_works(llm, reference_tokens)


def test_chat_without_tokenizer_raises(llm, reference_tokens):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    _assert_still_works(llm, reference_tokens)


def test_one_bad_prompt_in_a_batch_fails_the_whole_batch_up_front(llm, reference_tokens):
    steps_before = llm.engine.num_steps
    prompts = [[1, 2, 3], [4, 5, 6], [7, VOCAB + 10], [8, 9]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompts, GOOD_PARAMS)
    # Validation happens before any request runs: nothing was queued or stepped.
    assert llm.engine.num_steps == steps_before
    assert not llm.engine.has_unfinished_requests()
    # The same holds when the bad one is the last prompt and the reason is its length.
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1, 2, 3], _long_prompt(MAX_MODEL_LEN + 1)], GOOD_PARAMS)
    assert llm.engine.num_steps == steps_before
    assert not llm.engine.has_unfinished_requests()
    _assert_still_works(llm, reference_tokens)


def test_longest_valid_prompt_is_accepted(llm, reference_tokens):
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([_long_prompt(MAX_MODEL_LEN - 4)], sp)
    assert len(out[0].token_ids) == 4
    assert all(0 <= t < VOCAB for t in out[0].token_ids)
    _assert_still_works(llm, reference_tokens)


def test_boundary_token_ids_are_accepted(llm):
    out = llm.generate([[0, VOCAB - 1]], GOOD_PARAMS)
    assert out[0].prompt_token_ids == [0, VOCAB - 1]
    assert 1 <= len(out[0].token_ids) <= 4


def test_prompt_forms_give_identical_greedy_outputs(llm, reference_tokens):
    forms = [
        [[1, 2, 3]],
        [1, 2, 3],
        (1, 2, 3),
        np.array([1, 2, 3]),
        {"prompt_token_ids": [1, 2, 3]},
        [{"prompt_token_ids": [1, 2, 3]}],
        [np.array([1, 2, 3], np.int32)],
    ]
    for form in forms:
        out = llm.generate(form, GOOD_PARAMS)
        assert len(out) == 1, f"{form!r} gave {len(out)} outputs"
        assert out[0].prompt_token_ids == [1, 2, 3]
        assert out[0].token_ids == reference_tokens, f"{form!r} gave {out[0].token_ids}"


def test_batch_of_token_id_lists_matches_single_calls(llm, reference_tokens):
    outs = llm.generate([[1, 2, 3], [1, 2, 3]], GOOD_PARAMS)
    assert [o.token_ids for o in outs] == [reference_tokens, reference_tokens]
    assert outs[0].request_id != outs[1].request_id


# ----------------------------------------------------------------------------- total validation


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": [1]}, "stop strings must be strings"),
        ({"stop": [["x"]]}, "stop strings must be strings"),
        ({"stop": 5}, "stop must be"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 1e39}, "temperature"),
        ({"top_p": 10**400}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": False}, "top_p"),
        ({"stop_token_ids": [math.inf]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["7"]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"logprobs": -1}, "whole vocabulary"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
    ],
)
def test_sampling_params_check_every_type_and_device_bound(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        SamplingParams(**kwargs)


def test_sampling_params_store_plain_python_values():
    sp = SamplingParams(
        max_tokens=np.int64(3), top_k=np.int32(5), temperature=1, seed=np.uint64(7), stop=["a"]
    )
    assert (type(sp.max_tokens), type(sp.top_k), type(sp.temperature)) == (int, int, float)
    assert sp.seed == 7 and type(sp.seed) is int and sp.stop == ("a",)
    assert SamplingParams(top_k=2**31 - 1, seed=-1).top_k == 2**31 - 1


def _tampered(**fields) -> SamplingParams:
    """Params changed after construction (as a subclass or ``object.__setattr__`` could)."""
    sp = SamplingParams(max_tokens=4, temperature=0)
    for name, value in fields.items():
        object.__setattr__(sp, name, value)
    return sp


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"top_k": 2**31}, "top_k"),  # used to fail inside the step with an int32 overflow
        ({"seed": "x"}, "seed"),  # used to fail while adding, after earlier prompts were queued
        ({"stop": (1,)}, "stop strings"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_a_batch_with_one_bad_request_raises_and_leaves_the_engine_as_it_was(
    llm, reference_tokens, fields, reason
):
    steps_before = llm.engine.num_steps
    free_before = llm.engine.block_manager.num_free_blocks
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match=reason):
        llm.generate(prompts, [GOOD_PARAMS, _tampered(**fields), GOOD_PARAMS])
    assert llm.engine.num_steps == steps_before
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.engine.block_manager.num_free_blocks == free_before
    _assert_still_works(llm, reference_tokens)
    _assert_still_works(llm, reference_tokens)  # and the next call too


def test_sampling_params_of_the_wrong_type_are_refused(llm, reference_tokens):
    with pytest.raises(ValueError, match="not SamplingParams"):
        llm.generate([[1, 2], [3, 4]], [GOOD_PARAMS, {"max_tokens": 4}])
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([[1, 2]], "greedy")
    assert not llm.engine.has_unfinished_requests()
    _assert_still_works(llm, reference_tokens)


def test_an_interrupted_generate_aborts_what_it_added(llm, reference_tokens, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5, 6]], GOOD_PARAMS)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.engine.block_manager.num_used_blocks == 0
    _assert_still_works(llm, reference_tokens)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"kv_cache_memory_bytes": 100}, "holds no KV block"),
        ({"block_size": 2.5}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 1.5}, "max_num_seqs"),
        ({"max_num_batched_tokens": "2048"}, "max_num_batched_tokens"),
        ({"num_kv_blocks": 0.5}, "num_kv_blocks"),
        ({"max_model_len": 64.0}, "max_model_len"),
        ({"seed": "0"}, "seed"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_bad_engine_arguments_are_refused_before_anything_is_built(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        LLM("tiny-llama", **{"max_model_len": MAX_MODEL_LEN, **kwargs})
