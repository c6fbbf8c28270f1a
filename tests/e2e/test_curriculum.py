"""Context curriculum: a run moves from one stage to the next from its checkpoint, keeping the
step count, the optimizer state, the QB biases and its position in the data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from data_pipeline.loader import K3DataLoader
from data_pipeline.manifest import manifest_path
from tests.helpers.train_helpers import (
    FAST,
    REPO,
    free_port,
    losses,
    read_metrics,
    run_train,
    train_cmd,
    train_env,
)


def test_loader_continues_a_switched_stage_at_the_same_token_position(sample_data_dir):
    manifest = manifest_path(sample_data_dir)
    short = K3DataLoader(manifest, 128, 2, grad_accum=2)
    for _ in range(6):  # 3 optimizer steps of 2 x 2 rows of 128 tokens: 1536 tokens
        next(short)
    state = short.state_dict()
    same = K3DataLoader(manifest, 128, 2, grad_accum=2)
    assert same.continue_from(state) is None and same.step == 6  # an exact resume
    longer = K3DataLoader(manifest, 256, 2, grad_accum=1, seed=7)
    changed = longer.continue_from(state)
    assert changed == "global_batch 4 -> 2, seed 0 -> 7, seq_len 128 -> 256"
    assert longer.step == 3  # ceil(1536 / (2 rows x 256 tokens)) optimizer steps of 1 batch
    state["fingerprint"] = "another dataset"
    with pytest.raises(ValueError, match="fingerprint.*same dataset"):
        longer.continue_from(state)


def _checkpoint(run, step: int, tmp_path) -> dict:
    out = tmp_path / f"step{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step_{step:08d}", out)
    return torch.load(out, weights_only=False)


# stage 2 at twice the context, half the rows: the same tokens per step
STAGE_2 = ["stage=tiny_s2", "stage.seq_len=256", "stage.micro_batch_size=1",
           "stage.global_batch_size=2", "steps=4"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_switch_to_the_next_stage_from_a_checkpoint(tmp_path, sample_data_dir):
    """One process runs stage 1, then stage 2 from its checkpoint; a copy of the stage-1 run
    goes on to stage 2 on two ranks with the context split over them (torchrun,
    parallel.context=2): a switch of stage and layout at once, with the same losses."""
    run = tmp_path / "run"
    run_train(run, sample_data_dir, *FAST, "stage=tiny", "steps=2")
    first = _checkpoint(run, 2, tmp_path)
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    out = run_train(run, sample_data_dir, *FAST, *STAGE_2)
    assert "stage tiny_s2 continues the run (" in out.stderr + out.stdout
    assert "seq_len 128 -> 256" in out.stderr + out.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    second = _checkpoint(run, 4, tmp_path)
    loader = json.loads((run / "checkpoints" / "step_00000004" / "rank00000.json").read_text())
    # data: 2 steps of 4 x 128 tokens = 2 steps of 2 x 256, then the 2 steps of stage 2
    assert (loader["loader"]["seq_len"], loader["loader"]["optimizer_step"]) == (256, 4)
    # the optimizer continued: its step counters count all 4 steps, not 2 of a fresh start
    # (the optimizer state is saved flattened: one "state.<parameter>.<field>" key per entry)
    steps = {float(v) for k, v in second["optim"].items()
             if k.startswith("state.") and k.endswith(".step")}
    assert steps == {4.0}, steps
    biases = [k for k in first["model"] if k.endswith("balancer.bias")]
    assert biases
    for k in biases:  # QB kept its biases and went on updating them
        assert not torch.equal(first["model"][k], second["model"][k])

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={free_port()}"]
    cmd = launcher + train_cmd(moved, sample_data_dir)[1:] + [*FAST, *STAGE_2,
                                                               "parallel.context=2"]
    cp = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True,
                        timeout=600)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "stage tiny_s2 continues the run (" in cp.stderr + cp.stdout
    one, two = losses(run), losses(moved)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in (3, 4):  # within 1e-5, as every CP layout against one process
        assert abs(one[step] - two[step]) <= 1e-5 * abs(one[step]), (step, one[step], two[step])
