"""Serving engines as data: what each engine a GB10 owner chooses between does, with its source.

A profile says three things, each field with where it comes from (``sources``):

- the **batch policy** our scheduler runs for it: continuous or static batches, chunked prefill
  under a token budget, whether the KV cache is paged (vLLM, SGLang) or a context split into a
  fixed number of slots (llama.cpp's server, Ollama), and what a prefix cache matches (whole
  hashed blocks, or any token prefix for SGLang's radix tree);
- its **serving defaults** for the version cited (``max_num_seqs``, token budget, block size,
  memory utilization; slots and context for the llama.cpp family);
- the **kernel mechanisms** the cost model charges (``research.perf.cost_model``): up to how many
  token rows a step replays a captured graph, whether the grouped expert GEMM pads to MMQ tiles,
  whether dense GEMM math hides under the weight stream (``combine``), the KV read granule, and
  the KV dtype the engine stores.

Profiles state policy and mechanisms; the cost model prices; ``research.perf.engines.serving``
turns a profile, the machine and the user's overrides into the engine's configuration. Pure
Python: JAX is not imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from research.config import ENGINE_NAMES

PREFIX_CACHES = ("hash", "radix", "none")
POLICIES = ("continuous", "static")
# llama.cpp's CUDA backend: dense GEMMs, attention and the output layer do not overlap their math
# with the weight stream on GB10 (the dense 7B's batched decode; research.perf.validation).
LLAMA_CPP_COMBINE = {
    "dense_gemm": "sum",
    "attention": "sum",
    "lm_head": "sum",
    "expert_gemm": "max",
}
# What the llama.cpp family stores for a requested format: ggml-org's GGUF files (Q8_0; gpt-oss
# as MXFP4 experts and Q8_0 elsewhere), f16 for an unquantized model; where vLLM would run FP8,
# the GGUF of that width (Q8_0: 8.5 bits per weight).
GGUF_WEIGHTS = {
    None: None,
    "q8_0": "q8_0",
    "fp8": "q8_0",
    "gguf_mxfp4": "gguf_mxfp4",
    "mxfp4": "gguf_mxfp4",
}
LLAMA_CPP_SOURCE = "ggml-org/llama.cpp@0c1e57098"
# vLLM's published images on GB10 (sm_121), 0.11 to 0.22: every 4-bit MoE runs Marlin (W4A16),
# whatever the chip's FP4 path; NVFP4 dense layers run FlashInfer's CUTLASS FP4 GEMM; FP8 runs
# W8A8 (CUTLASS scaled_mm dense, Triton FP8 MoE). Sources in VLLM.sources["gemm_kernels"].
VLLM_GB10_KERNELS: dict[str | None, dict[str, str]] = {
    None: {"dense": "tensor", "expert": "tensor"},
    "awq": {"dense": "marlin", "expert": "marlin"},
    "mxfp4": {"dense": "marlin", "expert": "marlin"},
    "nvfp4": {"dense": "cutlass_fp4", "expert": "marlin"},
    "fp8": {"dense": "cutlass_fp8", "expert": "cutlass_fp8"},
}


@dataclass(frozen=True)
class EngineProfile:
    """One serving engine (module docstring). ``None`` in a serving default means "the engine
    derives it" (vLLM's batch defaults from the device's memory, ``vllm_batch_defaults``)."""

    name: str
    engine: str  # what it models, with its version
    # batch policy
    scheduling_policy: str
    paged: bool  # False: a context split into ``parallel`` slots (no paging)
    prefix_cache: str  # PREFIX_CACHES
    enable_chunked_prefill: bool
    # serving defaults
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    block_size: int | None  # paged engines: KV allocation granule (tokens)
    gpu_memory_utilization: float
    parallel: int | None = None  # slots (llama.cpp --parallel, OLLAMA_NUM_PARALLEL)
    # tokens of context over all slots (llama.cpp -c; None: the model's context, llama.cpp's
    # -c 0) or per slot (Ollama's num_ctx, ``ctx_per_slot``)
    ctx_size: int | None = None
    ctx_per_slot: bool = False
    # llama.cpp's --kv-unified: the slots share one pool of ctx_size cells instead of a context
    # split ctx_size / parallel ways. llama-server turns it on with its automatic slot count
    # and leaves it off when --parallel is given.
    kv_unified_by_default: bool = False
    # kernel mechanisms the cost model charges
    graph_max_tokens: int | None = None  # most rows a step replays a captured graph for
    eager_layer_overhead: bool = False  # larger steps pay the per-layer launch cost
    expert_tiles: str | None = None  # "mmq": expert rows padded to MMQ's tile
    combine: str | dict[str, str] = "max"
    kv_read_block: int | None = None  # tokens per K/V read granule (None: the block size)
    # requested quantization -> the format the engine stores (None: any engine format as is)
    weight_formats: dict[str | None, str | None] | None = None
    # machine -> stored format -> the kernel of its "dense" and "expert" GEMMs
    # (research.perf.gemm.KERNELS); a machine or format not listed runs gemm.default_kernel
    gemm_kernels: dict[str, dict[str | None, dict[str, str]]] = field(default_factory=dict)
    # how a paged pool is sized on a named machine: "vllm" (research.perf.vllm_memory: vLLM's
    # memory profile on the device's reported total) or "capacity" (kv_capacity's estimate)
    memory_profile: str = "capacity"
    # CostParams fields this engine assumes (not fitted): name -> value
    fixed: dict[str, float] = field(default_factory=dict)
    calibration: str = "vllm"  # whose GB10 fit it uses (research.perf.engines.calibration)
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"{self.name}: scheduling_policy must be one of {POLICIES}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"{self.name}: prefix_cache must be one of {PREFIX_CACHES}")
        if self.memory_profile not in ("vllm", "capacity"):
            raise ValueError(f"{self.name}: memory_profile must be 'vllm' or 'capacity'")
        if not self.paged and self.parallel is None:
            raise ValueError(f"{self.name}: an engine without paging needs its slot count")

    def options(self) -> tuple[str, ...]:
        """The override keys this engine has (``ServingOverrides`` fields it accepts)."""
        common = ("max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching")
        if self.paged:
            return (*common, "max_num_seqs", "block_size")
        return (*common, "parallel", "ctx_size")

    def kernels_for(self, quantization: str | None, hardware: str | None) -> dict[str, str] | None:
        """The GEMM kernels this engine runs ``quantization`` with on ``hardware`` (None: the
        format's default kernels, ``research.perf.gemm.default_kernel``)."""
        return self.gemm_kernels.get(hardware or "", {}).get(quantization)

    def describe(self) -> dict[str, Any]:
        """The profile as a results row records it."""
        return {"engine": self.name, "engine_version": self.engine}


