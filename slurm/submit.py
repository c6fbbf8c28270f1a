"""`k3-submit`: turns a training config into a Slurm job and submits it.

    k3-submit slurm=gpu_cluster slurm.partition=gpu model=k3_small run_dir=/shared/runs/a
    k3-submit --dry-run ...        # print the sbatch script, submit nothing

Takes the same configs and overrides as `k3-train` plus the `slurm` group. Everything is
validated before anything is written: the training config against the job's world size
(nodes x ranks per node) and the Slurm fields against the cluster (its partitions, via sinfo).
The fully resolved config is saved next to the job's logs; the job trains from exactly that file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from model.errors import ConfigError
from train.cli import (
    CONFIG_DIR,
    hydra_exit_codes,
    prepare_tool_argv,
    register_configs,
    to_train_config,
)
from train.config import TrainConfig, validate_train_config

from .render import render, validate_slurm

CONFIG_NAME = "config"


def cluster_partitions() -> list[str] | None:
    """Partition names from sinfo, or None where no Slurm client is installed."""
    if shutil.which("sinfo") is None:
        return None
    out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        raise ConfigError(f"cannot reach the Slurm controller (sinfo: {out.stderr.strip()}); "
                          "check SLURM_CONF or run on a login node")
    return sorted(set(out.stdout.split()))


def resolved_job_config(cfg: DictConfig, run_dir: Path) -> dict:
    """The composed config with every interpolation resolved and absolute paths, as a Hydra
    primary config the job loads with --config-path/--config-name."""
    data = OmegaConf.to_container(cfg, resolve=True)
    data["run_dir"] = str(run_dir)
    data["slurm"]["output_dir"] = str(Path(data["slurm"]["output_dir"]).resolve())
    data["defaults"] = ["train_schema", "_self_"]
    data["hydra"] = {"run": {"dir": str(run_dir)}, "job": {"chdir": False}}
    return data


def prepare(cfg: DictConfig, query_cluster: bool) -> tuple[TrainConfig, dict, str]:
    """Validates and renders; `query_cluster` checks the partition against sinfo (not in a dry
    run, which may happen on a machine without Slurm)."""
    train_cfg = to_train_config(cfg)
    slurm = train_cfg.slurm
    validate_slurm(slurm, train_cfg.device, cluster_partitions() if query_cluster else None)
    validate_train_config(train_cfg, world_size=slurm.nodes * slurm.ranks_per_node())
    run_dir = Path(train_cfg.run_dir).resolve()
    job_cfg = resolved_job_config(cfg, run_dir)
    output_dir = job_cfg["slurm"]["output_dir"]
    script = render(slurm, run_dir=str(run_dir), output_dir=output_dir, config_dir=output_dir,
                    config_name=CONFIG_NAME)
    return train_cfg, job_cfg, script


def submit(job_cfg: dict, script: str) -> str:
    output_dir = Path(job_cfg["slurm"]["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{CONFIG_NAME}.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(job_cfg)))
    script_path = output_dir / "job.sbatch"
    script_path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


register_configs()
_dry_run = False


_task_started = False  # set once Hydra has composed the config and calls the task


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    try:
        train_cfg, job_cfg, script = prepare(cfg, query_cluster=not _dry_run)
    except ConfigError as e:
        print(f"k3-submit: config error: {e}", file=sys.stderr)
        sys.exit(2)
    if _dry_run:
        print(script, end="")
        return
    job_id = submit(job_cfg, script)
    out = job_cfg["slurm"]["output_dir"]
    print(f"submitted job {job_id}: {train_cfg.slurm.nodes} node(s) x "
          f"{train_cfg.slurm.ranks_per_node()} rank(s)")
    print(f"  logs:    {out}/{train_cfg.slurm.job_name}-{job_id}.out")
    print(f"  config:  {out}/{CONFIG_NAME}.yaml")
    print(f"  metrics: {job_cfg['run_dir']}/metrics.jsonl")
    print(f"  W&B:     {job_cfg['run_dir']}/wandb ({train_cfg.logging.wandb_mode})")


def main() -> None:
    global _dry_run
    _dry_run = prepare_tool_argv("--dry-run")
    hydra_exit_codes(_hydra_main, lambda: _task_started)


if __name__ == "__main__":
    main()
