"""What the `precision` config does to a run: autocast, MX quantisation-aware training and
Transformer Engine's FP8 linears."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from model.k3 import K3Model

from .te_backend import TEPlan, te_plan_for

log = logging.getLogger("k3.train")


@dataclass
class PrecisionRecipe:
    dtype: torch.dtype | None  # autocast dtype, None = the parameters' own (fp32, or fp64)
    device_type: str
    qat: bool
    te: TEPlan | None = None  # Transformer Engine FP8 linears (CUDA with TE installed)
    fp64: bool = False  # float64 parameters, and float64 compute in the model's fp32 islands

    @classmethod
    def build(cls, cfg, device: torch.device, model: K3Model) -> PrecisionRecipe:
        name = cfg.name
        if name == "auto":
            name = "bf16" if device.type == "cuda" else "fp32"
        dtype = torch.bfloat16 if name in ("bf16", "mxfp4_qat") and device.type == "cuda" else None
        if name == "bf16" and device.type != "cuda":
            dtype = torch.bfloat16  # explicit request: honour it on CPU too
        recipe = cls(dtype, device.type, qat=name == "mxfp4_qat", fp64=name == "fp64")
        if recipe.fp64:  # before the layout shards the parameters and the optimizer sees them
            model.to(torch.float64)
        if recipe.qat:
            from .qat import apply_mx_qat

            count = apply_mx_qat(model, scale_mode=cfg.qat_scale_mode)
            log.info("MX QAT: %d expert groups with MXFP4 weights and MXFP8 inputs", count)
        if cfg.te == "auto" and name in ("bf16", "mxfp4_qat"):
            recipe.te = te_plan_for(model, device)
        return recipe

    def describe(self) -> str:
        base = f"{self.dtype} autocast" if self.dtype is not None else "fp32"
        base = "fp64" if self.fp64 else base
        base += " + MXFP4/MXFP8 QAT" if self.qat else ""
        return base + (f" + TE {self.te.recipe_name}" if self.te is not None else "")

    @contextlib.contextmanager
    def autocast(self):
        """torch autocast to `dtype` (nothing for fp32) with TE's FP8 region inside it."""
        with contextlib.ExitStack() as stack:
            if self.dtype is not None:
                stack.enter_context(torch.autocast(self.device_type, dtype=self.dtype))
            if self.te is not None:
                stack.enter_context(self.te.autocast())
            yield
