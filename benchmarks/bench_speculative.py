"""n-gram speculative decoding on SmolLM2-135M (real weights, this machine): tok/s with and
without speculation, and the acceptance, on repetitive and on random prompts.

    python -m benchmarks.bench_speculative [--concurrency 1 8 32] [--gen-len 128]
        [--prompt-len 256] [--k 4] [--out results.jsonl]

Repetitive prompts are a passage repeated (the lookup finds the continuation in the prompt);
random prompts are random token ids (it rarely does: the cost of verifying drafts that are
rejected). Greedy, EOS ignored, every request generates --gen-len tokens. Each configuration
runs once untimed first (compiles its step shapes), then once timed; one JSON line per point
goes to --out.
"""

from __future__ import annotations

import argparse
import json
import time

PASSAGE = (
    "def parse(line):\n    key, value = line.split('=', 1)\n    return key.strip(), "
    "value.strip()\n\nfor line in open('config.txt'):\n    key, value = parse(line)\n"
    "    settings[key] = value\n"
)


def prompts(kind: str, n: int, length: int, tokenizer, vocab: int) -> list[list[int]]:
    import numpy as np

    if kind == "repetitive":
        ids = tokenizer.encode(PASSAGE * (2 + length // 20))
        return [ids[i : i + length] for i in range(n)]
    rng = np.random.default_rng(0)
    return [rng.integers(100, vocab, length).tolist() for _ in range(n)]


def run_point(llm, batch: list[list[int]], gen_len: int) -> dict[str, float]:
    from research import SamplingParams

    sp = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(batch, sp)
    seconds = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    point = {"seconds": seconds, "output_tok_s": tokens / seconds}
    drafted = after.get("spec_num_draft_tokens", 0) - before.get("spec_num_draft_tokens", 0)
    if drafted:
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        rows = after["spec_num_drafts"] - before["spec_num_drafts"]
        point |= {
            "spec_acceptance_rate": accepted / drafted,
            "spec_mean_acceptance_length": 1 + accepted / rows,
        }
    return point


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", default=None, help="append one JSON line per point here")
    args = parser.parse_args(argv)

    from research import LLM

    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    max_len = args.prompt_len + args.gen_len + 1
    for label, config in (("plain", None), (f"ngram-k{args.k}", spec)):
        llm = LLM(
            "smollm2-135m",
            max_model_len=max_len,
            max_num_seqs=max(args.concurrency),
            enable_prefix_caching=False,
            speculative_config=config,
        )
        vocab = llm.model_config.vocab_size
        for kind in ("repetitive", "random"):
            for c in args.concurrency:
                batch = prompts(kind, c, args.prompt_len, llm.tokenizer, vocab)
                run_point(llm, batch, args.gen_len)  # compiles
                point = {"label": label, "prompts": kind, "concurrency": c}
                point |= run_point(llm, batch, args.gen_len)
                print(json.dumps(point), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(point) + "\n")


if __name__ == "__main__":
    main()
