"""What a sweep drives: our engine (real or simulated), HF transformers ``generate``, or any
OpenAI-compatible server over HTTP, behind one ``Backend`` interface (``make_backend``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any, Protocol

from research.bench import BenchmarkResult, BenchRequest, run_benchmark
from research.config import RunConfig

log = logging.getLogger(__name__)


class Backend(Protocol):
    model_id: str
    label: str
    vocab_size: int
    special_ids: tuple[int, ...]

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult: ...

    def stats(self) -> dict[str, Any]: ...


class EngineBackend:
    """This project's engine (``LLM``) on this machine."""

    def __init__(self, run: RunConfig):
        from research.llm import LLM
        from research.perf.engines.serving import from_run

        m, q, c = run.model, run.quantization, run.cache
        self.simulated = run.executor.kind == "simulated"
        # The engine profile's batch policy, pool and (simulated) costs: research.perf.engines.
        self.serving = serving = from_run(run)
        extra: dict = {}  # LLM arguments of the executor kind
        if self.simulated:
            extra = dict(
                executor="simulated",
                hardware=run.hardware.name,
                gpu_memory_utilization=run.hardware.gpu_memory_utilization,
                tensor_parallel_size=run.hardware.tensor_parallel_size,
                enable_expert_parallel=run.hardware.enable_expert_parallel,
                speculative_acceptance_rate=(
                    run.speculative.acceptance_rate if run.speculative.method else None
                ),
            )
        else:
            from research.engine.compile_cache import enable_compilation_cache

            enable_compilation_cache(run.executor.compilation_cache_dir)
            extra = dict(
                tensor_parallel_size=run.hardware.tensor_parallel_size,
                enable_expert_parallel=run.hardware.enable_expert_parallel,
                num_scheduler_steps=run.executor.num_scheduler_steps,
            )
        engine_kwargs = (
            dict(
                max_model_len=m.max_model_len,
                quantization=q.quantization,
                num_kv_blocks=c.num_kv_blocks,
            )
            | serving.llm_kwargs()
        )

        def make_llm() -> LLM:
            return LLM(
                m.model,
                **extra,
                **engine_kwargs,
                dtype=m.dtype,
                seed=m.seed,
                kv_cache_dtype=q.kv_cache_dtype,
                attention_backend=run.executor.attention_backend,
                gemm_backend=run.executor.gemm_backend,
                kv_cache_memory_bytes=c.kv_cache_memory_bytes,
                speculative_config=run.speculative.speculative_config(),
            )

        self._make_llm = make_llm
        self.run_config = run
        self.llm = make_llm()
        self.engine = self.llm.engine
        # "auto" as resolved by the executor (native on CPU where it builds, else xla)
        self.attention_backend = getattr(
            self.engine.executor, "backend", run.executor.attention_backend
        )
        self.gemm_backend = getattr(self.engine.executor, "gemm_backend", "xla")
        if self.simulated:
            self.reset(run.workload.seed)
        cfg = self.llm.model_config
        self.model_id = m.model
        engine_name = f"simulated-{run.hardware.name}" if self.simulated else "ours"
        if run.engine.name != "vllm":
            engine_name += f"-{run.engine.name}"
        if run.hardware.tensor_parallel_size > 1:
            engine_name += f"-tp{run.hardware.tensor_parallel_size}"
        if run.hardware.num_replicas > 1:
            engine_name += f"-x{run.hardware.num_replicas}"
        spec = run.speculative
        speculation = []
        if spec.method:
            speculation = [f"{spec.method}-k{spec.num_speculative_tokens}"]
            if self.simulated:
                speculation[0] += f"-a{spec.acceptance_rate}"
        self.label = " ".join(
            [engine_name, m.model, *([q.quantization] if q.quantization else []), *speculation]
        )
        self.vocab_size = cfg.vocab_size
        tokenizer = self.llm.tokenizer
        special = set(cfg.eos_token_ids)
        if tokenizer is not None:
            special |= set(tokenizer.all_special_ids)
        self.special_ids = tuple(sorted(special))

    def reset(self, seed: int) -> None:
        """Simulated only: a fresh engine (virtual clock at 0, empty pool and prefix cache)
        whose random draws (speculative acceptance, replica routing) start from ``seed``, so a
        point's figures depend on its own seed only, never on the points run before it. (A real
        engine keeps its compiled steps across points instead; it has no such draws.)"""
        if not self.simulated:
            return
        run = self.run_config
        engines = [self._make_llm().engine for _ in range(run.hardware.num_replicas)]
        for i, engine in enumerate(engines):
            engine.executor.reseed(seed + i)
        self.engine = engines[0]
        if run.hardware.num_replicas > 1:
            from research.perf.simulated import ReplicaRouter

            self.engine = ReplicaRouter(engines, seed=seed, routing=run.hardware.routing)

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult:
        return run_benchmark(
            self.engine,
            requests,
            max_concurrency=max_concurrency,
            **self._load(),
            progress=progress,
            # A simulated executor's virtual clock stamps the engine; waiting advances it.
            clock=self.engine.clock,
            sleep=self._sleep,
            request_path_s=self._request_path_s(),
        )

    def run_sessions(
        self, sessions: list[Any], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult:
        """Multi-turn sessions (``research.bench.sessions``), at most ``max_concurrency``
        active."""
        from research.bench.sessions import run_sessions

        return run_sessions(
            self.engine,
            sessions,
            max_concurrency=max_concurrency,
            progress=progress,
            clock=self.engine.clock,
            sleep=self._sleep,
            request_path_s=self._request_path_s(),
        )

    def _request_path_s(self) -> float:
        """A simulated server's request path (``CostParams.request_path_s`` of its calibration:
        the drivers deliver each request that much after its send); 0 for a real engine, whose
        path is real."""
        if not self.simulated:
            return 0.0
        engine = getattr(self.engine, "engines", [self.engine])[0]
        return engine.executor.cost_model.params.request_path_s

    def _load(self) -> dict[str, Any]:
        """The workload's arrival process, as ``run_benchmark`` takes it."""
        w = self.run_config.workload
        return dict(request_rate=w.request_rate, burstiness=w.burstiness, seed=w.seed)

    def precompile(self, requests: list[BenchRequest], concurrency: int) -> int:
        """Compile the step shapes serving ``requests`` will use (predicted by a shadow run of
        the scheduler, ``research.engine.shapes``) so that none compiles inside the timed point;
        returns how many were compiled."""
        if self.simulated or self.run_config.executor.enforce_eager:
            return 0
        from research.engine.shapes import predict_step_shapes

        t0 = time.perf_counter()
        shapes = predict_step_shapes(
            self.engine, requests, max_concurrency=concurrency, **self._load()
        )
        n = self.engine.executor.precompile(shapes)
        if n:
            log.info(
                f"  compiled {n} of the point's {len(shapes)} step shapes before timing it "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        return n

    @contextlib.contextmanager
    def recording_steps(self) -> Iterator[list[Any]]:
        """Yields a list that collects the ``StepShape`` of every step run inside the block."""
        log: list[Any] = []
        if self.simulated:
            yield log
            return
        from research.perf.cost_model import step_shape_from_plan

        executor = self.engine.executor
        execute = executor.execute

        def recorded(plan: Any) -> Any:
            log.append(step_shape_from_plan(plan))
            return execute(plan)

        executor.execute = recorded
        try:
            yield log
        finally:
            del executor.execute

    def roofline(self, shapes: list[Any], seconds: float) -> dict[str, float]:
        """The point's achieved FLOP/s and bytes/s against this machine's measured peaks
        (``research.perf.host_peaks``): the work of the padded calls the executor ran, counted
        by ``research.perf.host_model``, over the steps' wall time. Empty for a model the cost
        model cannot size (a checkpoint path)."""
        from research.perf.host_model import HostCostModel, host_hardware, roofline
        from research.perf.host_peaks import device_peaks

        run = self.run_config
        if (peaks := device_peaks(run.model.dtype)) is None:
            return {}
        try:
            model = HostCostModel(
                run.model.model,
                run.quantization.quantization,
                host_hardware(peaks["bandwidth"], peaks["flops"]),
                max_num_seqs=self.serving.max_num_seqs,
                max_num_batched_tokens=self.serving.max_num_batched_tokens,
                max_model_len=self.engine.max_model_len,
                block_size=self.serving.block_size,
                dtype=run.model.dtype,
                attention_backend=self.attention_backend,
            )
        except ValueError:
            return {}
        return roofline(model, shapes, seconds, peaks)

    def _sleep(self, seconds: float) -> None:
        if not self.simulated:
            time.sleep(seconds)
        elif hasattr(self.engine, "sleep"):  # a router of replicas
            self.engine.sleep(seconds)
        else:
            self.engine.executor.clock.sleep(seconds)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


class HFBackend:
    """HF transformers ``generate`` (greedy, in the run's dtype) in static batches of
    ``max_concurrency``."""

    def __init__(self, run: RunConfig):
        from research.bench.hf_peer import load_hf_model

        dtype = "float32" if run.model.dtype == "auto" else run.model.dtype
        self.model, self.tokenizer = load_hf_model(run.model.model, dtype)
        self.model_id = run.model.model
        self.label = f"hf-transformers {run.model.model}"
        self.vocab_size = int(self.model.config.vocab_size)
        self.special_ids = tuple(sorted(self.tokenizer.all_special_ids)) if self.tokenizer else ()

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult:
        from research.bench.hf_peer import run_hf_benchmark

        return run_hf_benchmark(
            self.model,
            self.tokenizer,
            requests,
            max_concurrency=max_concurrency or len(requests),
            progress=progress,
        )

    def stats(self) -> dict[str, Any]:
        return {}


class HTTPBackend:
    """An OpenAI-compatible server at ``run.executor.base_url`` serving ``run.model.model``,
    driven by the streaming HTTP client. The vocabulary for random prompts is the ``vocab_size``
    our server lists in ``/v1/models``; other servers (vLLM) list none, so 32000 is assumed."""

    def __init__(self, run: RunConfig):
        import httpx

        e = run.executor
        if e.base_url is None:
            raise ValueError("executor=http needs executor.base_url (e.g. http://127.0.0.1:8000)")
        headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        response = httpx.get(f"{e.base_url.rstrip('/')}/v1/models", headers=headers)
        response.raise_for_status()
        models = {m["id"]: m for m in response.json()["data"]}
        if run.model.model not in models:
            raise ValueError(f"{e.base_url} serves {sorted(models)}, not {run.model.model!r}")
        self.base_url, self.api_key = e.base_url, e.api_key
        self.model_id = run.model.model
        self.label = f"{e.label or 'http'} {run.model.model}"
        self.vocab_size = int(models[run.model.model].get("vocab_size", 32000))
        self.special_ids: tuple[int, ...] = ()
        self.workload = run.workload

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult:
        from research.bench.http_client import run_http_benchmark

        w = self.workload
        return run_http_benchmark(
            self.base_url,
            self.model_id,
            requests,
            max_concurrency=max_concurrency,
            api_key=self.api_key,
            request_rate=w.request_rate,
            burstiness=w.burstiness,
            seed=w.seed,
        )

    def stats(self) -> dict[str, Any]:
        return {}


class ReplicasBackend(HTTPBackend):
    """``hardware.num_replicas`` real engines on this machine: ``research.serve.router`` starts
    them as processes (each pinned to its share of the cores) behind one endpoint with
    ``hardware.routing``; the points are measured over HTTP as ``executor=http`` measures."""

    def __init__(self, run: RunConfig):
        import atexit
        import os
        import subprocess
        import sys

        from research.perf.engines.serving import from_run

        c, m, q, h = run.cache, run.model, run.quantization, run.hardware
        s = from_run(run)
        if run.engine.name != "vllm" or not s.enable_chunked_prefill or not s.enable_prefix_caching:
            raise ValueError(
                "replicas run the server: engine=vllm with chunked prefill and prefix caching"
            )
        from research.serve.router import free_port, wait_healthy

        port = free_port()
        flags = [
            m.model, "--port", str(port), "--num-replicas", str(h.num_replicas),
            "--routing", h.routing, "--dtype", m.dtype,
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--block-size", str(s.block_size), "--kv-cache-dtype", q.kv_cache_dtype,
            "--attention-backend", run.executor.attention_backend,
            "--gemm-backend", run.executor.gemm_backend,
            "--kv-cache-memory-bytes", str(c.kv_cache_memory_bytes), "--seed", str(m.seed),
        ]  # fmt: skip
        if m.max_model_len:
            flags += ["--max-model-len", str(m.max_model_len)]
        if c.num_kv_blocks:
            flags += ["--num-kv-blocks", str(c.num_kv_blocks)]
        if q.quantization:
            flags += ["--quantization", q.quantization]
        if run.executor.num_scheduler_steps > 1:
            flags += ["--num-scheduler-steps", str(run.executor.num_scheduler_steps)]
        cores = len(os.sched_getaffinity(0))
        if cores >= h.num_replicas:
            flags += ["--cpus-per-replica", str(cores // h.num_replicas)]
        self.process = subprocess.Popen([sys.executable, "-m", "research.serve.router", *flags])
        atexit.register(self.close)
        url = f"http://127.0.0.1:{port}"
        wait_healthy([url], [self.process], timeout=1800)
        e = dataclasses.replace(run.executor, base_url=url, label=f"ours-x{h.num_replicas}")
        super().__init__(dataclasses.replace(run, executor=e))

    def stats(self) -> dict[str, Any]:
        """The replicas' engine counters summed (each replica's ``/metrics``): steps, seconds
        in steps, host seconds of those steps, tokens generated and the CPU seconds of their
        servers' event loops; the router's CPU seconds (``/router/stats``) and this process's
        (``client_cpu_s``: the benchmark client's, the only work here while the replicas run)."""
        import time

        import httpx

        from research.serve.metrics import metric_samples

        names = {
            "research:num_steps": "num_steps",
            "research:engine_step_seconds_total": "step_time_s",
            "research:engine_host_seconds_total": "host_time_s",
            "research:generation_tokens_total": "generation_tokens",
            "research:server_loop_cpu_seconds_total": "server_loop_cpu_s",
        }
        out = dict.fromkeys(names.values(), 0.0)
        routed = httpx.get(f"{self.base_url}/router/stats", timeout=30).json()
        for replica in routed["replicas"]:
            text = httpx.get(f"{replica['url']}/metrics", timeout=30).text
            for name, _, value in metric_samples(text):
                if name in names:
                    out[names[name]] += value
        return out | {"router_cpu_s": routed["process_cpu_s"], "client_cpu_s": time.process_time()}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=120)


def make_backend(run: RunConfig) -> Backend:
    kind = run.executor.kind
    if kind == "real" and run.hardware.num_replicas > 1:
        return ReplicasBackend(run)
    if kind in ("real", "simulated"):
        if kind == "simulated" and run.hardware.name == "host":
            raise ValueError("the simulated executor models a named machine: hardware=gb10|h200")
        return EngineBackend(run)
    if kind == "hf":
        if run.quantization.quantization or run.quantization.kv_cache_dtype != "auto":
            raise ValueError("the hf peer runs the unquantized model; use quantization=none")
        return HFBackend(run)
    if kind == "http":
        return HTTPBackend(run)
    raise ValueError(f"executor kind {kind!r} is not available in this sweep")
