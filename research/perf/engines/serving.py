"""A profile, the machine and the user's overrides -> the engine our scheduler runs and the cost
model that prices it. The one place both the experiments and the validation replays get them.

``resolve`` checks every override against what the engine has (a KV block size for llama.cpp,
which does not page, is an error naming what is allowed) and returns ``Serving``:

- the scheduler and pool of the engine: ``max_num_seqs``, the token budget, static or continuous
  batches, chunked prefill, block size and prefix caching; for an engine without paging
  (llama.cpp's server, Ollama) the context is split into ``parallel`` slots, each one block of
  ``ctx_size / parallel`` tokens, which caps the batch at the slot count and every request at
  its slot's context;
- ``cost_model_options``: the mechanisms the profile charges, the routing law and shape of the
  workload's tokens, and the calibration of (machine, engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from research.perf.engines.profiles import EngineProfile, get_profile


@dataclass(frozen=True)
class Serving:
    """What ``resolve`` gives: ``llm_kwargs()`` for ``research.LLM``, and ``row()`` for the
    results row."""

    profile: EngineProfile
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    block_size: int
    num_kv_blocks: int | None  # None: sized by memory (paged engines)
    max_model_len: int | None  # None: the caller's (or the model's)
    cost_model_options: dict[str, Any] = field(default_factory=dict)
    routing: str | None = None
    routing_shape: float | None = None
    token_source: str | None = None
    calibration: str | None = None
    quantization: str | None = None  # the weight format the engine stores (simulated)

    def llm_kwargs(self) -> dict[str, Any]:
        out = dict(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_policy=self.profile.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            block_size=self.block_size,
        )
        if self.num_kv_blocks is not None:
            out["num_kv_blocks"] = self.num_kv_blocks
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        if self.calibration is not None:  # simulated: the format priced, the costs charged
            out |= {
                "quantization": self.quantization,
                "cost_model_options": self.cost_model_options,
            }
        return out

    def row(self) -> dict[str, Any]:
        """The keys every results row carries about how it was produced."""
        out = self.profile.describe() | {
            "scheduling_policy": self.profile.scheduling_policy,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "prefix_cache": self.profile.prefix_cache if self.enable_prefix_caching else "none",
        }
        if not self.profile.paged:
            out |= {"parallel": self.max_num_seqs, "kv_unified": self.block_size == 1}
        if self.calibration is not None:
            out |= {
                "weight_format": self.quantization or "none",
                "moe_routing": self.routing,
                "routing_shape": self.routing_shape,
                "token_source": self.token_source,
                "calibration": self.calibration,
            }
        return out


def _check_overrides(prof: EngineProfile, overrides: dict[str, Any]) -> dict[str, Any]:
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(prof.options()))
    if unknown:
        why = " (it does not page its KV cache)" if "block_size" in unknown else ""
        raise ValueError(
            f"engine {prof.name!r} has no option {', '.join(unknown)}{why}; it takes "
            f"{', '.join(prof.options())}"
        )
    return given


def _preset(model: str | None) -> Any:
    if model is None:
        return None
    try:
        from research.models.presets import get_preset

        return get_preset(model)
    except (KeyError, ValueError):
        return None


def _model_context(model: str | None, max_model_len: int | None) -> int:
    if (cfg := _preset(model)) is not None:
        return cfg.max_position_embeddings
    if max_model_len is None:
        raise ValueError("ctx_size 0 (the model's context) needs a preset model or max_model_len")
    return max_model_len


def _swa_blocks(model: str | None, parallel: int, block: int, ubatch: int) -> int:
    """Blocks of llama.cpp's separate sliding-window cache (gpt-oss): per slot, the window plus
    one ubatch, in ``block``-token blocks (our pool holds both caches: research.engine's
    block manager keeps a sliding table per sequence)."""
    cfg = _preset(model)
    if cfg is None or not cfg.sliding_layers or cfg.sliding_window is None:
        return 0
    return parallel * -(-(cfg.sliding_window + ubatch) // block)


def _slots(
    prof: EngineProfile, given: dict[str, Any], model: str | None, max_model_len: int | None
) -> tuple[int, int, int, int]:
    """(max_num_seqs, block_size, num_kv_blocks, max_model_len) of an engine without paging:
    ``parallel`` slots over one context. Split: each slot owns one block of its share of the
    context. Unified (llama-server's automatic slot count): the slots share one pool of
    ``ctx_size`` single-token cells and a request may fill it."""
    parallel = given.get("parallel", prof.parallel)
    unified = prof.kv_unified_by_default and "parallel" not in given
    ctx = given.get("ctx_size", prof.ctx_size) or _model_context(model, max_model_len)
    if parallel < 1 or ctx < 2:
        raise ValueError(f"parallel must be >= 1 and ctx_size >= 2, got {parallel}, {ctx}")
    ubatch = given.get("max_num_batched_tokens", prof.max_num_batched_tokens) or 512
    if unified:
        cap = ctx if max_model_len is None else min(ctx, max_model_len)
        return parallel, 1, ctx + _swa_blocks(model, parallel, 1, ubatch), cap
    per_slot = ctx if prof.ctx_per_slot else ctx // parallel
    if per_slot < 2:
        raise ValueError(f"ctx_size {ctx} split over {parallel} slots leaves {per_slot} tokens")
    cap = per_slot if max_model_len is None else min(per_slot, max_model_len)
    return parallel, per_slot, parallel + _swa_blocks(model, parallel, per_slot, ubatch), cap


def resolve(
    engine: str | EngineProfile = "vllm",
    hardware: str | None = None,
    *,
    model: str | None = None,
    quantization: str | None = None,
    token_source: str = "random",
    max_model_len: int | None = None,
    simulated: bool | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    **overrides: Any,
) -> Serving:
    """The engine ``engine`` on ``hardware`` (None or ``"host"``: this machine, real executor)
    with ``overrides`` (``EngineProfile.options``; None = the profile's default). ``simulated``
    (default: a named machine) adds the cost-model options, calibration and routing law of
    ``model`` at ``quantization`` on tokens from ``token_source``, and a paged engine whose
    profile says ``memory_profile="vllm"`` gets the pool vLLM's memory profile leaves
    (``research.perf.vllm_memory``) at ``gpu_memory_utilization`` (default: the profile's)."""
    from research.perf.kv_capacity import vllm_batch_defaults

    prof = get_profile(engine)
    given = _check_overrides(prof, overrides)
    named = hardware not in (None, "host")
    simulated = named if simulated is None else simulated
    if prof.weight_formats is not None and simulated:
        if quantization not in prof.weight_formats:
            allowed = ", ".join("none" if f is None else f for f in prof.weight_formats)
            raise ValueError(
                f"engine {prof.name!r} runs GGUF files: quantization must be one of {allowed}, "
                f"got {quantization!r}"
            )
        quantization = prof.weight_formats[quantization]
    budget_default, seqs_default = vllm_batch_defaults(hardware) if named else (2048, 256)
    budget = given.get("max_num_batched_tokens", prof.max_num_batched_tokens or budget_default)
    chunked = given.get("enable_chunked_prefill", prof.enable_chunked_prefill)
    caching = given.get("enable_prefix_caching", prof.prefix_cache != "none")
    if caching and prof.prefix_cache == "none":
        raise ValueError(f"engine {prof.name!r} has no prefix cache shared across requests")
    if prof.paged:
        seqs = given.get("max_num_seqs", prof.max_num_seqs or seqs_default)
        block, blocks, model_len = given.get("block_size", prof.block_size), None, max_model_len
    else:
        seqs, block, blocks, model_len = _slots(prof, given, model, max_model_len)
    serving = Serving(prof, seqs, budget, chunked, caching, block, blocks, model_len)
    if not simulated:
        return serving
    if model is None:
        raise ValueError("a simulated engine needs the model it serves")
    serving = replace(serving, quantization=quantization)
    # vLLM's pages hold bf16 or fp8 K/V; our int4 pages (an ablation) keep kv_capacity's sizing.
    if prof.paged and prof.memory_profile == "vllm" and named and kv_cache_dtype != "int4":
        from research.perf.vllm_memory import vllm_memory_profile

        util = (
            prof.gpu_memory_utilization
            if gpu_memory_utilization is None
            else gpu_memory_utilization
        )
        mem = vllm_memory_profile(
            model,
            quantization,
            hardware,
            util,
            max_num_batched_tokens=budget,
            tensor_parallel_size=tensor_parallel_size,
            block_size=block,
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=max_model_len,
        )
        serving = replace(serving, num_kv_blocks=mem.kv.num_blocks)
    return _with_costs(serving, hardware, model, token_source)


def mechanism_options(
    prof: EngineProfile, hardware: str, model: str, quantization: str | None,
    token_source: str, block_size: int,
) -> dict[str, Any]:  # fmt: skip
    """The cost-model options of ``prof``'s mechanisms (no parameters): the routing law of the
    workload's tokens, how operators combine, expert tiles, graph replay, the KV read granule
    and the GEMM kernels it runs ``quantization`` with on ``hardware``."""
    from research.perf.routing import routing_for

    law, shape = routing_for(model, token_source)
    return {
        "moe_routing": law,
        "moe_load_sigma": shape,
        "combine": prof.combine,
        "expert_tiles": prof.expert_tiles,
        "graph_max_tokens": prof.graph_max_tokens if prof.eager_layer_overhead else None,
        "block_size": prof.kv_read_block or block_size,
        "gemm_kernels": prof.kernels_for(quantization, hardware),
    }


def _with_costs(serving: Serving, hardware: str, model: str, token_source: str) -> Serving:
    from research.perf.engines.calibration import engine_params

    prof = serving.profile
    options = mechanism_options(
        prof, hardware, model, serving.quantization, token_source, serving.block_size
    )
    params, label = engine_params(prof, hardware, model)
    return replace(
        serving,
        cost_model_options={"params": params} | options,
        routing=options["moe_routing"],
        routing_shape=options["moe_load_sigma"],
        token_source=token_source,
        calibration=label,
    )


def from_run(run: Any, model: str | None = None) -> Serving:
    """``resolve`` for an experiment's ``RunConfig``: its ``engine`` group, cache options,
    machine, model and workload's token source (``hardware.moe_routing``, when set, replaces
    the token source's law: an ablation)."""
    simulated = run.executor.kind == "simulated"
    serving = resolve(
        run.engine.name,
        run.hardware.name,
        model=model or run.model.model,
        quantization=run.quantization.quantization,
        token_source=run.workload.token_source,
        max_model_len=run.model.max_model_len,
        simulated=simulated,
        gpu_memory_utilization=run.hardware.gpu_memory_utilization,
        tensor_parallel_size=run.hardware.tensor_parallel_size,
        kv_cache_dtype=run.quantization.kv_cache_dtype,
        block_size=run.cache.block_size,
        enable_prefix_caching=run.cache.enable_prefix_caching,
        **run.engine.overrides(),
    )
    if run.cache.num_kv_blocks is not None:  # the user's pool size wins over any sizing
        serving = replace(serving, num_kv_blocks=run.cache.num_kv_blocks)
    law = run.hardware.moe_routing
    if simulated and law is not None and law != serving.routing:
        options = serving.cost_model_options | {"moe_routing": law}
        serving = replace(serving, cost_model_options=options, routing=law)
    kernels = {c: k for c, k in run.engine.gemm_kernels.items() if k is not None}
    return with_build(serving, kernels, run.quantization.quantized_layers)


def with_build(
    serving: Serving,
    gemm_kernels: dict[str, str] | None,
    quantized_layers: tuple[str, ...] | None,
) -> Serving:
    """``serving`` with a build's GEMM kernels (per class, over the profile's) and the layer
    groups its checkpoint stores quantized (vLLM's ``--mxfp4-layers``): what
    ``engine.gemm_kernels`` and ``quantization.quantized_layers`` set. Both price a simulated
    engine; a real one runs what it loaded and refuses them."""
    if not gemm_kernels and not quantized_layers:
        return serving
    if not serving.cost_model_options:
        raise ValueError(
            "engine.gemm_kernels and quantization.quantized_layers price a simulated engine "
            "(executor=simulated); the real executor runs the kernels and weights it loaded"
        )
    from research.config import QUANTIZED_LAYER_GROUPS

    options = dict(serving.cost_model_options)
    if gemm_kernels:
        options["gemm_kernels"] = {**(options.get("gemm_kernels") or {}), **gemm_kernels}
    if quantized_layers:
        keys = [k for group in quantized_layers for k in QUANTIZED_LAYER_GROUPS[group]]
        options["quantized_weights"] = tuple(dict.fromkeys(keys))
    return replace(serving, cost_model_options=options)


__all__ = ["Serving", "from_run", "mechanism_options", "resolve", "with_build"]
