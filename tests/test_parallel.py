"""Tensor and expert parallelism on JAX's sharding, on forced host devices (conftest asks XLA for
four CPU devices): the same greedy tokens as one device, every parameter and KV page split as the
rules say, and configurations that do not divide refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from research import LLM, SamplingParams
from research.parallel import ShardingPlan, check_divisible
from research.parallel.sharding import KV_PAGE_AXES, rules
from research.quant.qtensor import QTensor

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60)), [3] * 17]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SMALL = dict(max_model_len=128, num_kv_blocks=64, block_size=8, max_num_seqs=8)

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=4"
)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    return {
        model: [o.token_ids for o in LLM(model, **SMALL).generate(PROMPTS, GREEDY)]
        for model in ("tiny-llama", "tiny-qwen3-moe")
    }


def _ways(plan: ShardingPlan, part) -> int:
    parts = (part,) if isinstance(part, str) else part or ()
    return int(np.prod([plan.mesh.shape[a] for a in parts]))


def _assert_split_as_the_rules_say(llm: LLM) -> None:
    """Every parameter leaf and KV page has the sharding its logical axes map to, and each
    device holds exactly its share (nothing silently replicated)."""
    plan = llm.plan
    executor = llm.engine.executor
    flat = jax.tree_util.tree_flatten_with_path(
        executor.params, is_leaf=lambda x: isinstance(x, QTensor)
    )[0]
    split = 0
    for path, leaf in flat:
        key = str(path[-1].key)
        arrays = jax.tree_util.tree_leaves(leaf)
        axes = plan.param_axes(key, len(leaf.shape))
        for a in arrays:
            spec = a.sharding.spec
            if not isinstance(leaf, QTensor):
                assert spec == plan.spec(axes), (key, spec)
            shard = a.addressable_shards[0].data.shape
            want = tuple(d // _ways(plan, p) for d, p in zip(a.shape, spec, strict=False))
            assert shard == want[: len(shard)], (key, a.shape, shard, spec)
            split += any(p is not None for p in spec)
    assert split >= 7 * llm.model_config.num_layers  # every layer's projections are split
    pool = executor.pool
    tp_kv = plan.mesh.shape["tp_kv"]
    for pages in [*pool.k, *pool.v]:
        assert pages.sharding.spec == plan.spec(KV_PAGE_AXES)
        per_device = [s.data.nbytes for s in pages.addressable_shards]
        assert set(per_device) == {pages.nbytes // tp_kv}  # 1/tp_kv of the KV bytes each


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_llama_tensor_parallel_matches_one_device(tp, reference):
    """The native CPU kernel per device on its own heads (what ``auto`` picks on a CPU)."""
    llm = LLM("tiny-llama", tensor_parallel_size=tp, **SMALL)
    assert llm.engine.executor.backend == "native"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["tiny-llama"]
    _assert_split_as_the_rules_say(llm)
    # 2 kv heads: split at TP=2; at TP=4 each kv head lives on two devices (as vLLM)
    assert llm.plan.mesh.shape == {"tp_kv": 2, "tp_q": tp // 2}


@pytest.mark.parametrize("ep", [2, 4])
def test_tiny_moe_expert_parallel_matches_one_device(ep, reference):
    llm = LLM("tiny-qwen3-moe", tensor_parallel_size=ep, enable_expert_parallel=True, **SMALL)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["tiny-qwen3-moe"]
    _assert_split_as_the_rules_say(llm)
    w_gate = llm.engine.executor.params["layers"][0]["w_gate"]
    assert w_gate.addressable_shards[0].data.shape[0] == 8 // ep  # experts, not their width


def test_moe_tensor_parallel_splits_expert_width(reference):
    llm = LLM("tiny-qwen3-moe", tensor_parallel_size=2, **SMALL)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["tiny-qwen3-moe"]
    w_gate = llm.engine.executor.params["layers"][0]["w_gate"]
    assert w_gate.addressable_shards[0].data.shape == (8, 64, 16)


def test_xla_attention_under_tensor_parallel(reference):
    llm = LLM("tiny-llama", tensor_parallel_size=2, attention_backend="xla", **SMALL)
    assert llm.engine.executor.backend == "xla"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["tiny-llama"]


def test_pallas_paged_attention_under_tensor_parallel(reference):
    llm = LLM("tiny-llama", tensor_parallel_size=2, attention_backend="pallas_interpret", **SMALL)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference["tiny-llama"]


def test_fp8_weights_split_with_their_scales(reference):
    one = LLM("tiny-llama", quantization="fp8", **SMALL)
    two = LLM("tiny-llama", quantization="fp8", tensor_parallel_size=2, **SMALL)
    want = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want
    wq = two.engine.executor.params["layers"][0]["wq"]
    assert wq.codes.addressable_shards[0].data.shape == (64, 32)
    assert wq.scales.addressable_shards[0].data.shape == (32,)  # per-column scales follow


def test_smollm2_tensor_parallel_3_matches_one_device(smollm2_llm):
    """9 query heads and 3 kv heads over 3 devices: the same greedy tokens as one device."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in smollm2_llm.generate(prompts, sp)]
    llm = LLM("smollm2-135m", dtype="float32", tensor_parallel_size=3, max_model_len=256)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    _assert_split_as_the_rules_say(llm)


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        ("tiny-llama", dict(tensor_parallel_size=3), r"does not divide num_heads.*\[1, 2, 4\]"),
        ("tiny-llama", dict(tensor_parallel_size=8), r"does not divide num_heads"),
        ("tiny-llama", dict(enable_expert_parallel=True), "has no experts"),
        ("tiny-qwen3-moe", dict(tensor_parallel_size=3), "does not divide"),
    ],
)
def test_configurations_that_do_not_divide_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model, **SMALL, **kwargs)


def test_a_plan_needs_its_devices():
    from research.models.presets import get_preset

    with pytest.raises(ValueError, match=r"needs 2 devices; JAX sees 1.*device_count=2"):
        ShardingPlan.create(get_preset("tiny-llama"), 2, devices=jax.devices()[:1])


def test_the_rules_table_is_the_only_place_splits_are_decided():
    import dataclasses

    from research.models.presets import get_preset

    check_divisible(get_preset("qwen3-30b-a3b"), 8, expert_parallel=True)  # 4 kv heads, twice
    cfg = dataclasses.replace(
        get_preset("tiny-llama"),
        num_heads=12,
        num_kv_heads=4,
        vocab_size=1536,
        intermediate_size=384,
    )
    with pytest.raises(ValueError, match="num_kv_heads=4: one must divide the other"):
        check_divisible(cfg, 6, expert_parallel=False)
    assert rules(True)["experts"] and not rules(True)["expert_ffn"]
    assert rules(False)["expert_ffn"] and not rules(False)["experts"]
