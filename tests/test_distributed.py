"""One model across two processes with ``jax.distributed`` on loopback (Gloo collectives on
CPU), each holding half of a TP=2 tiny-llama: the same greedy tokens as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from research import LLM, SamplingParams
from research.serve.router import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
ENGINE = ["--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "8"]


def test_two_processes_match_one(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",  # one device per process
    }
    prompts = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "research.parallel.launch",
                "tiny-llama",
                "--coordinator-address",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--tensor-parallel-size",
                "2",
                "--max-tokens",
                "10",
                *ENGINE,
                *prompts,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]

    def reported(out: str) -> list[dict]:  # Gloo prints its own lines too
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    got = [r["token_ids"] for r in reported(results[0][0])]
    assert reported(results[1][0]) == []  # only process 0 reports
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny-llama", max_model_len=128, num_kv_blocks=64, block_size=8)
    assert got == [o.token_ids for o in llm.generate(PROMPTS, sp)]
