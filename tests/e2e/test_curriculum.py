"""Context curriculum: a run moves from one stage to the next from its checkpoint, keeping the
step count, the optimizer state, the QB biases and its position in the data."""

from __future__ import annotations

import json
import math
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


def _stage_config(run):
    """The TrainConfig the run composed (Hydra saves it in <run_dir>/.hydra/config.yaml)."""
    from omegaconf import OmegaConf

    from train.cli import to_train_config
    from train.config import TrainConfig

    composed = OmegaConf.merge(OmegaConf.structured(TrainConfig),
                               OmegaConf.load(run / ".hydra" / "config.yaml"))
    return to_train_config(composed)


def _resume_and_replay(cfg, checkpoint):
    """What k3-train does on one process when it resumes `checkpoint` under `cfg`: the model,
    precision, plan and optimizers, the loader mapped to the new stage, the checkpoint loaded;
    then the first step's forward and backward on the loader's next micro-batches. Returns
    (step, what the loader switched, model state, the step's mean loss)."""
    from train.checkpoint import Checkpointer
    from train.data import build_loader
    from train.loop import build_parallel_model, forward_backward

    device = torch.device("cpu")
    model, precision, parallel, optimizers = build_parallel_model(cfg, None, device)
    loader = build_loader(cfg, dp_rank=0, dp_size=1)
    switched = []
    step = Checkpointer(checkpoint.parent, cfg.checkpoint.keep_last).load(
        checkpoint, model, optimizers, lambda s: switched.append(loader.continue_from(s["loader"])))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = iter(loader)
    accum = cfg.stage.global_batch_size // cfg.stage.micro_batch_size
    loss = forward_backward(model, [next(batches) for _ in range(accum)], device, precision,
                            parallel)
    return step, switched, state, float(loss)


# stage 2 at twice the context, half the rows: the same tokens per step
STAGE_2 = ["stage=tiny_s2", "stage.seq_len=256", "stage.micro_batch_size=1",
           "stage.global_batch_size=2", "steps=4"]
# k3_tiny's losses at steps 3 and 4 of this curriculum (stage 2 after 2 steps of stage 1),
# measured once: 7.56440 and 7.48296 (steps 1 and 2: 7.63790, 7.62167), with the tokenizer that
# reserves the chat tokens (ids 5..14; before them other merges gave 7.5494 and 7.4804). Within
# 0.01: room for another order of summation (1e-6), not for another model, data or resume point
# (a step earlier or later is 0.07 away).
STAGE_2_LOSS = {3: 7.5644, 4: 7.4830}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_switch_to_the_next_stage_from_a_checkpoint(tmp_path, sample_data_dir):
    """One process runs stage 1 (2 steps of 4 rows of 128 tokens), then stage 2 (2 rows of 256)
    from its checkpoint. What carries over is checked by value: the stage-2 run's first step
    starts from exactly the stage-1 checkpoint's weights and QB biases (an in-process resume of
    an untouched copy, as k3-train does it, reproduces the run's logged step-3 loss, and its
    biases equal the saved ones bit for bit), the loader switches to 256 tokens and continues at
    the same token position, the step counter and the optimizer's step counts go on from 2 to
    4, the biases keep updating, and the losses are finite and where they were measured. A copy
    of the stage-1 run goes on to stage 2 on two ranks with the context split over them
    (torchrun, parallel.context=2): a switch of stage and layout at once, with the same
    losses."""
    run = tmp_path / "run"
    run_train(run, sample_data_dir, *FAST, "stage=tiny", "steps=2")
    first = _checkpoint(run, 2, tmp_path)
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    out = run_train(run, sample_data_dir, *FAST, *STAGE_2)
    console = out.stderr + out.stdout
    assert "resumed from" in console and "step_00000002 at step 2" in console
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

    # The stage-2 configuration resuming the untouched copy of stage 1, in this process.
    cfg = _stage_config(run)
    assert (cfg.stage.name, cfg.stage.seq_len, cfg.stage.global_batch_size) == ("tiny_s2", 256, 2)
    step, switched, resumed, replayed = _resume_and_replay(
        cfg, moved / "checkpoints" / "step_00000002")
    assert step == 2 and len(switched) == 1 and "seq_len 128 -> 256" in switched[0]
    assert f"stage tiny_s2 continues the run ({switched[0]})" in console
    biases = [k for k in first["model"] if k.endswith("balancer.bias")]
    assert biases
    for k in biases:  # carried across the stage change exactly ...
        assert torch.equal(resumed[k], first["model"][k]), k
        assert first["model"][k].abs().sum() > 0, k  # (and not the zeros of a fresh balancer)
    for k, saved in first["model"].items():  # ... as is every weight
        assert torch.equal(resumed[k], saved), k
    # ... and the run's first stage-2 step started from them: its logged loss is the replay's
    # (the same ops on the same data on one process: measured bit-identical; the same replay
    # with the biases reset to zeros is 1.6e-5 off, with other routing).
    one = losses(run)
    assert abs(one[3] - replayed) <= 1e-6 * abs(replayed), (one[3], replayed)
    for k in biases:  # QB went on updating them in stage 2
        assert not torch.equal(first["model"][k], second["model"][k]), k
    for s, expected in STAGE_2_LOSS.items():
        assert math.isfinite(one[s]) and abs(one[s] - expected) <= 0.01, (s, one[s])

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={free_port()}"]
    cmd = launcher + train_cmd(moved, sample_data_dir)[1:] + [*FAST, *STAGE_2,
                                                               "parallel.context=2"]
    cp = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True,
                        timeout=600)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert f"stage tiny_s2 continues the run ({switched[0]})" in cp.stderr + cp.stdout
    two = losses(moved)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for s in (3, 4):  # within 1e-5, as every CP layout against one process
        assert abs(one[s] - two[s]) <= 1e-5 * abs(one[s]), (s, one[s], two[s])
