"""Serve a model over HTTP: ``python -m research.serve smollm2-135m --port 8000`` (the model is
positional as in ``vllm serve``; ``--model`` works too).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize``,
``POST /detokenize``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (see
``research.serve.app``).
"""

from __future__ import annotations

import argparse
import json

from research.engine.compile_cache import DEFAULT_CACHE_DIR


def _llm(model: str, args: argparse.Namespace) -> object:
    """The engine the flags describe (vLLM's names)."""
    from research.llm import LLM

    return LLM(
        model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        gemm_backend=args.gemm_backend,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        speculative_config=args.speculative_config,
        num_scheduler_steps=args.num_scheduler_steps,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m research.serve", description=__doc__)
    parser.add_argument(
        "model_tag", nargs="?", default=None, help="preset, .gguf, HF dir or checkpoint"
    )
    parser.add_argument("--model", default=None, help="the same, as a flag")
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: --model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto: the checkpoint's, float32 checkpoints in bfloat16 (as vLLM on CPU)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--quantization", default=None, help="fp8 | awq | nvfp4 | mxfp4")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | int4")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (native on CPU where it builds, else xla) | xla | native | pallas | pallas_interpret",
    )
    parser.add_argument(
        "--gemm-backend",
        default="auto",
        help="auto (the AMX kernel for bfloat16 where the CPU has it, else xla) | xla | native",
    )
    parser.add_argument("--max-waiting", type=int, default=256, help="queue bound; 429 beyond it")
    parser.add_argument(
        "--max-body-bytes", type=int, default=8 << 20, help="largest request body; 413 beyond it"
    )
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="decode steps one call may run (vLLM's multi-step scheduling); new requests join "
        "between calls",
    )
    parser.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='JSON, as vllm serve: \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, default=1 << 30, help="KV pool size on this host"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's KV sizing on a GPU; refused here (the engine sizes its pool with "
        "--kv-cache-memory-bytes or --num-kv-blocks)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="devices one model is split over"
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE: split the experts over the tensor-parallel devices instead of their width",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="do not compile the covering step shapes at start: the first request of each new "
        "shape then waits for its compile, and so does everyone in that step",
    )
    parser.add_argument(
        "--compilation-cache-dir",
        default=DEFAULT_CACHE_DIR,
        help="JAX's persistent compilation cache ('' turns it off): a restart skips XLA compiles",
    )
    args = parser.parse_args(argv)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model or "smollm2-135m"
    if args.gpu_memory_utilization is not None:
        parser.error(
            "--gpu-memory-utilization sizes vLLM's KV pool from a GPU's memory; this engine "
            "sizes it with --kv-cache-memory-bytes or --num-kv-blocks"
        )
    from research.parallel.devices import request_host_devices

    request_host_devices(args.tensor_parallel_size)  # on a CPU: one XLA device per shard

    import logging

    import uvicorn

    # The engine's start-up lines (KV blocks, maximum concurrency), as vLLM prints them.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from research.engine.compile_cache import enable_compilation_cache
    from research.serve.app import create_app

    enable_compilation_cache(args.compilation_cache_dir or None)

    try:
        llm = _llm(model, args)
    except ValueError as error:  # a configuration this model cannot take: say why, exit 2
        parser.error(str(error))
    if not args.enforce_eager:
        # As vLLM captures its CUDA graphs: every later call runs on a compiled shape at once
        # (padded to a covering one until its own shape has compiled in the background).
        print("compiling the covering step shapes (--enforce-eager skips this)", flush=True)
        llm.engine.executor.precompile_covers(progress=True)
    app = create_app(
        llm,
        served_model_name=args.served_model_name or model,
        max_waiting=args.max_waiting,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
    )
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
