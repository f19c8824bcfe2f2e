"""What gets quantized and in which groups, without JAX: the quantizer (``qtensor``, ``params``)
and the KV-capacity and cost models (``research.perf``) read the layout from here."""

from __future__ import annotations

FORMATS = ("awq", "nvfp4", "mxfp4", "fp8")
GROUP_SIZES = {"awq": 128, "nvfp4": 16, "mxfp4": 32}  # fp8: one group spans the whole column
AWQ_PACK = 8  # int4 values per int32 word (along the output axis)
# Every layer's linear weights: attention q/k/v/o and the MLP's (or stacked experts') gate/up/down.
QUANTIZED_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
EXPERT_KEYS = ("w_gate", "w_up", "w_down")
# Architectures whose published 4-bit checkpoints quantize the MoE experts only: openai/gpt-oss
# ships MXFP4 experts and bf16 attention, router and embeddings. Sizing and pricing count that.
EXPERTS_ONLY_ARCHITECTURES = ("gpt_oss",)


def quantized_keys(architecture: str) -> tuple[str, ...]:
    """The per-layer weights a quantized checkpoint of ``architecture`` stores quantized."""
    return EXPERT_KEYS if architecture in EXPERTS_ONLY_ARCHITECTURES else QUANTIZED_KEYS


# AWQ groups 128 input channels; a layer whose input width 128 does not divide (SmolLM2's hidden
# size is 576) uses the largest of these that does, as AutoAWQ users do with q_group_size.
AWQ_FALLBACK_GROUPS = (64, 32)


def awq_group_size(d_in: int) -> int:
    """AWQ's input channels per scale for a weight with ``d_in`` inputs."""
    candidates = (GROUP_SIZES["awq"], *AWQ_FALLBACK_GROUPS)
    for group in candidates:
        if d_in % group == 0:
            return group
    raise ValueError(
        f"awq: input width {d_in} is not a multiple of any supported group size {candidates}"
    )
