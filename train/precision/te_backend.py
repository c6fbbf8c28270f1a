"""Transformer Engine backend (GPU only): FP8 GEMMs for the language model's dense projections.

Which recipe runs where (TE's support matrix):
  compute capability 10.x, 11.x (Blackwell data centre): MXFP8BlockScaling (E4M3, E8M0 scale
      per 32 elements, the OCP MX format);
  9.x (Hopper) and 12.x (Blackwell workstation, no MXFP8 GEMMs in TE): Float8BlockScaling
      (DeepSeek-V3-style 1x128 / 128x128 blocks with fp32 scales; listed from the TE 2.4
      docs on, absent in 2.0; TE needs CUDA >= 12.9 for it);
  below 9.0: no FP8 recipe, bf16 autocast only.
TE has no MXFP4 recipe: the routed experts keep their fake-quant QAT path (train/precision/qat.py)
on every device. The TE modules replace the decoder's nn.Linear projections (attention, latent
down/up, shared experts, dense MLP) under the same attribute names, so parameter names,
optimizer groups and checkpoints do not change. Not replaced: the router (fp32, a parameter),
the routed experts, the LM head, the vision encoder, and the KDA gate projections (see
`te_target_modules`).

`transformer_engine` is imported only by the functions below, and `te_plan_for` returns before
any import on a non-CUDA device: importing this module or planning a CPU run never touches it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger("k3.train")

MXFP8 = "mxfp8_block_scaling"
FLOAT8_BLOCK = "float8_block_scaling"
# Both GEMM dimensions of a TE FP8 linear must be multiples of these (TE's
# get_align_size_for_quantization: 32 for MXFP8, 16 otherwise).
RECIPE_ALIGNMENT = {MXFP8: 32, FLOAT8_BLOCK: 16}
# KDA's beta and decay projections feed the recurrence's gates: a quantisation error there is
# exponentiated and compounds through the state over the whole sequence, and the GEMMs are thin
# (H outputs, rank 128), so FP8 would gain nothing.
RECURRENCE_GATES = frozenset({"beta_proj", "decay_down", "decay_up"})
# Path components that must never run through TE (routers stay fp32, routed experts stay MXFP4).
EXCLUDED_PARTS = frozenset({"router", "experts"})


class TEUnavailable(RuntimeError):
    """Transformer Engine cannot run the chosen recipe here; the message says why."""


def select_recipe(capability: tuple[int, int]) -> str | None:
    """The FP8 recipe for a CUDA compute capability (major, minor); None: bf16 only."""
    major = capability[0]
    if 10 <= major < 12:
        return MXFP8
    if major == 9 or major >= 12:
        return FLOAT8_BLOCK
    return None


def te_target_modules(model: nn.Module, alignment: int = 16) -> list[str]:
    """Qualified names of the decoder-layer nn.Linear modules TE should run: every projection
    under `layers.` except the KDA gate projections, anything inside a router or the routed
    experts, and linears whose in/out features are not multiples of `alignment`."""
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not name.startswith("layers."):
            continue
        parts = name.split(".")
        if parts[-1] in RECURRENCE_GATES or EXCLUDED_PARTS.intersection(parts):
            continue
        if module.in_features % alignment or module.out_features % alignment:
            continue
        names.append(name)
    return names


def te_import_error() -> str | None:
    """None when `transformer_engine.pytorch` imports, else why not."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # noqa: BLE001 - a broken install raises OSError, RuntimeError, ...
        return f"{type(e).__name__}: {e}"
    return None


def build_recipe(recipe_name: str) -> Any:
    from transformer_engine.common import recipe

    class_name = {MXFP8: "MXFP8BlockScaling", FLOAT8_BLOCK: "Float8BlockScaling"}[recipe_name]
    if not hasattr(recipe, class_name):
        raise TEUnavailable(f"this Transformer Engine has no recipe.{class_name} "
                            f"(TE 2.0 lacks Float8BlockScaling, the 2.4 docs list it)")
    return getattr(recipe, class_name)()  # defaults: E4M3 in forward and backward


