"""experiment=engine_comparison: every engine profile over the models and topologies, through
the ordinary simulated sweep (experiments/engine_comparison.py)."""

from __future__ import annotations

import json

import pytest

from experiments.engine_comparison import cell_run, cells, engine_comparison
from tests.test_experiments import _compose

SMALL = [
    "experiment=engine_comparison",
    "experiment.models=[qwen3-coder-30b-a3b]",
    "experiment.engines=[vllm,ollama]",
    "experiment.topologies=[one,tp2,replicas2]",
    "experiment.concurrencies=[1,4]",
    "experiment.prompts_per_concurrency=1",
    "experiment.prediction_band=false",
    "workload.input_len=64",
    "workload.output_len=16",
    "tracking=disabled",
]


def test_cells_formats_and_topologies():
    run = _compose(SMALL)
    # TP=2 only for the engines that shard across nodes: Ollama has no tp2 cell.
    assert cells(run) == [
        ("qwen3-coder-30b-a3b", "one", "vllm"),
        ("qwen3-coder-30b-a3b", "one", "ollama"),
        ("qwen3-coder-30b-a3b", "tp2", "vllm"),
        ("qwen3-coder-30b-a3b", "replicas2", "vllm"),
        ("qwen3-coder-30b-a3b", "replicas2", "ollama"),
    ]
    tp = cell_run(run, "qwen3-coder-30b-a3b", "vllm", "tp2")
    assert (tp.hardware.tensor_parallel_size, tp.hardware.num_replicas) == (2, 1)
    rep = cell_run(run, "qwen3-coder-30b-a3b", "ollama", "replicas2")
    assert (rep.hardware.num_replicas, rep.hardware.routing) == (2, "random")
    assert rep.quantization.quantization == "fp8" and rep.engine.name == "ollama"


def test_bad_cells_say_what_is_allowed():
    run = _compose(SMALL)
    with pytest.raises(
        ValueError, match=r"model_formats has no weight format for 'llama-3\.3-70b'"
    ):
        cell_run(run, "llama-3.3-70b", "vllm", "one")
    with pytest.raises(ValueError, match="unknown topology 'tp4'"):
        cell_run(run, "qwen3-coder-30b-a3b", "vllm", "tp4")
    with pytest.raises(ValueError, match="unknown topologies"):
        _compose([*SMALL, "experiment.topologies=[one,tp4]"])
    with pytest.raises(ValueError, match="unknown engines"):
        _compose([*SMALL, "experiment.engines=[vllm,tgi]"])


def test_engine_comparison_runs_every_cell_and_says_how(tmp_path):
    run = _compose(SMALL)
    points = engine_comparison(run, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(points) == 5 * 2
    for r in rows:  # every row says which profile, routing law and calibration produced it
        assert r["engine"] in ("vllm", "ollama") and r["topology"] in ("one", "tp2", "replicas2")
        assert r["moe_routing"] and r["routing_shape"] and r["calibration"]
    by = {(r["engine"], r["topology"], r["max_concurrency"]): r for r in rows}
    # Ollama's one slot: a second box doubles what four users get in aggregate; vLLM's batch
    # already serves four at once on one box, so its replicas gain less.
    one, two = by["ollama", "one", 4], by["ollama", "replicas2", 4]
    assert two["output_throughput"] > 1.5 * one["output_throughput"]
    assert by["vllm", "one", 4]["output_throughput"] > 2 * one["output_throughput"]
    # TP=2 splits the weight stream over two boxes: a single user decodes faster.
    assert by["vllm", "tp2", 1]["per_user_tok_s"] > by["vllm", "one", 1]["per_user_tok_s"]
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| qwen3-coder-30b-a3b |") == 5
    for topology in ("one", "tp2", "replicas2"):  # one figure per model and topology
        assert (tmp_path / f"engines_qwen3-coder-30b-a3b_{topology}.png").stat().st_size > 0
