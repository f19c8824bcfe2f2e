"""The llama.cpp comparison's plumbing: llama-batched-bench's JSONL read back, the binary found
or refused with a way to get one, and our side run as the same static workload (one prefill
step, then exactly ``ntg`` decode steps, nothing compiled while timed)."""

from __future__ import annotations

import pytest

from benchmarks import bench_llamacpp as bench

# As llama-batched-bench prints it: log lines on the same streams as the JSONL rows.
OUTPUT = """\
main: n_kv_max = 16384, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 1, \
"n_kv": 256, "t_pp": 0.233810, "speed_pp": 547.453064, "t_tg": 3.503684, "speed_tg": 36.532974, \
"t": 3.737494, "speed": 68.495094}
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 64, \
"n_kv": 16384, "t_pp": 14.0, "speed_pp": 585.14, "t_tg": 40.0, "speed_tg": 204.8, \
"t": 54.0, "speed": 303.4}
llama_perf_context_print:        load time =     101.23 ms
"""


def test_batched_bench_rows_and_build_are_read_back():
    rows = bench.parse_jsonl(OUTPUT)
    assert [(r["pl"], r["speed_tg"]) for r in rows] == [(1, 36.532974), (64, 204.8)]
    version = "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux"
    assert bench.build_info(version) == "llama.cpp 0.5.0-dev 0c1e570"
    unknown = "version: 0.5.0-dev (build 0, commit unknown)"
    assert bench.build_info(unknown) == "llama.cpp 0.5.0-dev"
    assert bench.build_info("no version line") is None


def test_the_build_uses_every_simd_extension_the_cpu_has_but_amx():
    avx2_only = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2\n"
    options = bench.ggml_isa_options(avx2_only)
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_AVX2=ON" in options
    assert "-DGGML_AVX512=OFF" in options and not any("AMX" in o for o in options)
    spr = "flags\t\t: avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8\n"
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF"} <= set(
        bench.ggml_isa_options(spr)
    )
    assert bench.ggml_isa_options("Features\t: fp asimd sve\n") == ["-DGGML_NATIVE=ON"]  # ARM


def test_a_missing_binary_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BATCHED_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--build DIR"):
        bench.find_binary(str(tmp_path / "nope"))
    exe = tmp_path / "bin" / bench.BINARY
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    with pytest.raises(FileNotFoundError):  # present but not executable
        bench.find_binary(str(exe))
    exe.chmod(0o755)
    assert bench.find_binary(str(exe)) == exe
    monkeypatch.setenv("LLAMA_BATCHED_BENCH", str(exe))
    assert bench.find_binary() == exe


def test_ours_runs_the_static_workload_of_batched_bench():
    """Each batch: one step prefills every prompt, ``ntg`` steps decode (``ntg + 1`` tokens),
    and the rates are the tokens over those phases."""
    ours = bench.Ours("tiny-llama", "float32", largest=3, npp=8, ntg=4)
    rows = [ours.run(b) for b in (1, 3)]
    assert [(r["pl"], r["steps"]) for r in rows] == [(1, 5), (3, 5)]
    for r in rows:
        assert r["speed_tg"] == pytest.approx(r["pl"] * 4 / r["t_tg"])
        assert r["speed_pp"] == pytest.approx(r["pl"] * 8 / r["t_pp"])
        assert r["t_pp"] > 0 and r["t_tg"] > 0


def test_table_gives_each_engine_its_gain_and_its_ratio_to_the_reference():
    results = {
        "llama.cpp": [dict(pl=1, speed_pp=500.0, speed_tg=40.0),
                      dict(pl=64, speed_pp=600.0, speed_tg=200.0)],
        "ours": [dict(pl=1, speed_pp=300.0, speed_tg=30.0),
                 dict(pl=64, speed_pp=900.0, speed_tg=500.0)],
    }  # fmt: skip
    lines = bench.table(results, "llama.cpp").splitlines()
    row64 = next(ln for ln in lines if ln.strip().startswith("64 |"))
    ours64 = row64.split("|")[2].split()
    assert ours64 == ["900", "500.0", "16.7x", "2.50x"]
    assert row64.split("|")[1].split() == ["600", "200.0", "5.0x", "1.00x"]


def test_decode_roofline_charges_weights_once_and_every_rows_cache():
    """Step 0.5 s (2 s over 4 steps); reads 100 weight bytes + 2 rows x 12 cached tokens x 1
    byte; 2 rows x 10 FLOPs: 2.48 of a 100 B/s read peak, 4.0 of a 10 FLOP/s peak."""
    rows = [dict(pl=2, pp=10, tg=4, t_tg=2.0, speed_pp=1.0, speed_tg=4.0)]
    bench.decode_roofline(rows, 100.0, 1.0, 100.0, flops_per_row=10.0, flop_peak=10.0)
    assert rows[0]["read_frac"] == pytest.approx(2.48)
    assert rows[0]["flop_frac"] == pytest.approx(4.0)
    assert bench.table({"x": rows}, None).splitlines()[-1].endswith("[4.00]")
    reads_only = [dict(rows[0])]
    del reads_only[0]["flop_frac"]
    assert bench.table({"x": reads_only}, None).splitlines()[-1].endswith("[2.48]")