@functools.cache
def _checkpoint_neutral_linear(te_linear: type) -> type:
    class CheckpointNeutralLinear(te_linear):
        """te.pytorch.Linear without `_extra_state` in its state dict. The block-scaling
        recipes compute every scale from the current tensor and keep no history, so there is
        nothing to save, and checkpoints stay exactly those of the nn.Linear model (a run can
        resume with or without TE)."""

        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

    return CheckpointNeutralLinear


def _te_copy(linear: nn.Linear, te_linear_cls: type) -> nn.Module:
    weight = linear.weight
    replacement = te_linear_cls(linear.in_features, linear.out_features,
                                bias=linear.bias is not None, params_dtype=weight.dtype,
                                device=weight.device)
    with torch.no_grad():
        replacement.weight.copy_(weight)
        if linear.bias is not None:
            replacement.bias.copy_(linear.bias)
    replacement.weight.requires_grad_(weight.requires_grad)
    return replacement.train(linear.training)


@dataclass
class TEPlan:
    recipe_name: str
    recipe: Any  # a transformer_engine.common.recipe.Recipe
    replaced: list[str]  # qualified names of the modules now run by TE
    te: Any  # the transformer_engine.pytorch module

    def autocast(self):
        """TE's FP8 region for this recipe: `te.pytorch.autocast` (its deprecated older name
        `fp8_autocast` where that is all there is). Enter it inside torch.autocast: TE takes
        its activation dtype from there."""
        if hasattr(self.te, "autocast"):
            return self.te.autocast(enabled=True, recipe=self.recipe)
        return self.te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)

    def check_supported(self) -> None:
        """Raises TEUnavailable with TE's reason when this GPU / CUDA cannot run the recipe
        (TE checks support when an FP8 region is entered)."""
        try:
            with self.autocast():
                pass
        except (AssertionError, RuntimeError) as e:
            raise TEUnavailable(str(e)) from e

    def describe(self) -> str:
        version = getattr(importlib.import_module("transformer_engine"), "__version__", "?")
        return (f"Transformer Engine {version}: {self.recipe_name} on {len(self.replaced)} "
                f"linears (attention, latent, shared experts, dense MLP); router, routed "
                f"experts, LM head and vision stay as they were")


def apply_te_backend(model: nn.Module, recipe_name: str) -> TEPlan:
    """Replaces `te_target_modules(model)` by te.pytorch.Linear modules holding the same weights
    (the model must already be on its CUDA device) and returns the plan whose `autocast()` runs
    them in FP8. Checks first that the recipe runs here; raises TEUnavailable if not, with the
    model untouched. Build the optimizer afterwards: the parameters are new tensors."""
    if recipe_name not in RECIPE_ALIGNMENT:
        raise ValueError(f"recipe_name={recipe_name!r} is invalid: must be one of "
                         f"{sorted(RECIPE_ALIGNMENT)}")
    te = importlib.import_module("transformer_engine.pytorch")
    plan = TEPlan(recipe_name, build_recipe(recipe_name), [], te)
    plan.check_supported()
    linear_cls = _checkpoint_neutral_linear(te.Linear)
    plan.replaced = te_target_modules(model, RECIPE_ALIGNMENT[recipe_name])
    for name in plan.replaced:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, _te_copy(getattr(parent, attr), linear_cls))
    return plan


def te_plan_for(model: nn.Module, device: torch.device) -> TEPlan | None:
    """The TE backend for a model already on `device`, or None (logged with the reason) when
    the device is not CUDA, TE does not import, or no FP8 recipe runs on this GPU."""
    if device.type != "cuda":
        return None
    error = te_import_error()
    if error is not None:
        log.info("Transformer Engine not used (%s): bf16 GEMMs", error)
        return None
    capability = torch.cuda.get_device_capability(device)
    recipe_name = select_recipe(capability)
    if recipe_name is None:
        log.info("Transformer Engine not used: no FP8 recipe for compute capability %d.%d",
                 *capability)
        return None
    try:
        plan = apply_te_backend(model, recipe_name)
    except TEUnavailable as e:
        log.warning("Transformer Engine not used: %s cannot run here: %s", recipe_name, e)
        return None
    log.info("%s", plan.describe())
    return plan
