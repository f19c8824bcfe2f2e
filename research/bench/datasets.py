"""Benchmark datasets with ``vllm bench serve``'s names and meanings, and replayed traces.

- ``random``: ``research.bench.workload.random_requests``; with ``prefix_len`` every prompt
  starts with the same ``prefix_len`` random tokens (``--random-prefix-len``), then its own
  ``input_len`` ones.
- ``prefix_repetition``: ``num_prefixes`` random prefixes of ``prefix_len`` tokens, each
  request one of them (in turn, shuffled) plus its own ``suffix_len`` random tokens
  (``--prefix-repetition-*``).
- ``burstgpt``: a local BurstGPT CSV; lengths from ``Request tokens`` / ``Response tokens`` of
  the rows of one model (vLLM keeps GPT-4's) with a response; random token ids.
- ``custom``: JSONL, one request per line: ``prompt_token_ids`` (a list) or ``prompt`` (text,
  tokenized by the engine's tokenizer), and ``output_tokens``.
- ``sharegpt``: a local ShareGPT JSON (``conversations`` of ``from``/``value`` turns): the first
  human turn as the prompt and the reply's token count as the output length, as vLLM takes it.
  Every turn as a multi-turn session: ``research.bench.sessions.sharegpt_sessions``.
- traces: ``azure_code`` / ``azure_conv`` (Azure LLM inference 2023: arrival time, context and
  generated tokens) and ``mooncake_conversation`` / ``mooncake_synthetic`` (Mooncake FAST'25:
  arrival in ms, lengths, one hash id per 512-token block), shipped in
  ``research/bench/data/traces`` with their licences; a user's file of either format goes
  through the same loader (``load_trace``). Each hash id expands to a fixed block of token ids
  (a generator seeded by the id), so equal ids are equal prefixes the engine's prefix cache
  shares, whatever its own KV block size. Arrival times are replayed, times ``time_scale``.

Bad input names the file and line: a missing column, a length that is not a whole number >= 0
(input >= 1), timestamps that go back, more hash ids than the input length covers.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from research.bench.workload import (
    BenchRequest,
    allowed_token_ids,
    length_bounds,
    random_requests,
)

TRACE_DIR = Path(__file__).parent / "data" / "traces"
# name -> (format, file in TRACE_DIR)
SHIPPED_TRACES = {
    "azure_code": ("azure", "AzureLLMInferenceTrace_code.csv"),
    "azure_conv": ("azure", "AzureLLMInferenceTrace_conv.csv"),
    "mooncake_conversation": ("mooncake", "mooncake_conversation_trace.jsonl"),
    "mooncake_synthetic": ("mooncake", "mooncake_synthetic_trace.jsonl"),
}
TRACE_FORMATS = ("azure", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
BURSTGPT_COLUMNS = ("Model", "Request tokens", "Response tokens")


class DatasetError(ValueError):
    """Bad dataset input, with the file and line it is on."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class TraceRecord:
    """One trace request: arrival (seconds from the trace's first), lengths, and the prefix
    blocks it is made of (Mooncake's hash ids; None: nothing shared)."""

    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


def _length(path: Path, line: int, name: str, value: object, minimum: int) -> int:
    try:
        n = int(str(value))
    except ValueError:
        raise DatasetError(path, line, f"{name} is {value!r}, not a whole number") from None
    if n < minimum:
        raise DatasetError(path, line, f"{name} is {n}; it must be >= {minimum}")
    return n


def _ordered(path: Path, line: int, t: float, last: float | None) -> None:
    if last is not None and t < last:
        raise DatasetError(path, line, f"timestamp {t} comes before the previous one ({last})")


def _csv_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV file whose header must name ``columns``."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise DatasetError(path, 1, f"missing column(s) {missing}; expected {columns}")
        yield from enumerate(reader, start=2)