def test_rounds_merge_into_medians_and_the_median_of_each_rounds_own_ratio():
    """Three rounds on a host whose speed moves: ours at 2x, 1x and 3x llama.cpp's S_TG in
    rounds where both move together. The ratio is the median of the rounds' ratios (2.0), not
    the ratio of the medians (300 / 200 = 1.5)."""
    ref = [100.0, 400.0, 200.0]
    ours = [200.0, 400.0, 600.0]
    rounds = [
        {
            "llama.cpp": [dict(pl=1, speed_pp=1.0, speed_tg=r)],
            "ours": [dict(pl=1, speed_pp=1.0, speed_tg=o)],
        }
        for r, o in zip(ref, ours, strict=True)
    ]
    merged = bench.median_rounds(rounds, {"ours": "llama.cpp"})
    assert merged["ours"][0]["speed_tg"] == 400.0 and merged["llama.cpp"][0]["speed_tg"] == 200.0
    assert merged["ours"][0]["ratio"] == pytest.approx(2.0)
    assert len(merged["ours"][0]["rounds"]) == 3
    row = bench.table(merged, {"ours": "llama.cpp"}).splitlines()[-1]
    assert row.split("|")[2].split()[-1] == "2.00x"


def test_the_engines_take_turns_per_batch_size_and_share_its_read(monkeypatch, tmp_path, capsys):
    """``main`` with both engines stood in for: per batch size llama.cpp and ours run back to
    back, the first alternating (so neither always runs in the other's wake), ours loaded once
    per dtype, and both rows of a batch size carry the one read timed right after them."""
    calls: list[tuple[str, int]] = []
    windows = iter(float(n) * 1e9 for n in range(1, 100))

    def fake_llamacpp(binary, path, npl, npp, ntg, threads, extra=()):
        calls.append(("llama.cpp", npl[0]))
        return [dict(pl=npl[0], pp=npp, tg=ntg, t_pp=1.0, speed_pp=1.0, t_tg=1.0,
                     speed_tg=100.0)], "llama.cpp 1"  # fmt: skip

    class FakeOurs:
        loaded = 0

        def __init__(self, *args, **kwargs):
            FakeOurs.loaded += 1

        def run(self, b):
            calls.append(("ours", b))
            return dict(pl=b, pp=8, tg=4, t_pp=1.0, speed_pp=1.0, t_tg=1.0, speed_tg=150.0)

        def roofline(self, rows, peaks):
            for r in rows:
                r["read_frac"] = 0.5

    monkeypatch.setattr(bench, "run_llamacpp", fake_llamacpp)
    monkeypatch.setattr(bench, "Ours", FakeOurs)
    monkeypatch.setattr(bench, "find_binary", lambda binary: tmp_path / "bench")
    monkeypatch.setattr(bench, "find_quantize", lambda binary: tmp_path / "quantize")
    monkeypatch.setattr(bench, "requantize", lambda q, g, dtype, d: tmp_path / f"{dtype}.gguf")
    monkeypatch.setattr(bench, "gguf_weight_bytes", lambda path: 1e6)
    monkeypatch.setattr(bench, "read_bandwidth_now", lambda: next(windows))
    monkeypatch.setattr(
        "research.perf.host_peaks.host_peaks",
        lambda: dict(bandwidth=1e10, bf16_flops=1e11, flops=1e11),
    )
    out = tmp_path / "rows.json"
    bench.main(["--npl", "1", "8", "--dtype", "bfloat16", "--rounds", "2", "--json", str(out)])
    assert FakeOurs.loaded == 1
    assert calls == [
        ("llama.cpp", 1), ("ours", 1), ("ours", 8), ("llama.cpp", 8),  # round 1
        ("ours", 1), ("llama.cpp", 1), ("llama.cpp", 8), ("ours", 8),  # round 2
    ]  # fmt: skip
    import json

    rows = json.loads(out.read_text())
    ours, ref = rows["ours bfloat16 (auto)"], rows["llama.cpp 1 BF16"]
    for mine, theirs in zip(ours, ref, strict=True):
        assert [r["window_read"] for r in mine["rounds"]] == [
            r["window_read"] for r in theirs["rounds"]
        ]
    assert [r["window_read"] for r in ours[0]["rounds"]] == [1e9, 3e9]
    assert ours[0]["ratio"] == pytest.approx(1.5)
    assert "1.50x" in capsys.readouterr().out
