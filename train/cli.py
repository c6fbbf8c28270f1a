"""`k3-train`: the Hydra entry point. With no arguments it trains k3_tiny on the bundled sample on
CPU with W&B offline; every field of configs/train.yaml can be overridden on the command line."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from model.errors import ConfigError

from .config import TrainConfig
from .startup_checks import check_known_keys, check_no_secret_overrides

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
log = logging.getLogger("k3.train")


def prepare_tool_argv(flag: str) -> bool:
    """For commands that share the training config but train nothing (k3-plan, k3-submit):
    removes `flag` (e.g. --json) from sys.argv, which Hydra would reject, and makes Hydra write
    no run directory or log files. Returns whether the flag was given."""
    given = flag in sys.argv
    if given:
        sys.argv.remove(flag)
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
                 "hydra/hydra_logging=none"]
    return given


def register_configs() -> None:
    """The typed schema every YAML in configs/ is merged into (Hydra structured config)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The validated dataclass tree of a composed Hydra config. A type error (a string where a
    number belongs) becomes a ConfigError naming the field."""
    check_known_keys(cfg)
    try:
        return OmegaConf.to_object(cfg)
    except Exception as e:  # omegaconf's ValidationError carries the full key
        field = getattr(e, "full_key", "?")
        raise ConfigError(f"{str(e).splitlines()[0]} (field: {field})") from e


def quiet_libraries() -> None:
    """Keeps the console to the run's own lines: megatron-core logs every index file it opens at
    INFO and warns on import that TE/Apex are missing (expected on CPU)."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


EXIT_CONFIG_ERROR = 2  # every configuration error, Hydra's own (bad override, unknown group)


def run(cfg: DictConfig) -> int:
    quiet_libraries()
    from .loop import train

    try:
        train_cfg = to_train_config(cfg)
        from .config import validate_train_config

        # A dry run reads no dataset, post-training its tasks: the data config is not checked.
        validate_train_config(train_cfg, data=train_cfg.dry_run.world_size == 0
                              and train_cfg.posttrain == "none")
        if train_cfg.posttrain != "none":
            from .posttrain.loop import posttrain

            return posttrain(train_cfg)
        return train(train_cfg)
    except ConfigError as e:  # also those found once the data is read (e.g. its vision sizes)
        print(f"k3-train: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


register_configs()
_task_started = False  # set once Hydra has composed the config and calls the task


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    code = run(cfg)
    if code:
        sys.exit(code)


def hydra_exit_codes(main, task_started=lambda: _task_started) -> None:
    """Runs a @hydra.main function; Hydra reports its own errors (an override it cannot parse,
    a config group option that does not exist) with exit code 1, which here becomes
    EXIT_CONFIG_ERROR, like every other configuration error. An error raised by the task itself
    (`task_started()` true) keeps its code. k3-plan and k3-submit pass their own flag."""
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not task_started():
            sys.exit(EXIT_CONFIG_ERROR)
        raise


def train_main() -> None:
    try:
        check_no_secret_overrides(sys.argv[1:])
    except ConfigError as e:
        print(f"k3-train: config error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    hydra_exit_codes(_hydra_main)


if __name__ == "__main__":
    train_main()
