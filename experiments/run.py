"""The experiments app: ``python -m experiments.run [group=option ...] [key=value ...]``.

Config groups (``configs/``): model, quantization, executor, hardware, cache, engine, workload,
experiment, tracking. ``-m`` sweeps across runs, e.g. block size and serving engine::

    python -m experiments.run -m cache.block_size=8,16,32 engine=vllm,static

Each run writes results.jsonl, run_config.json, PNG plots and an (offline) W&B run into its run
directory (``output_dir=PATH`` overrides it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from research.config import RunConfig, register_configs, run_config_from

register_configs()

# Hydra launcher and sweeper plugins: the module each needs and the extra that installs it.
PLUGINS = {
    "hydra/launcher=joblib": ("hydra_plugins.hydra_joblib_launcher", None),
    "hydra/launcher=submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "hydra/launcher=submitit_local": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "hydra/launcher=ray": ("hydra_plugins.hydra_ray_launcher", "ray"),
    "hydra/launcher=ray_aws": ("hydra_plugins.hydra_ray_launcher", "ray"),
    "hydra/sweeper=optuna": ("hydra_plugins.hydra_optuna_sweeper", None),
}


def missing_plugin(argv: list[str]) -> str | None:
    """An error naming what to install when the command line picks a Hydra plugin this
    environment lacks (Hydra itself would only say the config option is unknown)."""
    import importlib.util

    for arg in argv:
        key = arg.lstrip("+~").replace(" ", "")
        if key not in PLUGINS:
            continue
        module, extra = PLUGINS[key]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            install = f"pip install -e '.[{extra}]'" if extra else "pip install -e ."
            return f"{key} needs Hydra's plugin {module.split('.')[-1]!r}: {install}"
    return None


def model_override(run: RunConfig, overrides: list[str]) -> RunConfig:
    """An experiment that lists its models (``experiment.models``) runs the one chosen on the
    command line instead (``model=...`` or ``model.model=...``)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if run.experiment.models and keys & {"model", "model.model"}:
        return dataclasses.replace(
            run, experiment=dataclasses.replace(run.experiment, models=(run.model.model,))
        )
    return run


# Overrides that say where things go or how they are logged, not what was run.
NOT_SWEPT = ("output_dir", "hydra", "tracking", "experiment")


def job_name(run: RunConfig, overrides: list[str]) -> str:
    """The W&B run name: the experiment, then the values this job was given, each by its last
    key (``cache.block_size=8`` -> ``block_size=8``); paths, tracking and the experiment
    choice itself left out, so the jobs of a multirun read as what they swept."""
    shown = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key.split(".", 1)[0] in NOT_SWEPT and key != "experiment.concurrencies":
            continue
        shown.append(f"{key.rsplit('.', 1)[-1]}={value}")
    return " ".join([run.experiment.name, *shown])


def sweep_group(run: RunConfig, hydra_cfg: Any) -> tuple[str, str]:
    """(W&B group, job type): the group is the experiment and the time stamp of the sweep
    (multirun) or of the run, so two sweeps never share a group; the job type says the role."""
    from hydra.types import RunMode

    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    folder = Path(hydra_cfg.sweep.dir if multirun else hydra_cfg.runtime.output_dir)
    stamp = "-".join(folder.parts[-2:])
    return f"{run.experiment.name}/{stamp}", "multirun-job" if multirun else "run"


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> Any:
    """Runs the experiment; returns what a configuration search optimizes (the capacity
    runner's users at the SLO and p99 TTFT there), None for other runners."""
    from experiments.context_len import fit_max_model_len, max_model_len_given
    from experiments.runners import get_runner

    run = run_config_from(cfg)
    overrides = list(HydraConfig.get().overrides.task)
    run = model_override(run, overrides)
    if run.executor.kind != "simulated":
        from research.parallel.devices import request_host_devices

        request_host_devices(run.hardware.tensor_parallel_size)  # before JAX starts
    # Before the first point: max_model_len raised to the workload's longest request, or a
    # ValueError naming what to change (experiments.context_len: the rule).
    run = fit_max_model_len(run, explicit=max_model_len_given(overrides))
    out_dir = run.output_dir or HydraConfig.get().runtime.output_dir
    group, job_type = sweep_group(run, HydraConfig.get())
    runner = get_runner(run.experiment.runner)
    runner(run, out_dir, job_name=job_name(run, overrides), group=group, job_type=job_type)
    if run.experiment.runner == "capacity":
        from experiments.capacity import objective

        return objective(out_dir)
    return None


if __name__ == "__main__":
    import sys

    if (error := missing_plugin(sys.argv[1:])) is not None:
        sys.exit(f"error: {error}")
    main()
