"""k3-train with expert parallelism (parallel.expert=2 on two torchrun ranks) against one rank:
the same losses on the same data, with the MoonEP and the dynamic dispatch, across a
checkpoint and resume."""

import subprocess
import sys

import pytest

from tests.train_helpers import FAST, REPO, free_port, losses, run_train, train_cmd, train_env

NO_CHECKPOINTS = ["checkpoint.every=0", "checkpoint.save_at_end=false"]


@pytest.mark.timeout(600)
def test_two_rank_expert_parallel_matches_one_rank(tmp_path, sample_data_dir):
    one = tmp_path / "one"
    run_train(one, sample_data_dir, *FAST, "steps=4", *NO_CHECKPOINTS)
    reference = losses(one)
    # MoonEP stops after a checkpoint at step 2 and resumes from it (sharded experts saved as
    # their logical tensors); the dynamic dispatch runs straight through.
    runs = {"moonep": [["steps=2", "checkpoint.every=2"], ["steps=4", "checkpoint.every=2"]],
            "dynamic": [["steps=4", *NO_CHECKPOINTS]]}
    for dispatch, parts in runs.items():
        run = tmp_path / dispatch
        for part in parts:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        f"--master-port={free_port()}"]
            cmd = launcher + train_cmd(run, sample_data_dir)[1:] + [
                *FAST, *part, "parallel.expert=2", f"parallel.expert_dispatch={dispatch}"]
            out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
        if dispatch == "moonep":
            assert "resumed from" in out.stdout + out.stderr
        got = losses(run)
        assert sorted(got) == sorted(reference) == [1, 2, 3, 4]
        for step in reference:
            assert abs(reference[step] - got[step]) <= 1e-5 * abs(reference[step]), (
                dispatch, step, reference[step], got[step])
