"""``python -m pallas_kernels.verify`` exactly as the README gives it: every default target
(H200 sm_90, GB10 sm_121, the fallback at sm_80, sm_86 and sm_89) compiled offline with the
shipped tuning table, in a fresh process."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels import verify
from pallas_kernels.triton_ir import triton_compiler_available
from pallas_kernels.tuning import RaggedAttentionConfig, fallback_for

needs_triton = pytest.mark.skipif(
    triton_compiler_available() is not None, reason=str(triton_compiler_available())
)

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^(\w+) sm_(\d+): (\d+) configurations, (\d+) failed$", re.MULTILINE)


@needs_triton
@pytest.mark.slow
def test_readme_verify_command_passes_on_every_default_target():
    """No configuration fails (a spill in a shipped configuration, shared memory over the
    limit, a module that does not verify or compile) on any target, and Triton does not warn
    about its floating-point fusion default: the compile pins it, not the environment."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for name in ("TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION"):
        env.pop(name, None)
    run = subprocess.run(
        [sys.executable, "-m", "pallas_kernels.verify"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    out = run.stdout + run.stderr
    summary = {(m[1], int(m[2])): (int(m[3]), int(m[4])) for m in SUMMARY.finditer(run.stdout)}
    failing = [line for line in run.stdout.splitlines() if re.search(r"spilled|failed:| > ", line)]
    assert run.returncode == 0, "\n".join([*failing[:40], *run.stdout.splitlines()[-8:]])
    expected = {
        (t.name, t.compute_capability) for ts in verify.verify_targets().values() for t in ts
    }
    assert set(summary) == expected, summary
    assert {(t, cc) for (t, cc), (_, failed) in summary.items() if failed} == set(), summary
    assert all(n > 0 for n, _ in summary.values()), summary
    assert "offline compilation skipped" not in out
    assert re.search(r"^0 configuration\(s\) failed$", run.stdout, re.MULTILINE), failing
    assert "FP_FUSION" not in out, out[-2000:]


@needs_triton
def test_a_spilling_configuration_fails_the_check():
    """4 warps for bf16 (the rule before the fallback's own) at gpt-oss's shape with window,
    sinks and split-KV spills on sm_80, and the check fails it; the fallback's rule does not."""

    def case(target):
        (found,) = [
            c
            for c in verify.ragged_attention_cases(target)
            if "decode q=bfloat16 kv=auto d=64 g=8 " in c.label
            and "splits=4" in c.label
            and "window sinks" in c.label
        ]
        return found

    fallback = fallback_for(80)
    four_warps = dataclasses.replace(
        fallback,
        ragged_attention_rules={
            **fallback.ragged_attention_rules,
            "bfloat16": RaggedAttentionConfig(num_warps=4),
        },
    )
    spilled = verify.check_case(case(four_warps), four_warps, compile=True)
    assert spilled.compiled.spills > 0
    assert [p for p in spilled.problems if "spilled (a shipped configuration)" in p]
    shipped = verify.check_case(case(fallback), fallback, compile=True)
    assert shipped.compiled.spills == 0 and not shipped.problems
