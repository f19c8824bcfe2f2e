"""The offline Python API, with vLLM's names: ``LLM(...).generate`` and ``.chat``.

This version runs one sequence at a time over a contiguous KV cache: a jitted prefill over the
prompt padded to a power-of-two bucket, then a jitted one-token decode step, with sampling on
device. Prompt and cache lengths are bucketed so a handful of shapes compile.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from research.config import ModelConfig
from research.engine.request import RequestMetrics, RequestOutput, SamplingParams
from research.engine.sampler import SamplingTensors, sample
from research.models.load import load_model
from research.models.transformer import ContiguousKVCache, compute_logits, forward

PromptType = str | Sequence[int] | dict[str, Any]
_MIN_BUCKET = 16
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n (at least _MIN_BUCKET), capped at ``cap``."""
    return min(cap, max(_MIN_BUCKET, 1 << (n - 1).bit_length()))


class LLM:
    """Load a model and generate from prompts or chats.

    Args:
      model: preset name ("smollm2-135m", "tiny-llama", ...), a .gguf file, an HF directory
        (config.json + safetensors) or an orbax checkpoint written by ``save_checkpoint``.
      dtype: "float32" or "bfloat16" for weights, activations and the KV cache.
      max_model_len: longest prompt + generation; defaults to the model's context length.
      seed: seeds random-init presets and requests that give no seed of their own.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.seed = seed
        self.model_config, self.params, self.tokenizer = load_model(model, self.dtype, seed)
        cfg = self.model_config
        self.max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        if not 1 < self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} must be in [2, "
                f"{cfg.max_position_embeddings}] (the model's context length)"
            )
        self._request_counter = 0
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))

    # ------------------------------------------------------------------ jitted steps

    def _prefill_fn(self, params, cache, tokens, positions, last, st):
        """tokens/positions [1, T] (padding at position -1); last = index of the last prompt token."""
        cfg: ModelConfig = self.model_config
        hidden, cache = forward(params, cfg, tokens, positions, cache)
        logits = compute_logits(params, cfg, hidden[:, last])  # [1, V]
        return cache, sample(logits, st), logits

    def _decode_fn(self, params, cache, token, position, st):
        cfg: ModelConfig = self.model_config
        hidden, cache = forward(params, cfg, token[:, None], position[:, None], cache)
        logits = compute_logits(params, cfg, hidden[:, 0])
        return cache, sample(logits, st)

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
        for (_text, ids), sp in zip(encoded, params_list, strict=True):
            self._validate(ids, sp)
        return [
            self._run_one(text, ids, sp)
            for (text, ids), sp in zip(encoded, params_list, strict=True)
        ]

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
            for m in conv:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
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
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
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
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt)}")

    def _validate(self, ids: list[int], sp: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens and max_tokens is {sp.max_tokens}: "
                f"{len(ids) + sp.max_tokens} exceeds max_model_len {self.max_model_len}"
            )

    def _stop_ids(self, sp: SamplingParams) -> set[int]:
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop |= set(self.model_config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                stop.add(self.tokenizer.eos_token_id)
        return stop

    def _request_seed(self, sp: SamplingParams, request_id: str) -> int:
        if sp.seed is not None:
            return sp.seed & 0xFFFFFFFF
        return (self.seed * 1_000_003 + zlib.crc32(request_id.encode())) & 0xFFFFFFFF

    def _run_one(self, text: str | None, ids: list[int], sp: SamplingParams) -> RequestOutput:
        request_id = str(self._request_counter)
        self._request_counter += 1
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        cfg = self.model_config
        n = len(ids)
        seed = self._request_seed(sp, request_id)
        stop_ids = self._stop_ids(sp)

        cache = ContiguousKVCache.create(
            cfg, 1, _bucket(n + sp.max_tokens, self.max_model_len), self.dtype
        )
        t_pad = _bucket(n, self.max_model_len)
        tokens = np.zeros((1, t_pad), np.int32)
        tokens[0, :n] = ids
        positions = np.full((1, t_pad), -1, np.int32)
        positions[0, :n] = np.arange(n)

        metrics.first_scheduled_time = time.perf_counter()
        st = SamplingTensors.from_params([sp], [seed], [0])
        cache, next_token, _ = self._prefill(
            self.params, cache, jnp.asarray(tokens), jnp.asarray(positions), n - 1, st
        )
        out_ids: list[int] = []
        finish_reason, stop_reason = None, None
        out_text = ""
        while True:
            token = int(next_token[0])
            now = time.perf_counter()
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.token_times.append(now)
            if token in stop_ids:
                finish_reason, stop_reason = "stop", token
                if token in sp.stop_token_ids:
                    out_ids.append(token)  # vLLM keeps explicit stop tokens, drops EOS
                break
            out_ids.append(token)
            if sp.stop and self.tokenizer is not None:
                out_text = self.tokenizer.decode(out_ids, sp.skip_special_tokens)
                hit = next((s for s in sp.stop if s in out_text), None)
                if hit is not None:
                    finish_reason, stop_reason = "stop", hit
                    out_text = out_text[: out_text.index(hit)]
                    break
            if len(out_ids) >= sp.max_tokens:
                finish_reason = "length"
                break
            st = SamplingTensors.from_params([sp], [seed], [len(out_ids)])
            cache, next_token = self._decode(
                self.params,
                cache,
                jnp.asarray([token], jnp.int32),
                jnp.asarray([n + len(out_ids) - 1], jnp.int32),
                st,
            )
        metrics.finished_time = time.perf_counter()
        if not (isinstance(stop_reason, str)) and self.tokenizer is not None:
            out_text = self.tokenizer.decode(out_ids, sp.skip_special_tokens)
        return RequestOutput(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            text=out_text,
            token_ids=out_ids,
            finish_reason=finish_reason,
            metrics=metrics,
            stop_reason=stop_reason,
        )
