"""What the HTTP path costs: the same workload in process and through the OpenAI server.

``python -m benchmarks.bench_http [--model smollm2-135m --num-prompts 16 --input-len 32
--output-len 16 --concurrency 4]`` runs ``research.bench.run_benchmark`` on one engine, then
serves a second engine over the same weights with ``research.serve`` (uvicorn on a free local
port, in a background thread) and runs ``run_http_benchmark`` against it. Each run is preceded by
an untimed warmup with other requests of the same lengths (it compiles the step shapes; other
prompts, so the timed run gets no prefix-cache hits). Prints median TTFT and
TPOT of both and the difference.
"""

from __future__ import annotations

import argparse
import threading
import time

import uvicorn

from research import LLM
from research.bench import random_requests, run_benchmark
from research.bench.http_client import run_http_benchmark
from research.engine.engine import Engine
from research.serve import create_app


def _fresh_engine(llm: LLM) -> Engine:
    """A second engine over ``llm``'s weights with the same configuration (and shapes)."""
    e = llm.engine
    return Engine(
        llm.model_config,
        llm.params,
        llm.tokenizer,
        cache_config=e.cache_config,
        scheduler_config=e.scheduler_config,
        max_model_len=e.max_model_len,
        dtype=llm.dtype,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=256, max_num_seqs=args.concurrency)
    special = set(llm.model_config.eos_token_ids) | set(llm.tokenizer.all_special_ids)
    warmup, requests = (
        random_requests(
            args.num_prompts,
            args.input_len,
            args.output_len,
            vocab_size=llm.model_config.vocab_size,
            seed=seed,
            special_ids=special,
        )
        for seed in (1, 0)
    )

    run_benchmark(llm.engine, warmup, max_concurrency=args.concurrency)
    local = run_benchmark(llm.engine, requests, max_concurrency=args.concurrency).metrics()

    server = uvicorn.Server(
        uvicorn.Config(
            create_app(_fresh_engine(llm), served_model_name=args.model),
            host="127.0.0.1",
            port=0,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        run_http_benchmark(url, args.model, warmup, max_concurrency=args.concurrency)
        remote = run_http_benchmark(
            url, args.model, requests, max_concurrency=args.concurrency
        ).metrics()
    finally:
        server.should_exit = True
        thread.join()

    print(
        f"{args.model}: {args.num_prompts} requests, input {args.input_len}, "
        f"output {args.output_len}, concurrency {args.concurrency}"
    )
    print(f"{'':>16} {'in-process':>10} {'HTTP':>9} {'overhead':>9}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        key = f"median_{name}_ms"
        print(
            f"{key:>16} {local[key]:7.2f} ms {remote[key]:6.2f} ms "
            f"{remote[key] - local[key]:+6.2f} ms"
        )


if __name__ == "__main__":
    main()
