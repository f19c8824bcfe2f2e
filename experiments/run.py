"""The experiments app: ``python -m experiments.run [group=option ...] [key=value ...]``.

Config groups (``configs/``): model, quantization, executor, hardware, cache, scheduler, workload,
experiment, tracking. ``-m`` sweeps across runs, e.g. block size and policy::

    python -m experiments.run -m cache.block_size=8,16,32 scheduler=continuous,static

Each run writes results.jsonl, run_config.json, PNG plots and an (offline) W&B run into its run
directory (``output_dir=PATH`` overrides it).
"""

from __future__ import annotations

import dataclasses

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from research.config import RunConfig, register_configs, run_config_from

register_configs()


def model_override(run: RunConfig, overrides: list[str]) -> RunConfig:
    """An experiment that lists its models (``experiment.models``) runs the one chosen on the
    command line instead (``model=...`` or ``model.model=...``)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if run.experiment.models and keys & {"model", "model.model"}:
        return dataclasses.replace(
            run, experiment=dataclasses.replace(run.experiment, models=(run.model.model,))
        )
    return run


def job_name(run: RunConfig, overrides: list[str]) -> str:
    """The W&B run name: the experiment and the overrides that made this job (output paths
    left out), so the jobs of a multirun are told apart."""
    shown = [o for o in overrides if not o.split("=", 1)[0].startswith(("output_dir", "hydra"))]
    return "-".join([run.experiment.name, *shown])[:128]


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from experiments.sweep import run_experiment

    run = run_config_from(cfg)
    overrides = list(HydraConfig.get().overrides.task)
    run = model_override(run, overrides)
    if run.executor.kind != "simulated":
        from research.parallel.devices import request_host_devices

        request_host_devices(run.hardware.tensor_parallel_size)  # before JAX starts
    out_dir = run.output_dir or HydraConfig.get().runtime.output_dir
    run_experiment(run, out_dir, job_name=job_name(run, overrides))


if __name__ == "__main__":
    main()
