"""The engine's side of speculative decoding: building the proposer, asking it for drafts,
rolling back rejected drafts, and the counters (package docstring)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from research.config import ModelConfig, SpeculativeConfig
from research.engine.block_manager import BlockManager
from research.engine.scheduler import ScheduledSeq
from research.engine.sequence import Sequence
from research.models.transformer import Params


@dataclasses.dataclass
class SpecStats:
    """Speculative decoding counters (vLLM's names where it has them)."""

    num_drafts: int = 0  # verified rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: dict[int, int] = dataclasses.field(default_factory=dict)
    num_rollback_blocks: int = 0  # blocks released by rolling back rejected drafts
    proposer_time: float = 0.0  # wall seconds spent proposing drafts

    def record(self, item: ScheduledSeq, accepted: list[int]) -> None:
        """A verified row: its drafts and how many of them were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += len(item.draft_token_ids)
        self.num_accepted_tokens += len(accepted)
        for j in range(len(accepted)):
            self.accepted_per_position[j] = self.accepted_per_position.get(j, 0) + 1

    def as_dict(self, num_steps: int) -> dict[str, Any]:
        n, drafted = self.num_drafts, self.num_draft_tokens
        return {
            "spec_num_drafts": n,
            "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            # Tokens a verified row emits on average: its accepted drafts plus one sampled.
            "spec_mean_acceptance_length": 1 + self.num_accepted_tokens / n if n else 0.0,
            "spec_draft_tokens_per_step": drafted / num_steps if num_steps else 0.0,
            "spec_accepted_per_position": [
                self.accepted_per_position.get(j, 0)
                for j in range(max(self.accepted_per_position, default=-1) + 1)
            ],
            "spec_rollback_blocks": self.num_rollback_blocks,
            "spec_proposer_time_s": self.proposer_time,
        }


def make_proposer(
    spec: SpeculativeConfig,
    target: ModelConfig,
    *,
    draft_model: tuple[ModelConfig, Params] | None,
    dtype: Any,
    attention_backend: str,
    seed: int,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
) -> Any:
    """The proposer ``spec`` names: n-gram lookup, or a draft model (``draft_model`` if it is
    loaded already, else loaded here by name) with the target's vocabulary."""
    if spec.method == "ngram":
        from research.engine.spec.ngram import NgramProposer

        return NgramProposer(spec)
    from research.engine.spec.draft import DraftModelProposer

    if draft_model is None:
        from research.models.load import load_model

        cfg, params, _ = load_model(spec.model, dtype, seed)
    else:
        cfg, params = draft_model
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {spec.model!r} has a vocabulary of "
            f"{cfg.vocab_size} tokens; the target's has {target.vocab_size}"
        )
    return DraftModelProposer(
        spec,
        cfg,
        params,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
        attention_backend=attention_backend,
    )


def propose(proposer: Any, running: list[Sequence], stats: SpecStats) -> None:
    """Drafts for every caught-up running sequence (none for requests that want logprobs:
    those are returned per sampled position). A sequence never drafts past max_tokens."""
    t0 = time.perf_counter()
    requests = []
    for seq in running:
        seq.spec_token_ids = []
        sp = seq.sampling_params
        if seq.num_uncomputed_tokens != 1 or sp.logprobs is not None:
            continue
        room = sp.max_tokens - len(seq.output_token_ids) - 1
        if room > 0:
            requests.append((seq, room))
    if requests:
        drafts = proposer.propose_batch(requests)
        for seq, room in requests:
            seq.spec_token_ids = drafts.get(seq.request_id, [])[:room]
    stats.proposer_time += time.perf_counter() - t0


def rollback(block_manager: BlockManager, item: ScheduledSeq, num_accepted: int) -> int:
    """After a verified row's accepted drafts and its sampled token were appended: the K/V of
    the last token and the accepted drafts are computed, the rejected drafts' slots are rolled
    back (their blocks released where the rollback crosses a block boundary; the next step
    overwrites the rest), and full blocks of accepted tokens are registered in the prefix
    cache. Returns how many blocks were released."""
    seq = item.seq
    seq.num_computed_tokens = min(item.start + 1 + num_accepted, seq.num_tokens)
    released = block_manager.trim(seq, seq.num_computed_tokens)
    block_manager.cache_full_blocks(seq)
    return released
