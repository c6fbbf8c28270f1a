"""SiTU-GLU (SPEC 5, Eq. 12): bounded by beta_gate * beta_up, SwiGLU to first order near 0."""

import pytest
import torch

from model.activations import situ_glu, swiglu
from model.mlp import SiTUGLUMLP
from tests.tolerances import assert_close_rms


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
