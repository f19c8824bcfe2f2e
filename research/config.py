"""Frozen configuration dataclasses, one per concern.

These are the single schema of the project: presets are instances of them, loaders build them
from HF ``config.json`` / GGUF metadata, and the Hydra config groups (``configs/``) are backed by
them through Hydra's ConfigStore. No environment variable configures library code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

Architecture = Literal["llama", "qwen3", "qwen3_moe", "gpt_oss"]
# Architectures whose forward pass exists in research.models; the others are shapes only
# (used by the cost model and the KV-capacity formula).
RUNNABLE_ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """Frequency-dependent RoPE scaling: Llama-3's (``rope_type="llama3"``: ``low_freq_factor``,
    ``high_freq_factor``) or YaRN (``rope_type="yarn"``: ``beta_fast``, ``beta_slow``,
    ``truncate`` and the cos/sin gain ``attention_factor``, None = 0.1 ln(factor) + 1), with HF's
    field names and defaults."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "yarn"):
            raise ValueError(f"rope_type must be 'llama3' or 'yarn', got {self.rope_type!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of a decoder-only transformer. Sizes are data, not code.

    Dense models have ``num_experts == 0``; MoE models (Qwen3-MoE, gpt-oss) route every token
    to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``.
    """

    name: str
    architecture: Architecture
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # gpt-oss alternates sliding-window (this many tokens) and full attention layers:
    # ``layer_types[i]`` is "sliding_attention" or "full_attention" (empty: all full).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # gpt-oss switches: biases on q/k/v/o; a learned per-head logit in every softmax denominator
    # (attention sinks); a router with a bias whose softmax runs over the top-k logits only;
    # experts with biases and the clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g = gate,
    # gate clamped above and up on both sides at ``swiglu_limit`` (None: plain SwiGLU).
    attention_bias: bool = False
    attention_sinks: bool = False
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"{self.name}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if not self.is_moe and self.intermediate_size <= 0:
            raise ValueError(f"{self.name}: a dense model needs intermediate_size > 0")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(
                    f"{self.name}: layer_types must name one of {LAYER_TYPES} for each of the "
                    f"{self.num_layers} layers; got {self.layer_types}"
                )
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError(f"{self.name}: sliding_attention layers need sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """Keys a query of ``layer`` sees (itself included), or None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def sliding_layers(self) -> int:
        """How many layers attend within ``sliding_window`` only."""
        return sum(self.layer_window(i) is not None for i in range(self.num_layers))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def runnable(self) -> bool:
        return self.architecture in RUNNABLE_ARCHITECTURES

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """K and V bytes one token occupies across all layers (bf16 by default)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: ``num_kv_blocks`` blocks of ``block_size`` tokens, shared by all
    sequences. ``num_kv_blocks=None`` sizes the pool from ``kv_cache_memory_bytes``."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class CacheOptions:
    """The ``cache`` group: the KV pool as the user sets it; None takes the engine profile's
    value (``research.perf.engines``): vLLM's 16-token blocks and prefix caching, SGLang's
    1-token pages and radix cache. An engine without paging (llama.cpp) takes no block size."""

    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


# research.perf.engines.PROFILES has one profile per name (checked where they are defined).
ENGINE_NAMES = ("vllm", "llama_cpp", "ollama", "sglang", "static")


@dataclass(frozen=True)
class ServingConfig:
    """The ``engine`` group: which serving engine is modelled (``research.perf.engines.
    PROFILES``: vllm, llama_cpp, ollama, sglang, static) and the options a user passes it;
    None takes the profile's default for the version it cites. ``parallel`` and ``ctx_size``
    are llama.cpp's ``--parallel`` / ``-c`` (Ollama's ``OLLAMA_NUM_PARALLEL`` / ``num_ctx``);
    ``max_num_seqs`` is for engines that page their KV cache."""

    name: str = "vllm"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    parallel: int | None = None
    ctx_size: int | None = None
    # Simulated executor: the GEMM kernel per class (dense, expert) instead of the profile's
    # for this format and machine (research.perf.gemm.KERNELS), e.g. a vLLM build with
    # CUTLASS MXFP4 MoE: {dense: cutlass_fp4, expert: cutlass_fp4}; a class not named keeps
    # the profile's (null: the profile's). engine.gemm_kernels.expert=cutlass_fp4 sets one.
    gemm_kernels: dict[str, str | None] = field(
        default_factory=lambda: {"dense": None, "expert": None}
    )

    def __post_init__(self) -> None:
        # The names are checked here, not by importing the profiles: research.perf imports
        # this module, and a default RunConfig is built at import time.
        if self.name not in ENGINE_NAMES:
            raise ValueError(
                f"unknown engine {self.name!r}; expected one of {sorted(ENGINE_NAMES)}"
            )
        if set(self.gemm_kernels) - {"dense", "expert"}:  # a dict built in Python
            raise ValueError(
                f"engine.gemm_kernels maps dense and/or expert to a kernel, got "
                f"{dict(self.gemm_kernels)}"
            )

    def overrides(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                      "parallel", "ctx_size")
        }  # fmt: skip


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling (vLLM's names).

    ``continuous`` rebuilds the batch every step; ``static`` admits a new batch only when every
    request of the previous one has finished (the baseline continuous batching is compared to).
    """

    max_num_seqs: int = 256  # vLLM's default
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "continuous"  # continuous | static
    enable_chunked_prefill: bool = True
    # vLLM's multi-step scheduling: a step of decodes only runs up to this many decode steps in
    # one call (each row's sample its next input), its slots allocated ahead; stops are checked
    # after the call. 1 = one step per call.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if (
            isinstance(self.num_scheduler_steps, bool)
            or not isinstance(self.num_scheduler_steps, int)
            or not 1 <= self.num_scheduler_steps <= 1024
        ):
            raise ValueError(
                f"num_scheduler_steps must be an integer in [1, 1024], got {self.num_scheduler_steps!r}"
            )
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(
                f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys).

    ``ngram``: prompt lookup. The last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens of a
    sequence are looked up earlier in its own tokens (longest n-gram first, latest match), and
    up to ``num_speculative_tokens`` tokens that followed the match are proposed.
    ``draft_model``: ``model`` (a preset name or path with the target's vocabulary) decodes
    ``num_speculative_tokens`` tokens greedily from its own paged KV cache.
    The target model verifies the drafts in the same step; rejection sampling keeps its output
    distribution.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # draft_model: the draft's preset name or path

    def __post_init__(self) -> None:
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                "speculative_config: method 'draft_model' needs 'model' (a preset name or path), "
                f"got {self.model!r}"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        for name, low in (
            ("num_speculative_tokens", 1),
            ("prompt_lookup_max", 1),
            ("prompt_lookup_min", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"speculative_config: {name} must be an integer >= {low}, got {value!r}"
                )
        if self.num_speculative_tokens > 64:
            raise ValueError(
                "speculative_config: num_speculative_tokens must be <= 64, got "
                f"{self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_dict(cls, d: Any) -> SpeculativeConfig | None:
        """vLLM's dict (None, a dict or a SpeculativeConfig) -> a SpeculativeConfig or None.
        Unknown keys and bad values raise ValueError naming them."""
        if d is None or isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {d!r}")
        d = dict(d)
        if "model" in d and "method" not in d:
            d["method"] = "draft_model"  # vLLM infers the method from the model
        if "method" not in d:
            raise ValueError(
                f"speculative_config needs 'method' (one of {SPECULATIVE_METHODS}), got {d!r}"
            )
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known keys are {sorted(known)}"
            )
        low = d.get("prompt_lookup_min")
        if "prompt_lookup_max" not in d and isinstance(low, int) and not isinstance(low, bool):
            d["prompt_lookup_max"] = max(low, cls.prompt_lookup_max)
        return cls(**d)


# ---------------------------------------------------------------------- experiment schemas
# The Hydra app (``python -m experiments.run``) composes one RunConfig from the config groups in
# ``configs/``; ``register_configs`` stores these dataclasses in Hydra's ConfigStore so every
# YAML file is checked against them (unknown keys and wrong types are errors).

QUANTIZATION_CHOICES = (None, "awq", "nvfp4", "mxfp4", "fp8")
# vLLM's --mxfp4-layers groups -> the per-layer weight keys they store quantized.
QUANTIZED_LAYER_GROUPS = {
    "moe": ("w_gate", "w_up", "w_down"),
    "qkv": ("wq", "wk", "wv"),
    "o": ("wo",),
    "lm_head": ("lm_head",),
}
KV_CACHE_DTYPES = ("auto", "fp8", "int4")
EXECUTORS = ("real", "simulated", "hf", "http")


@dataclass(frozen=True)
class LoadConfig:
    """Which model and how to load it: a preset name, HF directory, GGUF file or orbax
    checkpoint; the dtype of activations and unquantized weights."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    max_model_len: int | None = None
    seed: int = 0
    # What max_model_len was before the run raised it to its workload's longest request
    # (experiments.context_len.fit_max_model_len); None: max_model_len is as configured.
    max_model_len_raised_from: int | None = None

    def __post_init__(self) -> None:
        raised = self.max_model_len_raised_from
        if raised is not None and (self.max_model_len is None or self.max_model_len <= raised):
            raise ValueError(
                f"max_model_len_raised_from={raised} says max_model_len was raised, but it is "
                f"{self.max_model_len}"
            )


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization applied at load and the KV-cache storage format."""

    quantization: str | None = None  # None | awq | nvfp4 | mxfp4 | fp8
    kv_cache_dtype: str = "auto"  # auto | fp8 | int4
    # Simulated executor: which layer groups are stored in ``quantization`` (vLLM's
    # ``--mxfp4-layers moe,qkv,o,lm_head``: moe, qkv, o, lm_head); None: the format's own
    # (the experts, or every linear layer for a dense model), the rest in the activation dtype.
    quantized_layers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.quantized_layers is not None:
            unknown = set(self.quantized_layers) - set(QUANTIZED_LAYER_GROUPS)
            if unknown or not self.quantized_layers:
                raise ValueError(
                    f"quantized_layers must be a non-empty list of {list(QUANTIZED_LAYER_GROUPS)}"
                    f" (vLLM's --mxfp4-layers), got {list(self.quantized_layers)}"
                )
            if self.quantization is None:
                raise ValueError(
                    f"quantized_layers needs a weight format that stores layers "
                    f"(awq, nvfp4, mxfp4, fp8), got quantization={self.quantization!r}"
                )
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class ExecutorConfig:
    """What runs the steps: ``real`` (JAX on this machine), ``simulated`` (a cost model of
    ``hardware``), or ``hf`` (HF transformers ``generate`` in static batches, the peer run).
    ``http`` benchmarks an OpenAI-compatible server (ours or vLLM) at ``base_url``."""

    kind: str = "real"
    attention_backend: str = "auto"  # auto | xla | native | pallas | pallas_interpret
    # bf16 projections: auto | xla | native (AMX kernel, research.native.gemm)
    gemm_backend: str = "auto"
    base_url: str | None = None  # http: e.g. http://127.0.0.1:8000 (without /v1)
    api_key: str | None = None  # http: sent as "Authorization: Bearer <api_key>"
    label: str | None = None  # http: names the server's line (e.g. llama-server, vllm)
    # real: compile every step shape a point will use before timing it (vLLM's graph capture);
    # true runs each point's shapes eagerly (compiled inside the point, as they come).
    enforce_eager: bool = False
    # real: JAX's persistent compilation cache (null: off), so a second run skips XLA compiles
    compilation_cache_dir: str | None = "~/.cache/research/jax"
    # real: decode steps one call may run (vLLM's multi-step scheduling; 1: one a call)
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ValueError(f"executor kind must be one of {EXECUTORS}, got {self.kind!r}")
        n = self.num_scheduler_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"executor.num_scheduler_steps must be an integer >= 1, got {n!r}")
        if n > 1 and self.kind != "real":
            raise ValueError(
                f"executor.num_scheduler_steps={n} runs on the real executor, not "
                f"{self.kind!r} (the simulator prices one step a token; a server takes "
                "--num-scheduler-steps itself)"
            )


@dataclass(frozen=True)
class HardwareConfig:
    """The machine: ``host`` for the real executor on this machine, or a named machine of the
    cost model. ``gpu_memory_utilization`` sizes the KV pool on named machines, as in vLLM."""

    name: str = "host"
    gpu_memory_utilization: float = 0.9
    # Devices one model is split across (TP): boxes when simulated; on the real executor, this
    # machine's devices (on a CPU, XLA host devices; see research.parallel)
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts split over those devices / boxes
    num_replicas: int = 1  # simulated: independent boxes behind a router (DP)
    routing: str = "random"  # simulated replicas: random | least_loaded | prefix_aware
    # simulated: research.perf.routing.ROUTING_LAWS; None: the law of the workload's tokens
    moe_routing: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.num_replicas < 1:
            raise ValueError("tensor_parallel_size and num_replicas must be >= 1")


@dataclass(frozen=True)
class WorkloadConfig:
    """What the benchmark sends (``research.bench.datasets``, ``research.bench.sessions``), with
    ``vllm bench serve``'s dataset names: ``random`` (lengths uniform in [L(1 - r), L(1 + r)],
    ``prefix_len`` shared tokens first), ``prefix_repetition``, ``sharegpt``, ``burstgpt`` and
    ``custom`` (a local ``path``), the shipped traces (``azure_code``, ``azure_conv``,
    ``mooncake_conversation``, ``mooncake_synthetic``) or ``trace`` (a user's file at ``path``
    in ``trace_format``), and multi-turn users: ``chat_sessions``, ``agents``, ``sharegpt_sessions``.
    Arrivals all at once (rate inf) or gamma with ``burstiness`` (1 = Poisson) at
    ``request_rate`` per second; a trace replays its own times (x ``time_scale``) unless
    ``replay_timestamps`` is off; sessions arrive at ``request_rate`` users per second.
    ``length_scale`` shrinks trace and session lengths for small models."""

    dataset: str = "random"
    # random ids (vllm bench serve's random dataset) or natural text: picks the MoE routing
    # law's shape in simulation (research.perf.routing.routing_for)
    token_source: str = "random"
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    prefix_len: int = 0  # random: --random-prefix-len; prefix_repetition: its prefix length
    suffix_len: int = 256  # prefix_repetition
    num_prefixes: int = 10  # prefix_repetition
    path: str | None = None  # sharegpt, burstgpt, custom, trace
    trace_format: str | None = None  # trace: azure | mooncake (default from the suffix)
    time_scale: float = 1.0  # traces: arrival times are multiplied by it
    length_scale: float = 1.0  # traces and sessions: every length is multiplied by it
    replay_timestamps: bool = True
    # sessions: turns per chat user (calls per agent), think time between turns
    turns: int = 5
    think_time_s: float = 10.0
    think_time_dist: str = "fixed"  # chat_sessions: fixed | exponential (mean think_time_s)
    system_len: int = 256  # chat_sessions
    context_len: int = 20000  # agents: the first call's context
    tool_output_len: int = 600  # agents: tokens a tool adds before the next call
    tool_time_s: float = 25.0  # agents

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.dataset in PATH_DATASETS and not self.path:
            raise ValueError(f"dataset {self.dataset!r} reads a local file: set workload.path")
        if self.token_source not in ("random", "text"):
            raise ValueError(f"token_source must be 'random' or 'text', got {self.token_source!r}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("request_rate and burstiness must be > 0")
        if min(self.prefix_len, self.suffix_len, self.tool_output_len) < 0:
            raise ValueError("prefix_len, suffix_len and tool_output_len must be >= 0")
        if self.num_prefixes < 1 or self.turns < 1 or self.context_len < 1:
            raise ValueError("num_prefixes, turns and context_len must be >= 1")
        if self.time_scale < 0 or self.length_scale <= 0:
            raise ValueError("time_scale must be >= 0 and length_scale > 0")
        if self.think_time_s < 0 or self.tool_time_s < 0:
            raise ValueError("think_time_s and tool_time_s must be >= 0")
        if self.think_time_dist not in ("fixed", "exponential"):
            raise ValueError(
                f"think_time_dist must be 'fixed' or 'exponential', got {self.think_time_dist!r}"
            )

    @property
    def is_sessions(self) -> bool:
        return self.dataset in SESSION_DATASETS


TRACE_DATASETS = (
    "azure_code",
    "azure_conv",
    "mooncake_conversation",
    "mooncake_synthetic",
    "trace",
)
SESSION_DATASETS = ("chat_sessions", "agents", "sharegpt_sessions")
PATH_DATASETS = ("sharegpt", "burstgpt", "custom", "trace", "sharegpt_sessions")
DATASETS = (
    "random",
    "prefix_repetition",
    "sharegpt",
    "burstgpt",
    "custom",
    *TRACE_DATASETS,
    *SESSION_DATASETS,
)


@dataclass(frozen=True)
class CapacityConfig:
    """``experiment=capacity`` (experiments/capacity.py): the largest population whose service
    level holds. The SLO: p99 TTFT at most ``slo_p99_ttft_ms`` and the median request's
    per-user speed (1000 / its mean TPOT) at least ``slo_min_tok_s``; None drops a bound.
    ``min_measured_requests`` sets the run length (turns per user grow until that many
    requests fall in the measured window, after ``warmup_turns`` per user); the run doubles
    (up to ``max_doublings`` times) while its two halves disagree on the verdict."""

    slo_p99_ttft_ms: float | None = 3000.0
    slo_min_tok_s: float | None = 15.0
    max_population: int = 1024
    start_population: int = 8  # the search doubles from here (and bisects below it on a fail)
    min_measured_requests: int = 200
    warmup_turns: int = 1
    max_doublings: int = 2
    start_spread_s: float | None = None  # users start uniformly over it (None: one period)
    # bisection stops when the bracket is within this fraction of the answer (0: exact)
    tolerance: float = 0.0
    # boxes to spend (None: the hardware group's): replicas = boxes / tensor_parallel_size, so
    # a search can weigh TP against replicas on the same machines
    boxes: int | None = None
    # the write-up's arithmetic printed beside: closed-loop curve at these concurrencies
    arithmetic_concurrencies: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128)

    def __post_init__(self) -> None:
        if self.slo_p99_ttft_ms is None and self.slo_min_tok_s is None:
            raise ValueError("a capacity SLO needs slo_p99_ttft_ms, slo_min_tok_s or both")
        if min(self.max_population, self.start_population, self.min_measured_requests) < 1 or (
            self.warmup_turns < 0
            or self.tolerance < 0
            or (self.boxes is not None and self.boxes < 1)
        ):
            raise ValueError(
                "max_population and min_measured_requests must be >= 1, warmup_turns >= 0"
            )


@dataclass(frozen=True)
class ExperimentConfig:
    """A sweep over concurrency inside one run (compiled functions are reused across points):
    ``prompts_per_concurrency`` requests per concurrency slot at each point, after an untimed
    warmup pass of ``warmup_prompts_per_concurrency`` requests per slot with the same length
    distribution (it compiles the step shapes; mixed lengths reach more shapes and want as many
    warmup requests as timed ones). SLOs (ms, None = unbounded) define goodput."""

    name: str = "concurrency_sweep"
    # What runs it (experiments.runners.RUNNERS): the concurrency sweep, or a validation
    runner: str = "sweep"
    models: tuple[str, ...] = ()  # several models in one run (default: the model group's)
    concurrencies: tuple[int, ...] = (1, 4, 16, 64)
    prompts_per_concurrency: int = 3
    warmup: bool = True
    warmup_prompts_per_concurrency: int = 1
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2el_ms: float | None = None
    prediction_band: bool = False  # simulated: rerun under research.perf.bands' variants
    # runner validate_host: fit the host model again right before each point, on single streams
    # of that minute (a shared host's speed drifts between the fit and a later point)
    refit_per_point: bool = False
    # Runs of every point (new prompts each: seed from the repeat), averaged with a 95%
    # bootstrap interval by experiments.compare / research.bench.stats.
    repeats: int = 1
    # runner engine_comparison (experiments/engine_comparison.py): the engine profiles, the
    # topologies (one | tp2 | replicas2) and each model's weight format ("none": unquantized)
    engines: tuple[str, ...] = ENGINE_NAMES
    topologies: tuple[str, ...] = ("one",)
    model_formats: dict[str, str] = field(default_factory=dict)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)

    def __post_init__(self) -> None:
        if unknown := [e for e in self.engines if e not in ENGINE_NAMES]:
            raise ValueError(f"unknown engines {unknown}; expected some of {list(ENGINE_NAMES)}")
        if unknown := [t for t in self.topologies if t not in ("one", "tp2", "replicas2")]:
            raise ValueError(f"unknown topologies {unknown}; expected one, tp2 or replicas2")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if self.prompts_per_concurrency < 1 or self.warmup_prompts_per_concurrency < 1:
            raise ValueError("prompts_per_concurrency and its warmup count must be >= 1")


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding in an experiment (the ``speculative`` group): ``method`` null is
    off, ``ngram`` is prompt lookup (``SpeculativeConfig``'s keys). ``acceptance_rate``:
    simulated only, the fraction of drafts the target accepts (a real run measures it)."""

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    acceptance_rate: float | None = None

    def __post_init__(self) -> None:
        self.speculative_config()  # validates
        if self.acceptance_rate is not None and not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {self.acceptance_rate}")

    def speculative_config(self) -> dict[str, Any] | None:
        """vLLM's dict for ``LLM(speculative_config=...)``, or None when off."""
        if self.method is None:
            return None
        d = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
        }
        SpeculativeConfig.from_dict(d)
        return d


