"""`vllm bench serve` in-process: workloads, a load driver, serving metrics, results files, plots.

```python
from research.bench import random_requests, run_benchmark, result_point, append_result

requests = random_requests(96, input_len=512, output_len=256, vocab_size=32000, seed=0)
result = run_benchmark(llm.engine, requests, max_concurrency=32)
append_result("results.jsonl", result_point(result, model_id="qwen3-30b-a3b"))
```

Plots live in ``research.bench.plots`` (imported on its own, so the driver needs no matplotlib).
No module here imports JAX: the driver is handed an engine object.
"""

from research.bench.driver import BenchmarkResult, run_benchmark
from research.bench.metrics import RequestRecord, compute_metrics
from research.bench.report import append_result, format_table, read_results, result_point
from research.bench.workload import BenchRequest, RandomDataset, arrival_times, random_requests

__all__ = [
    "BenchRequest",
    "BenchmarkResult",
    "RandomDataset",
    "RequestRecord",
    "append_result",
    "arrival_times",
    "compute_metrics",
    "format_table",
    "random_requests",
    "read_results",
    "result_point",
    "run_benchmark",
]
