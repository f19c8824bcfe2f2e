"""Every module imports on its own, first: an import cycle that only bites when a process's
first import is the wrong module (a server's entry point, a subprocess) fails here in seconds
instead of in the slow tier's end-to-end runs."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("research", "experiments", "benchmarks", "pallas_kernels")

# One fresh interpreter imports each module with the project's own modules cleared first, so
# every module is imported as if it were the first (third-party imports stay cached: fast).
SCRIPT = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in {packages!r}]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ":\\n" + traceback.format_exc(limit=-3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_first():
    names = modules()
    assert "research.serve.router" in names and "research.parallel.plan" in names
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(packages=PACKAGES), *names],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"modules that fail as a first import:\n{proc.stdout}{proc.stderr}"
