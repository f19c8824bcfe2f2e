"""notebooks/figures.ipynb runs top to bottom on a small results file and draws its figures."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from research.bench import append_result

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "figures.ipynb"


def _point(concurrency: int) -> dict:
    tpot_ms = 12.5 * (1 + concurrency / 16)
    return {
        "model_id": "tiny-llama",
        "num_prompts": 3 * concurrency,
        "request_rate": "inf",
        "max_concurrency": concurrency,
        "completed": 3 * concurrency,
        "output_throughput": 1000 * concurrency / tpot_ms,
        "median_tpot_ms": tpot_ms,
        "median_ttft_ms": 37.0 * (1 + concurrency / 8),
        "p99_ttft_ms": 60.0 * (1 + concurrency / 8),
    }


def test_figures_notebook_runs_and_draws(tmp_path, monkeypatch):
    results = tmp_path / "results.jsonl"
    for concurrency in (1, 8, 32):
        append_result(results, _point(concurrency))
    monkeypatch.setenv("RESULTS_PATH", str(results))
    monkeypatch.setenv("FIGURES_DIR", str(tmp_path / "figures"))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")
    # A kernelspec whose command is "python" runs this interpreter (the venv's).
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 2
    tables = [
        out["data"]["text/markdown"] for out in outputs if "text/markdown" in out.get("data", {})
    ]
    assert len(tables) == 1 and "| tiny-llama | 8 |" in tables[0]
    assert (tmp_path / "figures" / "concurrency_curves.png").stat().st_size > 1000


def test_reproduce_spark_notebook_runs_the_simulated_sweep(tmp_path, monkeypatch):
    """No results file given: the notebook runs the simulated gb10 sweep itself (two points per
    model to keep it short) and draws the curves of both models."""
    monkeypatch.delenv("RESULTS_PATH", raising=False)
    monkeypatch.setenv("FIGURES_DIR", str(tmp_path / "figures"))
    monkeypatch.setenv("CONCURRENCIES", "1,8")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", str(root))
    nb = nbformat.read(root / "notebooks" / "reproduce_spark.ipynb", as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(root)}}
    )
    client.execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert "llama-128  tpot_ms" in tables[0]  # the calibration table
    assert "held out" in tables[1]  # the leave-one-out table
    assert "simulated-gb10 llama-3.3-70b awq | 8 |" in tables[2]
    # concurrency curves, TTFT and the prediction bands
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 3


def _run_figures_notebook(cwd: Path) -> list:
    """Execute figures.ipynb in ``cwd``; the outputs of its code cells."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def test_figures_notebook_with_no_settings_reads_the_newest_run_and_writes_outside(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("RESULTS_PATH", raising=False)
    monkeypatch.delenv("FIGURES_DIR", raising=False)
    with pytest.raises(Exception, match="RESULTS_PATH"):  # nothing to read: says what to set
        _run_figures_notebook(tmp_path)

    for stamp, concurrencies in (("09-00-00", (1,)), ("10-00-00", (1, 8, 32))):
        results = tmp_path / "outputs" / "2026-01-01" / stamp / "results.jsonl"
        for concurrency in concurrencies:
            append_result(results, _point(concurrency))
    outputs = _run_figures_notebook(tmp_path)
    assert not [out for out in outputs if out.output_type == "error"]
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert "| tiny-llama | 32 |" in tables[0]  # the newer run
    assert not list(tmp_path.glob("**/*.png"))  # figures went to a temporary folder


@pytest.mark.slow  # about a minute: two short capacity searches
def test_capacity_notebook_runs_a_small_search(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPACITY_DIR", str(tmp_path / "capacity"))
    monkeypatch.setenv("QUICK", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", str(root))
    nb = nbformat.read(root / "notebooks" / "capacity.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(root)}}
    )
    client.execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert "users** (95% CI" in tables[0] and "the write-up's arithmetic" in tables[0]
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 1
    assert (tmp_path / "capacity" / "capacity.json").exists()
