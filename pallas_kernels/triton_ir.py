"""The Triton modules Pallas builds for a GPU, checked on a machine without one.

Lowering a ``pallas_call`` for CUDA (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``)
proves only that Pallas emitted *something*: JAX serializes the Triton module into the custom
call without verifying it, so a module with ill-typed ops lowers happily and fails on the GPU.
This module goes further, in three steps that need no GPU:

1. ``lower_triton_modules``: lower a function for CUDA and capture every Triton module that
   ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`` returns, with the MLIR
   verifier's verdict on each (``TritonModule.error`` is None when it verifies).
2. ``compile_offline``: compile a captured module with the ``triton`` package's own compiler
   (TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the ``ptxas`` that ships in the wheel) for a
   named target, e.g. sm_90 (H200) or sm_121 (GB10).
3. ``ptxas -v`` on that PTX: registers, spills and stack per kernel; Triton's metadata gives the
   dynamic shared memory the launch needs, checked against the target's per-block limit.

JAX lowers without a GPU for compute capability 9.0 (pallas_call_registration.py's fallback);
``capture_triton_modules(compute_capability)`` lowers for the named target instead (the lowering
reads it: fp8 conversions are refused below sm_89), so each target's cubin comes from its own
lowering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
from jax._src.pallas.triton import lowering as _triton_lowering


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Triton module as Pallas built it for CUDA."""

    name: str  # the kernel's function name (``pallas_call(name=...)``)
    text: str  # MLIR assembly, parseable by the triton package
    error: str | None  # the MLIR verifier's diagnostics; None when the module verifies
    grid: tuple[int, ...]

    @property
    def verified(self) -> bool:
        return self.error is None

    def dots(self) -> list[tuple[str, str, str]]:
        """Every ``tt.dot`` as (operand element type, ``inputPrecision``, accumulator element
        type), e.g. ("f32", "ieee", "f32") or ("bf16", "tf32", "f32"). Triton reads the precision
        only for f32 operands: "tf32" there means float32 inputs rounded to 10-bit mantissas."""
        dots = []
        for line in self.text.splitlines():
            if "tt.dot " not in line:
                continue
            precision = re.search(r"inputPrecision = (\w+)", line)
            types = re.search(r":\s*tensor<[\dx]+x(\w+)>.*->\s*tensor<[\dx]+x(\w+)>", line)
            if types is None:
                raise ValueError(f"cannot read the operand types of {line.strip()!r}")
            # IEEE is the attribute's default value, which MLIR does not print.
            dots.append(
                (types.group(1), precision.group(1) if precision else "ieee", types.group(2))
            )
        return dots


@contextlib.contextmanager
def capture_triton_modules(
    compute_capability: int | None = None,
) -> Iterator[list[TritonModule]]:
    """Collect every Triton module lowered inside the block (in lowering order).

    ``compute_capability`` (e.g. 121): lower for that target. Without a GPU, JAX lowers for
    sm_90 (``pallas_call_registration``'s fallback); the lowering reads the capability (fp8
    conversions are refused below sm_89, for one), so each target gets its own lowering."""
    captured: list[TritonModule] = []
    original = _triton_lowering.lower_jaxpr_to_triton_module

    @functools.wraps(original)
    def capturing(jaxpr, grid_mapping, platform, cc, *args, **kwargs):
        if compute_capability is not None:
            cc = compute_capability
        result = original(jaxpr, grid_mapping, platform, cc, *args, **kwargs)
        operation = result.module.operation
        try:
            operation.verify()
            error = None
        except Exception as exc:  # jaxlib's MLIRError carries the verifier's diagnostics
            error = str(exc)
        name = operation.attributes["sym_name"].value
        captured.append(
            TritonModule(
                name=name,
                text=operation.get_asm(),
                error=error,
                grid=tuple(int(g) for g in result.grid),
            )
        )
        return result

    _triton_lowering.lower_jaxpr_to_triton_module = capturing
    try:
        yield captured
    finally:
        _triton_lowering.lower_jaxpr_to_triton_module = original


def _is_array_like(value: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(
        isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) for leaf in leaves
    )


