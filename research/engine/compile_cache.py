"""JAX's persistent compilation cache, so that a second start does not recompile its steps.

``enable_compilation_cache(path)`` points JAX at a directory and caches every executable (no
minimum compile time or size). Tracing and lowering still run; only XLA's compile is skipped:
the covering shapes of a SmolLM2 server took 38 s cold and 18 s warm on a 2-core host.
"""

from __future__ import annotations

import os

DEFAULT_CACHE_DIR = "~/.cache/research/jax"


def enable_compilation_cache(path: str | os.PathLike | None = DEFAULT_CACHE_DIR) -> str | None:
    """Cache compiled executables under ``path`` (created if missing); None leaves JAX as it is.
    The default directory yields to ``$RESEARCH_JAX_CACHE_DIR`` (the tests point it at a
    per-run temporary folder). Returns the absolute directory used."""
    if path is None:
        return None
    if os.fspath(path) == DEFAULT_CACHE_DIR:
        path = os.environ.get("RESEARCH_JAX_CACHE_DIR", DEFAULT_CACHE_DIR)
    import jax

    directory = os.path.abspath(os.path.expanduser(os.fspath(path)))
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory
