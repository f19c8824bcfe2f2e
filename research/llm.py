"""The offline Python API, with vLLM's names: ``LLM(...).generate`` and ``.chat``.

Both run on the continuous-batching engine: every prompt is validated, queued, and the engine
steps until all are done; outputs come back in prompt order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from research.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from research.engine.engine import Engine, kv_cache_summary
from research.engine.kv_cache import kv_pool_bytes_per_block
from research.engine.request import RequestOutput, SamplingParams, check_bool, check_int, check_real
from research.models.load import auto_dtype, load_model
from research.quant import QUANTIZATIONS, quantize_params
from research.quant.kv import KV_DTYPES
from research.quant.params import stored_quantization

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict[str, Any]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class LLM:
    """Load a model and generate from prompts or chats.

    Args:
      model: preset name ("smollm2-135m", "tiny-llama", ...), a .gguf file, an HF directory
        (config.json + safetensors) or an orbax checkpoint written by ``save_checkpoint``.
      dtype: "float32" or "bfloat16" for weights, activations and the KV cache; "auto" (vLLM's
        default) is the checkpoint's, with float32 and float16 checkpoints served in bfloat16
        as vLLM does on CPU (``research.models.load.auto_dtype``): bfloat16 for the bundled GGUF
        and HF directories, the saved dtype for orbax checkpoints, float32 for random-init
        ``tiny-*`` presets, bfloat16 on the simulated executor.
      cost_model_options: simulated only: extra ``research.perf.CostModel`` keyword arguments
        (``moe_routing``, ``params``, ...).
      max_model_len: longest prompt + generation; defaults to the model's context length.
      seed: seeds random-init presets and requests that give no seed of their own.
      speculative_config: vLLM's dict, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 1}`` (``research.config.SpeculativeConfig``):
        drafts are verified in the same step and accepted by rejection sampling, so outputs
        are distributed as without it. ``{"model": <preset or path>, ...}``: a draft model.
      speculative_acceptance_rate: simulated only: the fraction of drafts the target accepts
        (each independently, until the first rejection).
      The rest configure the engine with vLLM's names (see CacheConfig, SchedulerConfig).
    """

    def __init__(
        self,
        model: str | os.PathLike = "smollm2-135m",
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        scheduling_policy: str = "continuous",
        enable_chunked_prefill: bool = True,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        gemm_backend: str = "auto",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        executor: str = "real",
        hardware: str | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        poison_freed_blocks: bool = False,
        cost_model_options: dict[str, Any] | None = None,
        speculative_config: dict[str, Any] | None = None,
        speculative_acceptance_rate: float | None = None,
    ):
        speculative = SpeculativeConfig.from_dict(speculative_config)
        if speculative is not None and executor == "simulated":
            if speculative.method != "ngram":
                raise ValueError(
                    "the simulated executor prices n-gram speculation only (method 'ngram')"
                )
            if speculative_acceptance_rate is None:
                raise ValueError(
                    "simulated speculative decoding needs speculative_acceptance_rate (the "
                    "fraction of drafts the target accepts, e.g. 0.7)"
                )
        if speculative_acceptance_rate is not None:
            if speculative is None or executor != "simulated":
                raise ValueError(
                    "speculative_acceptance_rate is for executor='simulated' with a "
                    "speculative_config (a real run measures its acceptance)"
                )
            if (
                not 0.0
                <= check_real("speculative_acceptance_rate", speculative_acceptance_rate)
                <= 1
            ):
                raise ValueError(
                    "speculative_acceptance_rate must be in [0, 1], got "
                    f"{speculative_acceptance_rate}"
                )
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a preset name or a path, got {model!r}")
        if dtype == "auto":
            dtype = "bfloat16" if executor == "simulated" else auto_dtype(model)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        _check_engine_args(
            max_model_len=max_model_len,
            seed=seed,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            poison_freed_blocks=poison_freed_blocks,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy=scheduling_policy,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        cache_config = CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.dtype = _DTYPES[dtype]
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        self.quantization = quantization
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        if executor not in ("real", "simulated"):
            raise ValueError(f"executor must be 'real' or 'simulated', got {executor!r}")
        sim = None
        check_bool("enable_expert_parallel", enable_expert_parallel)
        if executor == "simulated":
            # A cost model of `hardware` prices each step; no weights are loaded or allocated.
            from research.models.presets import get_preset
            from research.perf import kv_capacity_blocks
            from research.perf.cost_model import CostModel
            from research.perf.simulated import SimulatedExecutor, SyntheticProposer

            if hardware is None:
                raise ValueError('executor="simulated" needs hardware= (e.g. "gb10" or "h200")')
            self.model_config, self.params, self.tokenizer = get_preset(model), None, None
            if num_kv_blocks is None:
                num_kv_blocks = kv_capacity_blocks(
                    self.model_config,
                    quantization,
                    hardware,
                    gpu_memory_utilization,
                    block_size,
                    kv_cache_dtype=kv_cache_dtype,
                    dtype=dtype,
                    tensor_parallel_size=tensor_parallel_size,
                )
                cache_config = dataclasses.replace(cache_config, num_kv_blocks=num_kv_blocks)
            cost = CostModel(
                self.model_config,
                quantization,
                hardware,
                kv_cache_dtype,
                dtype,
                tensor_parallel_size=tensor_parallel_size,
                block_size=block_size,
                expert_parallel=enable_expert_parallel,
                **(cost_model_options or {}),
            )
            sim = SimulatedExecutor(cost, acceptance_rate=speculative_acceptance_rate or 0.0)
        else:
            self.model_config, self.params, self.tokenizer = load_model(model, self.dtype, seed)
            stored = stored_quantization(self.params)
            if stored is None:
                self.params = quantize_params(self.params, quantization)
            elif quantization not in (None, stored):
                raise ValueError(
                    f"{model} is a pre-quantized {stored} checkpoint; quantization="
                    f"{quantization!r} would requantize it (leave quantization unset, or "
                    f"pass {stored!r})"
                )
            else:  # as vLLM: the checkpoint's own quantization
                self.quantization = stored
        cfg = self.model_config
        self.max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        if not 1 < self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} must be in [2, "
                f"{cfg.max_position_embeddings}] (the model's context length)"
            )
        if executor == "real" and num_kv_blocks is None:
            per_block = kv_pool_bytes_per_block(cfg, block_size, self.dtype, kv_cache_dtype)
            if kv_cache_memory_bytes < per_block:
                raise ValueError(
                    f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds no KV block: one block "
                    f"of {block_size} tokens takes {per_block} bytes for {cfg.name}"
                )
        if not enable_chunked_prefill and max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        plan = None
        if enable_expert_parallel and not cfg.is_moe:
            raise ValueError(f"enable_expert_parallel: {cfg.name} has no experts")
        if executor == "real" and (tensor_parallel_size > 1 or enable_expert_parallel):
            from research.parallel import ShardingPlan

            plan = ShardingPlan.create(cfg, tensor_parallel_size, enable_expert_parallel)
            logger.info("sharding: %s", plan.describe())
        self.plan = plan
        self.engine = Engine(
            cfg,
            self.params,
            self.tokenizer,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype,
            gemm_backend=gemm_backend,
            seed=seed,
            poison_freed_blocks=poison_freed_blocks,
            plan=plan,
            speculative_config=speculative,
            **(dict(executor=sim, clock=sim.clock) if sim is not None else {}),
            **(
                dict(proposer=SyntheticProposer(speculative.num_speculative_tokens))
                if sim is not None and speculative is not None
                else {}
            ),
        )
        if plan is not None:
            self.params = self.engine.executor.params  # placed on the mesh; no second copy
        logger.info(kv_cache_summary(self.engine.block_manager, self.max_model_len))

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt: a string, a list of token ids, or a dict with
        ``prompt`` or ``prompt_token_ids``. Every prompt is validated before any work starts."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        return self.engine.generate(
            [ids for _, ids in encoded], params_list, [text for text, _ in encoded]
        )

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render one conversation (a list of {"role", "content"} dicts), or a list of them, with
        the model's chat template and generate a reply to each."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so chat() is unavailable")
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not conv:
                raise ValueError(f"a conversation is a non-empty list of messages, got {conv!r}")
            for m in conv:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
                if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                    raise ValueError(f"a message's role and content must be strings, got {m!r}")
            ids = self.tokenizer.apply_chat_template(conv, add_generation_prompt)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
            return [prompts]  # one prompt given as a flat list of token ids
        if not prompts:
            raise ValueError("no prompts given")
        return prompts

    @staticmethod
    def _as_params_list(sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if isinstance(sp, (str, bytes, dict)) or not hasattr(sp, "__iter__"):
            raise ValueError(
                f"sampling_params must be SamplingParams or a list of them, got {sp!r}"
            )
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        for i, p in enumerate(sp):
            if not isinstance(p, SamplingParams):
                raise ValueError(
                    f"sampling_params[{i}] is a {type(p).__name__}, not SamplingParams"
                )
        return sp

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token id lists")
            if not prompt:
                raise ValueError("prompt is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"prompt is not valid Unicode text: {error}") from None
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt)}")


def _check_engine_args(
    *,
    max_model_len: Any,
    seed: Any,
    max_num_seqs: Any,
    max_num_batched_tokens: Any,
    enable_chunked_prefill: Any,
    block_size: Any,
    num_kv_blocks: Any,
    kv_cache_memory_bytes: Any,
    enable_prefix_caching: Any,
    gpu_memory_utilization: Any,
    tensor_parallel_size: Any,
    poison_freed_blocks: Any,
) -> None:
    """Type and range of each engine argument, before anything is loaded or allocated."""
    big = 2**31 - 1  # the device step holds positions, block ids and counts as int32
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, 2, big)
    check_int("seed", seed, 0, 2**32 - 1)  # the key of random-init weights
    check_int("max_num_seqs", max_num_seqs, 1, big)
    check_int("max_num_batched_tokens", max_num_batched_tokens, 1, big)
    check_int("block_size", block_size, 1, big)
    if num_kv_blocks is not None:
        check_int("num_kv_blocks", num_kv_blocks, 1, big)
    check_int("kv_cache_memory_bytes", kv_cache_memory_bytes, 1, 2**63 - 1)
    check_int("tensor_parallel_size", tensor_parallel_size, 1, 1 << 16)
    if not 0.0 < check_real("gpu_memory_utilization", gpu_memory_utilization) <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    check_bool("enable_chunked_prefill", enable_chunked_prefill)
    check_bool("enable_prefix_caching", enable_prefix_caching)
    check_bool("poison_freed_blocks", poison_freed_blocks)
