"""SiTU-GLU (SPEC 5, Eq. 12): bounded by beta_gate * beta_up, SwiGLU to first order near 0."""

import pytest
import torch

from model.activations import situ_glu, situ_glu_halves, situ_glu_reference, swiglu
from model.mlp import SiTUGLUMLP
from tests.helpers.tolerances import assert_close_rms
from train.saved_activations import SavedBytes


def _grid() -> torch.Tensor:
    """Dense around 0, wide up to +-1e4, plus the extremes fp32 can hold."""
    near = torch.linspace(-10.0, 10.0, 401)
    wide = torch.linspace(-1e4, 1e4, 401)
    extremes = torch.tensor([-3e38, -1e30, -1e4, 1e4, 1e30, 3e38])
    return torch.cat([near, wide, extremes])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_bounded_by_100_everywhere(dtype):
    values = _grid()
    gate, up = torch.meshgrid(values, values, indexing="ij")
    random_gate, random_up = torch.randn(2, 100_000) * torch.logspace(-3, 4, 100_000)
    for g, u in ((gate, up), (random_gate, random_up)):
        out = situ_glu(g.to(dtype), u.to(dtype))
        assert out.dtype == dtype
        assert torch.isfinite(out).all()
        assert out.abs().max() <= 100.0
    # The bound is attained (tanh and sigmoid saturate): the caps are 4 and 25, not smaller.
    assert situ_glu(torch.tensor([1e4]), torch.tensor([1e4])).item() == pytest.approx(100.0)
    assert situ_glu(torch.tensor([1e4]), torch.tensor([-1e4])).item() == pytest.approx(-100.0)


def test_matches_swiglu_to_first_order_near_zero():
    # 4 tanh(g/4) = g (1 - g^2/48 + ...), 25 tanh(u/25) = u (1 - u^2/1875 + ...): the relative
    # gap to SwiGLU is g^2/48 + u^2/1875 + O(x^4) <= 0.0214 x^2 for |g|, |u| <= x.
    gaps = []
    for scale in (1e-1, 1e-2, 1e-3):
        gate, up = (torch.rand(2, 10_000, dtype=torch.float64) * 2 - 1) * scale
        gap = ((situ_glu(gate, up) - swiglu(gate, up)) / swiglu(gate, up)).abs().max().item()
        assert gap <= 0.0215 * scale**2, f"|x| <= {scale}: relative gap {gap:.3e}"
        gaps.append(gap)
    # Second order: each 10x smaller input shrinks the gap about 100x.
    assert gaps[1] < gaps[0] / 50 and gaps[2] < gaps[1] / 50, gaps


def test_computed_in_fp32_for_bf16_inputs():
    gate, up = (torch.randn(2, 4096) * 8).to(torch.bfloat16)
    expected = situ_glu(gate.float(), up.float()).to(torch.bfloat16)
    assert torch.equal(situ_glu(gate, up), expected)


def test_custom_betas():
    gate, up = torch.randn(2, 1000) * 100
    out = situ_glu(gate, up, beta_gate=2.0, beta_up=3.0)
    expected = 2 * torch.tanh(gate / 2) * torch.sigmoid(gate) * 3 * torch.tanh(up / 3)
    assert_close_rms(expected, out, 1e-6, "betas 2, 3")
    assert out.abs().max() <= 6.0


def test_mlp_is_down_of_situ_glu_of_gate_and_up_rows():
    mlp = SiTUGLUMLP(dim=32, intermediate=24, beta_gate=4.0, beta_up=25.0, init_std=0.5)
    x = torch.randn(10, 32, requires_grad=True)
    gate_weight, up_weight = mlp.gate_up.weight[:24], mlp.gate_up.weight[24:]
    expected = situ_glu(x @ gate_weight.T, x @ up_weight.T) @ mlp.down.weight.T
    assert_close_rms(expected, mlp(x), 1e-6, "mlp forward")
    assert mlp.gate_up.bias is None and mlp.down.bias is None
    assert mlp.down.weight.std().item() == pytest.approx(0.5, rel=0.1)


def _forward_backward(fn, gate, up, grad_out, **betas):
    gate, up = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = fn(gate, up, **betas)
    out.backward(grad_out)
    return out, gate.grad, up.grad


def _activation_inputs(dtype):
    """Gates from 1e-2 to 1e3 in scale (both saturations of tanh and sigmoid), ups to +-100."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(-2, 3, 96, dtype=torch.float64)
    gate = torch.randn(64, 96, dtype=torch.float64, generator=gen) * scale
    up = torch.randn(64, 96, dtype=torch.float64, generator=gen) * 30
    grad_out = torch.randn(64, 96, dtype=torch.float64, generator=gen)
    return gate.to(dtype), up.to(dtype), grad_out.to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("betas", [{}, {"beta_gate": 2.0, "beta_up": 3.0}])
def test_fused_matches_reference_forward_and_backward(dtype, tol, betas, torch_forms):
    gate, up, grad_out = _activation_inputs(dtype)
    fused = _forward_backward(situ_glu, gate, up, grad_out, **betas)
    reference = _forward_backward(situ_glu_reference, gate, up, grad_out, **betas)
    assert torch.equal(fused[0], reference[0])  # the same ops in the same order
    for name, ref, x in zip(("output", "gate grad", "up grad"), reference, fused):
        assert x.dtype == dtype
        assert_close_rms(ref, x, tol, f"{dtype} {betas}: {name}")


def test_fused_bf16_inputs_compute_in_fp32(torch_forms):
    gate, up, grad_out = _activation_inputs(torch.bfloat16)
    fused = _forward_backward(situ_glu, gate, up, grad_out)
    in_fp32 = _forward_backward(situ_glu, gate.float(), up.float(), grad_out.float())
    reference = _forward_backward(situ_glu_reference, gate, up, grad_out)
    assert torch.equal(fused[0], reference[0])
    for name, ref, fp32, x in zip(("output", "gate grad", "up grad"), reference, in_fp32, fused):
        assert x.dtype == torch.bfloat16
        # The fp32 result rounded once to bf16, as the reference's backward does ...
        assert torch.equal(x, fp32.to(torch.bfloat16)), name
        # ... whose fp32 sums differ by round-off, which flips the odd bf16 rounding (2^-8 of
        # one element each).
        assert_close_rms(ref, x, 1e-4, f"bf16: {name}")


def test_fused_saves_only_its_inputs():
    """The dense MLP's gate and up are two views of one Linear output: that one storage is all
    the activation keeps for backward (the plain form keeps its fp32 intermediates too)."""
    gate_up = torch.randn(256, 2 * 128, requires_grad=True) * 1.0
    gate, up = gate_up.chunk(2, dim=-1)
    with SavedBytes([gate_up]) as saved_by_reference:  # excluded: counts the intermediates
        situ_glu_reference(gate, up)
    with SavedBytes() as saved:
        situ_glu_halves(gate_up)
    assert saved.bytes == gate_up.untyped_storage().nbytes()
    assert saved_by_reference.bytes >= 3 * gate.numel() * 4
