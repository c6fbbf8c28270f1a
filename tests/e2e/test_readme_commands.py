"""Every `k3-train` and `torchrun ... -m train.cli` command in the README's shell blocks composes
and passes k3-train's start-up validation at its world size: an example a user copies never
fails on its configuration (the training runs themselves are tested elsewhere)."""

import re
import shlex

import pytest

from tests.helpers import REPO

README = REPO / "README.md"


def readme_train_commands() -> list[tuple[int, list[str]]]:
    """(world size, overrides) of each training command in the README's bash blocks, with its
    continuation lines joined and its comment dropped; commands with command-line flags
    (`--config-dir`, `--multirun`: another config tree, a Slurm launcher) are not included."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line.split(" #")[0])
            if words[:1] == ["k3-train"]:
                world, overrides = 1, words[1:]
            elif words[:1] == ["torchrun"] and "train.cli" in words:
                nproc = next(w for w in words if w.startswith("--nproc-per-node"))
                world = int(nproc.split("=")[1] if "=" in nproc
                            else words[words.index(nproc) + 1])
                overrides = words[words.index("train.cli") + 1:]
            else:
                continue
            if not any(o.startswith("-") for o in overrides):
                commands.append((world, overrides))
    return commands


COMMANDS = readme_train_commands()


def test_the_readme_has_its_training_examples():
    assert len(COMMANDS) >= 20
    assert sum(world > 1 for world, _ in COMMANDS) >= 12


@pytest.mark.parametrize("world, overrides", COMMANDS,
                         ids=[f"{world} ranks: {' '.join(o)}" for world, o in COMMANDS])
def test_readme_command_validates(world, overrides):
    from hydra import compose, initialize_config_dir

    from train.cli import CONFIG_DIR, register_configs, to_train_config
    from train.config import validate_train_config

    register_configs()
    with initialize_config_dir(CONFIG_DIR, version_base=None):
        cfg = to_train_config(compose("train", overrides=overrides))
    assert validate_train_config(cfg, world) is cfg
