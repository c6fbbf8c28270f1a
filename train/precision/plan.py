"""What the `precision` config does to a run: autocast, MX quantisation-aware training, and the
post-step MLA QK-Clip bookkeeping that needs the attention's max logits."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch

from model.k3 import K3Model

from ..distributed import all_reduce_max
from .te_backend import TEPlan, te_plan_for

log = logging.getLogger("k3.train")


@dataclass
class PrecisionPlan:
    dtype: torch.dtype | None  # autocast dtype, None = the parameters' own (fp32, or fp64)
    device_type: str
    qat: bool
    qk_clip: bool
    te: TEPlan | None = None  # Transformer Engine FP8 linears (CUDA with TE installed)
    fp64: bool = False  # float64 parameters, and float64 compute in the model's fp32 islands

    @classmethod
    def build(cls, cfg, device: torch.device, model: K3Model, qk_clip_tau: float = 0.0
              ) -> PrecisionPlan:
        name = cfg.name
        if name == "auto":
            name = "bf16" if device.type == "cuda" else "fp32"
        dtype = torch.bfloat16 if name in ("bf16", "mxfp4_qat") and device.type == "cuda" else None
        if name == "bf16" and device.type != "cuda":
            dtype = torch.bfloat16  # explicit request: honour it on CPU too
        plan = cls(dtype, device.type, qat=name == "mxfp4_qat", qk_clip=qk_clip_tau > 0,
                   fp64=name == "fp64")
        if plan.fp64:  # before the layout shards the parameters and the optimizer sees them
            model.to(torch.float64)
        if plan.qat:
            from .qat import apply_mx_qat

            count = apply_mx_qat(model, scale_mode=cfg.qat_scale_mode)
            log.info("MX QAT: %d expert groups with MXFP4 weights and MXFP8 inputs", count)
        if cfg.te == "auto" and name in ("bf16", "mxfp4_qat"):
            plan.te = te_plan_for(model, device)
        for mla in model.mla_layers():
            mla.record_max_logit = plan.qk_clip
        return plan

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

    def end_step(self, model: K3Model, tau: float, updated: bool, clip=None, group=None
                 ) -> dict[str, float]:
        """After the optimizer step (or a skipped one): applies QK-Clip to every MLA layer whose
        recorded max logit exceeded tau, resets the records, returns figures to log.
        `clip(mla, tau) -> (max logit, clipped heads)` is the layout's QK-Clip
        (parallel.apply.ParallelPlan.qk_clip_); default: whole heads on every rank, max logits
        reduced over `group` (None: the world; under pipeline parallelism the ranks of one
        stage, the others hold other layers)."""
        if not self.qk_clip:
            return {}
        clip = clip or functools.partial(_clip_whole_heads, group=group)
        max_logits, clipped = [], []
        for mla in model.mla_layers():
            if mla.max_logit is None:
                continue
            if updated:
                top, count = clip(mla, tau)
                clipped.append(count)
            else:
                top = mla.max_logit.max()
            max_logits.append(top)
            mla.max_logit = None
        if not max_logits:
            return {}
        row = {"attn/max_logit": float(torch.stack(max_logits).max())}
        if clipped:
            row["attn/clipped_heads"] = int(torch.stack(clipped).sum())
        return row


def _clip_whole_heads(mla, tau: float, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    from train.optim.qk_clip import qk_clip_

    all_reduce_max(mla.max_logit, group)  # every data-parallel replica clips the same heads
    count = qk_clip_(mla.q_b.weight, mla.kv_b.weight, mla.max_logit, tau, mla.num_heads,
                     mla.nope, mla.rope, mla.v_dim)
    return mla.max_logit.max(), count