@dataclass(frozen=True)
class TrackingConfig:
    """W&B: ``offline`` (default, no network), ``online``, or ``disabled``. Results files and
    plots land in the run directory whatever W&B does."""

    wandb_mode: str = "offline"
    project: str = "research-serving"
    plots: bool = True


@dataclass(frozen=True)
class RunConfig:
    """The whole experiment: one field per config group."""

    model: LoadConfig = LoadConfig()
    quantization: QuantConfig = QuantConfig()
    executor: ExecutorConfig = ExecutorConfig()
    hardware: HardwareConfig = HardwareConfig()
    cache: CacheOptions = CacheOptions()
    engine: ServingConfig = ServingConfig()
    workload: WorkloadConfig = WorkloadConfig()
    experiment: ExperimentConfig = ExperimentConfig()
    tracking: TrackingConfig = TrackingConfig()
    speculative: SpeculationConfig = SpeculationConfig()
    output_dir: str | None = None  # default: Hydra's run directory


RUN_GROUPS = {
    "model": LoadConfig,
    "quantization": QuantConfig,
    "executor": ExecutorConfig,
    "hardware": HardwareConfig,
    "cache": CacheOptions,
    "engine": ServingConfig,
    "workload": WorkloadConfig,
    "experiment": ExperimentConfig,
    "tracking": TrackingConfig,
    "speculative": SpeculationConfig,
}