VLLM = EngineProfile(
    name="vllm",
    engine="vLLM 0.12",
    scheduling_policy="continuous",
    paged=True,
    prefix_cache="hash",
    enable_chunked_prefill=True,
    max_num_seqs=None,  # 1024 on a device reporting >= 70 GiB (GB10), else 256
    max_num_batched_tokens=None,  # 8192 there, else 2048
    block_size=16,
    gpu_memory_utilization=0.9,
    combine="max",
    memory_profile="vllm",
    gemm_kernels={"gb10": VLLM_GB10_KERNELS},
    sources={
        "gemm_kernels": "MXFP4 MoE on sm_121 -> Marlin: vllm@007d5005 model_executor/layers/"
        "quantization/mxfp4.py get_mxfp4_backend (FlashInfer gated to SM90/SM100, Triton to "
        "cc < 11), vllm#41477 (0.20: marlin the default, triton and flashinfer_cutlass fail on "
        "GB10), vllm#43969 (0.22 images: MARLIN MoE backend), vllm#51158 ('silently fell back "
        "to Marlin W4A16' on SM12x); NVFP4 MoE -> Marlin in published builds (vllm#50925), "
        "dense -> FlashInfer CUTLASS FP4 (NVIDIA/dgx-spark-playbooks#91, NGC vllm 26.02/26.06); "
        "AWQ -> awq_marlin (MarlinLinearKernel on a W4A16 checkpoint, NVIDIA developer forum "
        "thread 361819); FP8 -> CUTLASS scaled_mm dense, TRITON Fp8 MoE backend (vllm#43507)",
        "scheduling_policy": "vllm/v1/core/sched/scheduler.py: one token budget shared by "
        "running decodes first, then waiting prompts, chunked",
        "prefix_cache": "vllm/v1/core/kv_cache_utils.py: hash of each FULL block chained to its "
        "parent's; a partial last block is never shared",
        "max_num_seqs": "vllm 0.12 vllm/engine/arg_utils.py get_batch_defaults: "
        "OPENAI_API_SERVER on GPUs >= 70 GiB -> 1024 seqs / 8192 tokens, else 256 / 2048",
        "block_size": "vllm/config/cache.py: 16 on CUDA",
        "gpu_memory_utilization": "vllm/config/cache.py: 0.9",
        "memory_profile": "vllm/v1/worker/gpu_worker.py determine_available_memory: "
        "ceil(total * utilization) - weights - non-torch - profile-run peak; 0.12 captures "
        "CUDA graphs after the pool (research/perf/vllm_memory.py)",
        "graph_max_tokens": "vllm/config/vllm.py: CUDA graphs captured up to min(2 * "
        "max_num_seqs, 512) tokens; not charged apart: the fitted per-step host time holds "
        "the launches (every calibration point is a captured decode or one large prefill)",
    },
)

