"""A trace's prompts through the engine's own block manager, one after another: the prefix
cache hit ratio a pool of ``num_blocks`` blocks gives, without running the model.

Each prompt is looked up, allocated (hit blocks reused), marked computed, registered and freed,
as the scheduler does for a prefill (``research.engine.scheduler``), so hashing, the rule that
the last token is always computed, and the LRU eviction of freed blocks are the engine's. Prompts
do not overlap in time here (a running request pins its blocks in a served run), and outputs
are not cached (a trace's next turn carries them in its own prompt blocks). A prompt longer
than the whole pool cannot be admitted: counted in ``too_long`` and skipped, as vLLM rejects it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from research.bench.workload import BenchRequest
from research.engine.block_manager import BlockManager
from research.engine.request import RequestMetrics, SamplingParams
from research.engine.sequence import Sequence


@dataclass(frozen=True)
class CacheReplay:
    num_blocks: int | None  # None: unbounded
    block_size: int
    prompt_tokens: int  # of the admitted prompts
    cached_tokens: int
    evictions: int
    too_long: int

    @property
    def hit_rate(self) -> float:
        """Token-weighted: cached prompt tokens over prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay_prefix_cache(
    requests: Iterable[BenchRequest], num_blocks: int | None, block_size: int = 16
) -> CacheReplay:
    """Replay ``requests``' prompts in order through a ``BlockManager`` of ``num_blocks``
    (None: as many as every prompt together needs, so nothing is evicted)."""
    requests = list(requests)
    unbounded = num_blocks is None
    if num_blocks is None:
        num_blocks = sum(-(-r.prompt_len // block_size) for r in requests) or 1
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=1)
    prompt_tokens = too_long = 0
    for i, r in enumerate(requests):
        seq = Sequence(str(i), list(r.prompt_token_ids), params, 0, RequestMetrics(0.0))
        computed = bm.get_computed_blocks(seq)
        num_new = seq.num_tokens - len(computed) * block_size
        if not bm.allocate_slots(seq, num_new, computed):
            too_long += 1
            continue
        bm.record_prefix_lookup(seq.num_tokens, len(computed))
        prompt_tokens += seq.num_tokens
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        bm.free(seq)
    return CacheReplay(
        None if unbounded else bm.num_blocks,
        block_size,
        prompt_tokens,
        bm.prefix_hits,
        bm.num_evictions,
        too_long,
    )


__all__ = ["CacheReplay", "replay_prefix_cache"]
