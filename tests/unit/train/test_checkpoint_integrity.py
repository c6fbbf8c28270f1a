"""Checkpoint integrity and safety, in one process on a small module: every damaged file is named,
resume falls back to the newest checkpoint that verifies, and nothing in a checkpoint directory
can run code when it is read back."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch

from train.checkpoint import Checkpointer
from train.checkpoint_integrity import (
    CHECKSUMS,
    CheckpointError,
    check,
    resume_checkpoint,
    verify,
    write_checksums,
)


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save(root, step: int, seed: int):
    model, opt = _model_and_optimizer(seed)
    ckpt = Checkpointer(root, keep_last=5)
    path = ckpt.save(step, model, [opt], {"loader": {"step": step}})
    return ckpt, path, model


def _shard(path):
    (shard,) = sorted(path.glob("*.distcp"))
    return shard


def test_save_then_load_round_trips_weights_rng_and_side_state(tmp_path):
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    ckpt, path, saved = _save(tmp_path, 3, seed=1)
    table = json.loads((path / CHECKSUMS).read_text())["files"]
    assert sorted(table) == sorted(p.name for p in path.iterdir()
                                   if p.name not in (CHECKSUMS, "COMPLETE"))
    assert not list(path.glob("*.pt"))  # side state is JSON, not a pickle
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    model, opt = _model_and_optimizer(seed=2)
    restored = {}
    step = ckpt.load(path, model, [opt], restored.update)
    assert step == 3 and restored == {"loader": {"step": 3}}
    for a, b in zip(saved.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected_draws


@pytest.mark.parametrize("damage", ["overwrite", "truncate", "delete"])
def test_a_damaged_shard_is_named_and_refused(tmp_path, damage):
    ckpt, path, _ = _save(tmp_path, 3, seed=1)
    shard = _shard(path)
    data = bytearray(shard.read_bytes())
    if damage == "overwrite":  # same size, different bytes inside
        middle = slice(len(data) // 2, len(data) // 2 + 8)
        data[middle] = bytes(b ^ 0xFF for b in data[middle])  # zeros could match zero state
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:len(data) // 2]))
    else:
        shard.unlink()
    problems = verify(path)
    assert len(problems) == 1 and str(shard) in problems[0], problems
    assert {"overwrite": "SHA-256", "truncate": "bytes, expected", "delete": "missing"}[
        damage] in problems[0]
    model, opt = _model_and_optimizer(seed=2)
    with pytest.raises(CheckpointError, match=shard.name):
        ckpt.load(path, model, [opt], lambda s: None)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    _save(tmp_path, 2, seed=1)
    _save(tmp_path, 4, seed=1)
    ckpt, newest, _ = _save(tmp_path, 6, seed=1)
    shard = _shard(newest)
    shard.write_bytes(shard.read_bytes()[:-10])
    path, warnings = resume_checkpoint(ckpt)
    assert path == tmp_path / "step_00000004"
    assert len(warnings) == 1 and "step_00000006" in warnings[0] and shard.name in warnings[0]
    # Kept for inspection, out of the way of the next resume and of pruning.
    assert (tmp_path / "rejected" / "step_00000006" / shard.name).is_file()
    assert not newest.exists()
    assert resume_checkpoint(ckpt) == (tmp_path / "step_00000004", [])


class _RunsCode:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_a_malicious_pickle_in_the_dcp_metadata_is_refused_naming_the_file(tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt, path, _ = _save(tmp_path / "ckpt", 3, seed=1)
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    write_checksums(path)  # whoever can write the folder can rewrite the checksums too
    model, opt = _model_and_optimizer(seed=2)
    with pytest.raises(CheckpointError, match=r"\.metadata.*builtins\.exec"):
        ckpt.load(path, model, [opt], lambda s: None)
    assert not (tmp_path / "PWNED").exists()


def test_a_malicious_pickle_inside_a_shard_entry_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.zeros(2)}, "extra": {"note": _RunsCode()}},
             checkpoint_id=str(path))
    write_checksums(path)
    check(path)
    from train.checkpoint_integrity import safe_dcp_load

    with pytest.raises(CheckpointError, match="extra.note"):
        safe_dcp_load({"model": {"w": torch.ones(2)}, "extra": {"note": None}}, path)
    assert not (tmp_path / "PWNED").exists()


def test_a_checkpoint_without_checksums_does_not_verify(tmp_path):
    _, path, _ = _save(tmp_path, 3, seed=1)
    (path / CHECKSUMS).unlink()
    (problem,) = verify(path)
    assert CHECKSUMS in problem
