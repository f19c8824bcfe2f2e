"""Machines as data: memory, bandwidth, tensor throughput and interconnect of a named box.

The figures of ``gb10`` and ``h200`` are docs/reference.md section 2, quoted from public sources, not
measured by us; the one exception is flagged where it is defined (H200's NVLink bandwidth and the
memory CUDA reports on an H200, which REFERENCE does not give).

Units: bytes, bytes/s and FLOP/s (dense, no sparsity). Bandwidths and FLOP rates are decimal (GB/s =
1e9 bytes/s, TFLOP/s = 1e12); memory capacities as marketed ("128 GB", "141 GB") are binary in
practice (DRAM/HBM is built in powers of two: an H200 reports 143,771 MiB ~ 140.4 GiB to CUDA), so
``memory_bytes`` is N * 2**30. The number that sizes the KV pool is ``cuda_visible_bytes``, what
``cudaMemGetInfo`` reports as total (vLLM's ``total_memory``).

``HARDWARE`` maps names to machines; ``register_hardware`` adds one (a cost-model calibration of a
new box, a hypothetical machine for a what-if), ``get_hardware`` looks one up.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field

GiB = 2**30
MiB = 2**20
GB = 10**9
TB = 10**12
TFLOPS = 10**12

# Keys of ``tensor_flops`` / ``measured_flops``: the element type fed to the tensor cores (fp32:
# plain float32 math, for a CPU host; a GPU without an fp32 entry runs float32 as TF32).
TENSOR_DTYPES = ("bf16", "fp8", "fp4", "fp32")


def _frozen_mapping(values: Mapping[str, float]) -> Mapping[str, float]:
    return types.MappingProxyType({str(k): float(v) for k, v in values.items()})


@dataclass(frozen=True)
class Hardware:
    """One accelerator box (a single GPU and its memory).

    Attributes:
        name: the key in ``HARDWARE`` (``"gb10"``, ``"h200"``, ...).
        memory_bytes: physical memory of the box (for GB10: unified CPU + GPU LPDDR5X).
        cuda_visible_bytes: total device memory CUDA reports; vLLM's KV budget is
            ``cuda_visible_bytes * gpu_memory_utilization`` (see ``research.perf.kv_capacity``).
        peak_bandwidth: spec-sheet memory bandwidth, bytes/s.
        achievable_bandwidth: the best bandwidth a read kernel is measured to reach, bytes/s; the
            cost model's ceiling for streaming weights and KV.
        tensor_flops: dense tensor-core peak per input type (keys from ``TENSOR_DTYPES``), FLOP/s;
            a type the machine has no tensor-core path for is absent.
        measured_flops: measured large-matmul throughput per input type, where published.
        interconnect_bandwidth: bytes/s to a second box of the same kind (one direction).
        interconnect_kind: what that link is.
        copy_bandwidth: measured device-to-device copy bandwidth, bytes/s, where published.
        sm_count: streaming multiprocessors.
        l2_bytes: L2 cache size.
        compute_capability: CUDA ``sm_XY`` as ``"XY"``.
        notes: provenance and caveats, free text.
    """

    name: str
    memory_bytes: int
    cuda_visible_bytes: int
    peak_bandwidth: float
    achievable_bandwidth: float
    tensor_flops: Mapping[str, float] = field(hash=False)
    measured_flops: Mapping[str, float] = field(default_factory=dict, hash=False)
    interconnect_bandwidth: float | None = None
    interconnect_kind: str | None = None
    copy_bandwidth: float | None = None
    sm_count: int | None = None
    l2_bytes: int | None = None
    compute_capability: str | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        # Read-only views: a frozen machine must not change through its dicts either.
        object.__setattr__(self, "tensor_flops", _frozen_mapping(self.tensor_flops))
        object.__setattr__(self, "measured_flops", _frozen_mapping(self.measured_flops))
        if not self.name:
            raise ValueError("Hardware needs a name")
        for attr in ("memory_bytes", "cuda_visible_bytes", "peak_bandwidth"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"{self.name}: {attr} must be > 0, got {getattr(self, attr)}")
        if not 0 < self.achievable_bandwidth <= self.peak_bandwidth:
            raise ValueError(
                f"{self.name}: achievable_bandwidth {self.achievable_bandwidth:.4g} must be in "
                f"(0, peak_bandwidth {self.peak_bandwidth:.4g}]"
            )
        for kind, values in (
            ("tensor_flops", self.tensor_flops),
            ("measured", self.measured_flops),
        ):
            if unknown := sorted(set(values) - set(TENSOR_DTYPES)):
                raise ValueError(
                    f"{self.name}: {kind} keys {unknown} unknown; expected some of {TENSOR_DTYPES}"
                )
            if any(v <= 0 for v in values.values()):
                raise ValueError(f"{self.name}: {kind} values must be > 0, got {dict(values)}")
        if "bf16" not in self.tensor_flops:
            raise ValueError(f"{self.name}: tensor_flops needs at least a 'bf16' peak")

    def flops(self, dtype: str = "bf16", *, measured: bool = False) -> float:
        """Dense tensor FLOP/s for ``dtype``; ``measured=True`` prefers the measured figure when
        one is published (falling back to the peak)."""
        if dtype not in self.tensor_flops:
            raise ValueError(
                f"{self.name} has no {dtype} tensor-core peak; known: {sorted(self.tensor_flops)}"
            )
        if measured and dtype in self.measured_flops:
            return self.measured_flops[dtype]
        return self.tensor_flops[dtype]

    def sustained_flops(self, dtype: str = "bf16") -> float:
        """The ceiling a fitted GEMM efficiency is a fraction of: the measured large-matmul rate
        for ``dtype`` where published; else its peak scaled by the measured/peak ratio of bf16
        (the one dtype measured on most machines: GB10's 91 of 125 TFLOP/s gives fp8 182 and fp4
        364 of their 250 / 500 peaks), else the peak itself. ``"tf32"`` (float32 weights on a
        GPU without an fp32 entry) is half the bf16 figure. Never above the peak."""
        if dtype == "tf32":
            return self.sustained_flops("bf16") / 2
        if dtype in self.measured_flops:
            return self.measured_flops[dtype]
        peak = self.flops(dtype)
        if "bf16" in self.measured_flops:
            return peak * self.measured_flops["bf16"] / self.tensor_flops["bf16"]
        return peak


HARDWARE: dict[str, Hardware] = {}


def register_hardware(hw: Hardware, *, overwrite: bool = False) -> Hardware:
    """Add ``hw`` to ``HARDWARE`` under ``hw.name`` (a ValueError if the name is taken, unless
    ``overwrite``)."""
    if hw.name in HARDWARE and not overwrite:
        raise ValueError(f"hardware {hw.name!r} is already registered (pass overwrite=True)")
    HARDWARE[hw.name] = hw
    return hw


def get_hardware(name: str | Hardware) -> Hardware:
    """The machine called ``name`` (a ``Hardware`` passes through); a ValueError lists the known
    names otherwise."""
    if isinstance(name, Hardware):
        return name
    try:
        return HARDWARE[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))} "
            "(or register one with research.perf.register_hardware)"
        ) from None


register_hardware(
    Hardware(
        name="gb10",
        memory_bytes=128 * GiB,
        cuda_visible_bytes=round(119.6 * GiB),
        peak_bandwidth=273 * GB,
        achievable_bandwidth=232 * GB,
        tensor_flops={"bf16": 125 * TFLOPS, "fp8": 250 * TFLOPS, "fp4": 500 * TFLOPS},
        measured_flops={"bf16": 91 * TFLOPS},
        interconnect_bandwidth=25 * GB,  # 200 Gb/s
        interconnect_kind="ConnectX-7 200 Gb/s",
        copy_bandwidth=218 * GB,
        sm_count=48,
        l2_bytes=24 * MiB,
        compute_capability="121",
        notes=(
            "NVIDIA DGX Spark. docs/reference.md section 2: 128 GB LPDDR5X unified CPU+GPU memory, "
            "CUDA reports ~119.6 GiB total; 273 GB/s peak (256-bit, 8533 MT/s), read kernels "
            "~232 GB/s, copies ~218 GB/s; dense BF16 ~125 TFLOP/s (matmul measured ~91), FP8 "
            "~250, FP4 ~500; 48 SMs, 24 MB L2, 100 KB smem/SM; ConnectX-7 200 Gb/s to a 2nd box."
        ),
    )
)

register_hardware(
    Hardware(
        name="h200",
        memory_bytes=141 * GiB,
        # Not in REFERENCE: the public nvidia-smi / cudaMemGetInfo total of an H200 SXM.
        cuda_visible_bytes=143_771 * MiB,
        peak_bandwidth=4.8 * TB,
        achievable_bandwidth=4.3 * TB,  # REFERENCE gives the measured copy figure only
        tensor_flops={"bf16": 990 * TFLOPS, "fp8": 1980 * TFLOPS},  # Hopper: no FP4 path
        measured_flops={"bf16": 790 * TFLOPS},
        # Not in REFERENCE (it says "NVLink"): NVIDIA's public NVLink 4 figure for H200 SXM,
        # 900 GB/s total per GPU (both directions together).
        interconnect_bandwidth=900 * GB,
        interconnect_kind="NVLink 4",
        copy_bandwidth=4.3 * TB,
        sm_count=132,
        l2_bytes=50 * MiB,
        compute_capability="90",
        notes=(
            "H200 SXM. docs/reference.md section 2: 141 GB HBM3e, 4.8 TB/s peak (4.3 TB/s copy "
            "measured), dense BF16 ~990 TFLOP/s (measured ~790), FP8 ~1980; 132 SMs, 50 MB L2. "
            "Not from REFERENCE: cuda_visible_bytes (143,771 MiB, nvidia-smi's figure) and the "
            "900 GB/s NVLink 4 bandwidth (NVIDIA's public spec); achievable_bandwidth is the "
            "measured copy rate, as no read-kernel figure is given."
        ),
    )
)
