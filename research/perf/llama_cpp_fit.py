"""llama.cpp's DGX Spark page replayed and fitted: the ``llama_cpp`` engine profile on GB10.

``data/gb10_public.json`` holds public single-box DGX Spark (GB10) measurements, each number with
its source (llama.cpp's ``benches/dgx-spark.md`` in three revisions, forum and blog records);
``load_points`` turns the ones an engine profile can replay into ``Point``s.

An engine profile (``PROFILES``) says how a tool drives the engine and which cost-model options
describe its kernels:

- ``llama.cpp``: ``llama-batched-bench`` is a static batch. Its prefill submits the B prompts of
  ``pp`` random tokens as one batch, cut into ubatches of ``n_ubatch`` = 2,048 tokens, each one
  forward over every sequence piece it holds; its decode runs ``tg`` steps of B one-token rows at
  contexts ``pp .. pp + tg - 1``. ``llama-bench`` runs ``pp2048 @ dN`` as one 2,048-token ubatch
  after N cached tokens and ``tg32 @ dN`` as 32 single-token steps. Weights are priced as the GGUF
  files store them (``cost_model.GGUF_FORMATS``), KV as f16, and the memory and compute times of
  the dense GEMMs, attention and the output layer ADD (``combine``): llama.cpp's batched decode
  on GB10 does not hide that math under the weight stream (the dense 7B's decode step grows
  from 34 ms at B=1 to 54 ms at B=32 while the bytes it reads grow by about 12%); the expert
  GEMMs, a few rows per expert at decode, overlap (max).

Per model and source revision, two efficiencies are fitted on batch 1 at the shortest context:
``bandwidth_efficiency`` on the decode rate of ``llama-batched-bench`` B=1 pp=512 and
``native_gemm_efficiency`` on ``llama-bench`` pp2048 at depth 0. (The batched bench's own B=1
pp=512 prefill is not used: it is the process's first timed forward of a prompt, and on
gpt-oss-20b it takes longer than the next row's two prompts, ``first_timed_run``; the report
gives its summary with and without those rows.) Two mechanisms of llama.cpp's CUDA backend are
priced from outside the set: steps of more than one token row launch kernel by kernel
(``graph_max_tokens``, ``eager_layer_overhead``, from llama.cpp's own graphs-on/off A/B on a DGX
Spark), and the grouped expert GEMM pads every expert's rows to its MMQ column tile
(``expert_tiles="mmq"``). Flash attention's efficiency is
fitted once per revision on the dense model's deepest prefill (pp2048 at depth 32,768, where
attention is most of the time) and shared by every model of that revision. Every other point is
predicted. MoE decode reads the distinct experts of the ``lognormal`` routing law
(``research.perf.routing``) with the shape of RANDOM token ids, which both benches feed: one
shape for every model, fitted on gpt-oss-120b's B=32 pp=512 decode points (those three points
are marked fitted) and predicted for every other model and point, and for the vLLM profile's
curve of gpt-oss-120b (``research.perf.validation_vllm``, the report's last section), which
nothing was fitted on but its C=1 point. The mechanisms are the ``llama_cpp`` engine profile's
(``research.perf.engines.profiles``), the profile every ``engine=llama_cpp`` experiment runs.

The fits are stored with the others (``research.perf.fits``); ``research.perf.validation`` prints
the report (docs/experiments/gb10_validation.md).
Pure Python (scipy for the fit); JAX is not imported.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from research.perf.cost_model import CostModel, CostParams, StepShape
from research.perf.kv_capacity import resolve_model
from research.perf.measurements import DATA, Row, records

# The published GGUF files: our preset with their shapes, and the file format.
GGUF_MODELS: dict[str, tuple[str, str]] = {
    "ggml-org/Qwen3-Coder-30B-A3B-Instruct-Q8_0-GGUF": ("qwen3-coder-30b-a3b", "q8_0"),
    "ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF": ("qwen2.5-coder-7b", "q8_0"),
    "ggml-org/gpt-oss-20b-GGUF": ("gpt-oss-20b", "gguf_mxfp4"),
    "ggml-org/gpt-oss-120b-GGUF": ("gpt-oss-120b", "gguf_mxfp4"),
}
LLAMA_CPP_SOURCES = ("llamacpp_dgx_spark_v1", "llamacpp_dgx_spark_v2", "llamacpp_dgx_spark_v3")
# llama-batched-bench and llama-bench feed random token ids.
TOKEN_SOURCE = "random"


@dataclass(frozen=True)
class EngineProfile:
    """How a benchmark tool drives its engine, as cost-model options."""

    name: str
    batching: str  # "static": every sequence starts together and runs to the end
    ubatch: int  # tokens per prefill forward
    combine: str | dict[str, str]  # cost_model.COMBINE_MODES, or per operator
    kv_cache_dtype: str
    dtype: str
    block_size: int  # KV granule the attention kernel reads
    fitted: tuple[str, ...]  # CostParams fields fitted per model
    fixed: dict[str, float] = field(default_factory=dict)  # CostParams fields assumed
    # CostParams fields fitted once per source on one model's point, shared by every model of
    # that source: field -> (model, point label).
    shared: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Models whose routing shape (research.perf.routing.LOAD_SIGMAS) is inferred from the
    # profile's points rather than a router statistic: model -> label of those points.
    routing_fit: dict[str, str] = field(default_factory=dict)
    # The most token rows a step may have and still replay a captured graph (None: every step
    # does); larger steps pay CostParams.eager_layer_overhead_s per layer.
    graph_max_tokens: int | None = None
    # How the grouped expert GEMM pads each expert's rows (CostModel(expert_tiles=...)).
    expert_tiles: str | None = None


GRAPH_AB_SOURCE = "llamacpp_pr19645_cuda_graphs"


def eager_layer_overhead(path: Path = DATA) -> float:
    """Host seconds per layer that a GB10 llama.cpp step of a few token rows pays when it is
    launched kernel by kernel instead of replayed from a CUDA graph: the mean, over the
    microbatch sizes above 1, of (step time with graphs off - step time with graphs on) / layers
    in llama.cpp's own A/B on a DGX Spark (``GRAPH_AB_SOURCE``, a model outside the validation
    set). At 2 and 3 rows the difference is the same 3.5 ms, which is what an additive host
    cost predicts."""
    rows = [r for r in records(path) if r["source"] == GRAPH_AB_SOURCE and r["n_ubatch"] > 1]
    if not rows:
        raise ValueError(f"{path} holds no {GRAPH_AB_SOURCE} rows above one token")
    per_layer = [
        (r["n_ubatch"] / r["tok_s_graphs_off"] - r["n_ubatch"] / r["tok_s_graphs_on"]) / r["layers"]
        for r in rows
    ]
    return statistics.fmean(per_layer)


def _llama_cpp_replay() -> EngineProfile:
    """``llama-batched-bench`` / ``llama-bench`` as the page ran them, on the mechanisms of the
    ``llama_cpp`` engine profile (``research.perf.engines.profiles.LLAMA_CPP``: one source for
    the validation and every ``engine=llama_cpp`` experiment)."""
    from research.perf.engines.profiles import LLAMA_CPP

    return EngineProfile(
        name="llama.cpp",
        batching="static",
        ubatch=2048,  # the page's -ub 2048 (the server's default is 512)
        combine=LLAMA_CPP.combine,
        kv_cache_dtype="auto",  # f16 K/V: 2 bytes, as bf16
        dtype="float16",
        block_size=LLAMA_CPP.kv_read_block,
        fitted=("bandwidth_efficiency", "native_gemm_efficiency"),
        # A step of one token row replays a CUDA graph: ~0.1 ms of host time, an assumption.
        # Every step of more rows is launched kernel by kernel (the builds on the page predate
        # llama.cpp#19645, which first captured graphs for them) and pays the per-layer host
        # cost llama.cpp's own graphs-on/off A/B on a DGX Spark measures.
        fixed={"per_step_overhead_s": 1e-4, "eager_layer_overhead_s": eager_layer_overhead()},
        graph_max_tokens=LLAMA_CPP.graph_max_tokens,
        # MMQ cuts every expert's routed rows into tiles as wide as the ubatch asks for (128
        # columns from 128 tokens up): a 512-token prompt gives gpt-oss-120b's 128 experts 16
        # rows each on average, computed as 128.
        expert_tiles=LLAMA_CPP.expert_tiles,
        # Flash attention's rate: the deepest prefill of the dense model, where attention is
        # two thirds of the time; every other model of the revision takes that rate.
        shared={
            "attention_efficiency": ("ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF", "bench pp2048 @ d32768")
        },
        # The benches feed random token ids: every MoE takes the random-token routing shape
        # (research.perf.routing.routing_for), fitted on these points of gpt-oss-120b.
        routing_fit={"ggml-org/gpt-oss-120b-GGUF": "batched tg B=32 pp=512"},
    )


PROFILES = {"llama.cpp": _llama_cpp_replay()}


@dataclass(frozen=True)
class Point:
    """One published rate the simulator can replay.

    metric: ``decode_tok_s`` (aggregate generated tokens per second over the batch) or
    ``prefill_tok_s`` (prompt tokens per second); ``tool`` is ``llama-batched-bench`` (``batch``
    sequences of ``pp`` prompt and ``tg`` generated tokens) or ``llama-bench`` (one sequence,
    ``tokens`` processed after ``depth`` cached ones)."""

    source: str
    model: str
    tool: str
    metric: str
    published: float
    batch: int = 1
    pp: int = 0
    tg: int = 0
    depth: int = 0
    raw_row: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        if self.tool == "llama-batched-bench":
            kind = "tg" if self.metric == "decode_tok_s" else "pp"
            return f"batched {kind} B={self.batch} pp={self.pp}"
        kind = "tg32" if self.metric == "decode_tok_s" else "pp2048"
        return f"bench {kind} @ d{self.depth}"

    @property
    def key(self) -> tuple[str, str]:
        return (self.source, self.model)


@functools.cache
def load_points(path: Path = DATA) -> tuple[Point, ...]:
    """Every llama.cpp DGX Spark point of a model in ``GGUF_MODELS``."""
    out = []
    for r in records(path):
        if r["source"] not in LLAMA_CPP_SOURCES or r["model"] not in GGUF_MODELS:
            continue
        common = dict(source=r["source"], model=r["model"], raw_row=r.get("raw_row", ""))
        if r["tool"] == "llama-batched-bench":
            shape = dict(batch=r["batch"], pp=r["pp"], tg=r["tg"])
            out.append(Point(**common, tool=r["tool"], metric="decode_tok_s",
                             published=r["s_tg_tok_s"], **shape))  # fmt: skip
            out.append(Point(**common, tool=r["tool"], metric="prefill_tok_s",
                             published=r["s_pp_tok_s"], **shape))  # fmt: skip
        elif r["tool"] == "llama-bench":
            metric = "decode_tok_s" if r["kind"] == "tg" else "prefill_tok_s"
            out.append(Point(**common, tool=r["tool"], metric=metric, published=r["tok_s"],
                             depth=r["depth"], pp=r["tokens"] if r["kind"] == "pp" else 0,
                             tg=r["tokens"] if r["kind"] == "tg" else 0))  # fmt: skip
    return tuple(out)


def is_fit_point(p: Point, profile: EngineProfile | None = None) -> bool:
    """The points a (source, model) is fitted on (module docstring), the point each shared
    parameter of ``profile`` is fitted on and those a routing shape is inferred from."""
    if profile is not None and (
        any((p.model, p.label) == anchor for anchor in profile.shared.values())
        or profile.routing_fit.get(p.model) == p.label
    ):
        return True
    if p.tool == "llama-batched-bench":
        return p.metric == "decode_tok_s" and p.batch == 1 and p.pp == 512
    return p.metric == "prefill_tok_s" and p.depth == 0


def cost_model(model: str, params: CostParams, profile: EngineProfile, **options: Any) -> CostModel:
    """The cost model of a published GGUF ``model`` under ``profile``."""
    from research.perf.routing import routing_for

    preset, fmt = GGUF_MODELS[model]
    law, shape = routing_for(preset, TOKEN_SOURCE)
    options = {
        "moe_routing": law,
        "moe_load_sigma": shape,
        "graph_max_tokens": profile.graph_max_tokens,
        "expert_tiles": profile.expert_tiles,
    } | options
    return CostModel(
        preset,
        fmt,
        "gb10",
        kv_cache_dtype=profile.kv_cache_dtype,
        dtype=profile.dtype,
        params=params,
        block_size=profile.block_size,
        combine=profile.combine,
        **options,
    )


def ubatches(batch: int, pp: int, size: int) -> list[StepShape]:
    """``batch`` prompts of ``pp`` tokens laid out one sequence after another and cut into
    forwards of ``size`` tokens: each forward's ``(tokens, context_before)`` pieces."""
    out, pieces, room = [], [], size
    for _ in range(batch):
        start = 0
        while start < pp:
            n = min(room, pp - start)
            pieces.append((n, start))
            start, room = start + n, room - n
            if room == 0:
                out.append(StepShape(tuple(pieces)))
                pieces, room = [], size
    if pieces:
        out.append(StepShape(tuple(pieces)))
    return out


