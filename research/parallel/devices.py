"""Host devices for tensor parallelism on a CPU: XLA makes one CPU device unless asked for more,
and must be asked before JAX starts."""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count"


def request_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices (for ``tensor_parallel_size=n`` on a CPU). A no-op for
    n <= 1, when the flag is already set, or once JAX has started (then ``ShardingPlan`` says
    how many devices it sees and how to get more)."""
    if n <= 1 or "jax" in sys.modules or _FLAG in os.environ.get("XLA_FLAGS", ""):
        return
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={n}".strip()
