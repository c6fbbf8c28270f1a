"""`k3-generate` as a user runs it: from a k3-train run's checkpoint with the sample data's
tokenizer, and from a k3-export directory with a prompts file, each completion the one the
engine gives the same weights in-process; refusals named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from data_pipeline.tokenizer import EOD_ID, encode_text, load_tokenizer
from model.config import k3_tiny
from model.errors import ConfigError
from model.k3 import K3Model
from tests.helpers import REPO
from tests.helpers.train_helpers import train_env
from train.checkpoint import Checkpointer
from train.config import TrainConfig
from train.export import export_checkpoint
from train.generate import sample
from train.generate_cli import GenerateConfig, run

PROMPTS = ["The river", "A small house stood"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, sample_data_dir):
    """A run directory as k3-train leaves it (its config, naming the sample data, and a
    checkpoint) with weights made non-trivial."""
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    model = K3Model(k3_tiny(), seed=3)
    with torch.no_grad():
        for balancer in model.balancers():
            balancer.bias.normal_(0, 0.05)
    cfg = TrainConfig(model=model.cfg, run_dir=str(run_dir))
    cfg.data.output_dir = str(sample_data_dir)
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    Checkpointer(run_dir / "checkpoints", keep_last=1).save(
        5, model, [torch.optim.AdamW(model.parameters())], rank_state={"loader": {}})
    return run_dir, model


def _k3_generate(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.generate_cli", *overrides], cwd=REPO,
                          env=train_env(), capture_output=True, text=True, timeout=300)


def test_a_runs_checkpoint_completes_a_prompt_as_the_engine_does(run_dir, sample_data_dir):
    run, model = run_dir
    out = _k3_generate(f"run_dir={run}", f"prompt={PROMPTS[0]}", "max_new_tokens=6",
                       "stop_tokens=[]")
    assert out.returncode == 0, out.stderr[-2000:]
    (record,) = [json.loads(line) for line in out.stdout.splitlines()]
    tokenizer = load_tokenizer(sample_data_dir / "tokenizer.json")
    expected = sample(model.eval(), [encode_text(tokenizer, PROMPTS[0])], 6)[0]
    assert record["tokens"] == expected.tokens and record["finish_reason"] == "length"
    assert record["logprobs"] == pytest.approx(expected.logprobs, abs=1e-5)
    assert record["completion"] == tokenizer.decode(expected.tokens)
    assert record["prompt"] == PROMPTS[0]


def test_an_export_completes_a_prompts_file_into_jsonl(run_dir, sample_data_dir, tmp_path):
    """Sampled at temperature 1 with the end-of-document stop: one record per prompt, in order,
    each ending at <eod> or the budget; the output file is never overwritten."""
    run, _ = run_dir
    export = export_checkpoint(run, tmp_path / "export", dtype="fp32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    output = tmp_path / "completions.jsonl"
    args = [f"export_dir={export}", f"tokenizer={sample_data_dir / 'tokenizer.json'}",
            f"prompts_file={prompts}", f"output={output}", "max_new_tokens=8",
            "temperature=1.0", "seed=7"]
    out = _k3_generate(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    for r in records:
        assert len(r["tokens"]) == len(r["logprobs"]) <= 8
        assert (r["finish_reason"] == "stop") == (r["tokens"][-1] == EOD_ID)
        assert r["finish_reason"] == "stop" or len(r["tokens"]) == 8
        assert all(lp <= 0 for lp in r["logprobs"])
    again = _k3_generate(*args)
    assert again.returncode == 2 and "exists" in again.stderr
    assert [json.loads(line) for line in output.read_text().splitlines()] == records


def test_a_draft_run_speculates_the_same_greedy_completion(run_dir):
    """draft_run_dir (here the run itself: every draft kept, rounds of k + 1 tokens) gives the
    completion plain decoding gives."""
    run_path = str(run_dir[0])
    plain, fast = (run(GenerateConfig(run_dir=run_path, prompt=PROMPTS[1], max_new_tokens=7,
                                      stop_tokens=[], **draft))
                   for draft in ({}, dict(draft_run_dir=run_path, speculative_tokens=3)))
    assert fast[0]["tokens"] == plain[0]["tokens"] and len(plain[0]["tokens"]) == 7
    assert fast[0]["logprobs"] == pytest.approx(plain[0]["logprobs"], abs=1e-5)


def test_a_draft_trained_with_another_tokenizer_is_refused(run_dir, sample_data_dir, tmp_path):
    run_path = run_dir[0]
    other = tmp_path / "draft"
    shutil.copytree(run_path, other)
    tokenizer = json.loads((sample_data_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # two words' ids swapped: other ids, same words
    a, b = [w for w in vocab if w.isalpha() and len(w) > 3][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "other.json").write_text(json.dumps(tokenizer))
    config = OmegaConf.load(other / ".hydra" / "config.yaml")
    config.data.tokenizer.path = str(tmp_path / "other.json")
    OmegaConf.save(config, other / ".hydra" / "config.yaml")
    with pytest.raises(ConfigError, match="draft_run_dir=.* was trained with tokenizer"):
        run(GenerateConfig(run_dir=str(run_path), draft_run_dir=str(other), prompt="a"))


@pytest.mark.parametrize("fields, message", [
    (dict(), "exactly one of run_dir"),
    (dict(export_dir="x"), "export_dir needs tokenizer"),
    (dict(run_dir="RUN", prompt="a", prompts_file="p.jsonl"), "exactly one of prompt"),
    (dict(run_dir="RUN", prompt="a", stop_tokens=["<nope>"]), "'<nope>' is not a token"),
    (dict(run_dir="RUN", prompt="a", draft_run_dir="RUN", speculative_tokens=0),
     "speculative_tokens=0 is invalid"),
    (dict(run_dir="RUN", prompt="a", draft_run_dir="RUN", draft_export_dir="x"),
     "at most one of draft_run_dir"),
])
def test_refusals_name_the_field(run_dir, fields, message):
    fields = {k: str(run_dir[0]) if v == "RUN" else v for k, v in fields.items()}
    with pytest.raises(ConfigError, match=message):
        run(GenerateConfig(**fields))