def simulate(p: Point, cm: CostModel, profile: EngineProfile) -> float:
    """The rate ``cm`` predicts for ``p`` under ``profile`` (tokens per second)."""
    if p.tool == "llama-batched-bench":
        if p.metric == "prefill_tok_s":
            seconds = sum(cm.step_time(s) for s in ubatches(p.batch, p.pp, profile.ubatch))
            return p.batch * p.pp / seconds
        seconds = sum(cm.step_time(StepShape.decode(p.batch, p.pp + i)) for i in range(p.tg))
        return p.batch * p.tg / seconds
    if p.metric == "prefill_tok_s":
        seconds = sum(
            cm.step_time(StepShape(((s.num_tokens, p.depth + s.seqs[0][1]),)))
            for s in ubatches(1, p.pp, profile.ubatch)
        )
        return p.pp / seconds
    seconds = sum(cm.step_time(StepShape.decode(1, p.depth + i)) for i in range(p.tg))
    return p.tg / seconds


def _base_params(profile: EngineProfile) -> CostParams:
    return CostParams(**({"bandwidth_efficiency": 1.0, "per_step_overhead_s": 0.0} | profile.fixed))


def fit(
    points: Sequence[Point],
    model: str,
    profile: EngineProfile,
    names: Sequence[str] | None = None,
    base: CostParams | None = None,
    **options: Any,
) -> CostParams:
    """``names`` (default ``profile.fitted``) of ``model`` by least squares on the log of
    ``points``' rates, the other fields from ``base``."""
    from scipy.optimize import least_squares

    base = _base_params(profile) if base is None else base
    names = tuple(profile.fitted if names is None else names)

    def residuals(x: Sequence[float]) -> list[float]:
        params = replace(base, **dict(zip(names, x, strict=True)))
        cm = cost_model(model, params, profile, **options)
        return [math.log(simulate(p, cm, profile) / p.published) for p in points]

    x0 = [0.8] * len(names)
    sol = least_squares(residuals, x0, bounds=([1e-3] * len(names), [1.0] * len(names)))
    return replace(base, **dict(zip(names, sol.x, strict=True)))


