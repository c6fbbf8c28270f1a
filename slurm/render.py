"""Renders the sbatch script of a training job from the `slurm` config group."""

from __future__ import annotations

import shlex
import string
import sys
from pathlib import Path

from model.errors import ConfigError
from train.config import SlurmConfig

TEMPLATE = Path(__file__).with_name("templates") / "job.sbatch.in"


class _Template(string.Template):
    delimiter = "@@"  # bash owns `$`


def validate_slurm(cfg: SlurmConfig, device: str, partitions: list[str] | None = None) -> None:
    """Fails before submission with the field, the value and what is valid. `partitions`: the
    cluster's partitions (sinfo), when known."""
    def fail(field: str, value, valid: str):
        raise ConfigError(f"slurm.{field}={value!r} is invalid: {valid}")

    if cfg.nodes < 1:
        fail("nodes", cfg.nodes, "must be >= 1")
    if cfg.gpus_per_node < 0:
        fail("gpus_per_node", cfg.gpus_per_node, "must be >= 0")
    if cfg.gpus_per_node > 0 and device == "cpu":
        fail("gpus_per_node", cfg.gpus_per_node,
             "must be 0 for a CPU layout (device=cpu); set device=cuda or auto to use GPUs")
    if device == "cuda" and cfg.gpus_per_node == 0:
        fail("gpus_per_node", cfg.gpus_per_node, "must be > 0 when device=cuda")
    if cfg.ranks_per_node() < 1:
        fail("procs_per_node", cfg.procs_per_node, "must be >= 1")
    if cfg.gpus_per_node and cfg.ranks_per_node() > cfg.gpus_per_node:
        fail("procs_per_node", cfg.procs_per_node,
             f"must be <= gpus_per_node={cfg.gpus_per_node} (one rank per GPU)")
    if cfg.cpus_per_node < 1:
        fail("cpus_per_node", cfg.cpus_per_node, "must be >= 1")
    if cfg.signal_seconds < 0:
        fail("signal_seconds", cfg.signal_seconds, "must be >= 0")
    if partitions is not None and cfg.partition is not None and cfg.partition not in partitions:
        fail("partition", cfg.partition, f"this cluster has partitions {sorted(partitions)}")


def sbatch_lines(cfg: SlurmConfig, output_dir: str) -> list[str]:
    lines = [f"--job-name={cfg.job_name}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1",
             f"--cpus-per-task={cfg.cpus_per_node}", f"--time={cfg.time}",
             f"--output={output_dir}/%x-%j.out", "--open-mode=append"]
    if cfg.gpus_per_node:
        lines.append(f"--gpus-per-node={cfg.gpus_per_node}")
    for flag, value in (("partition", cfg.partition), ("account", cfg.account),
                        ("qos", cfg.qos), ("constraint", cfg.constraint), ("mem", cfg.mem)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    if cfg.exclusive:
        lines.append("--exclusive")
    if cfg.requeue:
        lines += ["--requeue", f"--signal=B:USR1@{cfg.signal_seconds}"]
    lines += list(cfg.extra_sbatch)
    return [f"#SBATCH {line}" for line in lines]


def default_env(cfg: SlurmConfig) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(max(1, cfg.cpus_per_node // cfg.ranks_per_node())),
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(cfg.shutdown_timeout_s),
           "PYTHONUNBUFFERED": "1", "WANDB_RUN_GROUP": cfg.job_name}
    if cfg.gpus_per_node:
        env |= {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN"}
    return env | dict(cfg.env)


def render(cfg: SlurmConfig, *, run_dir: str, output_dir: str, config_dir: str,
           config_name: str, python: str | None = None) -> str:
    srun_extra = ""
    if cfg.container_image:
        srun_extra = f"--container-image={shlex.quote(cfg.container_image)} "
        if cfg.container_mounts:
            srun_extra += f"--container-mounts={shlex.quote(cfg.container_mounts)} "
    env_lines = "\n".join(f"export {k}={shlex.quote(str(v))}"
                          for k, v in sorted(default_env(cfg).items()))
    return _Template(TEMPLATE.read_text()).substitute(
        sbatch_lines="\n".join(sbatch_lines(cfg, output_dir)),
        config_file=f"{config_dir}/{config_name}.yaml",
        script_file=f"{output_dir}/job.sbatch",
        run_dir=shlex.quote(run_dir), env_lines=env_lines, srun_extra=srun_extra,
        python=shlex.quote(python or sys.executable), ranks_per_node=cfg.ranks_per_node(),
        config_dir=shlex.quote(config_dir), config_name=config_name,
        max_restarts=cfg.max_restarts)
