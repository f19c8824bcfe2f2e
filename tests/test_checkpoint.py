"""Orbax round trips through save_checkpoint / restore_checkpoint, and LLM(<checkpoint dir>)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research import LLM, SamplingParams
from research.models.presets import get_preset
from research.models.transformer import init_params, param_shapes
from research.models.weights import is_checkpoint, restore_checkpoint, save_checkpoint


def _assert_trees_bit_identical(restored, original) -> None:
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(original)
    flat_restored = jax.tree_util.tree_flatten_with_path(restored)[0]
    flat_original = jax.tree_util.tree_flatten_with_path(original)[0]
    for (path, got), (_, want) in zip(flat_restored, flat_original, strict=True):
        name = jax.tree_util.keystr(path)
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
        assert np.array_equal(got, want), f"{name}: values differ"
        assert got.tobytes() == want.tobytes(), f"{name}: bits differ"


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama", "tiny-qwen3"])
def test_round_trip_is_bit_identical(tmp_path, preset):
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.key(0))
    path = save_checkpoint(tmp_path / "ckpt", params, cfg)
    assert is_checkpoint(path)

    restored_cfg, restored = restore_checkpoint(path)
    assert restored_cfg == cfg
    _assert_trees_bit_identical(restored, params)
    # The restored tree has exactly the leaves the config describes.
    shapes = jax.tree_util.tree_map(lambda a: tuple(a.shape), restored)
    assert shapes == param_shapes(cfg)


def test_restored_config_keeps_rope_scaling_and_eos_tuple(tmp_path):
    cfg = get_preset("tiny-llama")  # has RopeScaling and a tuple of EOS ids
    save_checkpoint(tmp_path, init_params(cfg, jax.random.key(1)), cfg)
    restored_cfg, _ = restore_checkpoint(tmp_path)
    assert restored_cfg == cfg
    assert restored_cfg.rope_scaling == cfg.rope_scaling
    assert isinstance(restored_cfg.eos_token_ids, tuple)


def test_restore_with_matching_config_returns_that_config(tmp_path):
    cfg = get_preset("tiny-llama")
    params = init_params(cfg, jax.random.key(2))
    save_checkpoint(tmp_path, params, cfg)
    restored_cfg, restored = restore_checkpoint(tmp_path, cfg=cfg)
    assert restored_cfg == cfg
    _assert_trees_bit_identical(restored, params)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_bfloat16_round_trip_is_bit_identical(tmp_path, preset):
    cfg = get_preset(preset)
    params = init_params(cfg, jax.random.key(3), jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(params))
    save_checkpoint(tmp_path, params, cfg)
    restored_cfg, restored = restore_checkpoint(tmp_path)
    assert restored_cfg == cfg
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(restored))
    _assert_trees_bit_identical(restored, params)


def test_saving_twice_to_the_same_path_overwrites(tmp_path):
    cfg = get_preset("tiny-llama")
    save_checkpoint(tmp_path, init_params(cfg, jax.random.key(4)), cfg)
    second = init_params(cfg, jax.random.key(5))
    save_checkpoint(tmp_path, second, cfg)
    _, restored = restore_checkpoint(tmp_path)
    _assert_trees_bit_identical(restored, second)


@pytest.fixture(scope="module")
def tiny_llama_checkpoint(tmp_path_factory):
    cfg = get_preset("tiny-llama")
    path = tmp_path_factory.mktemp("tiny_llama_ckpt")
    save_checkpoint(path, init_params(cfg, jax.random.key(0)), cfg)
    return path


@pytest.mark.parametrize(
    ("changes", "leaf", "stored_shape", "expected_shape"),
    [
        ({"hidden_size": 32}, "['embed']", (256, 64), (256, 32)),
        ({"vocab_size": 300}, "['embed']", (256, 64), (300, 64)),
        ({"num_heads": 8}, "['layers'][0]['wo']", (64, 64), (128, 64)),
        ({"num_kv_heads": 4}, "['layers'][0]['wk']", (64, 32), (64, 64)),
        ({"intermediate_size": 96}, "['layers'][0]['w_down']", (128, 64), (96, 64)),
    ],
)
def test_restore_into_mismatched_config_names_leaf_and_shapes(
    tiny_llama_checkpoint, changes, leaf, stored_shape, expected_shape
):
    cfg = dataclasses.replace(get_preset("tiny-llama"), **changes)
    with pytest.raises(ValueError) as excinfo:
        restore_checkpoint(tiny_llama_checkpoint, cfg=cfg)
    message = str(excinfo.value)
    assert leaf in message
    assert str(stored_shape) in message
    assert str(expected_shape) in message
    assert "tiny-llama" in message


def test_restore_into_config_with_more_layers_names_the_missing_layer(tiny_llama_checkpoint):
    cfg = dataclasses.replace(get_preset("tiny-llama"), num_layers=3)
    with pytest.raises(
        ValueError,
        match=re.escape("leaf ['layers'][2]['attn_norm'] is missing (expected shape (64,))"),
    ):
        restore_checkpoint(tiny_llama_checkpoint, cfg=cfg)


def test_restore_dense_checkpoint_into_moe_config_names_missing_leaf(tiny_llama_checkpoint):
    moe = dataclasses.replace(get_preset("tiny-qwen3-moe"), name="moe-target")
    with pytest.raises(ValueError, match=re.escape("['layers'][0]['k_norm'] is missing")):
        restore_checkpoint(tiny_llama_checkpoint, cfg=moe)


def test_restore_into_tied_config_reports_unexpected_lm_head(tiny_llama_checkpoint):
    tied = dataclasses.replace(get_preset("tiny-llama"), tie_word_embeddings=True)
    with pytest.raises(
        ValueError, match=re.escape("unexpected leaf ['lm_head'] with shape (64, 256)")
    ):
        restore_checkpoint(tiny_llama_checkpoint, cfg=tied)


def test_save_rejects_params_that_do_not_match_config(tmp_path):
    cfg = get_preset("tiny-llama")
    params = init_params(cfg, jax.random.key(0))
    wrong = dataclasses.replace(cfg, num_layers=3)
    with pytest.raises(ValueError, match=re.escape("['layers'][2]['attn_norm'] is missing")):
        save_checkpoint(tmp_path / "bad", params, wrong)
    assert not is_checkpoint(tmp_path / "bad")


def test_restore_from_a_non_checkpoint_directory_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        restore_checkpoint(tmp_path)


def test_llm_loads_checkpoint_and_generates_the_same_greedy_tokens(tmp_path):
    original = LLM("tiny-llama", seed=0)
    path = save_checkpoint(tmp_path / "llm_ckpt", original.params, original.model_config)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = original.generate([[1, 2, 3]], sp)[0].token_ids
    assert len(want) == 8

    loaded = LLM(str(path))
    assert loaded.model_config == original.model_config
    assert loaded.tokenizer is None
    _assert_trees_bit_identical(loaded.params, original.params)
    # Guard against a trivial pass: another seed's weights differ from the checkpoint's.
    other = init_params(original.model_config, jax.random.key(1))
    assert not np.array_equal(np.asarray(other["embed"]), np.asarray(loaded.params["embed"]))
    assert loaded.generate([[1, 2, 3]], sp)[0].token_ids == want


def test_llm_accepts_a_pathlib_checkpoint_path_and_casts_dtype(tmp_path):
    cfg = get_preset("tiny-llama")
    params = init_params(cfg, jax.random.key(0))
    path = save_checkpoint(tmp_path, params, cfg)  # a pathlib.Path
    loaded = LLM(path, dtype="bfloat16")
    assert loaded.model_config == cfg
    for got, want in zip(
        jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(params), strict=True
    ):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))


def test_auto_dtype_is_the_checkpoints_as_vllm_on_cpu(tmp_path):
    """``dtype="auto"``: an orbax checkpoint keeps the dtype it was saved in; the bundled GGUF
    and HF directories serve in bfloat16 (vLLM maps float32 checkpoints to a 16-bit type);
    random-init presets, with no checkpoint, use float32."""
    import jax
    import jax.numpy as jnp

    from research.models.load import auto_dtype

    llm = LLM("tiny-llama", seed=0)
    assert llm.dtype == jnp.float32 and auto_dtype("tiny-llama") == "float32"
    as_bf16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), llm.params)
    path = save_checkpoint(tmp_path / "bf16", as_bf16, llm.model_config)
    assert auto_dtype(path) == "bfloat16"
    assert LLM(str(path)).dtype == jnp.bfloat16
    assert auto_dtype(save_checkpoint(tmp_path / "f32", llm.params, llm.model_config)) == "float32"
    assert auto_dtype("smollm2-135m") == "bfloat16"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert auto_dtype(tmp_path / "hf") == "bfloat16"
