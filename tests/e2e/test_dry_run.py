"""`k3-train ... dry_run.world_size=N dry_run.rank=R` as a user runs it: k3_small, rank 37 of
256 (FSDP2 x TP2 x EP8), one step at 4096 tokens on fake tensors, and its dry_run.json."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from model.config import k3_small
from model.k3 import K3Model
from tests.helpers import REPO
from tests.helpers.train_helpers import train_env

LAYOUT = ["parallel.data_shard=full", "parallel.tensor=2", "parallel.expert=8",
          "stage.seq_len=4096", "stage.micro_batch_size=1", "stage.global_batch_size=128",
          "optim.name=muon"]


def test_k3_small_dry_run_of_one_rank_of_256(tmp_path):
    out = subprocess.run([sys.executable, "-m", "train.cli", "model=k3_small",
                          f"run_dir={tmp_path}", "dry_run.world_size=256", "dry_run.rank=37",
                          *LAYOUT], cwd=REPO, env=train_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "dry_run.json").read_text())
    print({k: v for k, v in result.items() if k != "layout"})
    assert (result["world_size"], result["rank"]) == (256, 37)
    assert "rank 37: pp0 dp18 cp0 tp1 ep5" in result["layout"]
    with torch.device("meta"):
        total = sum(p.numel() for p in K3Model(k3_small()).parameters())
    # FSDP2 over 128 data ranks, TP2: a small share of the model, not all of it.
    assert 0 < result["parameters_on_rank"] < total / 32
    memory = result["memory_bytes"]
    assert result["peak_memory_bytes"] > memory["parameters"] + memory["optimizer_state"]
    assert set(result["collective_bytes"]) >= {"all_gather", "reduce_scatter", "all_reduce",
                                               "all_to_all"}
    assert result["planned_memory_bytes"] > 0
    assert not (tmp_path / "checkpoints").exists()  # nothing trained, nothing saved
