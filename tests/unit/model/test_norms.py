"""RMSNorm: the fused autograd function against its plain reference (forward, gradients of x
and of the weight), its dtypes (fp32 islands, float64 kept, bf16 input) and what it saves."""

import pytest
import torch

from model.norms import RMSNorm, rms_norm, rms_norm_reference
from tests.helpers.tolerances import assert_close_rms
from train.saved_activations import SavedBytes

EPS = 1e-5


def _forward_backward(fn, x, weight, grad_out):
    x = x.detach().clone().requires_grad_()
    if weight is not None:
        weight = weight.detach().clone().requires_grad_()
    out = fn(x, weight, EPS)
    out.backward(grad_out)
    return out, x.grad, None if weight is None else weight.grad


def _norm_inputs(x_dtype, weight_dtype):
    """[3, 50, 64] rows from 1e-3 to 1e2 in scale (eps matters for the smallest)."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(-3, 2, 50, dtype=torch.float64)[:, None]
    x = torch.randn(3, 50, 64, dtype=torch.float64, generator=gen) * scale
    weight = torch.rand(64, dtype=torch.float64, generator=gen) + 0.5
    grad_out = torch.randn(3, 50, 64, dtype=torch.float64, generator=gen)
    return x.to(x_dtype), weight.to(weight_dtype), grad_out.to(x_dtype)


def _compare(x_dtype, weight_dtype, with_weight, tol):
    x, weight, grad_out = _norm_inputs(x_dtype, weight_dtype)
    weight = weight if with_weight else None
    fused = _forward_backward(rms_norm, x, weight, grad_out)
    reference = _forward_backward(rms_norm_reference, x, weight, grad_out)
    assert torch.equal(fused[0], reference[0])  # the same ops in the same order
    assert fused[0].dtype == fused[1].dtype == x_dtype
    names = ("output", "x grad", "weight grad")[:3 if with_weight else 2]
    for name, ref, out in zip(names, reference, fused):
        assert out.dtype == ref.dtype
        assert_close_rms(ref, out, tol, f"{x_dtype} x, {weight_dtype} weight: {name}")
    return fused


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_fused_matches_reference_forward_and_backward(dtype, tol, with_weight, torch_forms):
    _compare(dtype, dtype, with_weight, tol)


def test_fused_bf16_input_computes_in_fp32_with_an_fp32_weight(torch_forms):
    fused = _compare(torch.bfloat16, torch.float32, True, 1e-6)
    assert fused[2].dtype == torch.float32
    x, weight, grad_out = _norm_inputs(torch.bfloat16, torch.float32)
    in_fp32 = _forward_backward(rms_norm, x.float(), weight, grad_out.float())
    for name, fp32, out in zip(("output", "x grad", "weight grad"), in_fp32, fused):
        assert torch.equal(out, fp32.to(out.dtype)), name  # fp32 math, rounded once


def test_module_under_bf16_autocast_matches_reference(torch_forms):
    norm = RMSNorm(64, EPS)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for dtype in (torch.float32, torch.bfloat16):
        x, _, grad_out = _norm_inputs(dtype, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fused = _forward_backward(lambda x, w, eps: norm(x), x, None, grad_out)
            reference = _forward_backward(rms_norm_reference, x, norm.weight, grad_out)
        assert fused[0].dtype == reference[0].dtype == dtype
        assert torch.equal(fused[0], reference[0])
        assert_close_rms(reference[1], fused[1], 1e-6, f"autocast, {dtype} x: x grad")


def test_fused_saves_x_and_one_value_per_row():
    x = torch.randn(4, 128, 64, requires_grad=True).to(torch.bfloat16)
    weight = torch.ones(64, requires_grad=True)
    with SavedBytes([weight]) as saved:
        rms_norm(x, weight, EPS)
    with SavedBytes([weight, x]) as saved_by_reference:  # x excluded: counts the intermediates
        rms_norm_reference(x, weight, EPS)
    assert saved.bytes == x.untyped_storage().nbytes() + 4 * 128 * 4  # x, fp32 1 / rms per row
    assert saved_by_reference.bytes >= 2 * x.numel() * 4  # fp32 copies of x's size
