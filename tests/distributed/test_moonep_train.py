"""k3-train with expert parallelism (parallel.expert=2 on two torchrun ranks) against one rank:
the same losses on the same data across a checkpoint and resume. The layouts beside it (EP with
FSDP2, ZeRO-1, HSDP, TP, the pipeline) and their checkpoint moves are checked in process by
test_moonep_model.py, test_combined_layouts.py and test_checkpoint_layouts.py; the dynamic
dispatch's results by test_moonep_layer.py."""

import subprocess
import sys

import pytest

from tests.helpers.train_helpers import (
    FAST,
    REPO,
    free_port,
    losses,
    run_train,
    train_cmd,
    train_env,
)

NO_CHECKPOINTS = ["checkpoint.every=0", "checkpoint.save_at_end=false"]


def _torchrun(ranks: int, run, data_dir, *overrides: str) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                f"--master-port={free_port()}"]
    out = subprocess.run(launcher + train_cmd(run, data_dir)[1:] + [*FAST, *overrides],
                         cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _assert_same_losses(reference: dict, got: dict, what: str) -> None:
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4]
    for step in reference:
        assert abs(reference[step] - got[step]) <= 1e-5 * abs(reference[step]), (
            what, step, reference[step], got[step])


@pytest.mark.timeout(900)
def test_two_rank_expert_parallel_matches_one_rank(tmp_path, sample_data_dir):
    one = tmp_path / "one"
    run_train(one, sample_data_dir, *FAST, "steps=4", *NO_CHECKPOINTS)
    reference = losses(one)
    # MoonEP stops after a checkpoint at step 2 and resumes from it (sharded experts saved as
    # their logical tensors).
    run = tmp_path / "moonep"
    for part in (["steps=2", "checkpoint.every=2"], ["steps=4", "checkpoint.every=2"]):
        out = _torchrun(2, run, sample_data_dir, *part, "parallel.expert=2")
    assert "resumed from" in out.stdout + out.stderr
    _assert_same_losses(reference, losses(run), "moonep")