def lower_triton_modules(
    fn: Callable[..., Any], *args: Any, compute_capability: int | None = None, **kwargs: Any
) -> list[TritonModule]:
    """Lower ``fn(*args, **kwargs)`` for CUDA (no GPU needed) and return its Triton modules,
    lowered for ``compute_capability`` (default: JAX's, sm_90 without a GPU).

    Arguments may be arrays or ``jax.ShapeDtypeStruct``s (nothing is allocated); keyword
    arguments that are not arrays are static. ``fn`` must run its kernels with
    ``interpret=False``."""
    dynamic = {name: value for name, value in kwargs.items() if _is_array_like(value)}
    static = {name: value for name, value in kwargs.items() if name not in dynamic}
    with capture_triton_modules(compute_capability) as modules:
        traced = jax.jit(functools.partial(fn, **static)).trace(*args, **dynamic)
        traced.lower(lowering_platforms=("cuda",))
    if not modules:
        raise ValueError("no Triton module was lowered: is the kernel called with interpret=False?")
    return modules


# ---- offline compilation ---------------------------------------------------------------------


class OfflineCompileUnavailable(RuntimeError):
    """The ``triton`` package (its compiler and ptxas) is not installed on this machine."""


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What ptxas and Triton say about one module compiled for one target."""

    name: str
    arch: int  # compute capability, e.g. 90 or 121
    ptx_target: str  # the PTX ``.target`` Triton chose, e.g. sm_90a
    num_warps: int
    num_stages: int
    registers: int  # per thread
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int  # dynamic shared memory per block (Triton's launch metadata)
    cubin_bytes: int

    @property
    def spills(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def triton_compiler_available() -> str | None:
    """None when offline compilation can run here, else the reason it cannot."""
    try:
        import triton  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError as exc:
        return f"the triton package (its compiler and ptxas) is not importable: {exc}"
    return None


# Floating-point fusion (a * b + c contracted to one FMA, in LLVM and in ptxas) as every
# compile here runs, whatever the environment: on, which is Triton 3.9's default and how the
# shipped table and the documented figures were compiled. Triton 3.10 turns its default off
# (and 3.9 warns on each run that leaves ``TRITON_DEFAULT_FP_FUSION`` unset).
FP_FUSION = True

_PTXAS_FIELDS = {
    "registers": r"Used (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}


def compile_offline(
    module: TritonModule, arch: int, *, num_warps: int = 4, num_stages: int = 3
) -> CompiledKernel:
    """Compile ``module`` to PTX and cubin for compute capability ``arch`` with the triton
    package's compiler (floating-point fusion as ``FP_FUSION`` says), and read registers and
    spills from ``ptxas -v`` on that PTX."""
    reason = triton_compiler_available()
    if reason is not None:
        raise OfflineCompileUnavailable(reason)
    if not module.verified:
        raise ValueError(f"{module.name} does not verify; not compiling:\n{module.error}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"{module.name}.ttir"
        source.write_text(module.text)
        kernel = triton.compile(
            str(source),
            target=GPUTarget("cuda", arch, 32),
            options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=FP_FUSION),
        )
        ptx = kernel.asm["ptx"]
        ptx_target = re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1)
        ptx_path = Path(tmp) / "kernel.ptx"
        ptx_path.write_text(ptx)
        report = subprocess.run(
            [
                get_ptxas(arch).path,
                "-v",
                *([] if FP_FUSION else ["--fmad=false"]),  # as Triton's own ptxas call
                f"--gpu-name={ptx_target}",
                str(ptx_path),
                "-o",
                str(Path(tmp) / "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    fields = {}
    for field, pattern in _PTXAS_FIELDS.items():
        match = re.search(pattern, report)
        if match is None:
            raise RuntimeError(f"ptxas -v printed no {field!r} for {module.name}:\n{report}")
        fields[field] = int(match.group(1))
    return CompiledKernel(
        name=module.name,
        arch=arch,
        ptx_target=ptx_target,
        num_warps=num_warps,
        num_stages=num_stages,
        shared_bytes=int(kernel.metadata.shared),
        cubin_bytes=len(kernel.asm["cubin"]),
        **fields,
    )
