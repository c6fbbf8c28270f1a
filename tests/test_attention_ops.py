"""doc_causal_attention: sdpa against the explicit reference, packed documents against each
document alone, the QK-Clip max logit against a direct computation, and static shapes."""

import pytest
import torch

import model.ops.attention as attention
from model.batch import cu_seqlens_from_lengths
from model.ops.attention import doc_causal_attention
from tests.static_shapes import assert_static, record
from tests.tolerances import assert_close_rms

TOL = 5e-3
B, T, H, DQK, DV = 2, 96, 2, 48, 32  # Dv != Dqk, as in MLA (192 vs 128)
SCALE = DQK ** -0.5
ROWS = [[10, 50, 36], [96]]  # docs of one row end at the row end; the second row is one doc


def make_qkv(dqk=DQK, dv=DV):
    return [torch.randn(B, T, H, d, requires_grad=True) for d in (dqk, dqk, dv)]


def forward_backward(q, k, v, cu_seqlens, backend, do):
    for x in (q, k, v):
        x.grad = None
    o = doc_causal_attention(q, k, v, cu_seqlens, SCALE, backend=backend)
    (o * do).sum().backward()
    return {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("dqk, dv", [(DQK, DV), (DV, DQK)], ids=["dv<dqk", "dv>dqk"])
def test_sdpa_matches_reference_with_grads(dqk, dv):
    q, k, v = make_qkv(dqk, dv)
    do = torch.randn(B, T, H, dv)
    cu_seqlens = cu_seqlens_from_lengths(ROWS, T)
    ref = forward_backward(q, k, v, cu_seqlens, "reference", do)
    got = forward_backward(q, k, v, cu_seqlens, "sdpa", do)
    for name in ref:
        assert_close_rms(ref[name], got[name], TOL, name)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_packed_documents_equal_each_document_alone(backend):
    q, k, v = make_qkv()
    do = torch.randn(B, T, H, DV)
    packed = forward_backward(q, k, v, cu_seqlens_from_lengths(ROWS, T), backend, do)
    for row, lengths in enumerate(ROWS):
        start = 0
        for length in lengths:
            doc = slice(start, start + length)
            alone = [x.detach()[row:row + 1, doc].clone().requires_grad_() for x in (q, k, v)]
            o = doc_causal_attention(*alone, None, SCALE, backend=backend)
            (o * do[row:row + 1, doc]).sum().backward()
            expected = [o, *(x.grad for x in alone)]
            for name, x in zip(("o", "dq", "dk", "dv"), expected):
                assert_close_rms(x, packed[name][row:row + 1, doc], TOL, f"{name} row {row}")
            start += length


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_max_logit_is_the_largest_allowed_logit(backend, monkeypatch):
    monkeypatch.setattr(attention, "MAX_LOGIT_BLOCK", 32)  # several row blocks for sdpa
    q, k, v = (x.detach() for x in make_qkv())
    # Planted forbidden logits: a future key in another document, a past key in another one.
    k[0, 60] = 10 * q[0, 5]
    k[0, 5] = 10 * q[0, 70]
    _, max_logit = doc_causal_attention(q, k, v, cu_seqlens_from_lengths(ROWS, T), SCALE,
                                        backend=backend, return_max_logit=True)
    expected = torch.full((H,), float("-inf"))
    for row, lengths in enumerate(ROWS):
        start = 0
        for length in lengths:
            qd, kd = (x[row, start:start + length].transpose(0, 1) for x in (q, k))  # [H, L, D]
            scores = qd @ kd.transpose(-1, -2) * SCALE
            scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(),
                                        float("-inf"))
            expected = torch.maximum(expected, scores.amax(dim=(1, 2)))
            start += length
    assert max_logit.shape == (H,) and not max_logit.requires_grad
    torch.testing.assert_close(max_logit, expected, rtol=1e-6, atol=1e-6)
    # The planted logits dominate the unmasked maximum: masking matters for every head.
    unmasked = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * SCALE).amax((0, 2, 3))
    assert (unmasked > expected).all()


def test_one_document_per_row_is_plain_causal_attention():
    q, k, v = (x.detach() for x in make_qkv())
    whole_rows = cu_seqlens_from_lengths([[T]] * B, T)
    for backend in ("sdpa", "reference"):
        expected = doc_causal_attention(q, k, v, None, SCALE, backend=backend)
        got = doc_causal_attention(q, k, v, whole_rows, SCALE, backend=backend)
        assert_close_rms(expected, got, TOL, backend)


def test_output_is_fp32_for_bf16_inputs():
    q, k, v = (x.detach().bfloat16() for x in make_qkv())
    o = doc_causal_attention(q, k, v, cu_seqlens_from_lengths(ROWS, T), SCALE)
    assert o.dtype == torch.float32 and o.shape == (B, T, H, DV)


def test_static_shapes_for_two_document_layouts():
    q, k, v = make_qkv()
    layouts = [[[10, 50, 36], [96]], [[90, 3, 3], [96]]]

    def step(cu_seqlens):
        for x in (q, k, v):
            x.grad = None
        o, max_logit = doc_causal_attention(q, k, v, cu_seqlens, SCALE, return_max_logit=True)
        (o.sum() + max_logit.sum()).backward()

    recs = [record(step, cu_seqlens_from_lengths(rows, T)) for rows in layouts]
    assert_static(*recs)


def test_unknown_backend_is_rejected():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="backend"):
        doc_causal_attention(q, k, v, None, SCALE, backend="flash")