def validate(
    points: Iterable[Point] | None = None,
    profile: str = "llama.cpp",
    **options: Any,
) -> tuple[list[Row], dict[tuple[str, str], CostParams]]:
    """Fit every (source, model) on its fit points, predict all its points."""
    prof = PROFILES[profile]
    points = list(load_points() if points is None else points)
    groups: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        groups.setdefault(p.key, []).append(p)
    rows, params = [], {}
    shared: dict[str, dict[str, float]] = {}  # source -> shared fields
    anchors = {model for model, _ in prof.shared.values()}
    # Anchor models first: they fit the shared fields with their own.
    for key in sorted(groups, key=lambda k: k[1] not in anchors):
        pts = groups[key]
        fit_pts = [p for p in pts if is_fit_point(p, prof)]
        names = list(prof.fitted)
        names += [f for f, (model, _) in prof.shared.items() if model == key[1]]
        base = replace(_base_params(prof), **shared.get(key[0], {}))
        if len(fit_pts) < len(names):
            raise ValueError(f"{key}: {len(fit_pts)} fit points for {len(names)} parameters")
        params[key] = fit(fit_pts, key[1], prof, names, base, **options)
        for f, (model, _) in prof.shared.items():
            if model == key[1]:
                shared.setdefault(key[0], {})[f] = getattr(params[key], f)
        cm = cost_model(key[1], params[key], prof, **options)
        rows += [Row(p, simulate(p, cm, prof), is_fit_point(p, prof)) for p in pts]
    return rows, params


