"""Performance models of named machines: hardware as data, vLLM's KV-capacity formula, the
calibrated step cost model behind the simulated executor (``research.perf.simulated``), and the
sizing method that turns a measured concurrency curve into a number of users.

Pure Python: nothing here imports JAX, so the simulated executor and the cost model can use it on
any machine.
"""

from typing import Any

from research.perf.cost_model import CostModel, CostParams, StepShape
from research.perf.hardware import (
    HARDWARE,
    TENSOR_DTYPES,
    Hardware,
    get_hardware,
    register_hardware,
)
from research.perf.kv_capacity import (
    DEFAULT_OTHER_BYTES,
    KVCapacity,
    estimate_activation_bytes,
    kv_bytes_per_token,
    kv_capacity,
    kv_capacity_blocks,
    kv_capacity_tokens,
    quantized_bytes,
    vllm_batch_defaults,
    weight_bytes,
)

_CALIBRATION = ("CALIBRATED", "calibration_report", "params_for", "predict_single_stream")
# The sizing names load on first use: ``python -m research.perf.sizing`` must find the module
# not yet imported (runpy warns otherwise).
_SIZING = (
    "POISSON_P99_Z",
    "SizingResult",
    "duty_cycle",
    "floor_crossing",
    "max_users_for_streams",
    "size_users",
    "streams_at_floor",
)


def __getattr__(name: str) -> Any:
    if name in _CALIBRATION:  # fitted on first use; `python -m` finds the module unimported
        from research.perf import calibration

        return getattr(calibration, name)
    if name in _SIZING:
        from research.perf import sizing

        return getattr(sizing, name)
    raise AttributeError(f"module 'research.perf' has no attribute {name!r}")


__all__ = [
    "CALIBRATED",
    "DEFAULT_OTHER_BYTES",
    "HARDWARE",
    "POISSON_P99_Z",
    "TENSOR_DTYPES",
    "CostModel",
    "CostParams",
    "Hardware",
    "KVCapacity",
    "SizingResult",
    "StepShape",
    "calibration_report",
    "duty_cycle",
    "estimate_activation_bytes",
    "floor_crossing",
    "get_hardware",
    "kv_bytes_per_token",
    "kv_capacity",
    "kv_capacity_blocks",
    "kv_capacity_tokens",
    "max_users_for_streams",
    "params_for",
    "predict_single_stream",
    "quantized_bytes",
    "register_hardware",
    "size_users",
    "streams_at_floor",
    "vllm_batch_defaults",
    "weight_bytes",
]
