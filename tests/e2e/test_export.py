"""k3-export (train/export.py): a real Checkpointer checkpoint -> safetensors + config.json ->
load_exported, checked tensor by tensor and on the forward pass.

The model is k3_tiny (expert dims multiples of 32, so MX blocks of 32 fit the experts'
reduction dimensions); one test uses expert_intermediate 48, which cannot be blocked.
"""

import copy
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from model.batch import K3Batch
from model.config import k3_tiny, replace
from model.k3 import K3Model
from tests.helpers import REPO
from train.checkpoint import Checkpointer
from train.config import PrecisionConfig, TrainConfig
from train.export import export_checkpoint, load_exported
from train.precision.mx import fake_quantize_mx, quantize_mx
from train.precision.qat import MXFakeQuant, apply_mx_qat

# DCP warns that it runs without a process group: these tests are single-process on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
FP32_KEPT = (".router.weight", ".balancer.bias")


def _tiny_cfg(expert_intermediate: int = 64):
    cfg = k3_tiny()
    return replace(cfg, moe=dataclasses.replace(cfg.moe, expert_intermediate=expert_intermediate))


def _is_expert_weight(name):
    return ".experts.w" in name


def _randomise(model):
    """Non-trivial values everywhere, QB router biases included (they start at zero)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn_like(tensor) * 0.05)
    return model


def _save_run(run_dir, model, precision=None, step=7):
    """A run directory as k3-train leaves it: .hydra/config.yaml and a real checkpoint."""
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True)
    train_cfg = TrainConfig(model=model.cfg, precision=precision or PrecisionConfig(),
                            run_dir=str(run_dir))
    (hydra / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(train_cfg)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Checkpointer(run_dir / "checkpoints", keep_last=2).save(step, model, [opt],
                                                            rank_state={"loader": {}})


def _batch(cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, cfg.vocab_size, (2, 32), generator=g)
    return K3Batch(tokens, tokens.roll(-1, dims=1), torch.tensor([0, 20, 32, 64]))


def _logits(model, batch):
    with torch.no_grad():
        return model.eval()(batch, return_logits=True).logits


def _expected(name, tensor, dtype):
    """What the export promises for one original tensor, after dequantising on reload."""
    if _is_expert_weight(name):
        return fake_quantize_mx(tensor, "e2m1")
    if name.endswith(FP32_KEPT):
        return tensor
    return tensor.to(dtype).float()


@pytest.fixture
def tiny_run(tmp_path):
    model = _randomise(K3Model(_tiny_cfg()))
    _save_run(tmp_path / "run", model)
    return tmp_path / "run", model


@pytest.mark.parametrize("dtype_name, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_round_trip_weights_and_forward(tiny_run, tmp_path, dtype_name, dtype):
    run_dir, model = tiny_run
    out = export_checkpoint(run_dir, tmp_path / "export", dtype=dtype_name)
    loaded = load_exported(out)

    original = model.state_dict()
    reloaded = loaded.state_dict()
    assert reloaded.keys() == original.keys()
    assert any(name.endswith(".balancer.bias") for name in original)
    for name, tensor in original.items():
        assert torch.equal(reloaded[name], _expected(name, tensor, dtype)), name

    # Reference: the original model with the expert weights fake-quantised in its forward (the
    # QAT seam) and every other tensor rounded as the export rounds it. Both networks hold the
    # same values and run the same fp32 ops, so the logits agree bit for bit; that is stricter
    # than the 5e-3 relative RMS of DESIGN 5 and catches a wrong rebuild (config, buffers, seams).
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            if not _is_expert_weight(name):
                tensor.copy_(_expected(name, tensor, dtype))
    for experts in [m.experts for m in reference.moe_layers()]:
        experts.weight_fake_quant = MXFakeQuant("e2m1")
    batch = _batch(model.cfg)
    assert torch.equal(_logits(loaded, batch), _logits(reference, batch))
    # ...and the quantisation is real: the unquantised model differs.
    assert not torch.allclose(_logits(model, batch), _logits(loaded, batch))


def test_file_layout_and_config(tiny_run, tmp_path):
    run_dir, model = tiny_run
    out = export_checkpoint(run_dir, tmp_path / "export")
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())

    w1 = model.layers["1"].mlp.experts.w1.detach()  # [E, 2I, L]
    packed = quantize_mx(w1, "e2m1").pack()
    blocks = tensors["layers.1.mlp.experts.w1.blocks"]
    scales = tensors["layers.1.mlp.experts.w1.scales"]
    e, rows, k = w1.shape
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (e, rows, k // 32, 16) and scales.shape == (e, rows, k // 32)
    assert torch.equal(blocks, packed.blocks) and torch.equal(scales, packed.scales)
    assert "layers.1.mlp.experts.w1" not in tensors
    assert tensors["layers.1.attn.q_proj.weight"].dtype == torch.bfloat16
    assert tensors["layers.1.mlp.router.weight"].dtype == torch.float32
    assert tensors["layers.1.mlp.balancer.bias"].dtype == torch.float32
    # Non-persistent buffers (QB statistics) are not part of the model file.
    assert not any("_histogram" in name or "last_load" in name for name in tensors)

    quant = config["quantization"]
    num_moe = len(model.moe_layers())
    assert len(quant["weights"]["tensors"]) == 2 * num_moe
    assert quant["weights"]["scale_mode"] == "floor" and quant["activations"] is None
    assert config["export"] == {"format_version": 1, "checkpoint": "step_00000007", "step": 7}
    assert config["moe"]["expert_intermediate"] == 64 and config["name"] == "k3_tiny"


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_qat_model_is_exported_losslessly_in_fp32(tmp_path, scale_mode):
    """A few QAT steps move the fp32 master weights off the MXFP4 grid; the fp32 export must
    still reproduce exactly the logits the QAT forward computes (MXFP8 inputs included)."""
    model = K3Model(_tiny_cfg())
    apply_mx_qat(model, scale_mode=scale_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(_batch(model.cfg, seed=10 + step)).loss_sum.backward()
        opt.step()
        opt.zero_grad()
    _save_run(tmp_path / "run", model, PrecisionConfig("mxfp4_qat", scale_mode))

    out = export_checkpoint(tmp_path / "run", tmp_path / "export", dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["activations"]["scale_mode"] == scale_mode
    loaded = load_exported(out)
    batch = _batch(model.cfg)
    assert torch.equal(_logits(loaded, batch), _logits(model, batch))


def test_cli_matches_function(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    cli_out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "train.export", "--run-dir", str(run_dir), "--out", str(cli_out),
         "--dtype", "fp32"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in result.stdout
    fn_out = export_checkpoint(run_dir, tmp_path / "fn", dtype="fp32")
    cli_tensors = load_file(str(cli_out / "model.safetensors"))
    fn_tensors = load_file(str(fn_out / "model.safetensors"))
    assert cli_tensors.keys() == fn_tensors.keys()
    assert all(torch.equal(cli_tensors[k], fn_tensors[k]) for k in fn_tensors)
    assert (json.loads((cli_out / "config.json").read_text())
            == json.loads((fn_out / "config.json").read_text()))


def test_export_picks_the_latest_checkpoint(tiny_run, tmp_path):
    run_dir, model = tiny_run
    with torch.no_grad():
        model.head.output.weight.mul_(2)
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(run_dir / "checkpoints", keep_last=2).save(9, model, [opt], {"loader": {}})
    out = export_checkpoint(run_dir, tmp_path / "export", dtype="fp32")
    assert json.loads((out / "config.json").read_text())["export"]["step"] == 9
    assert torch.equal(load_exported(out).head.output.weight, model.head.output.weight)
    older = export_checkpoint(run_dir, tmp_path / "older", dtype="fp32",
                              checkpoint=run_dir / "checkpoints" / "step_00000007")
    assert torch.equal(load_exported(older).head.output.weight, model.head.output.weight / 2)


def test_export_refuses_unblockable_expert_weights(tmp_path):
    model = K3Model(_tiny_cfg(48))  # w2 [E, L, 48]: its reduction dim is not 32-blockable
    _save_run(tmp_path / "run", model)
    with pytest.raises(ValueError, match=r"experts\.w2 .*multiple of 32"):
        export_checkpoint(tmp_path / "run", tmp_path / "export")


def test_cli_reports_a_missing_run_config(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "train.export", "--run-dir", str(tmp_path)], cwd=REPO,
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert ".hydra" in result.stderr