@functools.cache
def _shortest_prompt(key: tuple[str, str], tool: str) -> int:
    return min(x.pp for x in load_points() if x.key == key and x.tool == tool)


def first_timed_run(p: Point) -> bool:
    """The prefill of the first row ``llama-batched-bench`` prints (B=1 at its shortest prompt):
    the first timed forward of a prompt-sized batch in the process, after a 16-token warm-up.
    On every MoE of the page it takes at least 85% of the next row's prefill of twice the tokens
    (MMQ's tile padding, ``expert_tiles``), and on gpt-oss-20b LONGER (build 6918: 0.390 s for
    one 512-token prompt, 0.273 s for two): a one-time cost no per-step price can hold, since a
    model whose step cost grows with its tokens and meets the B=2 row misses this one by at
    least t(B=1) / t(B=2) - 1 (+43% there)."""
    return (
        p.tool == "llama-batched-bench"
        and p.metric == "prefill_tok_s"
        and p.batch == 1
        and p.pp == _shortest_prompt(p.key, p.tool)
    )


def summary(rows: Sequence[Row], first_run: bool = True) -> dict[str, float]:
    """Median and worst |error| over the points NOT fitted, and how many are beyond 30%;
    ``first_run=False`` leaves out the first timed runs (``first_timed_run``)."""
    errors = [
        abs(r.error) for r in rows if not r.fitted and (first_run or not first_timed_run(r.point))
    ]
    return {
        "points": len(errors),
        "median": statistics.median(errors),
        "worst": max(errors),
        "beyond_30": sum(e > 0.30 for e in errors),
    }


