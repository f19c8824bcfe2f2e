"""Every ``python -m experiments.run ...`` command in the fenced code blocks of
docs/experiments/*.md composes with Hydra and passes the pre-flight sizing
(``experiments.context_len.fit_max_model_len``) as written: none would stop before its first
point. A multirun (``-m``) is composed job by job: every combination of the command line's
comma lists, and each value of a sweeper's ``hydra.sweeper.params`` in the experiment's config
one at a time (Optuna's ``choice(...)`` included). Overrides of ``hydra.*`` / ``hydra/...``
(run directories, launchers, sweepers) say where and how jobs run, not what they are, and are
left out; a command with a ``<placeholder>`` is skipped (``SKIPPED`` lists them).

The slow tier runs the traces page's first command and the Mooncake synthetic trace, as
written, end to end."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from experiments.context_len import fit_max_model_len, longest_request, max_model_len_given
from experiments.run import model_override
from research.config import register_configs, run_config_from
from tests.test_experiments import CONFIGS, ROOT

DOCS = ROOT / "docs" / "experiments"
APP = "python -m experiments.run"


def doc_commands() -> list[tuple[str, str]]:
    """(file:line, command) of every ``python -m experiments.run`` command in a fenced code block
    of docs/experiments/*.md, backslash continuations joined, anything before ``python`` (an
    environment variable) dropped."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        fenced, pending, start = False, "", 0
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            if not pending:
                start = number
            pending += line.strip() if pending else line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip() + " "
                continue
            if APP in pending:
                found.append((f"{path.name}:{start}", pending[pending.index(APP) :]))
            pending = ""
    return found


COMMANDS = doc_commands()
# Commands with a <placeholder> the reader fills in: not composed.
SKIPPED = [(where, cmd) for where, cmd in COMMANDS if re.search(r"<[^>]*>", cmd)]


def _top_level_split(value: str) -> list[str]:
    """``a,b,[c,d]`` -> ``["a", "b", "[c,d]"]``: Hydra's sweep list, brackets kept whole."""
    parts, depth, current = [], 0, ""
    for ch in value:
        depth += ch in "[({"
        depth -= ch in "])}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def _args(command: str) -> list[str]:
    return shlex.split(command, comments=True)[len(APP.split()) :]


def is_multirun(command: str) -> bool:
    return bool({"-m", "--multirun"} & set(_args(command)))


def jobs(command: str) -> list[list[str]]:
    """The override lists of the runs ``command`` starts (one unless it is a multirun)."""
    overrides = [
        a
        for a in _args(command)
        if a not in ("-m", "--multirun") and not re.match(r"[+~]*hydra[./]", a)
    ]
    if not is_multirun(command):
        return [overrides]
    choices = []
    for o in overrides:
        key, _, value = o.partition("=")
        choices.append([f"{key}={v}" for v in _top_level_split(value)])
    return [list(job) for job in itertools.product(*choices)]


def _compose(overrides: list[str]):
    """(RunConfig, the config's own sweeper params as override lists, one value each)."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params")
    params = {} if params is None else OmegaConf.to_container(params, resolve=False)
    with open_dict(cfg):
        del cfg["hydra"]
    swept = []
    for key, value in params.items():
        text = str(value)
        if match := re.fullmatch(r"choice\((.*)\)", text):
            text = match.group(1)
        swept += [[f"{key}={v.strip()}"] for v in _top_level_split(text)]
    return run_config_from(cfg), swept


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 20, COMMANDS
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"traces.md", "sessions.md", "capacity.md"} <= pages
    assert SKIPPED == []  # none today; a placeholder command would be listed here


@pytest.mark.parametrize(
    "where, command", [c for c in COMMANDS if c not in SKIPPED], ids=[w for w, _ in COMMANDS]
)
def test_documented_command_composes_and_fits(where, command):
    for overrides in jobs(command):
        run, swept = _compose(overrides)
        runs = [(overrides, run)]
        if is_multirun(command):
            runs += [(overrides + s, _compose(overrides + s)[0]) for s in swept]
        for job, run in runs:
            run = model_override(run, job)
            sized = fit_max_model_len(run, explicit=max_model_len_given(job))  # raises if it stops
            longest = longest_request(sized)
            if longest is not None and sized.model.max_model_len is not None:
                assert sized.model.max_model_len >= longest.tokens, (where, job)


TRACES_FIRST = (
    "executor=simulated hardware=gb10 model=qwen3_coder_30b_a3b quantization=awq "
    "workload=mooncake_conversation 'experiment.concurrencies=[64]'"
)
MOONCAKE_SYNTHETIC = (
    "executor=simulated hardware=gb10 model=qwen3_coder_30b_a3b quantization=awq "
    "workload=mooncake_synthetic"
)


def test_the_traces_page_starts_with_the_command_run_below():
    assert COMMANDS[[w for w, _ in COMMANDS].index("traces.md:24")][1] == f"{APP} {TRACES_FIRST}"


@pytest.mark.slow  # two simulated sweeps of full-length Mooncake requests: about 25 s
@pytest.mark.parametrize(
    "args, raised_to, points",
    [(TRACES_FIRST, 121_856, [64]), (MOONCAKE_SYNTHETIC, 82_944, [1, 4, 16, 64])],
    ids=["traces_md_first", "mooncake_synthetic"],
)
def test_trace_commands_run_end_to_end_at_their_own_lengths(tmp_path, args, raised_to, points):
    """As written (no tracking, no figures): every request of every point completes, at the
    max_model_len the run raised and said it raised."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        *shlex.split(args),
        "tracking=disabled",
        "tracking.plots=false",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["max_concurrency"] for r in rows] == points
    for r in rows:
        assert r["failed"] == 0 and r["completed"] == 3 * r["max_concurrency"]
        assert (r["max_model_len"], r["max_model_len_raised_from"]) == (raised_to, 4096)
        assert r["config"]["model"]["max_model_len"] == raised_to
    log = (tmp_path / "hydra" / "run.log").read_text()
    assert "model.max_model_len raised from 4,096 (a config file's value" in log
    assert f"to {raised_to:,} (the next multiple of 1,024" in log


def test_jobs_expand_a_multirun():
    cmd = f"{APP} -m a=1,2 'b=[3,4]' hydra/launcher=joblib c=5,6"
    assert jobs(cmd) == [
        ["a=1", "b=[3,4]", "c=5"],
        ["a=1", "b=[3,4]", "c=6"],
        ["a=2", "b=[3,4]", "c=5"],
        ["a=2", "b=[3,4]", "c=6"],
    ]
    assert jobs(f"{APP} 'experiment.concurrencies=[1,64]'  # a comment") == [
        ["experiment.concurrencies=[1,64]"]
    ]
