"""The HF transformers peer: the same workload through ``model.generate`` in static batches.

``run_hf_benchmark`` is the baseline our engine is compared against: what you get by serving
with plain HF transformers, greedy and fp32, without continuous batching. It returns the same
``BenchmarkResult`` as ``run_benchmark``, so ``result_point`` writes the same results.jsonl keys.

Static batching. The requests are taken in order, ``max_concurrency`` at a time (the last batch
may be smaller). Each batch is one ``generate`` call: prompts left-padded to the longest one
with an attention mask, ``max_new_tokens`` = the batch's largest ``output_len``. Every row is
decoded for that many steps; a row that needs fewer tokens keeps being computed until the batch
finishes, and the next batch only starts then. That idle work is the cost of static batching;
``engine_stats["wasted_decode_tokens"]`` counts it.

ignore_eos. ``min_new_tokens`` is set to ``max_new_tokens`` so no row stops early: every request
gets exactly its ``output_len`` tokens, as with our engine's ``ignore_eos``. HF does this by
masking EOS out of the logits, so where EOS would have been the argmax the token differs from an
engine that only ignores the stop; the work and the timings are the same.

Send times (the closed-loop client). With ``send_at="batch_start"`` (the default) every request
of a batch is sent when the batch starts: the first batch at t0, and batch k at the moment batch
k-1's ``generate`` returned, since a closed-loop client refills its slots when they free and a
static server frees them all at once, when the batch ends. TTFT then counts from the start of
the request's own batch. ``send_at="slot_free"`` models instead a client that sends its next
request as soon as its previous one has streamed its last token (request j of batch k is sent at
the finish of request j of batch k-1); the wait for the rest of that batch then counts in the
next request's TTFT, as a queue would in front of a static server.

Token timestamps. A streamer (``transformers.generation.streamers.BaseStreamer``) gets ``put``
once with the prompt ids and then once per decoding step with that step's token for every row;
each step is stamped with ``clock()`` as ``put`` is called (on the host, after the step's
argmax, so the first stamp includes the prefill). Request i's ``token_times`` are the first
``output_len`` step stamps of its batch: ``first_token_time`` is the first stamp and
``finish_time`` the last one it needs, when a streaming server would have delivered its last
token. The benchmark's duration runs from the first send to the last finish, as in
``run_benchmark``. No warmup is done here; run a small batch first to exclude one-time costs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from research.bench.driver import BenchmarkResult
from research.bench.metrics import RequestRecord
from research.bench.workload import BenchRequest

HF_PRESETS = ("smollm2-135m",)
SendAt = Literal["batch_start", "slot_free"]


class StepClockStreamer(BaseStreamer):
    """Stamps every decoding step with ``clock()`` and keeps the tokens it was handed.

    ``generate`` calls ``put`` first with the prompt ids (ignored), then once per step with that
    step's tokens, shape ``[batch]``.
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.step_times: list[float] = []
        self.step_tokens: list[list[int]] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        now = self.clock()
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.step_times.append(now)
        self.step_tokens.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


@dataclass
class BatchOutput:
    """One ``generate`` call: the tokens each row needed and the clock readings around it."""

    token_ids: list[list[int]]  # row i: its first output_lens[i] generated tokens
    step_times: list[float]  # one stamp per decoding step, for the whole batch
    start_time: float  # just before the inputs were built
    end_time: float  # just after generate returned


