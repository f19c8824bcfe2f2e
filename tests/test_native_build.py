"""The native CPU kernels as a user installs them: built once per machine under a file lock,
one library per kernel family (a compile failure loses only its own kernels), keyed by
compiler and CPU, and shipped in a wheel with the headers they need."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVENTS = textwrap.dedent(
    """
    import json, sys
    from research import native
    families = sys.argv[1:]
    print(json.dumps({f: native.available(f) for f in families}))
    print(json.dumps(native.build_events()))
    print(json.dumps({f: native.build_error(f) for f in families}))
    """
)


def _python(code: str, env: dict, *args: str, cwd: Path = ROOT, python: str = sys.executable):
    return subprocess.Popen(
        [python, "-c", code, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_processes_on_an_empty_cache_build_the_library_once(tmp_path):
    env = {**os.environ, "RESEARCH_NATIVE_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    procs = [_python(EVENTS, env, "attention") for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    events = sorted(json.loads(o.splitlines()[1])["attention"] for o, _ in outs)
    assert events == ["built", "cached"]
    libs = list((tmp_path / "cache").glob("attention-*.so"))
    assert len(libs) == 1 and platform.machine() in libs[0].name


def test_a_family_that_fails_to_compile_loses_only_its_own_kernels(tmp_path):
    """A broken gemm source: the attention kernels still build and serve; the warning names
    the family and the compiler's error."""
    broken = tmp_path / "gemm.cc"
    broken.write_text("this is not C++;\n")
    code = textwrap.dedent(
        f"""
        import logging, json
        logging.basicConfig(level=logging.WARNING)
        from pathlib import Path
        from research import native
        sources, targets = native.FAMILIES["gemm"]
        native.FAMILIES["gemm"] = ([Path({str(broken)!r})], targets)
        print(json.dumps([native.available("attention"), native.available("gemm")]))
        print(native.build_error("gemm")[-300:].replace("\\n", " "))
        """
    )
    env = {**os.environ, "RESEARCH_NATIVE_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    out, err = _python(code, env).communicate(timeout=600)
    lines = out.splitlines()
    assert json.loads(lines[0]) == [True, False], err[-2000:]
    assert "gemm.cc" in lines[1] and "error" in lines[1]
    assert "native CPU gemm kernels unavailable" in err and "research_gemm_bf16" in err


def test_the_cache_key_covers_compiler_and_cpu(tmp_path, monkeypatch):
    from research import native

    monkeypatch.setenv("RESEARCH_NATIVE_CACHE", str(tmp_path))
    base = native.library_path("attention")
    monkeypatch.setattr(native, "_cpu_signature", lambda: "x86_64\nflags: sse2 avx2")
    other_cpu = native.library_path("attention")
    monkeypatch.setattr(native, "_compiler", lambda: ("g++", "g++ (Debian 99.1) 99.1"))
    other_compiler = native.library_path("attention")
    assert len({base, other_cpu, other_compiler}) == 3
    assert native.library_path("gemm") != base and base.parent == tmp_path


def test_aarch64_features_come_from_the_kernels_hwcaps():
    """On aarch64 the instruction-set check reads AT_HWCAP / AT_HWCAP2 (bit i of each is the
    i-th name Linux gives it), not /proc/cpuinfo, which an emulator leaves as the host's."""
    import struct

    from research import native

    hwcap = 1 << 1 | 1 << 20 | 1 << 22  # asimd, asimddp, sve
    hwcap2 = 1 << 1 | 1 << 13 | 1 << 14  # sve2, i8mm, bf16
    auxv = struct.pack("=8Q", 6, 4096, 16, hwcap, 26, hwcap2, 0, 0)
    assert native.hwcap_names(auxv) == {"asimd", "asimddp", "sve", "sve2", "i8mm", "bf16"}
    assert native.hwcap_names(struct.pack("=4Q", 16, 1 << 1, 0, 0)) == {"asimd"}
    assert native.hwcap_names(struct.pack("=4Q", 6, 4096, 0, 0)) is None  # no AT_HWCAP


def test_the_instruction_set_check_prefers_hwcaps_to_cpuinfo(monkeypatch):
    """Where the kernel's HWCAPs are known (aarch64 Linux), they are the CPU's flags, whatever
    /proc/cpuinfo says (under qemu-user it is the x86 host's)."""
    from research import native

    monkeypatch.setattr(native, "_arm_hwcaps", lambda: {"asimd", "asimddp"})
    monkeypatch.setattr(native.Path, "read_text", lambda self: "flags\t: sse2 avx2 avx512f\n")
    assert native._cpu_flags() == {"asimd", "asimddp"}
    monkeypatch.setattr(native, "_arm_hwcaps", lambda: None)
    assert native._cpu_flags() == {"sse2", "avx2", "avx512f"}


def test_an_arm_cpus_features_are_in_the_cache_key(tmp_path, monkeypatch):
    """Two ARM CPUs that differ only in their features (one with SVE) never share a library:
    their signatures differ (x86's came from ``flags``; ARM has ``Features`` instead)."""
    from research import native

    monkeypatch.setattr(native, "_arm_hwcaps", lambda: None)
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    signatures = []
    for features in ("fp asimd asimddp", "fp asimd asimddp sve sve2"):
        text = f"processor\t: 0\nFeatures\t: {features}\nCPU part\t: 0xd85\n"
        monkeypatch.setattr(native.Path, "read_text", lambda self, text=text: text)
        signatures.append(native._cpu_signature())
    assert signatures[0] != signatures[1] and "sve2" in signatures[1]


@pytest.mark.skipif(sys.platform != "linux", reason="the wheel test builds a Linux venv")
def test_a_wheel_install_builds_and_runs_the_native_attention(tmp_path):
    """pip wheel -> a fresh virtual environment (not editable, dependencies borrowed from this
    one's site-packages by a .pth line) -> the package's own sources and headers build the
    attention library, which matches a NumPy reference."""
    import site

    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert {"research/native/parallel.h", "research/native/vec_math.h"} <= set(names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q",
         str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    code = textwrap.dedent(
        """
        import numpy as np, research, jax.numpy as jnp
        from research import native
        assert "/venv/" in research.__file__, research.__file__
        assert native.available("attention"), native.build_error("attention")
        rng = np.random.default_rng(0)
        K, B, P, E, H = 2, 4, 8, 16, 4
        q = rng.standard_normal((1, H, E)).astype(np.float32)
        k = rng.standard_normal((K, B, P, E)).astype(np.float32)
        v = rng.standard_normal((K, B, P, E)).astype(np.float32)
        tables = np.array([[2, 0, 3, 1]], np.int32); n = 27
        out, _ = native.paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        jnp.asarray(tables), jnp.asarray([n], np.int32), 0.25)
        keys = np.concatenate([k[:, b] for b in tables[0]], axis=1)[:, :n]
        vals = np.concatenate([v[:, b] for b in tables[0]], axis=1)[:, :n]
        g = H // K
        ref = np.zeros((H, E), np.float32)
        for h in range(H):
            s = keys[h // g] @ q[0, h] * 0.25
            w = np.exp(s - s.max()); w /= w.sum()
            ref[h] = w @ vals[h // g]
        np.testing.assert_allclose(np.asarray(out)[0], ref, rtol=1e-4, atol=1e-5)
        print("ok", native.build_events())
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"RESEARCH_NATIVE_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    proc = _python(code, env, cwd=tmp_path, python=python)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert out.startswith("ok") and "built" in out
