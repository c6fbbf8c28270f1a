"""k3-plan: counts from the real (meta-device) model, FLOPs from the tested analytic count.

The three plans of k3_full (each traces the full model's layers on the meta device, the longest
subprocesses here) start together when the first of their tests runs, two at a time: each is a
single-threaded process, so two keep two cores busy while the other tests run."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from model.config import k3_full
from tests.helpers.train_helpers import REPO
from train.flops import forward_flops_per_token, training_flops_per_token


def _run_plan(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.plan", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _plan(*overrides):
    return _parsed(_run_plan("--json", *overrides))


def _parsed(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


FULL_MODEL_PLANS = {
    "large_layout": ["--json", "model=k3_full", "parallel.tensor=8", "parallel.expert=64",
                     "parallel.pipeline=8", "parallel.data=64", "stage.seq_len=8192",
                     "stage.micro_batch_size=1", "activation_checkpointing=true"],
    "context_expert_pipeline": [
        "--json", "model=k3_full", "parallel.tensor=8", "parallel.context=2",
        "parallel.pipeline=8", "parallel.expert=32", "parallel.expert_tensor=2",
        "parallel.data=8", "parallel.data_replicate=2", "parallel.data_shard=full",
        "stage.seq_len=8192", "stage.micro_batch_size=1", "activation_checkpointing=true"],
    "long_context": ["--json", "--long-context", "model=k3_full", "parallel.tensor=8",
                     "parallel.expert=64", "parallel.pipeline=8", "parallel.context=4",
                     "parallel.data=16", "parallel.data_shard=full",
                     "stage.micro_batch_size=1", "activation_checkpointing=true"],
}
TIMEOUTS = {"long_context": 600}


@pytest.fixture(scope="module")
def full_model_plans():
    """Every k3-plan run of FULL_MODEL_PLANS, started at once on two workers: name -> future of
    its CompletedProcess."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(_run_plan, *args, timeout=TIMEOUTS.get(name, 180))
               for name, args in FULL_MODEL_PLANS.items()}


@pytest.mark.slow  # k3-plan traces k3_full's layers on the meta device: minutes
def test_plan_of_the_full_model_on_a_large_layout(full_model_plans):
    p = _parsed(full_model_plans["large_layout"].result())
    params = p["parameters"]
    assert abs(params["total"] / 2.78e12 - 1) < 0.005
    assert abs(params["active"] / 104.2e9 - 1) < 0.005
    assert p["flops_per_token"]["forward"] == forward_flops_per_token(k3_full(), 8192)
    assert p["flops_per_token"]["training"] == training_flops_per_token(k3_full(), 8192)
    assert p["layout"]["world_size"] == 8 * 8 * 64
    mem = p["memory_per_gpu"]
    assert 0 < mem["total_gib"] < 141, mem  # fits an H200 with this layout
    assert mem["total_gib"] == pytest.approx(sum(v for k, v in mem.items() if k != "total_gib"))
    # Expert traffic per MoE layer and micro-batch: S = 8192 tokens, R = 64, L = 3584, bf16.
    traffic = p["expert_traffic"]
    assert (traffic["tokens_per_rank"], traffic["ranks"]) == (8192, 64)
    moonep = traffic["moonep_collective"]
    assert moonep["forward"]["token_all_gather"] == 63 * 8192 * 3584 * 2
    # Two all-to-alls, each relaying 1/64 of w1 [6144, 3584] and w2 [3584, 3072] per expert,
    # in bf16; their gradients in fp32.
    relayed = 6144 * 3584 // 64 + 3584 * 3072 // 64
    assert moonep["forward"]["copy_weights_all_to_all"] == 2 * 63 * 14 * relayed * 2
    assert moonep["backward"]["copy_grad_all_to_all"] == 2 * 63 * 14 * relayed * 4
    # The plan's counts (int32 [E]) and every entry's row (int32) and weight (fp32).
    assert moonep["forward"]["counts_all_gather"] == 63 * 896 * 4
    assert moonep["forward"]["routing_all_gather"] == 63 * 8192 * 16 * 8
    assert moonep["formula"]["token_all_gather"] == "(R-1)*S*L*a"
    assert traffic["dynamic"]["forward"]["dispatch_all_to_all"] == 8192 * 16 * 63 // 64 * 3584 * 2
    symm_mem = traffic["moonep_symm_mem"]  # worst cases: K = 16 < R - 1 = 63
    assert symm_mem["forward"]["token_exchange_max"] == 8192 * 16 * 3584 * 2
    # O(S*K) whatever R: each entry's token, row and weight to the rank computing it; the
    # copies by the relay's steps, at most its bytes.
    assert symm_mem["forward"]["routing_exchange_max"] == 8192 * 16 * 12
    assert symm_mem["forward"]["copy_weights_exchange_max"] == 2 * 63 * 14 * relayed * 2


def test_plan_rejects_an_expert_layout_that_does_not_divide():
    out = _run_plan("parallel.expert=3")
    assert out.returncode == 2 and "parallel.expert=3" in out.stderr


