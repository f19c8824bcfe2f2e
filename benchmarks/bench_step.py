"""This tree's engine step against another commit's, side by side in one window.

    python -m benchmarks.bench_step --baseline <git ref> [--model smollm2-135m]
        [--dtype float32] [--max-model-len 512]
        [--points 64x32@1,64x32@4,64x32@16,64x32@64,128x128@1,128x128@16,128x128@64]

Each point is ``<input>x<output>@<concurrency>``: a closed loop of 3 x concurrency random
prompts (``ignore_eos``) after a warmup of one per slot, every step shape the point uses
compiled before the clock starts (``predict_step_shapes`` + ``precompile``), as the main job
runs them, with the main job's model settings by default (float32, max_model_len 512). The baseline is checked out into a temporary git worktree; each point runs in a
fresh process per tree, baseline and this tree alternating point by point, so both see the
same machine. Prints, per point and tree: output tok/s, mean step ms, forward passes per step
(jitted forward calls: the baseline ran one per kind of row in a step, decodes / prefill
chunks / verifications) and the step shapes compiled; then the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs inside each tree (cwd = the tree): only APIs both sides have.
DRIVER = r"""
import json, random, sys, time
import jax
from research import LLM
from research.bench import BenchRequest, run_benchmark
from research.engine.shapes import predict_step_shapes

model, input_len, output_len, conc, dtype, max_len = sys.argv[1], *map(int, sys.argv[2:5]), *sys.argv[5:7]
llm = LLM(model, dtype=dtype, max_model_len=int(max_len))
engine = llm.engine
executor = engine.executor
vocab = llm.model_config.vocab_size
rng = random.Random(0)

def requests(n):
    return [BenchRequest([rng.randrange(3, vocab) for _ in range(input_len)], output_len)
            for _ in range(n)]

passes = [0, 0]  # forward passes, steps with tokens
execute = executor.execute

def counted(plan):
    result = execute(plan)
    if not plan.is_empty:
        fp = getattr(result, "forward_passes", None)
        if fp is None:  # one jitted forward per non-empty kind of row
            fp = bool(plan.decodes) + bool(plan.prefills) + bool(getattr(plan, "verifies", []))
        passes[0] += fp
        passes[1] += 1
    return result

executor.execute = counted
run_benchmark(engine, requests(conc), max_concurrency=conc)  # warmup
timed = requests(3 * conc)
executor.precompile(predict_step_shapes(engine, timed, max_concurrency=conc))
compiled_before = engine.num_compilations
passes[:] = [0, 0]
steps0, time0 = engine.num_steps, engine.step_time
result = run_benchmark(engine, timed, max_concurrency=conc)
m = result.metrics()
steps = engine.num_steps - steps0
print("RESULT " + json.dumps({
    "output_tok_s": m["output_throughput"],
    "mean_step_ms": 1000 * (engine.step_time - time0) / max(steps, 1),
    "forward_passes_per_step": passes[0] / max(passes[1], 1),
    "compiled_shapes": engine.num_compilations,
    "compiled_in_timed_point": engine.num_compilations - compiled_before,
    "attention_backend": getattr(executor, "backend", "?"),
}))
"""


def run_point(tree: Path, model: str, point: str, dtype: str, max_model_len: int) -> dict:
    shape, conc = point.split("@")
    input_len, output_len = shape.split("x")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(tree))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            DRIVER,
            model,
            input_len,
            output_len,
            conc,
            dtype,
            str(max_model_len),
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{tree} {point} failed:\n{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git ref to compare against")
    parser.add_argument("--model", default="smollm2-135m")
    # the main job's (configs/model/smollm2.yaml)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--points", default="64x32@1,64x32@4,64x32@16,64x32@64,128x128@1,128x128@16,128x128@64"
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON lines here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.baseline],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            rows = []
            head = (
                f"{'point':>12} {'tree':>9} {'tok/s':>8} {'step ms':>8} {'fwd/step':>8} "
                f"{'shapes':>6} {'in timed':>8}"
            )
            print(head, flush=True)
            for point in args.points.split(","):
                pair = {}
                for name, tree in (("baseline", base), ("this", ROOT)):
                    r = run_point(tree, args.model, point, args.dtype, args.max_model_len)
                    pair[name] = r
                    print(
                        f"{point:>12} {name:>9} {r['output_tok_s']:8.1f} {r['mean_step_ms']:8.1f} "
                        f"{r['forward_passes_per_step']:8.2f} {r['compiled_shapes']:6d} "
                        f"{r['compiled_in_timed_point']:8d}",
                        flush=True,
                    )
                b, t = pair["baseline"], pair["this"]
                ratio = t["output_tok_s"] / b["output_tok_s"]
                print(f"{point:>12} {'ratio':>9} {ratio:8.3f}", flush=True)
                rows.append({"point": point, "baseline": b, "this": t, "tok_s_ratio": ratio})
            if args.out:
                Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False
            )


if __name__ == "__main__":
    main()
