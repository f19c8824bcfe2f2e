"""Presets are data: their shapes match the published configs (docs/reference.md section 3)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from research.models.presets import PRESETS, get_preset
from research.models.transformer import param_shapes


@pytest.mark.parametrize(
    ("name", "kv_bytes_bf16"),
    [
        ("qwen3-30b-a3b", 98_304),
        ("qwen3-coder-30b-a3b", 98_304),
        ("llama-3.3-70b", 327_680),
        ("smollm2-135m", 23_040),
    ],
)
def test_kv_bytes_per_token_matches_reference(name, kv_bytes_bf16):
    assert get_preset(name).kv_bytes_per_token(2) == kv_bytes_bf16


def test_gpt_oss_full_attention_layers_kv_bytes():
    cfg = get_preset("gpt-oss-120b")
    # Half of gpt-oss's 36 layers use full attention; REFERENCE counts those: 36,864 bytes.
    assert cfg.kv_bytes_per_token(2) / 2 == 36_864
    assert cfg.sliding_window == 128


def _count(cfg) -> int:
    shapes = param_shapes(cfg)
    leaves = jax.tree_util.tree_leaves(shapes, is_leaf=lambda s: isinstance(s, tuple))
    return sum(int(np.prod(s)) for s in leaves)


@pytest.mark.parametrize(
    ("name", "billions", "tol"),
    [
        ("qwen3-30b-a3b", 30.5, 0.02),
        ("llama-3.3-70b", 70.6, 0.01),
        ("smollm2-135m", 0.1348, 0.01),
    ],
)
def test_parameter_counts_match_published_totals(name, billions, tol):
    assert _count(get_preset(name)) / 1e9 == pytest.approx(billions, rel=tol)


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'.*smollm2-135m"):
        get_preset("nope")


def test_every_preset_is_consistent():
    for cfg in PRESETS.values():
        assert cfg.num_heads % cfg.num_kv_heads == 0
        assert cfg.is_moe == (cfg.num_experts > 0)
        assert cfg.name in PRESETS