STATIC = EngineProfile(
    name="static",
    engine="HF transformers generate (static batches)",
    scheduling_policy="static",
    paged=True,
    prefix_cache="none",
    enable_chunked_prefill=True,
    max_num_seqs=None,
    max_num_batched_tokens=None,
    block_size=16,
    gpu_memory_utilization=0.9,
    graph_max_tokens=0,  # eager PyTorch: every step launched kernel by kernel
    eager_layer_overhead=True,
    sources={
        "scheduling_policy": "transformers GenerationMixin.generate: a batch runs until its "
        "longest member finishes; the next batch starts after",
        "graph_max_tokens": "generate runs eagerly (no CUDA graphs) unless compiled",
        "block_size": "our pool's granule: generate's cache is contiguous, sized like vLLM's "
        "pool here so that only the batch policy differs",
    },
)

LLAMA_CPP = EngineProfile(
    name="llama_cpp",
    engine="llama.cpp server (llama-server, ggml-org/llama.cpp@0c1e57098)",
    scheduling_policy="continuous",
    paged=False,
    prefix_cache="none",
    enable_chunked_prefill=True,
    max_num_seqs=None,
    max_num_batched_tokens=512,  # one n_ubatch forward per step
    block_size=None,
    gpu_memory_utilization=1.0,
    parallel=4,
    ctx_size=None,
    kv_unified_by_default=True,
    graph_max_tokens=1,
    eager_layer_overhead=True,
    expert_tiles="mmq",
    combine=LLAMA_CPP_COMBINE,
    kv_read_block=256,
    weight_formats=GGUF_WEIGHTS,
    calibration="llama_cpp",
    sources={
        "parallel": f"{LLAMA_CPP_SOURCE} tools/server/server.cpp: --parallel auto -> 4 slots "
        "and kv_unified (one pool shared by the slots); an explicit -np N splits the context "
        "n_ctx / N ways (src/llama-context.cpp n_ctx_seq)",
        "ctx_size": f"{LLAMA_CPP_SOURCE} common/common.h: n_ctx 0 = the model's training context",
        "max_num_batched_tokens": f"{LLAMA_CPP_SOURCE} common/common.h: n_batch 2048 computed "
        "in ubatches of n_ubatch 512: each step here is one ubatch",
        "scheduling_policy": "tools/server/server-context.cpp update_slots: every slot's next "
        "token and pending prompt tokens share one batch (cont_batching true)",
        "max_model_len": "server-context.cpp: a prompt beyond the slot's context is rejected "
        "(ERROR_TYPE_EXCEED_CONTEXT_SIZE), never truncated",
        "prefix_cache": "cache_prompt reuses a slot's own previous prompt only (common prefix "
        "with the slot's tokens); no sharing across slots: not modelled",
        "graph_max_tokens": "ggml-cuda: CUDA graphs for single-token steps only before "
        "llama.cpp#19645 (the builds on the GB10 page)",
        "expert_tiles": "ggml-cuda mmq.cuh: each expert's rows padded to the MMQ tile",
        "combine": "research.perf.validation: the dense 7B's batched decode on GB10",
        "kv_read_block": "ggml-cuda fattn: K/V read in 256-key tiles of a contiguous cache",
    },
)

