"""k3-submit: the rendered job (golden), config errors before submission, and real jobs on the
local Slurm cluster: a 2-node data-parallel run, preemption with requeue and resume, and a
hydra-submitit-launcher sweep with a failing point."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import GOLDEN, REPO
from tests.helpers.train_helpers import FAST, read_metrics, train_env


def submit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm.submit", *args], cwd=REPO,
                          env=train_env(), capture_output=True, text=True, timeout=timeout)


def test_dry_run_16_nodes_8_gpus_matches_golden():
    out = submit("--dry-run", "slurm=gpu_cluster", "slurm.partition=gpu", "slurm.account=proj",
                 "model=k3_small", "device=cuda", "run_dir=/shared/runs/k3-small",
                 "stage.global_batch_size=256", "stage.micro_batch_size=2")
    assert out.returncode == 0, out.stderr
    script = out.stdout.replace(sys.executable, "PYTHON")
    assert script == (GOLDEN / "submit_16x8.sbatch").read_text()
    for line in ("#SBATCH --nodes=16", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@300", "--nproc-per-node=8",
                 '--rdzv-endpoint="$head_addr:$rdzv_port"', '--rdzv-id="$SLURM_JOB_ID"'):
        assert line in script, line


@pytest.mark.parametrize("override, message", [
    ("slurm.nodes=0", "slurm.nodes=0"),
    ("slurm.gpus_per_node=8", "slurm.gpus_per_node=8"),  # the default layout is device=cpu here
    ("stage.global_batch_size=3", "stage.global_batch_size"),
    # A credential would be written into job.sbatch and the saved config: refused, not echoed.
    ("+slurm.env.WANDB_API_KEY=k3-secret-51d2", "slurm.env.WANDB_API_KEY is invalid"),
])
def test_bad_slurm_config_fails_before_submission(tmp_path, override, message):
    out = submit("--dry-run", f"run_dir={tmp_path}/run", "device=cpu", override)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "k3-secret-51d2" not in out.stdout + out.stderr
    assert not (tmp_path / "run").exists()


# ---- against the real local cluster ----------------------------------------------------------

@pytest.mark.slurm
def test_unknown_partition_fails_before_submission(tmp_path, slurm_cluster):
    out = submit(f"run_dir={tmp_path}/run", "device=cpu", "slurm=local",
                 "slurm.partition=no_such_partition")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "slurm.partition='no_such_partition'" in out.stderr
    assert slurm_cluster.partition in out.stderr  # names the valid ones
    assert not (tmp_path / "run").exists()


def _sacct(job_id: str) -> tuple[str, int]:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "--format=State,NNodes"],
                         capture_output=True, text=True)
    rows = [r.split("|") for r in out.stdout.split("\n") if r.strip()]
    return (rows[-1][0], int(rows[-1][1])) if rows else ("", 0)


def _wait_state(job_id: str, states: set[str], timeout: float) -> str:
    deadline = time.time() + timeout
    state = ""
    while time.time() < deadline:
        state, _ = _sacct(job_id)
        if state.split()[0:1] and state.split()[0] in states:
            return state.split()[0]
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {state!r} after {timeout}s")


def _submit_job(run_dir: Path, data_dir: Path, *overrides: str) -> str:
    out = submit("slurm=local", f"run_dir={run_dir}", f"data.output_dir={data_dir}",
                 "device=cpu", *FAST, "logging.wandb=false", *overrides)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = out.stdout.split("submitted job ")[1].split(":")[0]
    assert (run_dir / "slurm" / "config.yaml").exists()
    return job_id


@pytest.mark.slow
@pytest.mark.slurm
def test_two_node_job_completes_with_losses_and_checkpoint(tmp_path, slurm_cluster,
                                                           sample_data_dir):
    run = tmp_path / "run"
    job_id = _submit_job(run, sample_data_dir, "slurm.nodes=2", "steps=4",
                         "checkpoint.every=2")
    state = _wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 600)
    log = (run / "slurm" / f"k3-{job_id}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert _sacct(job_id)[1] == 2
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004"
    assert "2 node(s)" in log


@pytest.mark.slow
@pytest.mark.slurm
def test_preempted_job_checkpoints_requeues_and_resumes(tmp_path, slurm_cluster,
                                                        sample_data_dir):
    run = tmp_path / "run"
    steps = 60  # long enough that the signal lands mid-run on a fast machine too
    job_id = _submit_job(run, sample_data_dir, f"steps={steps}", "checkpoint.every=0")
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline, "the job did not start training"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    state = _wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 900)
    log = (run / "slurm" / f"k3-{job_id}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "requeueing job" in log and "restart 1" in log, log[-3000:]
    preempted_at = json.loads((run / "PREEMPTED").read_text())["step"]
    assert 3 <= preempted_at < steps
    # Every step trained exactly once across the two runs of the job.
    assert [r["step"] for r in read_metrics(run)] == list(range(1, steps + 1))


@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_sweep_completes_and_reports_a_failing_point(tmp_path, slurm_cluster,
                                                              sample_data_dir):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "train.cli", "--multirun", "hydra/launcher=submitit_slurm",
           "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10",
           "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
           "hydra.launcher.signal_delay_s=10", f"hydra.sweep.dir={sweep}",
           f"run_dir={sweep}/" + "${hydra:job.num}", f"data.output_dir={sample_data_dir}",
           "device=cpu", *FAST, "logging.wandb=false", "steps=2", "optim.lr=1e-3,3e-3"]
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for point in ("0", "1"):
        assert [r["step"] for r in read_metrics(sweep / point)] == [1, 2]

    failing = tmp_path / "failing"
    cmd_fail = [c.replace(str(sweep), str(failing)) for c in cmd]
    cmd_fail[-1] = "optim.lr=1e-3,-1"  # the second point fails its config check in the job
    # the subprocess timeout is the guard against a failing point hanging the sweep
    out = subprocess.run(cmd_fail, cwd=REPO, env=train_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode != 0
    assert "optim.lr" in out.stdout + out.stderr
