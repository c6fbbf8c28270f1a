"""The document-causal short convolution: the shifted multiply-adds against a per-document
F.conv1d, and the fused conv + SiLU autograd function against its plain reference (forward,
gradients of x and of the weight, float64, bf16 input) and what it saves."""

import pytest
import torch
import torch.nn.functional as F

from model.short_conv import (
    ShortConv,
    doc_causal_conv1d,
    doc_causal_conv1d_silu,
    doc_causal_conv1d_silu_reference,
)
from tests.helpers.tolerances import assert_close_rms, rel_rms
from train.saved_activations import SavedBytes

LENGTHS = [[5, 1, 30, 12], [48]]  # a one-token document, a row of one document
CHANNELS, KERNEL = 16, 4


def _segments() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                        for row in LENGTHS])


def _inputs(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, CHANNELS, dtype=torch.float64, generator=gen) * 3
    weight = torch.randn(CHANNELS, KERNEL, dtype=torch.float64, generator=gen)
    grad_out = torch.randn(2, 48, CHANNELS, dtype=torch.float64, generator=gen)
    return x.to(dtype), weight.to(weight_dtype), grad_out


def test_restarts_at_every_document_like_a_conv1d_per_document():
    x, weight, _ = _inputs(torch.float64, torch.float64)
    y = doc_causal_conv1d(x, weight, _segments())
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            doc = x[row, start:start + length].T[None]  # [1, C, length]
            expected = F.conv1d(F.pad(doc, (KERNEL - 1, 0)), weight[:, None], groups=CHANNELS)
            assert_close_rms(expected[0].T, y[row, start:start + length], 1e-13, f"{row}")
            start += length


def _forward_backward(fn, x, weight, segments, grad_out):
    x, weight = (t.detach().clone().requires_grad_() for t in (x, weight))
    out = fn(x, weight, segments)
    out.backward(grad_out.to(out.dtype))
    return out, x.grad, weight.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("with_segments", [True, False])
def test_fused_matches_reference_forward_and_backward(dtype, tol, with_segments, torch_forms):
    x, weight, grad_out = _inputs(dtype, dtype)
    segments = _segments() if with_segments else None
    fused = _forward_backward(doc_causal_conv1d_silu, x, weight, segments, grad_out)
    reference = _forward_backward(doc_causal_conv1d_silu_reference, x, weight, segments,
                                  grad_out)
    assert torch.equal(fused[0], reference[0])  # the same ops in the same order
    for name, ref, out in zip(("output", "x grad", "weight grad"), reference, fused):
        assert out.dtype == dtype
        assert_close_rms(ref, out, tol, f"{dtype}, segments {with_segments}: {name}")


def test_fused_bf16_input_rounds_its_fp32_gradient_once(torch_forms):
    """bf16 x (an autocast Linear's output) and an fp32 weight: computed in fp32. The reference
    rounds each of x's K gradient terms to bf16 before summing them, the fused form rounds the
    fp32 sum once, so its x gradient is the closer one to the float64 truth."""
    x, weight, grad_out = _inputs(torch.bfloat16, torch.float32)
    segments = _segments()
    fused = _forward_backward(doc_causal_conv1d_silu, x, weight, segments, grad_out)
    reference = _forward_backward(doc_causal_conv1d_silu_reference, x, weight, segments,
                                  grad_out)
    in_fp32 = _forward_backward(doc_causal_conv1d_silu, x.float(), weight, segments, grad_out)
    exact = _forward_backward(doc_causal_conv1d_silu_reference, x.double(), weight.double(),
                              segments, grad_out)
    assert torch.equal(fused[0], reference[0]) and fused[0].dtype == torch.float32
    assert fused[1].dtype == torch.bfloat16 and fused[2].dtype == torch.float32
    assert torch.equal(fused[1], in_fp32[1].to(torch.bfloat16))
    assert_close_rms(reference[2], fused[2], 1e-6, "bf16 x: weight grad")
    assert rel_rms(exact[1], fused[1]) <= rel_rms(exact[1], reference[1])
    assert rel_rms(exact[1], fused[1]) <= 2**-8  # bf16 unit round-off: one rounding


def test_module_with_a_halo_takes_the_fused_path_after_the_halo(torch_forms):
    conv = ShortConv(CHANNELS, KERNEL)
    x, _, grad_out = _inputs(torch.float32, torch.float32)
    segments = _segments()
    width = KERNEL - 1
    conv.halo = lambda x, segments, w: (x, segments)  # the halo of the first fragment: itself
    x_a, x_b = (x.clone().requires_grad_() for _ in range(2))
    with_halo = conv(x_a, segments)
    with_halo.backward(grad_out[:, width:].float())
    expected = doc_causal_conv1d_silu_reference(x_b, conv.weight, segments)[:, width:]
    expected.backward(grad_out[:, width:].float())
    assert torch.equal(with_halo, expected)
    assert_close_rms(x_b.grad, x_a.grad, 1e-6, "x grad through the halo")


def test_fused_saves_x_and_the_document_ids():
    x = torch.randn(2, 48, CHANNELS, requires_grad=True) * 1.0
    weight = torch.randn(CHANNELS, KERNEL, requires_grad=True)
    segments = _segments()
    with SavedBytes([weight]) as saved:
        doc_causal_conv1d_silu(x, weight, segments)
    with SavedBytes([weight, x, segments]) as saved_by_reference:  # counts the intermediates
        doc_causal_conv1d_silu_reference(x, weight, segments)
    assert saved.bytes == x.untyped_storage().nbytes() + segments.untyped_storage().nbytes()
    # The reference keeps views of x and the masks, and the pre-silu sum: one more x in fp32.
    assert saved_by_reference.bytes >= x.numel() * 4