def growth(rows: Sequence[Row], pp: int = 512, lo: int = 1, hi: int = 32) -> dict[tuple, tuple]:
    """Per (source, model): decode rate at B=hi over B=lo in ``llama-batched-bench`` at ``pp``,
    (published, predicted)."""
    rates: dict[tuple, dict[int, Row]] = {}
    for r in rows:
        p = r.point
        if p.tool == "llama-batched-bench" and p.metric == "decode_tok_s" and p.pp == pp:
            rates.setdefault(p.key, {})[p.batch] = r
    return {
        key: (
            by[hi].point.published / by[lo].point.published,
            by[hi].predicted / by[lo].predicted,
        )
        for key, by in rates.items()
        if lo in by and hi in by
    }


def implied_sigma(
    rows: Sequence[Row], params: dict[tuple[str, str], CostParams], batch: int = 32, pp: int = 512
) -> dict[tuple[str, str], float]:
    """A diagnostic, not used by the model: per MoE (source, model), the ``lognormal`` routing
    shape under which the fitted model meets the published decode rate at ``batch`` and
    ``pp`` (what the published curve says about routing on the bench's inputs)."""
    from scipy.optimize import brentq

    prof = PROFILES["llama.cpp"]
    out = {}
    for r in rows:
        p = r.point
        if not (p.tool == "llama-batched-bench" and p.metric == "decode_tok_s"
                and p.batch == batch and p.pp == pp):  # fmt: skip
            continue
        if not resolve_model(GGUF_MODELS[p.model][0]).is_moe:
            continue

        def gap(sigma: float, p: Point = p) -> float:
            cm = cost_model(p.model, params[p.key], prof, moe_load_sigma=sigma)
            return math.log(simulate(p, cm, prof) / p.published)

        out[p.key] = brentq(gap, 0.0, 4.0) if gap(0.0) * gap(4.0) < 0 else float("nan")
    return out
