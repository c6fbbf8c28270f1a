"""Every `k3-train` and `torchrun ... -m train.cli` command in the shell blocks of the README and
of every docs/*.md page composes and passes k3-train's start-up validation at its world size: an
example a user copies never fails on its configuration (the training runs themselves are tested
elsewhere)."""

import re
import shlex
from pathlib import Path

import pytest

from tests.helpers import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# Fenced blocks a user runs in a shell; a command in any of them is checked.
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)


def train_commands(page) -> list[tuple[int, list[str]]]:
    """(world size, overrides) of each training command in the page's shell blocks, with its
    continuation lines joined and its comment dropped; commands with command-line flags
    (`--config-dir`, `--multirun`: another config tree, a Slurm launcher) are not included."""
    commands = []
    for block in SHELL_BLOCK.findall(page.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line.split(" #")[0])
            if words[:1] == ["$"]:  # a console block's prompt
                words = words[1:]
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


COMMANDS = [(page.relative_to(REPO).as_posix(), world, overrides)
            for page in PAGES for world, overrides in train_commands(page)]


def test_the_docs_exist_and_hold_their_training_examples():
    names = {page.name for page in DOCS}
    assert {"training.md", "parallelism.md", "moonep.md", "checkpoints.md"} <= names
    assert len(COMMANDS) >= 20
    assert sum(world > 1 for _, world, _ in COMMANDS) >= 12
    assert any(page == "README.md" for page, _, _ in COMMANDS)


def test_the_readme_links_every_docs_page():
    readme = README.read_text()
    for page in DOCS:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page, world, overrides", COMMANDS,
                         ids=[f"{p}: {w} ranks: {' '.join(o)}" for p, w, o in COMMANDS])
def test_documented_command_validates(page, world, overrides, tmp_path):
    from hydra import compose, initialize_config_dir

    from train.cli import CONFIG_DIR, register_configs, to_train_config
    from train.config import validate_train_config

    register_configs()
    with initialize_config_dir(CONFIG_DIR, version_base=None):
        cfg = to_train_config(compose("train", overrides=overrides))
    # What an earlier command of the page makes (the pre-training run and its tokenizer):
    # stand-ins.
    if cfg.init_from is not None:
        cfg.init_from = str(_exported_config(tmp_path / "init_from", cfg.model))
    if cfg.data.tokenizer.path is not None and not Path(cfg.data.tokenizer.path).exists():
        cfg.data.tokenizer.path = str(_tokenizer(tmp_path / "tokenizer.json"))
    if cfg.dry_run.world_size > 0:  # k3-train's start-up check of a dry run: its world, no data
        world = cfg.dry_run.world_size
    assert validate_train_config(cfg, world, data=cfg.dry_run.world_size == 0) is cfg


def _exported_config(path, model):
    """A directory init_from reads as a k3-export of `model` (its config.json only: the
    start-up checks compare the model, the weights are read when the run starts)."""
    import json
    from dataclasses import asdict

    path.mkdir()
    (path / "config.json").write_text(json.dumps({**asdict(model), "export": {},
                                                  "quantization": {}}))
    return path


def _tokenizer(path):
    """A tokenizer as k3-data trains one (the reserved chat tokens included)."""
    from data_pipeline.tokenizer import train_tokenizer

    train_tokenizer([f"the river {i} runs to the sea" for i in range(50)], 300).save(str(path))
    return path
