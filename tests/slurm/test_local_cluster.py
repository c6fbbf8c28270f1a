"""The local Slurm cluster works the way the launcher tests need it: multi-node jobs with srun,
accounting through slurmdbd, node addresses for rendezvous, requeue, and signals to the batch
script."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm import local_cluster

# sacct states of a job that has not reached its final record yet.
UNFINISHED_STATES = {"", "PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING"}


def on_cluster(test: Callable) -> Callable:
    for mark in (pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(120)):
        test = mark(test)
    return test


def _slurm(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def _sbatch(tmp_path: Path, body: str, *options: str) -> int:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + body)
    output = f"--output={tmp_path}/slurm-%j.out"
    return int(_slurm("sbatch", "--parsable", output, *options, str(script)).strip())


def _wait_until(ready: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def _wait_for_job_end(job_id: int, timeout_s: float = 60.0) -> None:
    def gone() -> bool:
        return not _slurm("squeue", "-h", "-j", str(job_id)).strip()

    _wait_until(gone, f"job {job_id} to leave the queue", timeout_s)


def _accounted(job_id: int, timeout_s: float = 30.0) -> tuple[str, int]:
    """(State, NNodes) of the job allocation once slurmdbd has its final record: right after a
    job ends, sacct can still show a placeholder row."""
    row: list[str] = []

    def final() -> bool:
        nonlocal row
        lines = _slurm("sacct", "-j", str(job_id), "-X", "-P", "-n", "--format=State,NNodes")
        row = lines.splitlines()[0].split("|") if lines.strip() else []
        return bool(row) and row[0] not in UNFINISHED_STATES

    _wait_until(final, f"the final accounting record of job {job_id}", timeout_s)
    return row[0], int(row[1])


def _job_output(tmp_path: Path, job_id: int) -> str:
    return (tmp_path / f"slurm-{job_id}.out").read_text()


def _node_fields(node: str) -> dict[str, str]:
    words = _slurm("scontrol", "show", "node", node).split()
    return dict(word.split("=", 1) for word in words if "=" in word)


def test_conf_gives_each_node_its_own_port_and_a_share_of_memory(tmp_path: Path) -> None:
    conf = local_cluster.render_slurm_conf(local_cluster.ClusterConfig(root=tmp_path, nodes=3))
    nodes = [
        dict(word.split("=", 1) for word in line.split())
        for line in conf.splitlines()
        if line.startswith("NodeName=")
    ]
    assert [node["NodeName"] for node in nodes] == ["n1", "n2", "n3"]
    assert len({node["Port"] for node in nodes}) == 3
    assert all(node["NodeAddr"] == "127.0.0.1" for node in nodes)
    mem_total_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    assert 0 < sum(int(node["RealMemory"]) for node in nodes) < mem_total_mb
    # Must be in place before `sacctmgr add cluster` and slurmctld's first start.
    assert "\nAccountingStorageType=accounting_storage/slurmdbd\n" in conf


@on_cluster
def test_two_node_job_runs_a_step_on_each_node_and_is_accounted(slurm_cluster, tmp_path):
    job = _sbatch(
        tmp_path,
        "srun bash -c 'echo $SLURMD_NODENAME $SLURM_NODEID'\n",
        "--nodes=2",
        "--ntasks-per-node=1",
    )
    _wait_for_job_end(job)
    ran_on = sorted(_job_output(tmp_path, job).splitlines())
    assert ran_on == [f"{node} {index}" for index, node in enumerate(slurm_cluster.nodes)]
    assert _accounted(job) == ("COMPLETED", 2)


RENDEZVOUS = """
import os, socket, subprocess, time

def show(*args):
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout

first_node = show("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split()[0]
fields = dict(w.split("=", 1) for w in show("show", "node", first_node).split() if "=" in w)
address = (fields["NodeAddr"], 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000)
me = os.environ["SLURMD_NODENAME"]
if os.environ["SLURM_NODEID"] == "0":
    with socket.create_server(address) as server:
        server.settimeout(30)
        connection, _ = server.accept()
        print(me, "heard", connection.recv(64).decode(), flush=True)
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(address, timeout=5) as client:
                client.sendall(me.encode())
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
"""


@on_cluster
def test_node_addr_from_scontrol_serves_a_rendezvous_across_nodes(slurm_cluster, tmp_path):
    for node in slurm_cluster.nodes:
        assert _node_fields(node)["NodeAddr"] == slurm_cluster.node_addrs[node]
    (tmp_path / "rendezvous.py").write_text(RENDEZVOUS)
    job = _sbatch(
        tmp_path,
        f"srun --kill-on-bad-exit=1 {sys.executable} {tmp_path}/rendezvous.py\n",
        "--nodes=2",
        "--ntasks-per-node=1",
    )
    _wait_for_job_end(job)
    first, second = slurm_cluster.nodes[:2]
    assert _job_output(tmp_path, job) == f"{first} heard {second}\n"
    assert _accounted(job) == ("COMPLETED", 2)


@on_cluster
def test_requeued_job_runs_again_with_a_higher_restart_count(slurm_cluster, tmp_path):
    runs = tmp_path / "runs.txt"
    job = _sbatch(
        tmp_path,
        f"echo ${{SLURM_RESTART_COUNT:-0}} >> {runs}\n"
        # The first run waits to be requeued; the second finishes at once.
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 60; fi\n',
        "--requeue",
    )
    _wait_until(lambda: runs.exists() and runs.read_text() == "0\n", "the first run")
    _slurm("scontrol", "requeue", str(job))
    # A requeued job may start again only after AuthInfo's cred_expire (10 s here).
    _wait_for_job_end(job, timeout_s=60)
    assert runs.read_text().split() == ["0", "1"]
    assert _accounted(job) == ("COMPLETED", 1)


@on_cluster
def test_scancel_signal_batch_reaches_the_batch_script_trap(slurm_cluster, tmp_path):
    ready, caught = tmp_path / "ready", tmp_path / "caught"
    job = _sbatch(
        tmp_path,
        f"trap 'echo USR1 > {caught}; exit 0' USR1\n"
        f"touch {ready}\n"
        # bash runs a trap only between commands: wait on a background sleep.
        "sleep 60 &\nwait\n",
    )
    _wait_until(ready.exists, "the batch script to set its trap")
    _slurm("scancel", "--signal=USR1", "--batch", str(job))
    _wait_for_job_end(job, timeout_s=30)
    assert caught.read_text() == "USR1\n"
    assert _accounted(job) == ("COMPLETED", 1)


@on_cluster
def test_start_on_a_running_cluster_is_a_no_op(slurm_cluster):
    cfg = local_cluster.ClusterConfig(root=slurm_cluster.root)
    pids_before = {path.name: path.read_text() for path in cfg.run_dir.glob("*.pid")}
    again = local_cluster.start(cfg)
    assert not again.started_here
    assert {path.name: path.read_text() for path in cfg.run_dir.glob("*.pid")} == pids_before
