"""Where a result came from: the code's commit, the packages, the device, the seeds and the whole
resolved config, stamped on every results row; and ``write_csv`` for a flat copy of a results file.

Host-side: JAX is not imported here (``device`` reads it only if the caller already has).
"""

from __future__ import annotations

import csv
import functools
import math
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("research", "jax", "jaxlib", "numpy", "transformers", "torch", "wandb", "hydra-core")
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def git_state(root: Path = ROOT) -> dict[str, Any]:
    """``git_commit`` and ``git_dirty`` (uncommitted changes to tracked files) of the checkout
    the package runs from; None for both outside a git checkout."""
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", "-C", str(root), *args],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.strip()

        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": dirty}


@functools.cache
def code_state(root: Path = ROOT) -> str:
    """The code a result came from: the commit, plus a hash of the uncommitted diff of tracked
    files when there is one ("unknown" outside a git checkout)."""
    import hashlib

    state = git_state(root)
    if state["git_commit"] is None:
        return "unknown"
    if not state["git_dirty"]:
        return state["git_commit"]
    diff = subprocess.run(
        ["git", "-C", str(root), "diff", "HEAD"], capture_output=True, timeout=30
    ).stdout
    return f"{state['git_commit']}+{hashlib.sha256(diff).hexdigest()[:16]}"


@functools.cache
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device() -> dict[str, Any]:
    """The JAX devices of this process (kind and count), if JAX is loaded; the host's CPU."""
    out: dict[str, Any] = {"host_machine": platform.machine(), "host_cpus": _cpus()}
    jax = sys.modules.get("jax")
    if jax is not None:
        devices = jax.devices()
        out |= {"device_kind": devices[0].device_kind, "device_count": len(devices)}
    return out


def _cpus() -> int | None:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def provenance(config: Mapping[str, Any], seeds: Mapping[str, int]) -> dict[str, Any]:
    """The keys every results row carries: git, versions, device, seeds, the resolved config."""
    return {
        **git_state(),
        "versions": versions(),
        **device(),
        "seeds": dict(seeds),
        "config": _plain(config),
    }


def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats as strings ("inf"), tuples as lists, others as str."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float)):
        return value
    return str(value)


def write_csv(points: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """The scalar fields of ``points`` as one CSV row each (nested fields left to the JSON)."""
    path = Path(path)
    columns: list[str] = []
    for point in points:
        for key, value in point.items():
            if key not in columns and (value is None or isinstance(value, (str, int, float))):
                columns.append(key)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        for point in points:
            writer.writerow({k: point.get(k) for k in columns})
    return path