def _first_int(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def resolve_pad_token_id(model, tokenizer=None) -> int:
    """The tokenizer's pad (else EOS) token, else the model's generation config's, else 0.

    With left padding and an attention mask the pad id only fills masked positions."""
    candidates = []
    if tokenizer is not None:
        candidates += [tokenizer.pad_token_id, tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        candidates += [gen.pad_token_id, gen.eos_token_id]
    candidates += [getattr(model.config, "pad_token_id", None)]
    candidates += [getattr(model.config, "eos_token_id", None)]
    for candidate in candidates:
        pad = _first_int(candidate)
        if pad is not None:
            return pad
    return 0


def check_token_ids(model, requests: Sequence[BenchRequest]) -> None:
    """Raise ValueError unless every prompt is non-empty with ids in the model's vocabulary."""
    vocab = model.get_input_embeddings().num_embeddings
    for i, request in enumerate(requests):
        if request.prompt_len == 0:
            raise ValueError(f"request {i} has an empty prompt")
        if request.output_len < 1:
            raise ValueError(f"request {i} asks for {request.output_len} tokens; must be >= 1")
        low, high = min(request.prompt_token_ids), max(request.prompt_token_ids)
        if low < 0 or high >= vocab:
            raise ValueError(
                f"request {i} has token ids in [{low}, {high}], outside the model's vocabulary "
                f"[0, {vocab}); draw prompts with vocab_size <= {vocab}"
            )


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """``(input_ids, attention_mask)``, both ``[batch, longest]`` int64, prompts right-aligned."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    output_lens: Sequence[int],
    *,
    pad_token_id: int,
    clock: Callable[[], float] = time.perf_counter,
) -> BatchOutput:
    """One static batch: greedy ``generate`` of ``max(output_lens)`` tokens for every row.

    Checks that the streamed tokens are the ones ``generate`` returned, and that it ran every
    step (``min_new_tokens`` keeps rows from stopping at EOS)."""
    if len(prompts) != len(output_lens) or not prompts:
        raise ValueError("need one output_len per prompt, and at least one prompt")
    start = clock()
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    steps = max(output_lens)
    streamer = StepClockStreamer(clock)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=pad_token_id,
            streamer=streamer,
        )
    end = clock()
    generated = out[:, input_ids.shape[1] :].cpu()
    if len(streamer.step_times) != steps or generated.shape[1] != steps:
        raise RuntimeError(
            f"generate ran {len(streamer.step_times)} steps and returned {generated.shape[1]} "
            f"tokens per row; expected {steps}"
        )
    if torch.tensor(streamer.step_tokens).T.tolist() != generated.tolist():
        raise RuntimeError("the streamed tokens differ from the ones generate returned")
    return BatchOutput(
        token_ids=[generated[row, :n].tolist() for row, n in enumerate(output_lens)],
        step_times=streamer.step_times,
        start_time=start,
        end_time=end,
    )


def run_hf_benchmark(
    model,
    tokenizer,
    requests: Sequence[BenchRequest],
    *,
    max_concurrency: int,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = False,
    num_threads: int | None = None,
    send_at: SendAt = "batch_start",
) -> BenchmarkResult:
    """Serve ``requests`` with HF ``generate`` in static batches of ``max_concurrency``.

    ``tokenizer`` (or None) only supplies the pad token. ``num_threads`` sets torch's CPU threads
    for the run (restored after). See the module docstring for the timing semantics.
    ``engine_stats`` has the backend, batch count, decode steps, wasted decode tokens (rows
    computed past their output_len), threads and every request's generated ``token_ids``.
    """
    if not requests:
        raise ValueError("no requests to send")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if send_at not in ("batch_start", "slot_free"):
        raise ValueError(f"send_at must be 'batch_start' or 'slot_free', got {send_at!r}")
    check_token_ids(model, requests)
    pad_token_id = resolve_pad_token_id(model, tokenizer)
    batches = [
        list(range(i, min(i + max_concurrency, len(requests))))
        for i in range(0, len(requests), max_concurrency)
    ]

    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    records: list[RequestRecord] = []
    token_ids: list[list[int]] = []
    decode_steps = wasted = 0
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    try:
        threads = torch.get_num_threads()
        previous_end: float | None = None
        for k, batch in enumerate(batches):
            lens = [requests[i].output_len for i in batch]
            out = generate_batch(
                model,
                [requests[i].prompt_token_ids for i in batch],
                lens,
                pad_token_id=pad_token_id,
                clock=clock,
            )
            batch_send = out.start_time if previous_end is None else previous_end
            for row, i in enumerate(batch):
                if send_at == "slot_free" and k > 0:
                    send = records[batches[k - 1][row]].finish_time
                else:
                    send = batch_send
                times = out.step_times[: lens[row]]
                records.append(
                    RequestRecord(
                        prompt_len=requests[i].prompt_len,
                        output_len=lens[row],
                        send_time=send,
                        first_token_time=times[0],
                        token_times=times,
                        finish_time=times[-1],
                    )
                )
                token_ids.append(out.token_ids[row])
            previous_end = out.end_time
            decode_steps += max(lens)
            wasted += sum(max(lens) - n for n in lens)
            bar.update(len(batch))
    finally:
        bar.close()
        if num_threads is not None:
            torch.set_num_threads(previous_threads)

    first_send = min(r.send_time for r in records)
    last_finish = max(r.finish_time for r in records)
    return BenchmarkResult(
        records=records,
        start_time=records[0].send_time,
        duration=last_finish - first_send,
        max_concurrency=max_concurrency,
        request_rate=math.inf,
        burstiness=1.0,
        engine_stats={
            "backend": "hf-transformers",
            "batching": "static",
            "send_at": send_at,
            "num_batches": len(batches),
            "decode_steps": decode_steps,
            "wasted_decode_tokens": wasted,
            "num_threads": threads,
            "token_ids": token_ids,
        },
    )


def load_hf_model(model: str | os.PathLike = "smollm2-135m", dtype: str = "float32"):
    """``(model, tokenizer)`` in eval mode, in ``dtype`` ("float32" or "bfloat16"), from a
    preset, a .gguf file or an HF directory.

    ``"smollm2-135m"`` is the bundled SmolLM2-135M GGUF (dequantized by transformers). The
    tokenizer is None for a directory without one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the HF peer runs float32 or bfloat16, got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    name = str(model)
    if name in HF_PRESETS:
        from research.models.weights import smollm2_gguf_path  # imports JAX; only needed here

        path = smollm2_gguf_path()
    else:
        path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch_dtype
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    elif path.is_dir() and (path / "config.json").exists():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        has_tokenizer = any(
            (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
        )
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    else:
        raise ValueError(
            f"{name!r} is neither an HF preset {HF_PRESETS}, a .gguf file nor an HF directory "
            "with a config.json"
        )
    hf.eval()
    return hf, tokenizer
