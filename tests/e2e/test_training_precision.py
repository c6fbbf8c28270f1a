"""Precision and optimizer variants of a real training run: MXFP4/MXFP8 QAT stays close to the
fp32 run, and Per-Head Muon trains (its advantage over AdamW is a benchmark figure, not a test)."""

import pytest

from tests.helpers.train_helpers import FAST, losses, run_train

pytestmark = pytest.mark.slow
STEPS = 20


def _final_loss(run_dir) -> float:
    by_step = losses(run_dir)
    return sum(by_step[s] for s in range(STEPS - 2, STEPS + 1)) / 3


def test_mxfp4_qat_trains_within_5_percent_of_fp32(tmp_path, sample_data_dir):
    common = (*FAST, f"steps={STEPS}", "checkpoint.every=0", "checkpoint.save_at_end=false",
              "logging.wandb=false")
    run_train(tmp_path / "fp32", sample_data_dir, *common, "precision=fp32")
    out = run_train(tmp_path / "qat", sample_data_dir, *common, "precision=mxfp4_qat")
    assert "MXFP4/MXFP8 QAT" in out.stdout + out.stderr
    fp32, qat = _final_loss(tmp_path / "fp32"), _final_loss(tmp_path / "qat")
    first = losses(tmp_path / "fp32")[1]
    assert fp32 < 0.9 * first, "the fp32 reference did not learn"
    assert abs(qat - fp32) <= 0.05 * fp32, (qat, fp32)


def test_muon_trains_and_prints_its_parameter_groups(tmp_path, sample_data_dir):
    out = run_train(tmp_path / "muon", sample_data_dir, *FAST, f"steps={STEPS}", "optim=muon",
                    "checkpoint.every=0", "logging.wandb=false")
    log = out.stdout + out.stderr
    assert "Muon" in log and "row-block heads" in log and "AdamW" in log
    by_step = losses(tmp_path / "muon")
    assert _final_loss(tmp_path / "muon") < 0.9 * by_step[1]
