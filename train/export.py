"""`k3-export`: a training checkpoint -> `model.safetensors` + `config.json` for inference.

    k3-export --run-dir RUN [--checkpoint RUN/checkpoints/step_N] [--out DIR] [--dtype bf16|fp32]

The model config (and the precision the run trained with) comes from the config Hydra saved
for the run, `<run_dir>/.hydra/config.yaml`; the weights from the model half of the newest
complete checkpoint (the optimizer state is never read). Tensors written:
- routed-expert weights (GroupedExperts `w1`, `w2`) as MXFP4 in the gpt-oss layout:
  `<name>.blocks` uint8 (..., K/32, 16) and `<name>.scales` uint8 E8M0 (..., K/32), blocks along
  the reduction (last) dimension, scale mode from the run's `precision.qat_scale_mode`;
- router weights and Quantile Balancing biases in fp32: the router runs in fp32 and its top-k
  choice is discontinuous, so a rounded bias or score can move tokens to other experts;
- every other parameter and persistent buffer in `--dtype` (bf16 by default).
A run trained with MX QAT exported in fp32 reloads to exactly the network QAT trained: the
stored expert weights are the fake-quantised values its forward used, and `load_exported`
restores the MXFP8 fake quantisation of the expert GEMM inputs recorded in `config.json`.

The whole model is materialised on the host by one process; the full-size K3 needs a sharded,
streaming export instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from model.config import K3Config
from model.k3 import K3Model
from model.moe.experts import GroupedExperts
from train.checkpoint import Checkpointer
from train.checkpoint_integrity import check, safe_dcp_load
from train.precision.mx import SCALE_MODES, MXTensor, quantize_mx
from train.precision.qat import MXFakeQuant

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MX_BLOCK = 32
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Name suffixes kept in fp32 whatever --dtype says (see the module docstring).
FP32_SUFFIXES = (".router.weight", ".balancer.bias")
# config.json keys that are not K3Config fields.
EXPORT_KEYS = ("quantization", "export")


@dataclass
class RunPrecision:
    """What the run's precision config means for the export."""

    qat: bool  # precision.name == mxfp4_qat: expert GEMM inputs were MXFP8 fake-quantised
    scale_mode: str  # MX scale exponent rounding (precision.qat_scale_mode)


def k3_config_from_dict(values: dict) -> K3Config:
    """A validated K3Config from plain nested values (a saved Hydra config or config.json)."""
    merged = OmegaConf.merge(OmegaConf.structured(K3Config), values)
    return OmegaConf.to_object(merged).validate()


def read_run_config(run_dir: Path) -> tuple[K3Config, RunPrecision]:
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run's model config is read from the "
                                f"config Hydra saves in <run_dir>/.hydra")
    saved = OmegaConf.load(path)
    model = OmegaConf.to_container(saved.model, resolve=True)
    precision = saved.get("precision") or {}
    return k3_config_from_dict(model), RunPrecision(
        qat=precision.get("name") == "mxfp4_qat",
        scale_mode=precision.get("qat_scale_mode") or "floor")


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of a k3-train run."""
    checkpoint = Checkpointer(Path(run_dir) / "checkpoints", keep_last=1).latest()
    if checkpoint is None:
        raise FileNotFoundError(f"no complete checkpoint under {Path(run_dir) / 'checkpoints'}")
    return Path(checkpoint)


def load_checkpoint_model(cfg: K3Config, checkpoint: Path) -> K3Model:
    """K3Model on the CPU with the model half of a Checkpointer checkpoint (DCP reads only the
    keys it is asked for, so the optimizer state stays on disk); checksums verified first."""
    check(Path(checkpoint))
    model = K3Model(cfg)
    state = {"model": get_model_state_dict(model)}
    safe_dcp_load(state, Path(checkpoint))
    set_model_state_dict(model, state["model"])
    return model


def expert_weight_names(model: torch.nn.Module) -> list[str]:
    return [f"{prefix}.{name}" for prefix, module in model.named_modules()
            if isinstance(module, GroupedExperts) for name in ("w1", "w2")]


def exported_tensors(model: K3Model, dtype: torch.dtype,
                     scale_mode: str) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of `model` as written to the safetensors file."""
    mxfp4 = set(expert_weight_names(model))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if name in mxfp4:
            if tensor.shape[-1] % MX_BLOCK:
                raise ValueError(f"{name} {tuple(tensor.shape)}: MXFP4 needs the reduction "
                                 f"(last) dimension to be a multiple of {MX_BLOCK}")
            packed = quantize_mx(tensor.float(), "e2m1", MX_BLOCK, scale_mode).pack()
            out[f"{name}.blocks"] = packed.blocks.contiguous()
            out[f"{name}.scales"] = packed.scales.contiguous()
        elif not tensor.is_floating_point():
            out[name] = tensor.contiguous()
        elif name.endswith(FP32_SUFFIXES):
            out[name] = tensor.float().contiguous()
        else:
            out[name] = tensor.to(dtype).contiguous()
    return out


