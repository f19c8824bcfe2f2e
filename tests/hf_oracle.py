"""HF transformers as the correctness oracle."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy decoding with HF's KV cache that, like ``ignore_eos``, neither stops at nor
    suppresses EOS (``generate`` would stop at the model's EOS)."""
    out = model(input_ids, use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        tokens.append(int(nxt[0]))
        out = model(nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
    return tokens
