"""On-policy post-training as a user runs it: `k3-train stage=rl` on the bundled task set, its
episodes paused every 4 tokens (partial rollouts), killed with SIGKILL in the middle of its
second iteration and started again: the resumed run continues the paused episodes from its
checkpoint and ends exactly as an uninterrupted run (the same metrics rows, episodes in flight
with their tokens, log-probabilities and weight versions, and weights). Then `stage=mopd` with
that run as the teacher of every domain logs the reverse KL (a domain without a teacher:
tests/unit/train/test_posttrain_config.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.train_helpers import read_metrics, run_train
from train.export import latest_checkpoint, load_checkpoint_model, read_run_config
from train.rank_state import rank_file

pytestmark = pytest.mark.timeout(900)

TIMINGS = {"rollout_time_s", "train_time_s", "step_time_s", "peak_mem_gb"}


def _common(sample_data_dir) -> list[str]:
    return ["init_from=null", f"rollout.tokenizer={sample_data_dir / 'tokenizer.json'}",
            "steps=3", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "rollout.max_new_tokens=8", "rollout.iteration_tokens=4", "checkpoint.every=1",
            "logging.wandb=false", "logging.plot=false"]


def _pool(run_dir) -> dict:
    return json.loads(rank_file(latest_checkpoint(run_dir), 0).read_text())["posttrain"]


@pytest.fixture(scope="module")
def rl_runs(tmp_path_factory, sample_data_dir):
    root = tmp_path_factory.mktemp("posttrain")
    common = ["stage=rl", *_common(sample_data_dir)]
    whole, killed = root / "whole", root / "killed"
    run_train(whole, sample_data_dir, *common)
    out = run_train(killed, sample_data_dir, *common, check=False,
                    env_extra={"K3_FAULT_RANK_FAILURE": "0:1:kill"})
    assert out.returncode == -9, out.stderr[-3000:]
    interrupted = _pool(killed)  # the checkpoint of the first iteration
    run_train(killed, sample_data_dir, *common)
    return whole, killed, interrupted


def test_a_run_killed_mid_iteration_resumes_its_paused_episodes_exactly(rl_runs):
    whole, killed, interrupted = rl_runs
    # The kill came after the first iteration's checkpoint: every episode paused at 4 tokens.
    assert [len(e["tokens"]) for e in interrupted["episodes"]] == [4] * 4
    assert all(e["pauses"] == 1 and e["finish_reason"] is None
               for e in interrupted["episodes"])
    rows = {r["step"]: {k: v for k, v in r.items() if k not in TIMINGS}
            for r in read_metrics(whole)}
    again = {r["step"]: {k: v for k, v in r.items() if k not in TIMINGS}
             for r in read_metrics(killed)}
    assert rows == again and sorted(rows) == [0, 1, 2, 3]
    # The greedy evaluation: before the first step (not again on resuming) and at the end.
    assert [s for s in rows if "eval_reward" in rows[s]] == [0, 3]
    # Episodes of 8 tokens, 4 an iteration: the groups train at step 2; step 3 pauses anew.
    assert [rows[s]["paused_episodes"] for s in (1, 2, 3)] == [4, 0, 4]
    assert rows[2]["finished_episodes"] == 4 and rows[2]["resumed_episodes"] == 4
    assert _pool(whole) == _pool(killed)
    cfg, _ = read_run_config(whole)
    a = load_checkpoint_model(cfg, latest_checkpoint(whole)).state_dict()
    b = load_checkpoint_model(cfg, latest_checkpoint(killed)).state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_mopd_distils_from_a_teacher_per_domain(rl_runs, tmp_path, sample_data_dir):
    whole, _, _ = rl_runs
    teacher = f"[{{path:{whole},domains:[math,string,code]}}]"
    run_train(tmp_path / "mopd", sample_data_dir, "stage=mopd", *_common(sample_data_dir),
              f"mopd.teachers={teacher}", "mopd.kl=full")
    trained = [r for r in read_metrics(tmp_path / "mopd") if "kl" in r]
    assert trained and all(r["kl"] > 0 for r in trained)
