"""Weight quantization on SmolLM2-135M: logit KL divergence against float32, and weight bytes.

    python -m benchmarks.bench_quant [--formats awq nvfp4 mxfp4 fp8]

For 8 chat prompts, every position's next-token distribution of the quantized model is compared
with the float32 model's: KL(p_float32 || p_quantized) in nats, mean and max over positions, the
fraction of positions whose greedy token agrees, and the bytes of all weights as stored (the
tied embedding stays float32 in every format; "linear" counts only the quantized matrices).
"""

from __future__ import annotations

import argparse
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain why the sky is blue in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "What does a CPU cache do?",
    "Give me a short recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["awq", "nvfp4", "mxfp4", "fp8"])
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from research.models.load import load_model
    from research.models.transformer import ContiguousKVCache, compute_logits, forward
    from research.quant import quantize_params, weight_bytes
    from research.quant.params import QUANTIZED_KEYS

    cfg, params, tok = load_model("smollm2-135m", jnp.float32, 0)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    positions = np.full((len(prompts), width), -1, np.int32)
    for i, ids in enumerate(prompts):
        tokens[i, : len(ids)] = ids
        positions[i, : len(ids)] = np.arange(len(ids))
    valid = positions >= 0

    @jax.jit
    def log_probs(p):
        cache = ContiguousKVCache.create(cfg, len(prompts), width)
        hidden, _ = forward(p, cfg, jnp.asarray(tokens), jnp.asarray(positions), cache)
        return jax.nn.log_softmax(compute_logits(p, cfg, hidden), axis=-1)

    def linear_bytes(p) -> int:
        return sum(weight_bytes(layer[k]) for layer in p["layers"] for k in QUANTIZED_KEYS)

    ref = np.asarray(log_probs(params))
    rows = [
        dict(
            format="float32",
            kl_mean=0.0,
            kl_max=0.0,
            top1_agreement=1.0,
            linear_mb=linear_bytes(params) / 1e6,
            total_mb=weight_bytes(params) / 1e6,
        )
    ]
    for fmt in args.formats:
        t0 = time.perf_counter()
        qparams = quantize_params(params, fmt)
        lq = np.asarray(log_probs(qparams))
        kl = np.sum(np.exp(ref) * (ref - lq), axis=-1)[valid]  # [positions]
        agree = (ref.argmax(-1) == lq.argmax(-1))[valid]
        rows.append(
            dict(
                format=fmt,
                kl_mean=float(kl.mean()),
                kl_max=float(kl.max()),
                top1_agreement=float(agree.mean()),
                linear_mb=linear_bytes(qparams) / 1e6,
                total_mb=weight_bytes(qparams) / 1e6,
                seconds=time.perf_counter() - t0,
            )
        )
    print(f"SmolLM2-135M, {len(prompts)} prompts, {int(valid.sum())} positions")
    print("| format | KL mean (nats) | KL max | top-1 agreement | linear MB | all weights MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['format']} | {r['kl_mean']:.4f} | {r['kl_max']:.3f} | "
            f"{r['top1_agreement']:.3f} | {r['linear_mb']:.1f} | {r['total_mb']:.1f} |"
        )
    return rows


if __name__ == "__main__":
    main()
