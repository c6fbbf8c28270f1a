"""Pre-train -> SFT with MXFP4 QAT -> export, as a user runs it: k3-train on the sample, then
`k3-train stage=sft_qat init_from=<that run>` on the bundled chat set (which k3-data prepares
with the pre-training tokenizer), then k3-export. The SFT run starts from the pre-trained
weights (its first loss is the pre-trained model's on chat data, not a random model's), records
where it started, learns (the validation loss falls), and its export reloads to exactly the
logits of the QAT forward it trained."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from data_pipeline.config import StageConfig
from data_pipeline.loader import K3DataLoader
from data_pipeline.pipeline import manifest_path
from tests.helpers.train_helpers import REPO, train_cmd, train_env
from train.export import (
    export_checkpoint,
    latest_checkpoint,
    load_checkpoint_model,
    load_exported,
    read_run_config,
)
from train.precision.qat import apply_mx_qat

SFT_STAGE = StageConfig(seq_len=512, micro_batch_size=4, global_batch_size=4, seed=1234)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, sample_data_dir):
    root = tmp_path_factory.mktemp("sft")
    pretrained = root / "pretrain"
    out = subprocess.run(train_cmd(pretrained, sample_data_dir, "steps=15", "eval.every=0",
                                   "logging.wandb=false"),
                         cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sft = root / "sft"
    out = subprocess.run(train_cmd(sft, root / "chat_data", "stage=sft_qat",
                                   f"init_from={pretrained}", "epochs=2",
                                   f"data.tokenizer.path={sample_data_dir / 'tokenizer.json'}"),
                         cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return pretrained, sft, root / "chat_data"


def test_sft_starts_from_the_pretrained_weights_and_learns(sft_run):
    pretrained, sft, chat_data = sft_run
    rows = _metrics(sft)
    assert rows[0]["init/source"] == f"checkpoint {latest_checkpoint(pretrained).resolve()}"
    # The first step's loss is the pre-trained model's on the first chat batch (before any
    # update; QAT's MXFP4 forward both times).
    cfg, _ = read_run_config(pretrained)
    model = load_checkpoint_model(cfg, latest_checkpoint(pretrained))
    apply_mx_qat(model)
    loader = K3DataLoader.from_stage(manifest_path(chat_data), SFT_STAGE)
    with torch.no_grad():
        out = model(next(iter(loader)))
    assert rows[0]["loss"] == pytest.approx(float(out.loss_sum / out.num_tokens), rel=1e-4)
    assert rows[-1]["step"] == 2 * loader.steps_per_epoch  # epochs=2
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) >= 2 and val[-1] < val[0] - 0.3, val


def test_the_qat_sft_export_reloads_to_the_same_logits(sft_run, tmp_path):
    _, sft, chat_data = sft_run
    cfg, run_precision = read_run_config(sft)
    assert run_precision.qat
    trained = load_checkpoint_model(cfg, latest_checkpoint(sft)).eval()
    apply_mx_qat(trained, scale_mode=run_precision.scale_mode)
    export = export_checkpoint(sft, tmp_path / "export", dtype="fp32")
    config = json.loads((export / "config.json").read_text())
    assert config["quantization"]["weights"]["format"] == "mxfp4"
    assert config["quantization"]["activations"]["format"] == "mxfp8"
    batch = next(iter(K3DataLoader.from_stage(manifest_path(chat_data), SFT_STAGE)))
    with torch.no_grad():
        expected = trained(batch, return_logits=True).logits
        got = load_exported(export)(batch, return_logits=True).logits
    assert torch.equal(got, expected)


def test_k3_generate_chat_prompts_the_fine_tuned_model_as_it_was_trained(sft_run):
    """chat=true: the prompt is a user turn with the template's generation prompt, and the
    end of the assistant's turn stops the completion; a QAT run's model has its MXFP4 forward."""
    from data_pipeline.chat import K3_CHAT_TEMPLATE, encode_prompt
    from data_pipeline.tokenizer import RESERVED_TOKENS, load_tokenizer
    from train.generate import sample
    from train.generate_cli import GenerateConfig, load_model, run

    _, sft, _ = sft_run
    question = "Where does the river Lundruten flow?"
    (record,) = run(GenerateConfig(run_dir=str(sft), chat=True, prompt=question,
                                   max_new_tokens=12))
    model, tokenizer_path = load_model(str(sft), None, None)
    # A QAT run generates with the forward it trained: MXFP4 experts.
    assert all(moe.experts.weight_fake_quant is not None for moe in model.moe_layers())
    tokenizer = load_tokenizer(tokenizer_path)
    ids = encode_prompt([{"role": "user", "content": question}], tokenizer, K3_CHAT_TEMPLATE)
    stops = [RESERVED_TOKENS.index("<eod>"), RESERVED_TOKENS.index("<|im_end|>")]
    expected = sample(model, [ids], 12, stop_token_ids=stops)[0]
    assert record["tokens"] == expected.tokens
    assert record["finish_reason"] == expected.finish_reason
