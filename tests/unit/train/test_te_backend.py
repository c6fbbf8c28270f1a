"""Transformer Engine backend (train/precision/te_backend.py).

On CPU: the recipe table, which modules TE would run, and that no CPU code path even tries to
import transformer_engine. The tests marked `gpu_te` need CUDA and an importable TE
(scripts/gpu_check.sh runs them); they replace the linears for real and compare with bf16.
"""

import dataclasses
import importlib.util
import sys

import pytest
import torch
from torch import nn

from model.batch import K3Batch
from model.config import k3_tiny, replace
from model.k3 import K3Model
from tests.helpers.tolerances import rel_rms
from train.config import PrecisionConfig
from train.precision.recipe import PrecisionRecipe
from train.precision.te_backend import (
    FLOAT8_BLOCK,
    MXFP8,
    RECIPE_ALIGNMENT,
    _checkpoint_neutral_linear,
    apply_te_backend,
    select_recipe,
    te_import_error,
    te_target_modules,
)


def _te_usable():
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


gpu_te = pytest.mark.skipif(not _te_usable(), reason="needs CUDA and transformer_engine")


class _ImportSpy:
    """A meta-path finder that records every attempt to import transformer_engine (and lets the
    normal finders answer), so a test fails even where TE is not installed."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformer_engine":
            self.attempts.append(name)
        return None


@pytest.fixture
def import_spy():
    spy = _ImportSpy()
    sys.meta_path.insert(0, spy)
    yield spy
    sys.meta_path.remove(spy)


@pytest.mark.parametrize("capability, recipe", [
    ((7, 0), None), ((8, 0), None), ((8, 9), None),  # no FP8 block scaling before Hopper
    ((9, 0), FLOAT8_BLOCK),  # Hopper
    ((10, 0), MXFP8), ((10, 3), MXFP8), ((11, 0), MXFP8),  # Blackwell data centre
    ((12, 0), FLOAT8_BLOCK),  # Blackwell workstation: TE has no MXFP8 GEMMs there
])
def test_select_recipe(capability, recipe):
    assert select_recipe(capability) == recipe


def test_target_modules_on_tiny():
    model = K3Model(k3_tiny())
    names = te_target_modules(model)
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is nn.Linear for n in names)
    per_layer = {i: {n.split(".", 2)[2] for n in names if n.startswith(f"layers.{i}.")}
                 for i in range(model.cfg.num_layers)}
    moe_linears = {"mlp.latent_down", "mlp.latent_up", "mlp.shared.gate_up", "mlp.shared.down"}
    kda = {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.gate_proj", "attn.o_proj"}
    # MLA kv_a is 64 -> 16 + 8 = 24 outputs: not a multiple of 16, so TE cannot take it.
    mla = {"attn.q_a", "attn.q_b", "attn.kv_b", "attn.gate_proj", "attn.o_proj"}
    assert per_layer[0] == kda | {"mlp.gate_up", "mlp.down"}  # dense first layer
    assert per_layer[1] == kda | moe_linears
    assert per_layer[3] == mla | moe_linears
    assert per_layer[7] == mla | moe_linears
    assert all(n.startswith("layers.") for n in names)  # no lm_head, no vision
    assert not [n for n in names if "router" in n or "experts" in n or "decay" in n
                or "beta" in n]
    # MXFP8's 32-alignment also drops MLA's q_b (32 -> 2 * 24 = 48 outputs).
    assert "layers.3.attn.q_b" not in te_target_modules(model, alignment=32)
    assert "layers.3.attn.q_a" in te_target_modules(model, alignment=32)


@pytest.mark.parametrize("precision", ["bf16", "mxfp4_qat", "auto", "fp32"])
def test_cpu_precision_plan_never_imports_te(import_spy, precision):
    cfg = k3_tiny()  # expert_intermediate 64: MX QAT needs w2's reduction dim in blocks of 32
    model = K3Model(replace(cfg, moe=dataclasses.replace(cfg.moe, expert_intermediate=64)))
    before = {n: type(m) for n, m in model.named_modules()}
    plan = PrecisionRecipe.build(PrecisionConfig(precision), torch.device("cpu"), model)
    assert plan.te is None
    assert import_spy.attempts == []
    assert not any(name.startswith("transformer_engine") for name in sys.modules)
    assert {n: type(m) for n, m in model.named_modules()
            if "fake_quant" not in n} == before  # QAT adds only its quantiser children
    with plan.autocast():
        out = model(K3Batch(*(torch.randint(1, 100, (1, 32)),) * 2, torch.tensor([0, 32])))
    assert torch.isfinite(out.loss_sum)


def test_bad_recipe_name_fails_before_importing_te(import_spy):
    with pytest.raises(ValueError, match="recipe_name"):
        apply_te_backend(K3Model(k3_tiny()), "nvfp4")
    assert import_spy.attempts == []


@pytest.mark.skipif(_te_usable(), reason="transformer_engine is importable here")
def test_import_error_is_reported_without_te():
    assert "transformer_engine" in te_import_error()


def test_checkpoint_neutral_subclass_drops_extra_state():
    """TE modules add `<name>._extra_state` to state dicts (their FP8 metadata); the subclass
    apply_te_backend uses must not, so checkpoints keep the nn.Linear keys. Shown on a plain
    Linear subclass that declares extra state the way TE's base module does."""

    class LinearWithExtraState(nn.Linear):
        def get_extra_state(self):
            return {"scale": 1.0}

        def set_extra_state(self, state):
            raise AssertionError("must not be called")

    assert "_extra_state" in LinearWithExtraState(4, 4).state_dict()
    neutral = _checkpoint_neutral_linear(LinearWithExtraState)(4, 4)
    assert list(neutral.state_dict()) == ["weight", "bias"]
    neutral.load_state_dict(nn.Linear(4, 4).state_dict())  # strict: no missing extra state


@gpu_te
def test_te_linears_keep_names_weights_and_track_bf16():
    device = torch.device("cuda")
    model = K3Model(k3_tiny()).to(device)
    recipe = select_recipe(torch.cuda.get_device_capability(device))
    if recipe is None:
        pytest.skip("no FP8 recipe on this GPU")
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    batch = K3Batch(*(torch.randint(1, 2000, (2, 64), device=device),) * 2,
                    torch.tensor([0, 64, 128], device=device))
    bf16 = PrecisionRecipe(torch.bfloat16, "cuda", qat=False)
    with torch.no_grad(), bf16.autocast():
        expected = model.eval()(batch, return_logits=True).logits

    plan = apply_te_backend(model, recipe)
    assert plan.replaced == te_target_modules(K3Model(k3_tiny()), RECIPE_ALIGNMENT[recipe])
    state = model.state_dict()
    assert list(state) == list(reference)  # same names, no `_extra_state`
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    fp8 = PrecisionRecipe(torch.bfloat16, "cuda", qat=False, te=plan)
    with torch.no_grad(), fp8.autocast():
        got = model(batch, return_logits=True).logits
    # E4M3 keeps 3 mantissa bits: each operand carries a relative rounding error of RMS about
    # 2^-3 / sqrt(12) = 0.036, so one GEMM output is off by about 0.05 relative RMS; 0.1 allows
    # for a few layers of propagation. (Not yet measured on a GPU.)
    assert rel_rms(expected, got) <= 0.1
    model.train()
    with fp8.autocast():
        loss = model(batch).loss_sum
    loss.backward()
    replaced_weights = [p for n, p in model.named_parameters()
                        if n.rsplit(".", 1)[0] in plan.replaced]
    assert len(replaced_weights) == len(plan.replaced)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in replaced_weights)