@pytest.mark.slow  # k3-plan traces k3_full's layers on the meta device: minutes
def test_plan_accepts_context_expert_and_pipeline_layouts_through_the_topology(
        full_model_plans):
    p = _parsed(full_model_plans["context_expert_pipeline"].result())
    lay = p["layout"]
    assert lay["world_size"] == 1024
    assert (lay["pipeline"], lay["data"], lay["data_replicate"], lay["context"], lay["tensor"],
            lay["expert"], lay["expert_tensor"], lay["expert_data"]) == (8, 8, 2, 2, 8, 32, 2, 2)


def test_plan_rejects_a_bad_layout_naming_the_field():
    out = _run_plan("parallel.data=4", "parallel.data_replicate=3", "parallel.data_shard=full")
    assert out.returncode == 2 and "parallel.data_replicate=3" in out.stderr, out.stderr


def test_plan_without_a_data_size_takes_the_fewest_ranks_that_hold_the_experts():
    lay = _plan("parallel.tensor=2", "parallel.expert=8")["layout"]
    assert (lay["world_size"], lay["data"], lay["expert_data"]) == (8, 4, 1)


def test_long_context_memory_fit_equals_the_trace():
    """The quadratic through three short traces is the traced count at a longer context."""
    from model.config import k3_tiny
    from train.plan import fitted_saved_after_forward, saved_after_forward

    for checkpointing in (False, True):
        assert (fitted_saved_after_forward(k3_tiny(), 8192, 1, 4, checkpointing)
                == saved_after_forward(k3_tiny(), 8192, 1, 4, checkpointing))


@pytest.mark.slow  # k3-plan traces k3_full's layers on the meta device: minutes
def test_long_context_plan_says_which_context_stages_fit_an_h200(full_model_plans):
    rows = _parsed(full_model_plans["long_context"].result())["long_context"]
    assert [r["seq_len"] for r in rows] == [8192, 65536, 262144, 1048576]
    totals = [r["total_gib"] for r in rows]
    assert totals == sorted(totals)
    # weights, gradients and optimizer states do not depend on the context; activations do
    assert len({round(r["total_gib"] - r["activations_gib"], 6) for r in rows}) == 1
    assert [r["fits_h200"] for r in rows] == [t * 2**30 <= 0.9 * 141e9 for t in totals]
    # 1M needs more CP here (248 GiB, 75 of them the collective MoonEP transport's [R*S, L]
    # buffers; PP8 x CP16 x TP8 x EP64 on symm_mem: 84 GiB, its dry run 90 GiB)
    assert [r["fits_h200"] for r in rows] == [True, True, True, False]


@pytest.mark.parametrize("module", ["train.plan", "slurm.submit"])
def test_hydra_errors_of_the_tools_exit_2_like_every_config_error(module):
    """An unknown config group option is Hydra's own error (exit 1 in Hydra); k3-plan and
    k3-submit report it with the project's config-error code, as k3-train does."""
    args = [sys.executable, "-m", module, "model=no_such_preset"]
    if module == "slurm.submit":
        args.append("--dry-run")
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "no_such_preset" in out.stderr


def test_data_parallel_bytes_per_collective_equal_the_hand_count():
    """k3-plan's bytes per data-parallel collective and step (what benchmarks/parallel_overhead.py
    counts on 4 gloo ranks, ratio 1.000 in RESULTS.md) against the count by hand on k3_tiny:
    N fp32 parameters, N_root outside the decoder layers, each MoE layer's [E, bins + 1] int64
    Quantile Balancing statistics."""
    import torch

    from model.config import k3_tiny
    from model.k3 import K3Model
    from parallel.topology import Topology
    from train.config import ParallelConfig
    from train.plan import data_parallel_bytes

    cfg = k3_tiny()
    model = K3Model(cfg)
    n = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    moe = model.moe_layers()
    qb = 4 * len(moe) * cfg.moe.num_experts * (moe[0].balancer.bins + 1)  # int32 counts
    full = {"all_gather": 4 * n + 4 * (n - root), "reduce_scatter": 4 * n}
    cases = {
        (4, 1, "none"): {"all_reduce": 4 * n},
        (4, 1, "optimizer"): {"all_reduce": 4 * n, "broadcast": 4 * n},
        (4, 2, "optimizer"): {"all_reduce": 4 * n, "broadcast": 4 * n},
        (4, 4, "optimizer"): {"all_reduce": 4 * n},  # one rank per replica: nothing to send
        (4, 1, "full"): full,
        (4, 2, "full"): {**full, "all_reduce": 2 * n},  # the halves over the replicas
    }
    with torch.device("meta"):
        meta = K3Model(cfg)
    for (data, replicate, shard), expected in cases.items():
        layout = Topology.from_config(ParallelConfig(data=data, data_replicate=replicate,
                                                     data_shard=shard), data, cfg)
        got = data_parallel_bytes(meta, layout)
        assert got == {**expected, "QB counts (int32)": qb}, (data, replicate, shard, got)
    one = Topology.from_config(ParallelConfig(tensor=2), 2, cfg)
    assert data_parallel_bytes(meta, one) == {}  # no data-parallel ranks
    printed = _plan("parallel.data=4", "parallel.data_replicate=2",
                    "parallel.data_shard=optimizer")["data_parallel_bytes"]
    assert printed == {"all_reduce": 4 * n, "broadcast": 4 * n, "QB counts (int32)": qb}
