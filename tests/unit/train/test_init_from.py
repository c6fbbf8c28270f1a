"""init_from's refusals (train/init_from.py): a source holding another model is refused naming
the field, fields that only choose how the model runs may differ, and a path that is not a
run, checkpoint or export, or lies inside the run's own directory, is refused by name."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from model.config import k3_tiny
from model.errors import ConfigError
from train.config import TrainConfig, validate_train_config


def _export_like(path, **changes):
    """A directory init_from reads as a k3-export: its config.json (the weights are not read
    by the checks)."""
    path.mkdir(parents=True)
    values = asdict(k3_tiny())
    for name, value in changes.items():
        *parents, leaf = name.split(".")
        node = values
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    (path / "config.json").write_text(json.dumps({**values, "export": {}, "quantization": {}}))
    return path


def _validate(tmp_path, init_from):
    cfg = TrainConfig(run_dir=str(tmp_path / "sft"), init_from=str(init_from))
    return validate_train_config(cfg, world_size=1, data=False)


@pytest.mark.parametrize("field, value, shown", [
    ("hidden_size", 128, "model.hidden_size=128 there, 64 here"),
    ("moe.num_experts", 16, "model.moe.num_experts=16 there, 8 here"),
    ("kda.gate_lower_bound", -3.0, "model.kda.gate_lower_bound=-3.0 there, -5.0 here"),
])
def test_another_model_is_refused_naming_the_field(tmp_path, field, value, shown):
    source = _export_like(tmp_path / "export", **{field: value})
    with pytest.raises(ConfigError, match=shown):
        _validate(tmp_path, source)


def test_fields_that_only_choose_how_the_model_runs_may_differ(tmp_path):
    source = _export_like(tmp_path / "export", name="pretrained", max_seq_len=2048,
                          **{"kda.backend": "torch", "moe.dispatch": "loop"})
    assert _validate(tmp_path, source).init_from == str(source)


def test_a_path_that_is_no_run_checkpoint_or_export_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a k3-train run directory, a complete "
                                          "checkpoint"):
        _validate(tmp_path, tmp_path / "empty")


def test_a_source_inside_the_runs_own_directory_is_refused(tmp_path):
    source = _export_like(tmp_path / "sft" / "export")
    with pytest.raises(ConfigError, match="lies inside run_dir"):
        _validate(tmp_path, source)
