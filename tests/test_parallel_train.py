"""k3-train under torchrun end to end: a tensor-parallel run equals one process, and a failing
rank fails the job (non-zero exit within parallel.timeout_s, the last complete checkpoint valid,
a hung rank named by the others) after which the same command resumes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.train_helpers import FAST, REPO, free_port, losses, run_train, train_cmd, train_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def torchrun(run_dir, data_dir, ranks: int, *overrides: str, env_extra=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           f"--master-port={free_port()}"] + train_cmd(run_dir, data_dir)[1:] + list(overrides)
    return subprocess.run(cmd, cwd=REPO, env=train_env(**(env_extra or {})),
                          capture_output=True, text=True, timeout=timeout)


def test_tensor_parallel_run_matches_one_process(tmp_path, sample_data_dir):
    common = [*FAST, "steps=4", "checkpoint.every=0", "checkpoint.save_at_end=false",
              "optim.name=muon"]
    run_train(tmp_path / "one", sample_data_dir, *common)
    out = torchrun(tmp_path / "tp2", sample_data_dir, 2, *common, "parallel.tensor=2")
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "tp2")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


TIMEOUT_S = 20
FAILING = ["stage.seq_len=128", "stage.micro_batch_size=1", "stage.global_batch_size=4",
           "logging.plot=false", "logging.wandb=false", "steps=4", "checkpoint.every=2",
           "parallel.data_shard=full", f"parallel.timeout_s={TIMEOUT_S}"]


@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_a_failing_rank_fails_the_job_and_the_run_resumes(tmp_path, sample_data_dir, kind):
    run = tmp_path / kind
    failing_rank = 2 if kind == "kill" else 1
    start = time.monotonic()
    out = torchrun(run, sample_data_dir, 4, *FAILING,
                   env_extra={"K3_FAULT_RANK_FAILURE": f"{failing_rank}:2:{kind}"})
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    log = out.stdout + out.stderr
    if kind == "kill":  # torchrun names the rank that died by SIGKILL
        assert f"(exitcode: -9) local_rank: {failing_rank}" in log, log[-3000:]
    else:  # the others' collectives time out after parallel.timeout_s; their roll call names it
        assert "timed out" in log.lower() or "timeout" in log.lower(), log[-3000:]
        named = (f"ranks that did not arrive within parallel.timeout_s={TIMEOUT_S}s: "
                 f"[{failing_rank}]")
        assert log.count(named) == 3, log[-3000:]  # on each of the other three ranks
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_00000002"
    # How long it took is reported, not asserted (a loaded machine stretches start-up); a job
    # that never ends fails the test through torchrun()'s subprocess timeout.
    print(f"{kind}: failed job exited after {elapsed:.0f} s (start-up included)")
    resumed = torchrun(run, sample_data_dir, 4, *FAILING)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert (run / "DONE").exists()
    assert sorted(losses(run)) == [1, 2, 3, 4]
