"""The training system end to end, in subprocesses: demo, exact resume after SIGKILL, a crash
during a checkpoint write, 2-rank data parallelism, W&B offline records, config errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from model.config import k3_tiny
from tests.helpers.train_helpers import (
    FAST,
    REPO,
    free_port,
    losses,
    read_metrics,
    run_train,
    train_cmd,
    train_env,
    wait_for,
)
from train.checkpoint_integrity import verify
from train.flops import training_flops_per_token
from train.wandb_records import read_history, run_id

pytestmark = pytest.mark.slow


def test_short_run_learns_and_writes_everything(tmp_path, sample_data_dir):
    run = tmp_path / "run"
    out = run_train(run, sample_data_dir, *FAST, "steps=30", "checkpoint.every=10",
                    "logging.plot=true", "optim.lr=5e-3")
    assert "fp32, kernels: native CPU\n" in out.stdout + out.stderr
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.8 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb", "moe/cv_mean",
                "moe/max_over_mean_max", "moe/bias_min", "moe/bias_max", "attn/max_logit"):
        assert key in rows[-1], key
    assert rows[-1]["mfu_peak_source"] == "cpu matmul probe"
    # The text's FLOPs every step; MoonViT's on top where the step has images (some do).
    text = training_flops_per_token(k3_tiny(), 128) * 4 * 128
    assert min(r["model_flops"] for r in rows) == text
    assert max(r["model_flops"] for r in rows) > text
    assert (run / "training.png").stat().st_size > 1000
    assert (run / "DONE").exists()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step_00000010", "step_00000020", "step_00000030"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000030"


def test_exact_resume_after_sigkill(tmp_path, sample_data_dir):
    n = 4
    straight = tmp_path / "straight"
    run_train(straight, sample_data_dir, *FAST, f"steps={2 * n}", f"checkpoint.every={n}")

    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(killed, sample_data_dir, *FAST, f"steps={2 * n}",
                                      f"checkpoint.every={n}"),
                            cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    latest = killed / "checkpoints" / "latest"
    wait_for(lambda: latest.exists(), 300, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.read_text() == f"step_{n:08d}"
    run_train(killed, sample_data_dir, *FAST, f"steps={2 * n}", f"checkpoint.every={n}")
    expected, resumed = losses(straight), losses(killed)
    assert sorted(resumed) == list(range(1, 2 * n + 1))
    for step in range(n + 1, 2 * n + 1):
        assert resumed[step] == expected[step], (step, resumed[step], expected[step])


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, sample_data_dir):
    run = tmp_path / "run"
    out = run_train(run, sample_data_dir, *FAST, "steps=6", "checkpoint.every=3",
                    check=False, env_extra={"K3_FAULT_KILL_DURING_SAVE": "6"})
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_00000003"
    assert (ckpt / "step_00000006.partial").is_dir()  # the interrupted write, never published
    assert not (ckpt / "step_00000006").exists()
    resumed = run_train(run, sample_data_dir, *FAST, "steps=6", "checkpoint.every=3")
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert "step_00000003" in resumed.stderr + resumed.stdout
    assert (ckpt / "latest").read_text() == "step_00000006"
    assert not (ckpt / "step_00000006.partial").exists()


def test_two_rank_data_parallel_matches_one_rank(tmp_path, sample_data_dir):
    """Training loss and the validation loss (held-out split, eval.every) alike; the two ranks'
    checkpoint verifies against the checksums they wrote together."""
    args = [*FAST, "steps=4", "checkpoint.every=0", "eval.every=2", "eval.batches=2"]
    one = tmp_path / "one"
    run_train(one, sample_data_dir, *args, "checkpoint.save_at_end=false")
    two = tmp_path / "two"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={free_port()}"]
    cmd = launcher + train_cmd(two, sample_data_dir)[1:] + args
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])
    # The same images in each step's global batch, split over the ranks: the same model FLOPs.
    flops_a, flops_b = ([r["model_flops"] for r in read_metrics(run)] for run in (one, two))
    assert flops_a == flops_b and len(set(flops_a)) > 1, (flops_a, flops_b)
    val_a = {r["step"]: r["val_loss"] for r in read_metrics(one) if "val_loss" in r}
    val_b = {r["step"]: r["val_loss"] for r in read_metrics(two) if "val_loss" in r}
    assert sorted(val_a) == sorted(val_b) == [2, 4]
    for step in val_a:
        assert abs(val_a[step] - val_b[step]) <= 1e-5 * abs(val_a[step]), (step, val_a, val_b)
    ckpt = two / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert verify(ckpt) == []


def test_wandb_offline_history_and_resume_keeps_the_run_id(tmp_path, sample_data_dir):
    run = tmp_path / "run"
    run_train(run, sample_data_dir, *FAST, "steps=3", "logging.wandb=true")
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history = read_history(files[0])
    assert [row["_step"] for row in history] == [1, 2, 3]
    logged = {row["_step"]: row["loss"] for row in history}
    assert logged == pytest.approx(losses(run), rel=1e-6)
    first_id = run_id(files[0])
    assert first_id == (run / "wandb_run_id").read_text()

    run_train(run, sample_data_dir, *FAST, "steps=5", "logging.wandb=true")
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    assert {run_id(f) for f in files} == {first_id}
    assert [row["_step"] for row in read_history(files[-1])] == [4, 5]


@pytest.mark.parametrize("override, field", [
    ("model=k3_huge", "model"),
    ("model.kda.num_heads=0", "model.kda.num_heads"),
    ("optim.lr=-1", "optim.lr"),
    ("parallel.data=3", "parallel.data"),
    ("data.sources.0.path=/nonexistent/k3", "data.sources[0].path"),
    ("stage.global_batch_size=3", "stage.global_batch_size"),
    ("model.moe.top_k=lots", "top_k"),
    ("parallel.tensor=3", "model.kda.num_heads=2 is invalid: must be divisible by parallel.tensor"),
])
def test_bad_config_fails_before_any_work(tmp_path, sample_data_dir, override, field):
    run = tmp_path / "run"
    out = run_train(run, sample_data_dir, override, check=False, timeout=120)
    assert out.returncode != 0
    assert field in out.stderr, out.stderr[-2000:]
    assert not (run / "checkpoints").exists()


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path, sample_data_dir):
    run = tmp_path / "run"
    # An absurd init overflows most steps' forward or backward (a few batches stay finite).
    out = run_train(run, sample_data_dir, *FAST, "steps=30", "model.init_std=1e10",
                    "max_nonfinite_in_a_row=3", "checkpoint.every=0",
                    "checkpoint.save_at_end=false", "logging.wandb=false", check=False)
    assert out.returncode != 0
    assert "3 steps in a row had a non-finite loss" in out.stdout + out.stderr
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) < 30
    skipped = [r["skipped"] for r in rows]
    # It stopped at the first third non-finite step in a row, and counted the runs right.
    assert skipped[-3:] == [True] * 3
    assert not any(all(skipped[i:i + 3]) for i in range(len(rows) - 3))
    expected, count = [], 0
    for s in skipped:
        count = count + 1 if s else 0
        expected.append(count)
    assert [r["nonfinite_in_a_row"] for r in rows] == expected


def test_deterministic_runs_use_deterministic_algorithms_without_filling_new_memory():
    import torch

    from train.loop import seed_everything

    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    try:
        seed_everything(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]
