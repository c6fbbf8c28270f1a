"""Runs `k3-train` in subprocesses the way a user would, on the prepared bundled sample."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO

# Small and fast, but every mechanism of k3_tiny is in: 2 rows of 128 tokens per micro-batch.
FAST = ["stage.seq_len=128", "stage.micro_batch_size=2", "stage.global_batch_size=4",
        "logging.plot=false", "optim.warmup_steps=2"]


def train_env(threads: int = 1, **extra: str) -> dict:
    env = dict(os.environ, **extra)
    env.update({"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                "WANDB_SILENT": "true", "WANDB_MODE": "offline"})
    return env


def train_cmd(run_dir: Path, data_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "train.cli", f"run_dir={run_dir}",
            f"data.output_dir={data_dir}", *overrides]


def run_train(run_dir: Path, data_dir: Path, *overrides: str, timeout: float = 600,
              check: bool = True, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(train_cmd(run_dir, data_dir, *overrides), cwd=REPO,
                         env=train_env(**(env_extra or {})),
                         capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"k3-train failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                             f"{out.stderr[-3000:]}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}


def wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    """Polls `predicate` while the training process `proc` runs (killed on timeout)."""
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}): "
                                 f"{proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the training process")
        time.sleep(0.05)
