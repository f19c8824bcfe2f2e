"""``fit_max_model_len``: ``model.max_model_len`` sized for the workload's longest request
before the run starts.

The sizing rule (``fit_max_model_len``, called by ``experiments.run`` before any runner): a trace
(``azure_*``, ``mooncake_*``, ``trace``), ``chat_sessions`` or ``agents`` workload knows its
longest request (prompt + output tokens, after ``workload.length_scale``) before the first point.
When that exceeds ``model.max_model_len``:

- a ``model.max_model_len`` given on the command line (``model.max_model_len=N``, also with ``+``
  or ``++``) is the user's: the run stops with a ValueError naming it, the longest prompt, the
  value that would fit and a ``workload.length_scale`` that would;
- otherwise the value came from a config file (the model preset's, or an experiment's): it is
  raised to the longest request rounded up to a multiple of ``MAX_MODEL_LEN_STEP`` (1,024)
  tokens, never past the model's own context (``max_position_embeddings``), and only if the
  engine's KV pool holds one such request (``pool_tokens``) and an engine without paging gives
  a request that much of its slot. The run logs a warning from what to what and why and keeps
  the old value in ``model.max_model_len_raised_from`` (every results row's ``config``, and the
  sweep's rows as ``max_model_len`` / ``max_model_len_raised_from``). Where the model's context
  or the pool is too small, the run stops naming ``workload.length_scale``.

Only the executors that run this project's engine (``real``, ``simulated``) and the runners that
send the workload (``sweep``, ``engine_comparison``, ``capacity``) are sized; a server over HTTP
and HF ``generate`` keep their own limits, and ``sharegpt_sessions`` lengths come from its file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.workloads import scaled
from research.config import TRACE_DATASETS, ModelConfig, RunConfig

log = logging.getLogger(__name__)

# Runners that send ``run.workload`` (the validations build their own requests).
WORKLOAD_RUNNERS = ("sweep", "engine_comparison", "capacity")
SIZED_EXECUTORS = ("real", "simulated")
# A raised max_model_len is the longest request rounded up to a multiple of this.
MAX_MODEL_LEN_STEP = 1024


@dataclass(frozen=True)
class LongestRequest:
    """The longest request a run's workload sends (prompt and output tokens, after
    ``workload.length_scale``) and which request that is."""

    prompt_len: int
    output_len: int
    of: str

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.output_len


def trace_requests_read(run: RunConfig) -> int | None:
    """How many of a trace's first records the run sends: the largest point's timed requests or
    its warm-up, whichever is more (``experiments.sweep.run_point`` takes ``prompts_per_concurrency
    x C`` and the warm-up ``warmup_prompts_per_concurrency x C``, both from the trace's start).
    None for the capacity search, which reads as far as its runs grow."""
    e = run.experiment
    if e.runner == "capacity":
        return None
    per_slot = max(e.prompts_per_concurrency, e.warmup_prompts_per_concurrency if e.warmup else 0)
    return max(e.concurrencies) * per_slot


Lengths = Callable[[float], tuple[int, int]]


def _longest_at(run: RunConfig) -> tuple[Lengths, str] | None:
    """(length_scale -> (prompt, output) of the workload's longest request, which request that
    is), or None for a workload that is not sized here."""
    from research.bench.workload import length_bounds

    w = run.workload
    if w.dataset in TRACE_DATASETS:
        from research.bench import datasets

        records = datasets.load_trace(w.path if w.dataset == "trace" else w.dataset, w.trace_format)
        n = trace_requests_read(run)
        of = f"the longest of all {len(records):,} requests of the trace"
        if n is not None and n < len(records):
            records = records[:n]
            of = f"the longest of the trace's first {n:,} requests, the ones this run sends"

        def trace(scale: float) -> tuple[int, int]:
            return max(datasets.trace_lengths(records, scale), key=sum)

        return trace, of
    if w.dataset == "chat_sessions":

        def chat(scale: float) -> tuple[int, int]:
            # A conversation's last turn: the system prompt, every message and answer before it
            # and its own message (lengths at the top of their range), then its answer.
            message = length_bounds(scaled(w.input_len, scale), w.range_ratio)[1]
            answer = length_bounds(scaled(w.output_len, scale), w.range_ratio)[1]
            return scaled(w.system_len, scale) + w.turns * message + (w.turns - 1) * answer, answer

        return chat, f"the last turn of a {w.turns}-turn conversation"
    if w.dataset == "agents":

        def agent(scale: float) -> tuple[int, int]:
            # A task's last call: the context, then every earlier answer and tool output.
            answer, tool = scaled(w.output_len, scale), scaled(w.tool_output_len, scale)
            return scaled(w.context_len, scale) + (w.turns - 1) * (answer + tool), answer

        return agent, f"the last call of a {w.turns}-call task"
    return None


def longest_request(run: RunConfig) -> LongestRequest | None:
    """The longest request ``run.workload`` sends (module notes), or None for a workload whose
    lengths are not known before the run (random draws, ShareGPT files)."""
    found = _longest_at(run)
    if found is None:
        return None
    lengths, of = found
    prompt, output = lengths(run.workload.length_scale)
    return LongestRequest(prompt, output, of)


def model_shape(model: str) -> ModelConfig | None:
    """The shapes (and context length) of a preset, an orbax checkpoint, an HF directory or a
    GGUF file, read without loading weights; None where they cannot be read."""
    from research.models.presets import PRESETS

    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    try:
        if (path / "model_config.json").is_file():
            return ModelConfig.from_dict(json.loads((path / "model_config.json").read_text()))
        if (path / "config.json").is_file():
            from research.models.weights import config_from_hf

            return config_from_hf(json.loads((path / "config.json").read_text()))
        if path.suffix == ".gguf" and path.is_file():
            import gguf

            from research.models.weights import config_from_gguf

            return config_from_gguf(gguf.GGUFReader(str(path)))
    except (OSError, ValueError, KeyError):
        return None
    return None


def served_runs(run: RunConfig) -> list[RunConfig]:
    """One ``RunConfig`` per engine the run builds: each model of ``experiment.models``, or each
    cell of an engine comparison (``experiments.engine_comparison.cell_run``)."""
    if run.experiment.runner == "engine_comparison":
        from experiments.engine_comparison import cell_run, cells

        return [cell_run(run, m, e, t) for m, t, e in cells(run)]
    models = run.experiment.models or (run.model.model,)
    return [dataclasses.replace(run, model=dataclasses.replace(run.model, model=m)) for m in models]


def pool_tokens(run: RunConfig, cfg: ModelConfig) -> tuple[int, int | None]:
    """(tokens the KV pool of ``run``'s engine holds, the most tokens the engine gives one
    request: an unpaged engine's slot, else None), sized as the backend sizes it: the user's
    ``cache.num_kv_blocks``, the engine profile's (vLLM's memory profile, an unpaged engine's
    slots), else the KV-capacity formula (simulated) or ``cache.kv_cache_memory_bytes`` (real).
    The engine refuses a request longer than its pool (``research.engine.validation``)."""
    from research.perf.engines.serving import from_run

    serving = from_run(run)
    blocks = serving.num_kv_blocks
    if blocks is None and run.executor.kind == "simulated":
        from research.perf.kv_capacity import kv_capacity_blocks

        blocks = kv_capacity_blocks(
            cfg,
            serving.quantization,
            run.hardware.name,
            run.hardware.gpu_memory_utilization,
            serving.block_size,
            kv_cache_dtype=run.quantization.kv_cache_dtype,
            dtype="bfloat16" if run.model.dtype == "auto" else run.model.dtype,
            tensor_parallel_size=run.hardware.tensor_parallel_size,
        )
    elif blocks is None:
        from research.engine.args import DTYPES
        from research.engine.kv_cache import kv_pool_bytes_per_block
        from research.models.load import auto_dtype

        dtype = auto_dtype(run.model.model) if run.model.dtype == "auto" else run.model.dtype
        per_block = kv_pool_bytes_per_block(
            cfg, serving.block_size, DTYPES[dtype], run.quantization.kv_cache_dtype
        )
        blocks = run.cache.kv_cache_memory_bytes // per_block
    cap = None if serving.profile.paged else serving.max_model_len
    return blocks * serving.block_size, cap


def max_model_len_given(overrides: list[str]) -> bool:
    """Whether the command line sets ``model.max_model_len`` (``model.max_model_len=N``, with or
    without ``+`` / ``++``): Hydra's task overrides (``HydraConfig.get().overrides.task``)."""
    return any(o.lstrip("+~").split("=", 1)[0].strip() == "model.max_model_len" for o in overrides)


def _workload_name(run: RunConfig) -> str:
    w = run.workload
    return f"workload.path={w.path}" if w.dataset == "trace" else f"workload={w.dataset}"


def _fitting_scale(lengths: Lengths, below: float, limit: int) -> float | None:
    """The largest 1/2^k under ``below`` at which the longest request fits in ``limit`` tokens
    (a power of two keeps a Mooncake trace's 512-token blocks whole engine blocks)."""
    for k in range(1, 40):
        scale = 2.0**-k
        if scale < below and sum(lengths(scale)) <= limit:
            return scale
    return None


def fit_max_model_len(run: RunConfig, *, explicit: bool) -> RunConfig:
    """``run`` with ``model.max_model_len`` raised to its workload's longest request where the
    rule allows it, or a ValueError saying what to change (module notes). ``explicit``: the
    command line set ``model.max_model_len`` (``max_model_len_given``)."""
    w = run.workload
    if run.executor.kind not in SIZED_EXECUTORS or run.experiment.runner not in WORKLOAD_RUNNERS:
        return run
    found = _longest_at(run)
    if found is None:
        return run
    lengths, of = found
    prompt, output = lengths(w.length_scale)
    needed, current = prompt + output, run.model.max_model_len
    if current is not None and needed <= current:
        return run
    served = served_runs(run)
    shapes = {r.model.model: model_shape(r.model.model) for r in served}
    contexts = {m: c.max_position_embeddings for m, c in shapes.items() if c is not None}
    tightest = min(contexts, key=lambda m: contexts[m]) if contexts else None
    native = contexts[tightest] if tightest is not None else None
    longest = (
        f"{_workload_name(run)} sends a prompt of {prompt:,} tokens (+{output:,} output), {of}"
    )
    noun = "trace" if w.dataset in TRACE_DATASETS else "workload"

    def shrink(limit: int) -> str:
        scale = _fitting_scale(lengths, w.length_scale, limit)
        return (
            f"scale the {noun} (workload.length_scale={scale!r})"
            if scale
            else f"shorten the {noun}"
        )

    past_context = native is not None and needed > native
    context = f"{tightest}'s context is {native:,} tokens" if native is not None else ""
    if current is None:  # the engine takes the model's own context
        if not past_context:
            return run
        raise ValueError(f"{longest}; {context}: {shrink(native)}")
    rounded = -(-needed // MAX_MODEL_LEN_STEP) * MAX_MODEL_LEN_STEP
    target = min(rounded, native) if native is not None else rounded
    if explicit:
        fix = (
            f"{context}, so {shrink(current)}"
            if past_context
            else f"raise it (model.max_model_len={target}) or {shrink(current)}"
        )
        raise ValueError(
            f"{longest}; model.max_model_len={current} was set on the command line: {fix}"
        )
    if unknown := [m for m, c in shapes.items() if c is None]:
        raise ValueError(
            f"{longest}, past model.max_model_len={current}, and {unknown[0]}'s context length "
            f"cannot be read before it loads: set model.max_model_len (within its context) or "
            f"{shrink(current)}"
        )
    if past_context:
        raise ValueError(
            f"{longest}; {context} (model.max_model_len={current} cannot be raised past it): "
            f"{shrink(native)}"
        )
    raised = dataclasses.replace(
        run,
        model=dataclasses.replace(
            run.model, max_model_len=target, max_model_len_raised_from=current
        ),
    )
    pools = []
    for r in served_runs(raised):
        pool, slot = pool_tokens(r, shapes[r.model.model])
        if slot is not None and slot < needed:
            fix = (
                "leave it out of experiment.engines"
                if run.experiment.runner == "engine_comparison"
                else "raise engine.ctx_size"
            )
            raise ValueError(
                f"{longest}; engine={r.engine.name} gives a request at most {slot:,} tokens (its "
                f"slot of engine.ctx_size): {fix} or {shrink(slot)}"
            )
        if pool < needed:
            memory = (
                "hardware.gpu_memory_utilization, cache.num_kv_blocks"
                if r.executor.kind == "simulated"
                else "cache.kv_cache_memory_bytes, cache.num_kv_blocks"
            )
            raise ValueError(
                f"{longest}; {r.model.model}'s KV pool on {r.hardware.name} holds {pool:,} tokens, "
                f"less than that one request: give it more ({memory}) or {shrink(pool)}"
            )
        pools.append(pool)
    how = f"the next multiple of {MAX_MODEL_LEN_STEP:,}" if target == rounded else "its context"
    log.warning(
        f"{longest}: model.max_model_len raised from {current:,} (a config file's value; the "
        f"command line did not set it) to {target:,} ({how}; {context}, the KV pool holds "
        f"{min(pools):,} tokens). Set model.max_model_len on the command line to choose it yourself."
    )
    return raised
