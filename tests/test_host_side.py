"""Host-side engine modules (requests, block manager, scheduler) import no JAX."""

from __future__ import annotations

import subprocess
import sys


def test_host_modules_do_not_import_jax():
    code = (
        "import sys\n"
        "import research.engine.block_manager, research.engine.scheduler\n"
        "import research.engine.sequence, research.engine.request, research.config\n"
        "import research\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