def quantization_entry(model: K3Model, dtype_name: str, run: RunPrecision) -> dict:
    activations = None
    if run.qat:
        activations = {"format": "mxfp8", "element": "e4m3", "block_size": MX_BLOCK,
                       "scale_mode": run.scale_mode,
                       "applies_to": "inputs of the routed-expert GEMMs (fake-quantised)"}
    return {
        "weights": {"format": "mxfp4", "element": "e2m1", "scale": "e8m0",
                    "block_size": MX_BLOCK, "scale_mode": run.scale_mode, "axis": -1,
                    "layout": "gpt-oss: <name>.blocks uint8 (..., K/32, 16), two codes per byte, "
                              "even element in the low nibble; <name>.scales uint8 (..., K/32)",
                    "tensors": expert_weight_names(model)},
        "activations": activations,
        "fp32_tensors": [n for n in model.state_dict() if n.endswith(FP32_SUFFIXES)],
        "dtype": dtype_name,
    }


def export_checkpoint(run_dir: str | Path, out: str | Path | None = None,
                      checkpoint: str | Path | None = None, dtype: str = "bf16",
                      scale_mode: str | None = None) -> Path:
    """Writes model.safetensors and config.json into `out` (default <run_dir>/export) from
    `checkpoint` (default: the latest complete one under <run_dir>/checkpoints). `scale_mode`
    overrides the run's precision.qat_scale_mode. Returns the output directory."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: must be one of {sorted(EXPORT_DTYPES)}")
    if scale_mode is not None and scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r} is invalid: must be one of {SCALE_MODES}")
    run_dir = Path(run_dir)
    cfg, run = read_run_config(run_dir)
    if scale_mode is not None:
        run = dataclasses.replace(run, scale_mode=scale_mode)
    checkpoint = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run_dir)
    model = load_checkpoint_model(cfg, checkpoint)
    tensors = exported_tensors(model, EXPORT_DTYPES[dtype], run.scale_mode)
    out = Path(out) if out is not None else run_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    step = json.loads((checkpoint / "COMPLETE").read_text()).get("step")
    config = {**dataclasses.asdict(cfg),
              "quantization": quantization_entry(model, dtype, run),
              "export": {"format_version": FORMAT_VERSION, "checkpoint": checkpoint.name,
                         "step": step}}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_exported(path: str | Path, device: str | torch.device = "cpu") -> K3Model:
    """The exported model in eval mode with fp32 parameters: MXFP4 expert weights dequantised
    (exactly), and the MXFP8 input fake quantisation of the expert GEMMs restored when the run
    trained with it."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    version = config.get("export", {}).get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path / CONFIG_FILE}: export format_version {version!r}, this code "
                         f"reads {FORMAT_VERSION}")
    quant = config["quantization"]
    cfg = k3_config_from_dict({k: v for k, v in config.items() if k not in EXPORT_KEYS})
    tensors = load_file(str(path / WEIGHTS_FILE))
    for name in quant["weights"]["tensors"]:
        mx = MXTensor.from_packed(tensors.pop(f"{name}.blocks"), tensors.pop(f"{name}.scales"),
                                  quant["weights"]["element"])
        tensors[name] = mx.dequantize(torch.float32)
    model = K3Model(cfg)
    model.load_state_dict(tensors, strict=True)
    activations = quant.get("activations")
    if activations is not None:
        input_quant = MXFakeQuant(activations["element"], activations["block_size"],
                                  activations["scale_mode"])
        # Collected first: assigning a module registers a child, which must not happen mid-walk.
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        for module in experts:
            module.input_fake_quant = input_quant
    return model.to(device).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3-export", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path,
                        help="the training run directory (holds .hydra/ and checkpoints/)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a step_* checkpoint directory (default: the latest complete one)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: <run-dir>/export)")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="bf16",
                        help="dtype of the high-precision tensors")
    parser.add_argument("--scale-mode", choices=SCALE_MODES, default=None,
                        help="MX scale rounding (default: the run's precision.qat_scale_mode)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.out, args.checkpoint, args.dtype,
                                args.scale_mode)
    except (FileNotFoundError, ValueError) as e:
        print(f"k3-export: {e}", file=sys.stderr)
        return 2
    size_mb = (out / WEIGHTS_FILE).stat().st_size / 2**20
    print(f"k3-export: wrote {out / WEIGHTS_FILE} ({size_mb:.1f} MiB) and {out / CONFIG_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
