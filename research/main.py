"""The default job: load SmolLM2-135M on CPU and answer a chat prompt.

python -m research.main [--model smollm2-135m] [--prompt "..."] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    from research import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model)
    t1 = time.perf_counter()
    print(f"loaded {args.model} in {t1 - t0:.1f} s")
    out = llm.chat(
        [{"role": "user", "content": args.prompt}],
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature),
    )[0]
    t2 = time.perf_counter()
    print(f"user: {args.prompt}")
    print(f"assistant: {out.text}")
    print(
        f"{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated "
        f"(finish_reason={out.finish_reason}) in {t2 - t1:.2f} s including compilation"
    )


if __name__ == "__main__":
    main()
