"""The `slurm_cluster` fixture: one real local Slurm cluster (slurm/local_cluster.py) per session.

tests/conftest.py registers it as a plugin, so any test can take `slurm_cluster`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from slurm import local_cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[local_cluster.ClusterInfo]:
    """Starts the cluster (or reuses one already running as configured), points SLURM_CONF at it
    for this process and its subprocesses (sbatch, submitit, datatrove), and stops it at the end
    if it started it. Skips where the machine cannot run it; with $CI set that is a failure."""
    problem = local_cluster.missing_requirements()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"the local Slurm cluster is required in CI: {problem}")
        pytest.skip(problem)
    cfg = local_cluster.ClusterConfig()
    cluster = local_cluster.start(cfg)
    previous_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.slurm_conf)
    try:
        yield cluster
    finally:
        if previous_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous_conf
        if cluster.started_here:
            local_cluster.stop(cfg)
