"""Host and launch time of a step, and the request path outside the steps.

- ``per_step_overhead_s`` + ``per_seq_overhead_s`` per scheduled sequence: the engine's own host
  work each step (scheduling, input preparation, sampling bookkeeping, detokenizing);
- a step of more token rows than the engine replays a captured graph for (``graph_max_tokens``)
  is launched kernel by kernel and pays ``eager_layer_overhead_s`` per layer. llama.cpp's CUDA
  backend captures single-token steps only (before llama.cpp#19645); vLLM captures decode-only
  batches in full and mixed ones piecewise up to its capture size, its attention launched
  between the pieces: its profile leaves that inside the fitted per-step time (every vLLM
  calibration point is a captured decode or one large prefill, where ~50 launches are under 1%);
- ``request_path_s``, once per request: what the server spends between the client's send and the
  engine seeing the request (HTTP, tokenization, the API server's queue), plus the first
  chunk's way back. The benchmark drivers deliver a simulated request that long after its send
  (``research.bench.driver``, ``request_path_s``), holding its slot: TTFT and E2EL grow by it,
  TPOT and ITL do not. Every profile's calibration has it at 0 (the prefill validation fits it
  per source: ``research.perf.validation_prefill``).
Pure Python.
"""

from __future__ import annotations

from research.perf.params import CostParams
from research.perf.step_shape import StepShape


def graph_replayed(shape: StepShape, graph_max_tokens: int | None) -> bool:
    """Whether the step replays a captured graph (None: every step does)."""
    return graph_max_tokens is None or shape.num_tokens <= graph_max_tokens


def launch_overhead_s(
    params: CostParams, shape: StepShape, layers: int, graph_max_tokens: int | None
) -> float:
    """Host seconds of one step (module docstring)."""
    seconds = params.per_step_overhead_s + params.per_seq_overhead_s * shape.num_seqs
    if not graph_replayed(shape, graph_max_tokens):
        seconds += params.eager_layer_overhead_s * layers
    return seconds


__all__ = ["graph_replayed", "launch_overhead_s"]
