"""k3-train under torchrun end to end: a tensor-parallel run equals one process, a pipeline run
(2 stages) equals it too, validation loss included, and its checkpoint continues in one process
with the same losses; a failing rank fails the job (non-zero exit within parallel.timeout_s, the
last complete checkpoint valid, a hung rank named by the other) after which the same command
resumes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def torchrun(run_dir, data_dir, ranks: int, *overrides: str, env_extra=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           f"--master-port={free_port()}"] + train_cmd(run_dir, data_dir)[1:] + list(overrides)
    return subprocess.run(cmd, cwd=REPO, env=train_env(**(env_extra or {})),
                          capture_output=True, text=True, timeout=timeout)


# A constant learning rate after warm-up: a run of 2 steps takes the first 2 of a 4-step run.
# Validation every 2 steps. global_batch_size 4 in micro-batches of 2 rows: 2 per step, one per
# pipeline stage.
COMMON = [*FAST, "checkpoint.every=0", "optim.name=muon", "optim.schedule=constant",
          "eval.every=2"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, sample_data_dir):
    """The reference: 4 steps in one process; its metrics rows by step."""
    run = tmp_path_factory.mktemp("one")
    run_train(run, sample_data_dir, *COMMON, "steps=4", "checkpoint.save_at_end=false")
    return {row["step"]: row for row in read_metrics(run)}


def _assert_same(reference: dict, run, steps: list[int], key: str = "loss") -> None:
    got = {row["step"]: row[key] for row in read_metrics(run) if key in row}
    assert sorted(got) == steps, (key, sorted(got))
    for step in steps:
        a, b = reference[step][key], got[step]
        assert abs(a - b) <= 1e-5 * abs(a), (key, step, a, b)


def test_tensor_parallel_run_matches_one_process(tmp_path, sample_data_dir, one_process):
    out = torchrun(tmp_path / "tp2", sample_data_dir, 2, *COMMON, "steps=4",
                   "checkpoint.save_at_end=false", "parallel.tensor=2")
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_same(one_process, tmp_path / "tp2", [1, 2, 3, 4])


def test_pipeline_run_matches_one_process_and_resumes_there(tmp_path, sample_data_dir,
                                                            one_process):
    run = tmp_path / "pp2"
    out = torchrun(run, sample_data_dir, 2, *COMMON, "steps=2", "parallel.pipeline=2")
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_same(one_process, run, [1, 2])
    _assert_same(one_process, run, [2], key="val_loss")  # the stages' forward-only walk
    # MoE figures of both stages' layers in the one logged row (k3_tiny: MoE layers 1-7).
    assert {f"moe/layer{i}/cv" for i in range(1, 8)} <= set(read_metrics(run)[-1])
    resumed = run_train(run, sample_data_dir, *COMMON, "steps=4", "checkpoint.save_at_end=false")
    assert "resumed from" in resumed.stdout + resumed.stderr
    _assert_same(one_process, run, [1, 2, 3, 4])
    _assert_same(one_process, run, [2, 4], key="val_loss")


TIMEOUT_S = 15
FAILING = ["stage.seq_len=128", "stage.micro_batch_size=1", "stage.global_batch_size=4",
           "logging.plot=false", "logging.wandb=false", "steps=6", "checkpoint.every=2",
           "parallel.data_shard=full", f"parallel.timeout_s={TIMEOUT_S}"]


def test_a_failing_rank_fails_the_job_and_the_run_resumes(tmp_path, sample_data_dir):
    """One run through both failures on 2 ranks: rank 1 killed as step 3 starts, then, resumed,
    rank 1 hung as step 5 starts; each job ends with the last complete checkpoint valid, and the
    same command then finishes the run with the losses and gradient norms of the same command run
    without failures, bit for bit, at every step any of its jobs logged (the same 2 ranks, data
    and seed: deterministic fp32 CPU runs, so a resumed step that lost any state, optimizer
    moments, loader position or QB bias, differs). How long a failed job took is reported, not
    asserted (a loaded machine stretches start-up); one that never ends fails the test through
    torchrun()'s subprocess timeout."""
    uninterrupted = tmp_path / "uninterrupted"
    out = torchrun(uninterrupted, sample_data_dir, 2, *FAILING)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = {row["step"]: row for row in read_metrics(uninterrupted)}
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    run = tmp_path / "run"
    start = time.monotonic()
    out = torchrun(run, sample_data_dir, 2, *FAILING,
                   env_extra={"K3_FAULT_RANK_FAILURE": "1:3:kill"})
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "(exitcode: -9) local_rank: 1" in log, log[-3000:]  # torchrun names the dead rank
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    print(f"kill: failed job exited after {time.monotonic() - start:.0f} s (start-up included)")

    start = time.monotonic()
    out = torchrun(run, sample_data_dir, 2, *FAILING,
                   env_extra={"K3_FAULT_RANK_FAILURE": "1:5:hang"})
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "resumed from" in log
    # Rank 0's collectives time out after parallel.timeout_s; its roll call names rank 1.
    assert "timed out" in log.lower() or "timeout" in log.lower(), log[-3000:]
    named = f"ranks that did not arrive within parallel.timeout_s={TIMEOUT_S}s: [1]"
    assert log.count(named) == 1, log[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004"
    print(f"hang: failed job exited after {time.monotonic() - start:.0f} s (start-up included)")

    resumed = torchrun(run, sample_data_dir, 2, *FAILING)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert (run / "DONE").exists()
    assert sorted(losses(run)) == [1, 2, 3, 4, 5, 6]
    # Every row any of the three jobs logged (a step logged twice is checked twice).
    differ = [(row["step"], key, row[key], expected[row["step"]][key])
              for row in read_metrics(run) for key in ("loss", "grad_norm")
              if row[key] != expected[row["step"]][key]]
    assert not differ, f"(step, figure, resumed run, uninterrupted run): {differ}"