def load_azure(path: str | Path) -> list[TraceRecord]:
    """An Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    path = Path(path)
    out: list[TraceRecord] = []
    start = last = None
    for line, row in _csv_rows(path, AZURE_COLUMNS):
        try:
            t = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
        except (TypeError, ValueError):
            raise DatasetError(
                path, line, f"TIMESTAMP {row['TIMESTAMP']!r} is not a time"
            ) from None
        _ordered(path, line, t, last)
        start = t if start is None else start
        last = t
        out.append(
            TraceRecord(
                t - start,
                _length(path, line, "ContextTokens", row["ContextTokens"], 1),
                _length(path, line, "GeneratedTokens", row["GeneratedTokens"], 1),
            )
        )
    if not out:
        raise DatasetError(path, None, "no requests")
    return out


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSONL file; bad JSON names its line."""
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as e:
                raise DatasetError(path, line, f"not JSON ({e.msg})") from None


def load_mooncake(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRecord]:
    """A Mooncake trace JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids`` one per ``block_tokens``-token block)."""
    path = Path(path)
    out: list[TraceRecord] = []
    last = None
    for line, obj in _jsonl(path):
        missing = [k for k in MOONCAKE_KEYS if k not in obj]
        if missing:
            raise DatasetError(path, line, f"missing key(s) {missing}; expected {MOONCAKE_KEYS}")
        t = float(obj["timestamp"]) / 1000.0
        _ordered(path, line, t, last)
        last = t
        n_in = _length(path, line, "input_length", obj["input_length"], 1)
        n_out = _length(path, line, "output_length", obj["output_length"], 1)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
            raise DatasetError(path, line, "hash_ids must be a list of integers")
        if len(ids) > math.ceil(n_in / block_tokens):
            raise DatasetError(
                path,
                line,
                f"{len(ids)} hash ids of {block_tokens} tokens cover more than input_length "
                f"{n_in} (at most {math.ceil(n_in / block_tokens)})",
            )
        out.append(TraceRecord(t, n_in, n_out, tuple(ids)))
    if not out:
        raise DatasetError(path, None, "no requests")
    return out


def load_trace(name_or_path: str | Path, fmt: str | None = None) -> list[TraceRecord]:
    """A shipped trace by name (``SHIPPED_TRACES``) or a file of format ``fmt`` (azure |
    mooncake; default from the suffix: .csv azure, .jsonl mooncake)."""
    if str(name_or_path) in SHIPPED_TRACES:
        fmt, file = SHIPPED_TRACES[str(name_or_path)]
        path = TRACE_DIR / file
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(
                f"no trace {str(name_or_path)!r}: not a shipped one ({sorted(SHIPPED_TRACES)}) "
                "and no such file"
            )
        fmt = fmt or {".csv": "azure", ".jsonl": "mooncake"}.get(path.suffix)
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"trace format must be one of {TRACE_FORMATS}, got {fmt!r} ({path})")
    return load_azure(path) if fmt == "azure" else load_mooncake(path)


class BlockTokens:
    """Token ids of trace blocks: block ``h`` is ``block_tokens`` ids drawn by a generator
    seeded with (``seed``, ``h``), so equal hash ids are equal token runs."""

    def __init__(self, block_tokens: int, allowed: np.ndarray, seed: int):
        self.block_tokens, self.allowed, self.seed = block_tokens, allowed, seed
        self._cache: dict[int, np.ndarray] = {}

    def __call__(self, h: int) -> np.ndarray:
        block = self._cache.get(h)
        if block is None:
            rng = np.random.default_rng((self.seed, h))
            block = self._cache[h] = rng.choice(self.allowed, size=self.block_tokens)
        return block