def register_configs() -> None:
    """Store ``RunConfig`` in Hydra's ConfigStore as ``run_schema``: the primary config lists
    it first in its defaults, so every group's YAML is merged onto (and checked against) it."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    def writable(cfg: Any) -> Any:
        # Frozen dataclasses give read-only nodes (each nested one too); the YAML on top must be
        # able to set values. Types and keys are still checked against the schema.
        OmegaConf.set_readonly(cfg, False)
        for key in cfg:
            if OmegaConf.is_dict(cfg._get_node(key)):
                writable(cfg._get_node(key))
        return cfg

    ConfigStore.instance().store(name="run_schema", node=writable(OmegaConf.structured(RunConfig)))


# Dataclasses nested in a group's dataclass, by the annotation their field carries.
NESTED_CONFIGS = {"CapacityConfig": CapacityConfig}


def run_config_from(cfg: Any) -> RunConfig:
    """A composed Hydra config (DictConfig) -> the frozen RunConfig, validated."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    top = set(RUN_GROUPS) | {"output_dir"}
    if unknown := sorted(set(container) - top):
        raise ValueError(
            f"unknown config keys {unknown} (an override like +{unknown[0]}=... that nothing "
            f"reads); the config has {sorted(top)}"
        )
    groups = {}
    for group, schema in RUN_GROUPS.items():
        values = dict(container.get(group) or {})
        known = {f.name for f in dataclasses.fields(schema)}
        if unknown := sorted(set(values) - known):
            raise ValueError(f"{group}: unknown keys {unknown}; expected some of {sorted(known)}")
        nested = {f.name: f.type for f in dataclasses.fields(schema)}
        for key, value in values.items():  # YAML lists -> tuples, nested groups -> dataclasses
            if isinstance(value, list):
                values[key] = tuple(value)
            elif isinstance(value, dict) and nested[key] in NESTED_CONFIGS:
                cls = NESTED_CONFIGS[nested[key]]
                values[key] = cls(
                    **{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
                )
        groups[group] = schema(**values)
    return RunConfig(**groups, output_dir=container.get("output_dir"))
