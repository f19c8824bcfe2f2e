"""The machine's peaks for the roofline columns: measured once, then read from the cache."""

from __future__ import annotations

import json

import pytest

from research.perf import host_peaks as hp


def test_peaks_are_measured_once_and_cached(tmp_path, monkeypatch):
    cache = tmp_path / "peaks.json"
    first = hp.host_peaks(cache)
    assert first["flops"] > 1e9 and first["bandwidth"] > 1e8  # any CPU does this much
    assert first["bf16_flops"] > 1e9
    assert first["bandwidth"] == max(first["copy_bandwidth"], first["read_bandwidth"])
    assert json.loads(cache.read_text())[first["machine"]] == first

    def no_measuring(**_):
        raise AssertionError("measured again")

    monkeypatch.setattr(hp, "measure_host_peaks", no_measuring)
    assert hp.host_peaks(cache) == first
    with pytest.raises(AssertionError, match="measured again"):
        hp.host_peaks(cache, refresh=True)
