"""Static against continuous batching on a mixed-length workload, side by side in one run.

    python -m benchmarks.bench_batching [--model smollm2-135m] [--num-requests 64]
        [--min-output 16] [--max-output 256] [--prompt-len 32] [--max-num-seqs 16]

Every request arrives at t=0 with ``ignore_eos``, so each generates exactly its drawn output
length (uniform in [min, max]). Static batching admits a new batch only when the previous one has
fully finished; continuous batching refills a slot the step after it frees. Prints steps,
wall time, output tok/s, preemptions and compiled step shapes for both, and their ratio. Each
policy runs the workload twice and the second (compiled) pass is timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def run_policy(llm, policy: str, prompts, sps, max_num_seqs: int) -> dict[str, float]:
    from research.config import CacheConfig, SchedulerConfig
    from research.engine.engine import Engine

    engine = Engine(
        llm.model_config,
        llm.params,
        llm.tokenizer,
        cache_config=CacheConfig(
            num_kv_blocks=llm.engine.block_manager.num_blocks, enable_prefix_caching=False
        ),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, scheduling_policy=policy),
        max_model_len=llm.max_model_len,
        dtype=llm.dtype,
    )
    from research.engine import executor

    # A first, untimed pass compiles every step shape the workload needs; the timed pass must
    # then compile nothing (traces_in_timed_run = 0), whatever the number of steps.
    engine.generate(prompts, sps)
    warm_steps, warm_traces = engine.num_steps, executor.STEP_TRACES[0]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sps)
    wall = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    assert all(len(o.token_ids) == sp.max_tokens for o, sp in zip(outs, sps, strict=True))
    return {
        "steps": engine.num_steps - warm_steps,
        "wall_s": wall,
        "output_tok_s": generated / wall,
        "preemptions": engine.stats()["num_preemptions"],
        "compiled_shapes": engine.num_compilations,
        "traces_in_timed_run": executor.STEP_TRACES[0] - warm_traces,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from research import LLM, SamplingParams

    rng = np.random.RandomState(args.seed)
    llm = LLM(args.model, max_model_len=args.prompt_len + args.max_output + 16)
    vocab = llm.model_config.vocab_size
    prompts = [
        rng.randint(3, vocab, size=args.prompt_len).tolist() for _ in range(args.num_requests)
    ]
    lengths = rng.randint(args.min_output, args.max_output + 1, size=args.num_requests)
    sps = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in lengths]

    results = {
        p: run_policy(llm, p, prompts, sps, args.max_num_seqs) for p in ("static", "continuous")
    }
    print(
        f"{args.model}: {args.num_requests} requests, prompt {args.prompt_len}, output uniform "
        f"in [{args.min_output}, {args.max_output}] (total {int(lengths.sum())} tokens), "
        f"max_num_seqs {args.max_num_seqs}, CPU"
    )
    keys = [
        "steps",
        "wall_s",
        "output_tok_s",
        "preemptions",
        "compiled_shapes",
        "traces_in_timed_run",
    ]
    print(f"{'policy':<12}" + "".join(f"{k:>20}" for k in keys))
    for policy, r in results.items():
        print(
            f"{policy:<12}"
            + "".join(f"{r[k]:>20.1f}" if isinstance(r[k], float) else f"{r[k]:>20}" for k in keys)
        )
    s, c = results["static"], results["continuous"]
    print(
        f"continuous / static: {c['output_tok_s'] / s['output_tok_s']:.2f}x output tok/s, "
        f"{s['steps'] / c['steps']:.2f}x fewer steps"
    )


if __name__ == "__main__":
    main()
