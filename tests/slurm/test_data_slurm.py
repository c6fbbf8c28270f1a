"""The bundled sample through datatrove's SlurmPipelineExecutor on the local Slurm cluster: `k3-data
data.executor.kind=slurm` submits the five stages as dependent job arrays, the finalize job writes
the manifest and swaps the build in, and the data equals the local executor's run (conftest's
`sample_data_dir`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_pipeline.config import DataConfig, ExecutorConfig
from data_pipeline.pipeline import ensure_prepared
from tests.helpers import REPO

STAGES = {"curate": 2, "buckets": 20, "global": 1, "tokenize": 2, "finalize": 1}  # tasks=2
UNFINISHED = {"", "PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING",
              "SUSPENDED"}


def _venv_activate() -> str | None:
    """The running interpreter's venv, for the jobs to activate (None outside a venv: the jobs
    then use the PATH they inherit from here)."""
    activate = Path(sys.prefix) / "bin" / "activate"
    return str(activate) if sys.prefix != sys.base_prefix and activate.exists() else None


def _slurm(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def _job_states(job_ids: list[str]) -> dict[str, list[str]]:
    """Job id -> the sacct state of each of its array tasks (one row while all are pending)."""
    rows = _slurm("sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "--format=JobID,State")
    states: dict[str, list[str]] = {job: [] for job in job_ids}
    for line in rows.splitlines():
        job_id, state = line.split("|")
        state = (state.split() or [""])[0]  # "CANCELLED by 0" -> CANCELLED
        states[job_id.split("_")[0]].append(state)
    return states


def _slurm_logs(out: Path, lines: int = 40) -> str:
    tails = []
    for path in sorted((out / "logs" / "slurm").glob("*/*.out")):
        text = path.read_text(errors="replace").splitlines()
        tails.append(f"--- {path.relative_to(out)}\n" + "\n".join(text[-lines:]))
    return "\n".join(tails) or "(no Slurm job logs)"


def _wait_for_jobs(job_ids: list[str], out: Path, timeout_s: float) -> dict[str, list[str]]:
    """Polls sacct until every array task has COMPLETED; fails at the first one that ended
    otherwise (its dependants would wait forever), with the jobs' logs."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = _job_states(job_ids)
        failed = {j: s for j, s in states.items() if set(s) - UNFINISHED - {"COMPLETED"}}
        if failed:
            raise AssertionError(f"Slurm jobs failed: {failed}\n{_slurm_logs(out)}")
        if all(s and set(s) == {"COMPLETED"} for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"Slurm jobs unfinished after {timeout_s:.0f} s: {states}\n"
                                 f"{_slurm_logs(out)}")
        time.sleep(1)


def _cancel_jobs_named(prefix: str) -> None:
    """Ends what is left of this test's jobs (datatrove's stats-merging jobs, or the rest of a
    failed chain), so that nothing outlives it on a shared cluster."""
    queue = _slurm("squeue", "-h", "-o", "%i %j")
    jobs = [i for i, name in (line.split() for line in queue.splitlines()) if
            name.startswith(prefix)]
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)


def _k3_data(overrides: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "data_pipeline.cli", *overrides], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result


def _files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_slurm_executor_produces_the_same_data_as_the_local_executor(slurm_cluster,
                                                                     sample_data_dir, tmp_path):
    out, job_name = tmp_path / "data", f"k3-data-test-{os.getpid()}"
    overrides = [f"data.output_dir={out}", "data.progress=false", "data.executor.kind=slurm",
                 f"data.executor.partition={slurm_cluster.partition}", "data.executor.tasks=2",
                 "data.executor.workers=-1", f"data.executor.job_name={job_name}",
                 "+data.executor.sbatch_args.mem-per-cpu=1G"]
    if _venv_activate():
        overrides.append(f"data.executor.venv_path={_venv_activate()}")
    try:
        submit = _k3_data(overrides)
        job_ids = submit.stdout.split("submitted Slurm jobs ")[1].split(" (")[0].split()
        assert len(job_ids) == len(STAGES), submit.stdout
        states = _wait_for_jobs(job_ids, out, timeout_s=300)
    finally:
        _cancel_jobs_named(job_name)
    assert [len(s) for s in states.values()] == list(STAGES.values())
    for stage, tasks in STAGES.items():  # datatrove's completion marks, one per task
        assert len(list((out / "logs" / stage / "completions").iterdir())) == tasks, stage

    local = Path(sample_data_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"]
    assert manifest == json.loads((local / "manifest.json").read_text())  # prefixes: relative
    summary, local_summary = (json.loads((d / "summary.json").read_text()) for d in (out, local))
    summary.pop("timing")  # wall times: the Slurm run has none, the local run its own
    local_summary.pop("timing")
    assert summary == local_summary and summary["balanced"]
    assert summary["outcomes"]["quarantined"] and summary["outcomes"]["kept"] > 0
    for name in ("quarantine.jsonl", "tokenizer.json"):
        assert (out / name).read_bytes() == (local / name).read_bytes(), name
    shards, local_shards = _files(out / "shards"), _files(local / "shards")
    assert shards and shards.keys() == local_shards.keys()
    # .bin/.idx tokens, pack plans, media index and frames, per-document records
    assert [f for f in shards if shards[f] != local_shards[f]] == []

    # Finished: a resumed submission has nothing left to run, and training accepts the data.
    assert "nothing submitted" in _k3_data([*overrides, "data.resume=true"]).stdout
    slurm_cfg = DataConfig(output_dir=str(out), progress=False,
                           executor=ExecutorConfig(kind="slurm", tasks=2))
    assert ensure_prepared(slurm_cfg) == out / "manifest.json"
    assert json.loads((out / "manifest.json").read_text()) == manifest
