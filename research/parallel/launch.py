"""One model across processes (and machines) with ``jax.distributed``: every process runs this
with the same arguments but its own ``--process-id``; together their devices form the mesh the
model is split over. Process 0 prints the results as JSON lines.

On two machines (one CPU device each; GPUs work the same way with one process per host)::

    # machine A (10.0.0.1)                         # machine B
    python -m research.parallel.launch tiny-llama \\  python -m research.parallel.launch tiny-llama \\
      --coordinator-address 10.0.0.1:1234 \\          --coordinator-address 10.0.0.1:1234 \\
      --num-processes 2 --process-id 0 \\             --num-processes 2 --process-id 1 \\
      --tensor-parallel-size 2 --prompt-ids 1,2,3     --tensor-parallel-size 2 --prompt-ids 1,2,3

Every process runs the same scheduler on the same requests (JAX's multi-controller model), so
their steps agree; the collectives between them run over Gloo on CPUs.
"""

from __future__ import annotations

import argparse
import json
import os


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize`` (CPU collectives over Gloo), as JAX documents it."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m research.parallel.launch", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--coordinator-address", required=True, help="HOST:PORT of process 0")
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--tensor-parallel-size", type=int, required=True)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--prompt-ids", action="append", default=[], help="comma-separated token ids; repeatable"
    )
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt; repeatable")
    args = parser.parse_args(argv)
    prompts: list = [[int(t) for t in p.split(",")] for p in args.prompt_ids] + args.prompt
    if not prompts:
        parser.error("give at least one --prompt or --prompt-ids")

    initialize(args.coordinator_address, args.num_processes, args.process_id)
    import jax

    from research import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    if jax.process_index() == 0:
        for out in outs:
            print(
                json.dumps(
                    {
                        "prompt_token_ids": out.prompt_token_ids,
                        "token_ids": out.token_ids,
                        "text": out.text,
                    }
                ),
                flush=True,
            )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
