"""`k3-train ... dry_run.world_size=N dry_run.rank=R` as a user runs it: k3_small, rank 37 of
256 (FSDP2 x TP2 x EP8), one step at 4096 tokens on fake tensors, and its dry_run.json; and a
pipeline rank of a combined layout whose layers are recomputed in backward, on MoonEP's symm_mem
transport; each one's collective bytes per op against k3-plan's count, and two more layouts'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from model.config import k3_small
from model.k3 import K3Model
from tests.helpers import REPO
from tests.helpers.train_helpers import train_env

LAYOUT = ["parallel.data_shard=full", "parallel.tensor=2", "parallel.expert=8",
          "stage.seq_len=4096", "stage.micro_batch_size=1", "stage.global_batch_size=128",
          "optim.name=muon"]


def _dry_run(run_dir, *overrides: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "train.cli", f"run_dir={run_dir}", *overrides],
                         cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((run_dir / "dry_run.json").read_text())


def _assert_k3_plan_counts_the_collectives(result: dict) -> None:
    """Per op, the bytes the step hands to the collectives equal k3-plan's count
    (train/collective_sizing.py) within 10%, and every op it counts is called (measured within
    2.5%: what k3-plan leaves out is FSDP2's padding of the dense matrices' rows and the
    scalars' few hundred bytes)."""
    measured, planned = result["collective_bytes"], result["planned_collective_bytes"]
    assert set(measured) == set(planned)
    ratios = {op: measured[op] / planned[op] for op in measured}
    assert all(abs(r - 1) <= 0.1 for r in ratios.values()), ratios


def test_k3_small_dry_run_of_one_rank_of_256(tmp_path):
    result = _dry_run(tmp_path, "model=k3_small", "dry_run.world_size=256", "dry_run.rank=37",
                      *LAYOUT)
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
    # k3-plan's figure for the layout is within 20% of what the step holds at its peak
    # (measured: 4.65 GiB against 4.8).
    assert abs(result["peak_memory_bytes"] / result["planned_memory_bytes"] - 1) <= 0.2
    _assert_k3_plan_counts_the_collectives(result)
    assert not (tmp_path / "checkpoints").exists()  # nothing trained, nothing saved


def test_a_checkpointed_pipeline_rank_with_experts_tensor_and_fsdp2(tmp_path):
    """PP2 x TP2 x DP4 with EP2 x ETP2 and FSDP2 (k3_tiny, world 16), layers recomputed in
    backward: FSDP2 hands the experts their gathered weights in the recompute too (the
    tensor-parallel MoE once swapped in their shards, whose shapes broke MoonEP's copy exchange,
    and once their gathered etp DTensors, which FSDP2 had prefetched). MoonEP on the
    symm_mem transport, which a dry run accepts without CUDA: its exchanges become all-to-alls of
    the static buffers on the fake process group."""
    result = _dry_run(tmp_path, "dry_run.world_size=16", "dry_run.rank=0",
                      "parallel.data_shard=full", "parallel.expert=2", "parallel.tensor=2",
                      "parallel.expert_tensor=2", "parallel.pipeline=2",
                      "stage.micro_batch_size=1",
                      "stage.global_batch_size=8", "optim.name=muon",
                      "activation_checkpointing=true", "parallel.moonep.transport=symm_mem")
    assert "rank 0: pp0 dp0 cp0 tp0 ep0" in result["layout"]
    assert result["collective_calls"]["all_to_all"] > 0
    assert result["collective_calls"]["send"] == result["collective_calls"]["recv"] > 0
    _assert_k3_plan_counts_the_collectives(result)


# Two more layouts whose collectives k3-plan counts: the pipeline with zig-zag context
# parallelism (two local rows: the MoE gathers the sequence before it flattens it) on symm_mem,
# recomputed; ZeRO-1 over replicas whose two micro-batches are reduced once, tensor parallelism
# without sequence parallelism, the collective transport.
COLLECTIVE_LAYOUTS = {
    "pp2_cp2_tp2_ep2_fsdp2": ["dry_run.world_size=16", "parallel.pipeline=2",
                              "parallel.context=2", "parallel.tensor=2", "parallel.expert=2",
                              "parallel.data_shard=full", "stage.global_batch_size=4",
                              "activation_checkpointing=true",
                              "parallel.moonep.transport=symm_mem"],
    "zero1_tp2_ep2_without_sp": ["dry_run.world_size=8", "parallel.tensor=2",
                                 "parallel.expert=2", "parallel.data_shard=optimizer",
                                 "parallel.sequence_parallel=false",
                                 "stage.global_batch_size=8"],
}


@pytest.mark.parametrize("name", list(COLLECTIVE_LAYOUTS))
def test_k3_plan_counts_the_collectives_of(tmp_path, name):
    result = _dry_run(tmp_path, "dry_run.rank=0", "stage.micro_batch_size=1", "optim.name=muon",
                      *COLLECTIVE_LAYOUTS[name])
    _assert_k3_plan_counts_the_collectives(result)
