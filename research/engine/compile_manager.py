"""Which shapes the engine step is compiled for, and compiling them before they are needed.

A step's compiled shape is (N packed tokens, R rows, M blocks per row), each a bucket: R a
power of two (capped at ``max_num_seqs``), N a power of two up to 16 and then a power of two or
its 1.5x midpoint (``token_bucket``, capped at the token budget), and M the longest block
table's bucket for the XLA reference, whose gather reads every column; the kernels read each
row's pages up to its length, so for them M is always the longest table a sequence can have
and drops out. The mix of decodes, prefill chunks and verifications, the tokens per row and
how many rows are decodes all travel as data: one compile serves every mix of the same size.
S (scored positions per row: 1, or 1 + drafts with speculative decoding) is fixed per engine.

``CompileManager`` holds every executable of the step (and of its K/V write), precompiles
the shapes a workload is predicted to use (``research.engine.shapes``) or a set of covers that
holds every step the engine can run, and, when serving, runs a step of an uncompiled shape
padded to the cheapest compiled cover while its own shape compiles on a background thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

from research.engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # (N tokens, R rows, M blocks per row)


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= n and >= minimum, capped at maximum (which may be any n)."""
    return min(max(minimum, 1 << max(0, n - 1).bit_length()), maximum)


def context_bucket(n: int, minimum: int, maximum: int) -> int:
    """Blocks per row: the smallest of minimum * {1, 2, 3, 4, 6, 8, 12, ...} (powers of two and
    their 1.5x midpoints) >= n, capped at maximum. The XLA reference reads every bucketed
    block, so finer steps than powers of two cut up to half the context read."""
    if n <= minimum:
        return min(minimum, maximum)
    p = minimum
    while True:  # (2p, 3p) for p = m, 2m, 4m, ...: 2m, 3m, 4m, 6m, 8m, 12m, ...
        for size in (2 * p, 3 * p):
            if size >= n:
                return min(size, maximum)
        p *= 2


def token_bucket(n: int, maximum: int) -> int:
    """Tokens per step: a power of two up to 16, then 16 * {2, 3, 4, 6, 8, 12, ...}
    (``context_bucket``'s powers of two and 1.5x midpoints), capped at maximum. Every padded
    token costs a full forward, and a step's tokens are often a few decodes past a prefill
    chunk's power of two: the midpoints cap that waste at a third instead of a half."""
    if n <= 16:
        return bucket(n, 1, maximum)
    return context_bucket(n, 16, maximum)


def _spec(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))


