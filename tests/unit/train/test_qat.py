"""MX QAT (train/precision/qat.py): STE fake quantisers and the experts' seams.

The grouped-experts module (model/moe/experts.py) is written elsewhere; `_StubExperts` below
has the same seams (`weight_fake_quant`, `input_fake_quant`, stacked w1 [E, 2I, L] and
w2 [E, L, I] with the reduction dimension last) and applies them where the real one must.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.static_shapes import assert_static, record
from train.precision.mx import fake_quantize_mx, quantize_mx
from train.precision.qat import (
    MXFakeQuant,
    apply_mx_qat,
    mxfp4_weight_fake_quant,
    mxfp8_input_fake_quant,
)

E, L, I, M = 3, 64, 32, 6
E2M1_VALUES = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


class _StubExperts(nn.Module):
    """Every token through every expert, SwiGLU; enough to exercise the seams."""

    def __init__(self, seam=None):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, L) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, L, I) * 0.1)
        self.weight_fake_quant = seam
        self.input_fake_quant = seam

    def forward(self, x):
        wq = self.weight_fake_quant or (lambda w: w)
        xq = self.input_fake_quant or (lambda a: a)
        gate, up = torch.einsum("ml,efl->emf", xq(x), wq(self.w1)).chunk(2, dim=-1)
        return torch.einsum("emi,eli->ml", xq(F.silu(gate) * up), wq(self.w2))


class _OnlyWeightSeam(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight_fake_quant = None


def test_weight_ste_forward_is_fake_quant_and_gradient_is_identity():
    w = torch.randn(E, 2 * I, L, requires_grad=True)
    y = mxfp4_weight_fake_quant(w)
    assert torch.equal(y, fake_quantize_mx(w.detach(), "e2m1"))
    upstream = torch.randn_like(y)
    y.backward(upstream)
    assert torch.equal(w.grad, upstream)


def test_input_ste_keeps_dtype_and_passes_gradient():
    x = torch.randn(M, L, dtype=torch.bfloat16, requires_grad=True)
    y = mxfp8_input_fake_quant(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fake_quantize_mx(x.detach(), "e4m3"))
    upstream = torch.randn_like(y)
    y.backward(upstream)
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, upstream)


def test_fake_quantised_weights_sit_on_the_block_grid():
    """Each block of 32 along the reduction dim holds at most 15 distinct values (16 codes,
    +-0 equal), each an E2M1 value times the block's power-of-two scale."""
    w = torch.randn(E, 2 * I, L) * torch.logspace(-3, 3, E).reshape(E, 1, 1)
    blocks = mxfp4_weight_fake_quant(w).reshape(E, 2 * I, L // 32, 32)
    scale = torch.exp2(quantize_mx(w, "e2m1").scales.double() - 127).unsqueeze(-1)
    on_grid = blocks.double() / scale
    assert set(on_grid.abs().unique().tolist()) <= E2M1_VALUES
    for block in blocks.reshape(-1, 32):
        assert block.unique().numel() <= 15
    assert (on_grid.abs().amax(-1) > 3).all()  # floor scale: every block uses its top binade


def test_apply_mx_qat_sets_both_seams_and_counts():
    model = nn.Sequential(nn.Linear(L, L), _StubExperts(),
                          nn.Sequential(_StubExperts(nn.Identity())), _OnlyWeightSeam())
    assert apply_mx_qat(model) == 2
    for experts in (model[1], model[2][0]):
        assert isinstance(experts.weight_fake_quant, MXFakeQuant)
        assert (experts.weight_fake_quant.fmt, experts.input_fake_quant.fmt) == ("e2m1", "e4m3")
        modes = (experts.weight_fake_quant.scale_mode, experts.input_fake_quant.scale_mode)
        assert modes == ("floor", "floor")
    assert model[3].weight_fake_quant is None
    assert not any(isinstance(m, MXFakeQuant) for m in model[0].modules())
    assert apply_mx_qat(model, scale_mode="rceil") == 2  # re-application replaces the seams
    assert model[1].weight_fake_quant.scale_mode == model[1].input_fake_quant.scale_mode == "rceil"


def test_apply_mx_qat_rejects_unknown_scale_mode():
    with pytest.raises(ValueError, match="scale_mode"):
        apply_mx_qat(_StubExperts(), scale_mode="even")


def test_qat_experts_forward_and_straight_through_gradients():
    """Forward equals the experts run on fake-quantised weights and inputs; the master weights
    receive exactly the gradient the fake-quantised weights would (STE). The reference keeps the
    STE for the hidden activation (checked on its own above): plain fake_quantize_mx has no
    useful gradient."""
    experts = _StubExperts()
    apply_mx_qat(experts)
    x = torch.randn(M, L)
    out = experts(x)
    out.square().sum().backward()

    w1q = fake_quantize_mx(experts.w1.detach(), "e2m1").requires_grad_()
    w2q = fake_quantize_mx(experts.w2.detach(), "e2m1").requires_grad_()
    gate, up = torch.einsum("ml,efl->emf", fake_quantize_mx(x, "e4m3"), w1q).chunk(2, dim=-1)
    h = mxfp8_input_fake_quant(F.silu(gate) * up)
    ref = torch.einsum("emi,eli->ml", h, w2q)
    ref.square().sum().backward()
    assert torch.equal(out, ref)
    assert torch.equal(experts.w1.grad, w1q.grad) and torch.equal(experts.w2.grad, w2q.grad)
    plain = _StubExperts()
    plain.load_state_dict(experts.state_dict())
    assert not torch.equal(plain(x), out)  # the seams changed the numbers


def test_qat_hot_path_is_static_and_sync_free():
    experts = _StubExperts()
    apply_mx_qat(experts)
    x_plain = torch.randn(M, L)
    x_odd = x_plain.clone()
    x_odd[0] = 0.0
    x_odd[1, :32] = 1e-40

    def step(x):
        experts.zero_grad(set_to_none=True)  # same grad allocation in both runs
        experts(x).sum().backward()

    assert_static(record(step, x_plain), record(step, x_odd))