# Ollama runs llama.cpp's runner: the llama_cpp profile's mechanisms, calibration and GGUF
# weights, under Ollama's own slot, context and queue defaults.
OLLAMA = replace(
    LLAMA_CPP,
    name="ollama",
    engine="Ollama 0.12.11 (llama.cpp runner)",
    max_num_batched_tokens=512,  # num_batch
    parallel=1,
    ctx_size=4096,
    ctx_per_slot=True,
    kv_unified_by_default=False,
    sources={
        "parallel": "ollama/ollama v0.12.11 envconfig/config.go: OLLAMA_NUM_PARALLEL 1 (since "
        "v0.9.7); requests beyond it wait on llm/server.go's semaphore, in arrival order",
        "ctx_size": "v0.12.11 envconfig/config.go: OLLAMA_CONTEXT_LENGTH 4096 per slot; "
        "llm/server.go asks num_ctx * parallel and the runner splits it per slot; "
        "server/routes.go raises gpt-oss to 8192 (not modelled: pass engine.ctx_size)",
        "max_num_batched_tokens": "ollama api/types.go DefaultOptions: num_batch 512",
        "mechanisms": "llama.cpp's CUDA backend underneath: the llama_cpp profile's mechanisms",
    },
)

SGLANG = EngineProfile(
    name="sglang",
    engine="SGLang 0.5.10",
    scheduling_policy="continuous",
    paged=True,
    prefix_cache="radix",
    enable_chunked_prefill=True,
    max_num_seqs=2048,
    max_num_batched_tokens=8192,  # chunked_prefill_size
    block_size=1,  # page_size 1: the radix tree matches any token prefix
    gpu_memory_utilization=0.9,
    kv_read_block=16,
    gemm_kernels={
        "gb10": VLLM_GB10_KERNELS | {"nvfp4": {"dense": "cutlass_fp4", "expert": "cutlass_fp4"}}
    },
    sources={
        "gemm_kernels": "sgl-project/sglang#17421: the SM120 cutlass_fp4_group_mm NVFP4 MoE "
        "kernel dispatched for SM121; every other format as vLLM's images run it (an "
        "assumption: no GB10 kernel log of SGLang in the set)",
        "prefix_cache": "python/sglang/srt/mem_cache/radix_cache.py: RadixAttention, on by "
        "default, matches token prefixes at page_size granularity",
        "block_size": "python/sglang/srt/server_args.py: page_size 1",
        "max_num_batched_tokens": "sglang 0.5.10 srt/server_args.py "
        "_handle_gpu_memory_settings: chunked_prefill_size 8192 below 160 GiB (GB10 reports "
        "~120); cuda_graph_max_bs 256 there (not charged apart, as for vLLM)",
        "max_num_seqs": "model_executor/model_runner_kv_cache_mixin.py: max_running_requests "
        "from the pool, at least 2048: never binding below that",
        "scheduling_policy": "server_args.py schedule_policy 'fcfs'",
        "kv_read_block": "an assumption (not measured): FlashInfer gathers page-1 KV by index "
        "but pipelines loads in 16-token tiles",
        "gpu_memory_utilization": "server_args.py mem_fraction_static: (memory - reserved) / "
        "memory, ~0.9 on a 120 GiB device; 0.88 when the memory is unknown",
    },
)

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (VLLM, LLAMA_CPP, OLLAMA, SGLANG, STATIC)}
DEFAULT_ENGINE = "vllm"
if set(PROFILES) != set(ENGINE_NAMES):  # config validates engine= against ENGINE_NAMES
    raise RuntimeError(f"profiles {sorted(PROFILES)} differ from config's {sorted(ENGINE_NAMES)}")


def get_profile(name: str | EngineProfile) -> EngineProfile:
    """The profile called ``name`` (``PROFILES``), or ``name`` itself if it is one."""
    if isinstance(name, EngineProfile):
        return name
    if name not in PROFILES:
        raise ValueError(f"unknown engine {name!r}; expected one of {sorted(PROFILES)}")
    return PROFILES[name]


__all__ = ["DEFAULT_ENGINE", "PROFILES", "EngineProfile", "get_profile"]