class CompileManager:
    """Shapes and executables of one executor's step."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        reads_whole_table: bool,
        lower: Callable[[Shape], tuple[Any, Any]],
    ):
        """``lower(shape)`` -> (compiled step, compiled K/V write) for ``shape``;
        ``reads_whole_table``: the attention backend's cost grows with M (the XLA gather)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.reads_whole_table = reads_whole_table
        self.num_scored = 1
        self._lower = lower
        self.shapes: set[Shape] = set()  # every shape compiled (by a run or ahead of time)
        self.compiled: dict[Shape, Any] = {}  # ahead-of-time executables
        self.writes: dict[int, Any] = {}  # N -> compiled K/V write
        self.compile_in_background = False
        self.covered_calls = 0  # steps run padded to a cover
        self.step_compiles = 0  # shapes first compiled inside a step (a step that waited)
        # Multi-step loops (``num_scheduler_steps``): step shape -> executable.
        self.multi: dict[Shape, Any] = {}
        self._pending: set[Any] = set()  # shapes, and ("multi", shape) for the loops
        self._lock = threading.Lock()
        self._compiler: ThreadPoolExecutor | None = None

    @property
    def token_cap(self) -> int:
        """The largest N: the token budget, or every row verifying all its drafts."""
        return max(self.max_num_batched_tokens, self.max_num_seqs * self.num_scored)

    def shape_for(self, rows: list[ScheduledSeq]) -> Shape:
        """The bucketed (N, R, M) of the step that runs ``rows``."""
        r = bucket(len(rows), 1, self.max_num_seqs)
        n = max(r, token_bucket(sum(item.num_new_tokens for item in rows), self.token_cap))
        if not self.reads_whole_table:
            return n, r, self.max_blocks
        if all(item.start == 0 for item in rows):
            return n, r, 0  # fresh prompts only: no cached context to read
        m_min = -(-128 // self.block_size)  # at least 128 tokens: fewer shapes for short ones
        longest = max(len(item.seq.block_ids) for item in rows)
        return n, r, context_bucket(longest, m_min, self.max_blocks)

    def token_buckets(self) -> list[int]:
        """Every N ``token_bucket`` gives, up to the cap."""
        out, n = [], 1
        while True:
            b = token_bucket(n, self.token_cap)
            out.append(b)
            if b >= self.token_cap:
                return out
            n = b + 1

    def row_buckets(self) -> list[int]:
        seqs = self.max_num_seqs
        return sorted({bucket(k, 1, seqs) for k in (1 << i for i in range(seqs.bit_length() + 1))})

    def cover_shapes(self) -> list[Shape]:
        """Shapes that hold every step the engine can run: per token bucket N, the most rows an
        N-token step can have, over the longest table. A step (n, r, m) runs in the cover of
        the smallest N >= n, whose R >= r (r <= n) and M >= m."""
        rows = self.row_buckets()
        covers = set()
        for n in self.token_buckets():
            r = max((x for x in rows if x <= n), default=rows[0])
            covers.add((max(n, r), r, self.max_blocks))
        return sorted(covers)

    def all_shapes(self) -> list[Shape]:
        """Every (N, R) pair the engine can run (R <= N), over the longest table."""
        return sorted(
            (n, r, self.max_blocks)
            for n in self.token_buckets()
            for r in self.row_buckets()
            if r <= n
        )

    # ------------------------------------------------------------------ executables

    def store(self, shape: Shape, step: Any, write: Any) -> None:
        with self._lock:
            self.compiled[shape] = step
            self.writes.setdefault(shape[0], write)
            self.shapes.add(shape)

    def compile(self, shapes: Iterable[Shape], progress: bool = False) -> int:
        """Compile (not run) every shape of ``shapes`` not compiled yet; returns how many."""
        todo = sorted(set(shapes) - self.shapes)
        for i, shape in enumerate(todo):
            t0 = time.perf_counter()
            self.store(shape, *self._lower(shape))
            if progress:
                n, r, m = shape
                print(
                    f"  compiled {i + 1}/{len(todo)}: N={n} R={r} M={m} "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
        return len(todo)

    def _cover(self, shape: Shape) -> Shape | None:
        """The cheapest compiled shape at least as large as ``shape`` in every dimension."""
        with self._lock:
            ready = list(self.shapes)
        fits = [s for s in ready if all(a >= b for a, b in zip(s, shape, strict=True))]
        return min(fits, key=lambda s: (s[0] + s[1] * (1 + s[2]), s)) if fits else None

    def resolve(self, shape: Shape, exact: bool = False) -> tuple[Shape, Any, Any]:
        """(shape to run, its compiled step or None (jit it), its compiled write or None) for a
        step of ``shape``; when serving (and not ``exact``), an uncompiled shape runs padded to
        a cover while its own compiles in the background."""
        if self.compile_in_background and not exact and shape not in self.shapes:
            cover = self._cover(shape)
            if cover is not None:
                self._compile_later(shape)
                self.covered_calls += 1
                shape = cover
        with self._lock:
            if shape not in self.shapes:
                self.step_compiles += 1  # jitted by this step: it waits for the compile
            self.shapes.add(shape)
            return shape, self.compiled.get(shape), self.writes.get(shape[0])

    def resolve_multi(
        self, shape: Shape, lower: Callable[[], Any], ahead: bool = False
    ) -> Any | None:
        """The compiled multi-step loop for ``shape`` (``lower()`` compiles it). Outside serving
        it compiles now (``ahead``: before the steps, not inside one); when serving it compiles
        in the background and None says to run one step meanwhile."""
        with self._lock:
            compiled = self.multi.get(shape)
        if compiled is not None:
            return compiled
        if ahead or not self.compile_in_background:
            compiled = lower()
            with self._lock:
                self.step_compiles += not ahead
                self.multi[shape] = compiled
            return compiled
        self._background(("multi", shape), self._compile_multi, shape, lower)
        return None

    def _compile_multi(self, shape: Shape, lower: Callable[[], Any]) -> None:
        compiled = lower()
        with self._lock:
            self.multi[shape] = compiled

    def wait_for_background(self, timeout: float = 120.0) -> bool:
        """Block until no background compile is pending (True) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.05)
        return False

    def _compile_later(self, shape: Shape) -> None:
        with self._lock:
            if shape in self.shapes:
                return
        self._background(shape, self._compile_in_background, shape)

    def _compile_in_background(self, shape: Shape) -> None:
        self.store(shape, *self._lower(shape))

    def _background(self, key: Any, compile_: Callable[..., None], *args: Any) -> None:
        """``compile_(*args)`` on the compile thread, unless ``key`` (a step shape, or
        ("multi", shape) for a loop) is pending already. A failure is logged: the cover, or
        single steps, keep serving and the next miss retries."""
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="step-compiler")
        self._compiler.submit(self._run_background, key, compile_, args)

    def _run_background(self, key: Any, compile_: Callable[..., None], args: tuple) -> None:
        try:
            compile_(*args)
        except Exception:
            logger.exception("background compile of %s failed", key)
        finally:
            with self._lock:
                self._pending.discard(key)


def lower_step(step: Any, write: Any, args: tuple[Any, ...], static: dict[str, Any]) -> Any:
    """Ahead-of-time executables of ``step(*args, **static)`` and of the K/V write of its
    outputs (``write(pool, new_k, new_v, slots[, sliding_slots])``; None where the step writes
    the pool itself)."""
    spec = functools.partial(jax.tree_util.tree_map, _spec)
    params, pool, inputs = args
    lowered = step.lower(spec(params), spec(pool), inputs, **static)
    if write is None:
        return lowered.compile(), None
    out = lowered.out_info
    new_k, new_v = ([_spec(x) for x in out[key]] for key in ("new_k", "new_v"))
    n = inputs.token_ids.shape[0]
    slots = jax.ShapeDtypeStruct((n,), jnp.int32)
    sliding = slots if pool.layer_slots else None
    return lowered.compile(), write.lower(spec(pool), new_k, new_v, slots, sliding).compile()
