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

import numpy as np

from research.engine.args import EngineArgs, EngineConfig
from research.engine.engine import Engine, kv_cache_summary
from research.engine.request import RequestOutput, SamplingParams
from research.models.load import load_model
from research.quant import quantize_params
from research.quant.params import stored_quantization

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict[str, Any]


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

    def __init__(self, model: str | os.PathLike = "smollm2-135m", **kwargs: Any):
        """``kwargs``: ``research.engine.args.EngineArgs``' fields (vLLM's names), validated
        once into an ``EngineConfig`` before anything is loaded or allocated."""
        config = EngineArgs(model=model, **kwargs).create_config()
        self.dtype = config.jnp_dtype
        self.quantization = config.quantization
        self.kv_cache_dtype = config.kv_cache_dtype
        sim = None
        if config.executor == "simulated":
            sim, config = self._simulated(config)
        else:
            self.model_config, self.params, self.tokenizer = load_model(
                config.model, self.dtype, config.seed
            )
            stored = stored_quantization(self.params)
            if config.quantization == "gguf":
                self.params = self._gguf_blocks(config)
            elif stored is None:
                self.params = quantize_params(self.params, config.quantization)
            elif config.quantization not in (None, stored):
                raise ValueError(
                    f"{config.model} is a pre-quantized {stored} checkpoint; quantization="
                    f"{config.quantization!r} would requantize it (leave quantization unset, or "
                    f"pass {stored!r})"
                )
            else:  # as vLLM: the checkpoint's own quantization
                self.quantization = stored
        config = config.for_model(self.model_config)
        self.config = config
        self.max_model_len = config.max_model_len
        cfg = self.model_config
        plan = None
        if config.executor == "real" and (
            config.tensor_parallel_size > 1 or config.enable_expert_parallel
        ):
            from research.parallel import ShardingPlan

            plan = ShardingPlan.create(
                cfg, config.tensor_parallel_size, config.enable_expert_parallel
            )
            logger.info("sharding: %s", plan.describe())
        self.plan = plan
        extra: dict[str, Any] = {}
        if sim is not None:
            from research.perf.simulated import SyntheticProposer

            extra = dict(executor=sim, clock=sim.clock)
            if config.speculative is not None:
                k = config.speculative.num_speculative_tokens
                extra["proposer"] = SyntheticProposer(k)
        self.engine = Engine.from_config(
            config, cfg, self.params, self.tokenizer, plan=plan, **extra
        )
        if plan is not None:
            self.params = self.engine.executor.params  # placed on the mesh; no second copy
        logger.info(kv_cache_summary(self.engine.block_manager, self.max_model_len))

    def _gguf_blocks(self, config: EngineConfig) -> Any:
        """quantization="gguf": the GGUF's Q4_1 / Q8_0 linear weights kept as stored and read by
        the native kernel (``research.native.gemm.BlockWeight``); a clear error where that
        kernel cannot run here."""
        from research.models.load import gguf_file
        from research.models.weights import gguf_block_params
        from research.native import gemm

        if gemm.unavailable_reason(self.dtype) is not None:
            raise ValueError(
                f'quantization="gguf" needs the native gemm kernels: {gemm.describe(self.dtype)}'
            )
        return gguf_block_params(gguf_file(config.model), self.params, self.model_config)

    def _simulated(self, config: EngineConfig) -> tuple[Any, EngineConfig]:
        """A cost model of ``config.hardware`` prices each step; no weights are loaded or
        allocated. Returns the simulated executor and the config with its pool size."""
        from research.models.presets import get_preset
        from research.perf import kv_capacity_blocks
        from research.perf.cost_model import CostModel
        from research.perf.simulated import SimulatedExecutor

        self.model_config, self.params, self.tokenizer = get_preset(config.model), None, None
        cache = config.cache
        if cache.num_kv_blocks is None:
            blocks = kv_capacity_blocks(
                self.model_config,
                config.quantization,
                config.hardware,
                config.gpu_memory_utilization,
                cache.block_size,
                kv_cache_dtype=config.kv_cache_dtype,
                dtype=config.dtype,
                tensor_parallel_size=config.tensor_parallel_size,
            )
            config = dataclasses.replace(
                config, cache=dataclasses.replace(cache, num_kv_blocks=blocks)
            )
        # The KV read granule is the pool's block unless the engine profile says otherwise
        # (llama.cpp reads 256-key tiles of an unpaged cache: research.perf.engines).
        options = {"block_size": cache.block_size} | (config.cost_model_options or {})
        cost = CostModel(
            self.model_config,
            config.quantization,
            config.hardware,
            config.kv_cache_dtype,
            config.dtype,
            tensor_parallel_size=config.tensor_parallel_size,
            expert_parallel=config.enable_expert_parallel,
            **options,
        )
        rate = config.speculative_acceptance_rate or 0.0
        return SimulatedExecutor(cost, acceptance_rate=rate), config

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
