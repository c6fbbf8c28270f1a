"""k3-train as a user meets it when things go wrong: a kill and a damaged checkpoint,
every configuration mistake stopped at start-up with exit code 2, and the held-out
split the validation loss is measured on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import wandb

from data_pipeline.dedup import load_duplicates
from data_pipeline.validation_split import is_held_out
from tests.helpers.train_helpers import (
    FAST,
    REPO,
    read_metrics,
    run_train,
    train_cmd,
    train_env,
    wait_for,
)
from train.config import LoggingConfig
from train.metrics import MetricsLogger
from train.run_log import PANELS
from train.wandb_records import branch_point, read_history, run_history, run_id

SECRET = "k3-test-secret-7f3a9c41"


def _logged(run, step: int) -> bool:
    path = run / "metrics.jsonl"
    return path.exists() and f'{{"step": {step},' in path.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_then_damaged_checkpoint_resumes_from_the_last_good_one_recording_each_step_once(
        tmp_path, sample_data_dir):
    run = tmp_path / "run"
    args = (*FAST, "steps=8", "checkpoint.every=2", "checkpoint.keep_last=5", "eval.every=3",
            "logging.wandb=true", "logging.plot=true")
    env = train_env(WANDB_API_KEY=SECRET)
    proc = subprocess.Popen(train_cmd(run, sample_data_dir, *args), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _logged(run, 5), 600, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000004"
    shard = ckpts / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = slice(len(data) // 2, len(data) // 2 + 16)
    # Same size, damaged inside: inverted bytes (zeros could match a zero-filled state tensor).
    data[middle] = bytes(b ^ 0xFF for b in data[middle])
    shard.write_bytes(bytes(data))

    out = run_train(run, sample_data_dir, *args, env_extra={"WANDB_API_KEY": SECRET})
    console = out.stdout + out.stderr
    assert "step_00000004 failed verification" in console and "__0_0.distcp" in console
    assert "resumed from" in console and "step_00000002" in console
    assert (ckpts / "rejected" / "step_00000004" / "__0_0.distcp").is_file()  # kept

    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert "__0_0.distcp" in rows[2]["resume/rejected_checkpoints"]  # first row after resume
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6, 8]
    assert rows[-1]["eta_s"] == 0.0 and "ETA" in console
    for _, series, _ in PANELS:  # every panel of training.png has its figures
        for key, _ in series:
            assert any(isinstance(r.get(key), float) for r in rows), key
    assert (run / "training.png").stat().st_size > 1000

    # The killed process's offline W&B file holds what wandb flushed before the kill (often
    # nothing); the resumed one rewinds the run to the checkpoint's step and goes on from there.
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    wandb_id = (run / "wandb_run_id").read_text()
    assert run_id(files[1]) == wandb_id and branch_point(files[1]) == (wandb_id, 2)
    resumed = read_history(files[1])
    assert [h["_step"] for h in resumed] == list(range(3, 9))
    assert {h["_step"]: h["loss"] for h in resumed} == pytest.approx(
        {r["step"]: r["loss"] for r in rows[2:]}, rel=1e-6)
    assert "__0_0.distcp" in resumed[0]["resume/rejected_checkpoints"]
    steps = [h["_step"] for h in run_history(files)]
    assert steps == sorted(set(steps)) and steps[-6:] == list(range(3, 9))

    assert SECRET not in console
    for path in run.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_wandb_and_metrics_hold_each_step_once_after_a_resume(tmp_path):
    """The W&B run got to step 6 (streamed online, or flushed) before the process died; the
    resume from step 4 logs steps 5 to 8 again."""
    cfg = LoggingConfig(wandb=True, wandb_mode="offline")
    first = MetricsLogger(tmp_path, 0, cfg, 8, resume_step=0, run_config={})
    for step in range(1, 7):
        first.log(_row(step, loss=10.0 + step))
    first.finish(None)
    time.sleep(1.1)  # W&B names an offline run's folder by the second it started in
    second = MetricsLogger(tmp_path, 0, cfg, 8, resume_step=4, run_config={})
    for step in range(5, 9):
        second.log(_row(step, loss=float(step)))
    second.finish(None)
    wandb.teardown()  # the W&B service writes the run file on its own time: wait for it
    expected = {1: 11.0, 2: 12.0, 3: 13.0, 4: 14.0, 5: 5.0, 6: 6.0, 7: 7.0, 8: 8.0}
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {r["step"]: r["loss"] for r in rows} == expected
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    history = run_history(files)
    assert [h["_step"] for h in history] == list(range(1, 9))
    assert {h["_step"]: h["loss"] for h in history} == expected


def _row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e3,
            "mfu": 0.1, "mfu_peak_source": "test", "peak_mem_gb": 1.0}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("override, message", [
    ("+optim.lrr=1e-3", "optim.lrr (did you mean optim.lr?)"),
    ("+model.moe.top_kk=3", "model.moe.top_kk"),
    ("model=k3_huge", "k3_huge"),  # Hydra's own error
    ("optim.betas=[0.9]", "optim.betas=[0.9] is invalid: must be two numbers"),
    ("model.vocab_size=1000", "model.vocab_size=1000 is invalid: the data's tokenizer has 2048"),
    ("data.tokenizer.vocab_size=4096", "data.tokenizer.vocab_size=4096 is invalid: must be <= "
                                       "model.vocab_size=2048"),
    ("model.pad_token_id=7", "model.pad_token_id=7 is invalid: the data uses id 0 for <pad>"),
    (f"+slurm.env.WANDB_API_KEY={SECRET}", "slurm.env.WANDB_API_KEY is invalid"),
    ("eval.batches=0", "eval.batches=0 is invalid"),
])
def test_every_config_error_stops_at_start_up_with_exit_code_2(tmp_path, sample_data_dir,
                                                              override, message):
    run = tmp_path / "run"
    out = run_train(run, sample_data_dir, override, check=False, timeout=300)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert message in out.stderr, out.stderr[-2000:]
    assert SECRET not in out.stderr + out.stdout
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    saved = [p for p in run.rglob("*") if p.is_file()] if run.exists() else []
    assert not [p for p in saved if SECRET.encode() in p.read_bytes()]  # .hydra/overrides.yaml


def test_credential_names_are_told_apart_from_ordinary_environment_names():
    from train.startup_checks import SECRET_NAME

    for name in ("WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "APIKEY"):
        assert SECRET_NAME.search(name), name
    for name in ("TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "OMP_NUM_THREADS", "WANDB_PROJECT"):
        assert not SECRET_NAME.search(name), name


# Published SHA-256 digests (FIPS 180-2 test vectors): a document is held out when the first 8
# bytes of the digest of its text (then its media), read big-endian, fall below fraction * 2**64.
SHA256_PREFIX = {"": 0xE3B0C44298FC1C14, "abc": 0xBA7816BF8F01CFEA}
# is_held_out("caption", [bytes([i])], 0.5) for i = 0..15, from SHA-256 of b"caption" + bytes([i])
# computed once with hashlib: the same on every run, machine and process.
CAPTION_HELD_AT_HALF = [False] * 6 + [True, False, True, True, False, False] + [True] * 4
CAPTION_06_00_PREFIX = 0x71B772114464BEE7  # SHA-256(b"caption\x06\x00")[:8], hashlib, once


def test_held_out_documents_are_chosen_by_content_hash():
    """The split is a pure function of the content: SHA-256 of the text (then the media bytes)
    against the fraction, the answers pinned from the digest's definition rather than compared
    with another call of the same function (a per-process salted hash would pass that); about
    `fraction` of random documents, none at 0 and all at 1."""
    for text, prefix in SHA256_PREFIX.items():
        position = prefix / 2**64  # 0.8894... for "", 0.7283... for "abc"
        assert is_held_out(text, [], position + 1e-9), text
        assert not is_held_out(text, [], position - 1e-9), text
    assert [is_held_out("caption", [bytes([i])], 0.5) for i in range(16)] == CAPTION_HELD_AT_HALF
    # The media enter after the text, blob after blob: b"caption\x06\x00" whichever way split.
    position = CAPTION_06_00_PREFIX / 2**64  # 0.4442...
    for media in ([b"\x06\x00"], [b"\x06", b"\x00"]):
        assert is_held_out("caption", media, position + 1e-9), media
        assert not is_held_out("caption", media, position - 1e-9), media
    rng = np.random.default_rng(0)
    texts = [rng.bytes(32).hex() for _ in range(20000)]
    held = [is_held_out(t, [], 0.05) for t in texts]
    assert 0.045 < np.mean(held) < 0.055
    assert not any(is_held_out(t, [], 0.0) for t in texts)
    assert all(is_held_out(t, [], 1.0) for t in texts)


def test_the_sample_dataset_holds_out_a_disjoint_validation_split(sample_data_dir):
    manifest = json.loads((sample_data_dir / "manifest.json").read_text())

    def ids(entries) -> set[str]:
        found = set()
        for source in entries:
            for shard in source["shards"]:
                path = sample_data_dir / f"{shard['prefix']}.docs.jsonl"
                found |= {json.loads(line)["id"] for line in path.read_text().splitlines()}
        return found

    train_ids, held_ids = ids(manifest["sources"]), ids(manifest["validation"])
    assert held_ids and not train_ids & held_ids
    # Every kept text document whose content hashes below the fraction is held out, no other.
    dups = load_duplicates(str(sample_data_dir / "work"))
    expected, text_ids = set(), set()
    for path in sorted((sample_data_dir / "work" / "curated").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            if doc["id"] in dups or doc["metadata"]["modality"] != "text":
                continue
            text_ids.add(doc["id"])
            if is_held_out(doc["text"], [], 0.05):
                expected.add(doc["id"])
    assert expected and held_ids & text_ids == expected
    summary = json.loads((sample_data_dir / "summary.json").read_text())
    assert summary["balanced"] and summary["output"]["validation"]["docs"] == len(held_ids)
