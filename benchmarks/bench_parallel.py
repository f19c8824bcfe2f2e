"""One engine against tensor parallelism against replicas, on this machine, over HTTP, beside the
host cost model's prediction of the same three setups.

    python -m benchmarks.bench_parallel [--model smollm2-135m --tp 3 --replicas 2
        --concurrencies 1 8 32 --input-len 128 --output-len 128]

Setups (each a real server, measured with the ``vllm bench serve``-style HTTP client):

- one engine: ``python -m research.serve`` on every core;
- TP: the same with ``--tensor-parallel-size N`` (N XLA host devices sharing this machine's
  cores: the split work runs side by side, the replicated work N times, plus the all-reduces);
- replicas: ``python -m research.serve.router`` over R engines, each pinned to its own cores,
  least-loaded routing.

The prediction: the host cost model (``research.perf.host_model``) fitted on the one-engine
server's single-stream runs only (TTFT and TPOT at two prompt lengths; rates bounded by the
machine's measured peaks, ``research.perf.host_peaks``), then run through our
scheduler at each concurrency: for TP with every device 1/N of the fitted machine and the
sharding plan's collectives as host-memory copies, for replicas with each replica 1/R of it
behind the same routing policy. Per-user tok/s is 1000 / median TPOT; aggregate is output
tokens per second of the whole run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from research.serve.router import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def _start(cmd: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", *cmd, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy([f"http://127.0.0.1:{port}"], [proc], timeout=1200)
    except (RuntimeError, TimeoutError):
        proc.terminate()
        raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-concurrency", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--out", default=None, help="write the measurements here (JSON)")
    parser.add_argument(
        "--predict-from", default=None, help="a JSON of --out: predict again, measure nothing"
    )
    args = parser.parse_args(argv)

    from research.bench import compute_metrics, random_requests
    from research.bench.http_client import run_http_benchmark
    from research.config import CacheConfig, SchedulerConfig
    from research.models.presets import get_preset
    from research.perf.host_model import (
        HostCostModel,
        SingleStream,
        fit_host,
        host_hardware,
        simulated_engine,
    )
    from research.perf.simulated import ReplicaRouter

    cfg = get_preset(args.model)
    max_seqs = max(args.concurrencies)
    long_prompt = 3 * args.input_len
    max_model_len = long_prompt + args.output_len + 16
    engine_flags = [
        args.model,
        "--dtype", args.dtype,
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_seqs),
        "--num-kv-blocks", str(args.num_kv_blocks),
    ]  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    setups = {
        "one engine": ["research.serve", *engine_flags],
        f"TP={args.tp}": ["research.serve", *engine_flags, "--tensor-parallel-size", str(args.tp)],
        f"{args.replicas} replicas": [
            "research.serve.router", *engine_flags,
            "--num-replicas", str(args.replicas), "--routing", "least_loaded",
            "--cpus-per-replica", str(max(1, cores // args.replicas)),
        ],
    }  # fmt: skip

    def requests(n: int, input_len: int, seed: int) -> list:
        return random_requests(
            n, input_len, args.output_len, vocab_size=cfg.vocab_size, seed=seed,
            special_ids=cfg.eos_token_ids,
        )  # fmt: skip

    def point(url: str, c: int, input_len: int = args.input_len) -> dict:
        reqs = requests(max(3, args.prompts_per_concurrency * c), input_len, seed=c)
        result = run_http_benchmark(url, args.model, reqs, max_concurrency=c)
        if failed := [r.error for r in result.records if not r.success]:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
        m = compute_metrics(result.records, result.duration)
        return {
            "aggregate": m["output_throughput"],
            "per_user": 1000.0 / m["median_tpot_ms"],
            "ttft_s": m["median_ttft_ms"] / 1e3,
            "tpot_s": m["median_tpot_ms"] / 1e3,
        }

    measured: dict[str, dict[int, dict]] = {}
    single: dict[int, dict] = {}
    if args.predict_from:
        saved = json.loads(Path(args.predict_from).read_text())
        measured = {k: {int(c): v for c, v in d.items()} for k, d in saved["measured"].items()}
        single = {int(n): v for n, v in saved["single"].items()}
        setups = {k: setups.get(k, []) for k in measured}
    for name, cmd in setups.items():
        if name in measured:
            continue
        port = free_port()
        t0 = time.perf_counter()
        proc = _start(cmd, port)
        url = f"http://127.0.0.1:{port}"
        try:
            point(url, max_seqs)  # compiles what the covers did not; untimed
            if name == "one engine":  # the host model's calibration runs
                for n in (args.input_len, long_prompt):
                    point(url, 1, n)
                    single[n] = point(url, 1, n)
            measured[name] = {c: point(url, c) for c in args.concurrencies}
        finally:
            _stop(proc)
        print(f"{name}: measured in {time.perf_counter() - t0:.0f} s", flush=True)

    if args.out:
        Path(args.out).write_text(json.dumps({"measured": measured, "single": single}, indent=1))
    from research.perf.host_peaks import host_peaks

    fit = fit_host(
        args.model,
        SingleStream(
            output_len=args.output_len,
            tpot_s={n: r["tpot_s"] for n, r in single.items()},
            ttft_s={n: r["ttft_s"] for n, r in single.items()},
        ),
        max_num_seqs=max_seqs,
        max_num_batched_tokens=2048,
        max_model_len=max_model_len,
        dtype=args.dtype,
        # measured peaks are float32's: a bfloat16 fit is left unbounded (AMX runs it faster)
        peaks=host_peaks() if args.dtype == "float32" else None,
    )
    bw, flops = fit.hw.achievable_bandwidth, fit.hw.sustained_flops("fp32")
    cache = CacheConfig(num_kv_blocks=args.num_kv_blocks)
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048)

    def host_model(share: int, tp: int = 1) -> HostCostModel:
        hw = host_hardware(bw / share, flops / share)
        # On one host an all-reduce between devices is a copy through memory.
        hw = dataclasses.replace(hw, interconnect_bandwidth=bw, interconnect_kind="host memory")
        return HostCostModel(
            args.model, None, hw, params=fit.params, tensor_parallel_size=tp,
            max_num_seqs=max_seqs, max_num_batched_tokens=2048, max_model_len=max_model_len,
            dtype=args.dtype,
        )  # fmt: skip

    def simulate(make_engine: object, c: int) -> dict:
        from research.bench import run_benchmark

        engine = make_engine()
        reqs = requests(max(3, args.prompts_per_concurrency * c), args.input_len, seed=c)
        sleep = getattr(engine, "sleep", None) or engine.executor.clock.sleep
        result = run_benchmark(engine, reqs, max_concurrency=c, clock=engine.clock, sleep=sleep)
        m = compute_metrics(result.records, result.duration)
        return {"aggregate": m["output_throughput"], "per_user": 1000.0 / m["median_tpot_ms"]}

    def one() -> object:
        return simulated_engine(host_model(1), cache, sched, max_model_len)

    def tp() -> object:
        return simulated_engine(host_model(args.tp, args.tp), cache, sched, max_model_len)

    def replicas() -> object:
        engines = [
            simulated_engine(host_model(args.replicas), cache, sched, max_model_len)
            for _ in range(args.replicas)
        ]
        return ReplicaRouter(engines, routing="least_loaded")

    predicted = {
        name: {c: simulate(make, c) for c in args.concurrencies}
        for name, make in zip(setups, (one, tp, replicas), strict=True)
    }
    print(
        f"\n{args.model} {args.dtype}, {args.input_len} in / {args.output_len} out, {cores} cores; "
        f"host model fitted on the one-engine single-stream runs: {bw / 1e9:.1f} GB/s, "
        f"{flops / 1e9:.0f} GFLOP/s\n"
    )
    print("| setup | concurrency | aggregate tok/s | per-user tok/s | predicted aggregate | "
          "predicted per-user | per-user error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in setups:
        for c in args.concurrencies:
            got, pred = measured[name][c], predicted[name][c]
            err = 100.0 * (pred["per_user"] - got["per_user"]) / got["per_user"]
            print(
                f"| {name} | {c} | {got['aggregate']:.1f} | {got['per_user']:.1f} | "
                f"{pred['aggregate']:.1f} | {pred['per_user']:.1f} | {err:+.0f}% |"
            )


if __name__ == "__main__":
    main()