def trace_lengths(
    records: Iterable[TraceRecord], length_scale: float = 1.0
) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each record as ``trace_requests`` sends it: both lengths
    times ``length_scale``, rounded, at least 1. Sizing a run before it starts reads these
    (``experiments.context_len.longest_request``) without drawing any token ids."""
    if length_scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    return [
        (max(1, round(r.input_len * length_scale)), max(1, round(r.output_len * length_scale)))
        for r in records
    ]


def trace_requests(
    records: Sequence[TraceRecord],
    *,
    vocab_size: int,
    special_ids: Iterable[int] = (),
    seed: int = 0,
    length_scale: float = 1.0,
    time_scale: float = 1.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[BenchRequest]:
    """``BenchRequest`` of every record: prompts of ``input_len * length_scale`` tokens (at least
    1) built from the record's hash blocks (each ``block_tokens * length_scale`` tokens; the
    tokens past its last block, and a record without hash ids, are its own random ids), outputs
    of ``output_len * length_scale``, arrivals at ``timestamp_s * time_scale``."""
    if length_scale <= 0 or time_scale < 0:
        raise ValueError(
            f"length_scale must be > 0 and time_scale >= 0, got {length_scale}, {time_scale}"
        )
    allowed = allowed_token_ids(vocab_size, special_ids)
    scaled_block = max(1, round(block_tokens * length_scale))
    blocks = BlockTokens(scaled_block, allowed, seed)
    rng = np.random.default_rng((seed, 1 << 30))
    out = []
    for r, (n_in, n_out) in zip(records, trace_lengths(records, length_scale), strict=True):
        parts = [blocks(h) for h in (r.hash_ids or ())]
        ids = np.concatenate(parts)[:n_in] if parts else np.empty(0, dtype=np.int64)
        if len(ids) < n_in:
            ids = np.concatenate([ids, rng.choice(allowed, size=n_in - len(ids))])
        out.append(BenchRequest(ids.tolist(), n_out, arrival_time=r.timestamp_s * time_scale))
    return out


def prefix_random_requests(
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 32000,
    seed: int = 0,
    special_ids: Iterable[int] = (),
) -> list[BenchRequest]:
    """vLLM's random dataset with ``--random-prefix-len``: one shared prefix, then each
    request's own random tokens."""
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    reqs = random_requests(
        num_prompts, input_len, output_len, range_ratio, vocab_size, seed, special_ids
    )
    if not prefix_len:
        return reqs
    rng = np.random.default_rng((seed, 2))
    prefix = rng.choice(allowed_token_ids(vocab_size, special_ids), size=prefix_len).tolist()
    return [BenchRequest(prefix + r.prompt_token_ids, r.output_len) for r in reqs]


def prefix_repetition_requests(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int = 32000,
    seed: int = 0,
    special_ids: Iterable[int] = (),
) -> list[BenchRequest]:
    """vLLM's ``prefix_repetition`` dataset: ``num_prefixes`` prefixes of ``prefix_len`` random
    tokens, used in turn by the requests (then shuffled), each with ``suffix_len`` own tokens."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError(
            f"num_prefixes ({num_prefixes}) must be >= 1 and prefix_len ({prefix_len}) + "
            f"suffix_len ({suffix_len}) >= 1"
        )
    length_bounds(output_len, 0.0)
    allowed = allowed_token_ids(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    prefixes = [rng.choice(allowed, size=prefix_len).tolist() for _ in range(num_prefixes)]
    reqs = [
        BenchRequest(
            prefixes[i % num_prefixes] + rng.choice(allowed, size=suffix_len).tolist(), output_len
        )
        for i in range(num_prompts)
    ]
    order = rng.permutation(num_prompts)
    return [reqs[i] for i in order]


def burstgpt_requests(
    path: str | Path,
    num_prompts: int,
    *,
    model: str | None = "GPT-4",
    vocab_size: int = 32000,
    seed: int = 0,
    special_ids: Iterable[int] = (),
    length_scale: float = 1.0,
) -> list[BenchRequest]:
    """The first ``num_prompts`` BurstGPT rows of ``model`` (None: every model) that got a
    response, as random-token requests of their lengths (vLLM ignores the timestamps too)."""
    path = Path(path)
    records = []
    for line, row in _csv_rows(path, BURSTGPT_COLUMNS):
        if model is not None and row["Model"] != model:
            continue
        n_out = _length(path, line, "Response tokens", row["Response tokens"], 0)
        if n_out == 0:  # a failed request
            continue
        n_in = _length(path, line, "Request tokens", row["Request tokens"], 1)
        records.append(TraceRecord(0.0, n_in, n_out))
        if len(records) == num_prompts:
            break
    if not records:
        raise DatasetError(path, None, f"no rows of model {model!r} with a response")
    reqs = trace_requests(
        records,
        vocab_size=vocab_size,
        special_ids=special_ids,
        seed=seed,
        length_scale=length_scale,
    )
    return [BenchRequest(r.prompt_token_ids, r.output_len) for r in reqs]


Tokenize = Callable[[str], list[int]]


def custom_requests(
    path: str | Path, num_prompts: int, tokenize: Tokenize | None, default_output_len: int
) -> list[BenchRequest]:
    """The first ``num_prompts`` lines of a JSONL file: ``{"prompt_token_ids": [...]}`` or
    ``{"prompt": "..."}`` (needs ``tokenize``), with ``output_tokens`` (default
    ``default_output_len``)."""
    path = Path(path)
    out = []
    for line, obj in _jsonl(path):
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise DatasetError(path, line, "prompt_token_ids must be non-empty ids >= 0")
        elif "prompt" in obj:
            if tokenize is None:
                raise DatasetError(path, line, "a text prompt needs the engine's tokenizer")
            ids = tokenize(str(obj["prompt"]))
        else:
            raise DatasetError(path, line, "each line needs 'prompt' or 'prompt_token_ids'")
        n_out = _length(
            path, line, "output_tokens", obj.get("output_tokens", default_output_len), 1
        )
        out.append(BenchRequest(list(ids), n_out))
        if len(out) == num_prompts:
            break
    if not out:
        raise DatasetError(path, None, "no requests")
    return out


def load_sharegpt(path: str | Path) -> list[list[str]]:
    """Each ShareGPT conversation as its turns' texts (human, assistant, ...), conversations of
    fewer than two turns dropped (vLLM drops them too)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(path, e.lineno, f"not JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise DatasetError(path, None, "expected a list of conversations")
    out = []
    for i, conv in enumerate(data):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(path, None, f"conversation {i} has no 'conversations' list")
        texts = [str(t.get("value", "")) for t in turns if isinstance(t, dict)]
        if len(texts) >= 2:
            out.append(texts)
    if not out:
        raise DatasetError(path, None, "no conversation with two turns")
    return out


def sharegpt_requests(path: str | Path, num_prompts: int, tokenize: Tokenize) -> list[BenchRequest]:
    """vLLM's ShareGPT sampling: the first turn as the prompt, the reply's token count as the
    output length; pairs with a prompt or reply under 4 tokens are skipped, as in vLLM."""
    out = []
    for texts in load_sharegpt(path):
        prompt, reply = tokenize(texts[0]), tokenize(texts[1])
        if len(prompt) < 4 or len(reply) < 4:
            continue
        out.append(BenchRequest(prompt, len(reply)))
        if len(out) == num_prompts:
            break
    if not out:
        raise DatasetError(path, None, "no turn pair of 4 or more tokens each")
    return out


__all__ = [
    "SHIPPED_TRACES",
    "TRACE_DIR",
    "BlockTokens",
    "DatasetError",
    "TraceRecord",
    "burstgpt_requests",
    "custom_requests",
    "load_azure",
    "load_mooncake",
    "load_sharegpt",
    "load_trace",
    "prefix_random_requests",
    "prefix_repetition_requests",
    "sharegpt_requests",
    "trace_lengths",
    "trace_requests",
]
