"""doc_causal_attention / segment_attention: the blockwise and sdpa backends against the dense
reference (outputs, gradients, max logit), packed documents against each document alone, the
varlen wrapper's plumbing, static shapes, and the blockwise backend's memory at 64K tokens.
The blockwise backend runs in both its forms: the native kernel that fp32 CPU tensors take
(model/ops/cpu) and the torch tiles (`blockwise_torch`)."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import model.ops.attention as attention
from model.batch import cu_seqlens_from_lengths, segment_ids
from model.ops import cpu as native
from model.ops.attention import doc_causal_attention, offset_doc_causal_attention, segment_attention
from tests.helpers import REPO
from tests.helpers.static_shapes import assert_static, record
from tests.helpers.tolerances import assert_close_rms

# fp32 comparisons of one algorithm against another (blockwise tiles, native kernel, sdpa,
# segments, varlen's plumbing) or against itself on another layout: the relative RMS error of
# o, dq, dk and dv, measured over every fp32 case of this file at seeds 0-3, is at most 4.9e-7
# (blockwise dq, sdpa dq of packed documents; varlen's stand-in 4.4e-7, one document per row
# exactly 0); the bound is 10x that. Only summation order differs: a wrong mask, tile edge or
# offset shows as 1e-1 to 1, a 12-bit log2(e) in the tiles' exp as 3e-5.
TOL = 5e-6
B, T, H, DQK, DV = 2, 100, 2, 48, 32  # Dv != Dqk, as in MLA (192 vs 128)
SCALE = DQK ** -0.5
# Docs of one row end at the row end (one of them empty); the second row is one doc. With the
# small tiles below no document boundary and not T lies on the tile grid.
ROWS = [[10, 0, 53, 37], [100]]
LAYOUTS = {"packed": ROWS, "no_cu_seqlens": None}


# The blockwise backend with the native kernels off: its torch tiles.
BLOCKWISE_TORCH = pytest.param("blockwise", marks=pytest.mark.torch_tiles, id="blockwise_torch")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch, request):
    """Several query and key tiles at T=100; key tiles not aligned with query tiles."""
    monkeypatch.setattr(attention, "BLOCK_Q", 16)
    monkeypatch.setattr(attention, "BLOCK_K", 40)
    with native.native_kernels(request.node.get_closest_marker("torch_tiles") is None):
        yield


def make_qkv(dqk=DQK, dv=DV):
    return [torch.randn(B, T, H, d, requires_grad=True) for d in (dqk, dqk, dv)]


def cu(layout):
    return None if LAYOUTS[layout] is None else cu_seqlens_from_lengths(LAYOUTS[layout], T)


def segment_lengths(layout):
    """The segments' lengths over the flattened rows, as the "segments" backend takes them."""
    rows = LAYOUTS[layout] or [[T]] * B
    return [n for row in rows for n in row]


def forward_backward(q, k, v, cu_seqlens, backend, do, causal=True, seqlens=None):
    for x in (q, k, v):
        x.grad = None
    o, max_logit = segment_attention(q, k, v, cu_seqlens, SCALE, causal, backend=backend,
                                     return_max_logit=True, seqlens=seqlens)
    (o * do).sum().backward()
    return {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}, max_logit


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dqk, dv", [(DQK, DV), (DV, DQK)], ids=["dv<dqk", "dv>dqk"])
@pytest.mark.parametrize("backend", ["blockwise", BLOCKWISE_TORCH, "sdpa", "segments"])
def test_backend_matches_reference_with_grads(backend, dqk, dv, layout, causal):
    q, k, v = make_qkv(dqk, dv)
    do = torch.randn(B, T, H, dv)
    ref, ref_max = forward_backward(q, k, v, cu(layout), "reference", do, causal)
    got, got_max = forward_backward(q, k, v, cu(layout), backend, do, causal,
                                    segment_lengths(layout))
    for name in ref:
        assert_close_rms(ref[name], got[name], TOL, name)
    torch.testing.assert_close(got_max, ref_max, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
@pytest.mark.parametrize("backend", ["blockwise", BLOCKWISE_TORCH, "sdpa", "segments",
                                     "reference"])
def test_packed_documents_equal_each_document_alone(backend, causal):
    q, k, v = make_qkv()
    do = torch.randn(B, T, H, DV)
    packed, _ = forward_backward(q, k, v, cu("packed"), backend, do, causal,
                                 segment_lengths("packed"))
    for row, lengths in enumerate(ROWS):
        start = 0
        for length in lengths:
            doc = slice(start, start + length)
            start += length
            if length == 0:
                continue
            alone = [x.detach()[row:row + 1, doc].clone().requires_grad_() for x in (q, k, v)]
            o = segment_attention(*alone, None, SCALE, causal, backend=backend,
                                  seqlens=[length])
            (o * do[row:row + 1, doc]).sum().backward()
            expected = [o, *(x.grad for x in alone)]
            for name, x in zip(("o", "dq", "dk", "dv"), expected):
                assert_close_rms(x, packed[name][row:row + 1, doc], TOL, f"{name} row {row}")


@pytest.mark.parametrize("backend", ["blockwise", BLOCKWISE_TORCH, "sdpa", "reference"])
def test_max_logit_is_the_largest_allowed_logit(backend):
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
            if length:
                expected = torch.maximum(expected, scores.amax(dim=(1, 2)))
            start += length
    assert max_logit.shape == (H,) and not max_logit.requires_grad
    torch.testing.assert_close(max_logit, expected, rtol=1e-6, atol=1e-6)
    # The planted logits dominate the unmasked maximum: masking matters for every head.
    unmasked = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * SCALE).amax((0, 2, 3))
    assert (unmasked > expected).all()


@pytest.mark.parametrize("backend", ["blockwise", BLOCKWISE_TORCH, "sdpa", "reference"])
def test_one_document_per_row_is_plain_causal_attention(backend):
    q, k, v = (x.detach() for x in make_qkv())
    whole_rows = cu_seqlens_from_lengths([[T]] * B, T)
    expected = doc_causal_attention(q, k, v, None, SCALE, backend=backend)
    got = doc_causal_attention(q, k, v, whole_rows, SCALE, backend=backend)
    assert_close_rms(expected, got, TOL, backend)


@pytest.mark.parametrize("backend", ["auto", "blockwise"])
def test_output_is_fp32_for_bf16_inputs(backend):
    """bf16 q, k, v (on CPU "auto" is the blockwise backend) give an fp32 output computed in
    fp32: it equals the float64 reference on the same bf16 values. Those values are exact in
    fp32 and float64, so only fp32 arithmetic differs: measured rel-RMS 1.6e-7 to 1.8e-7 (seeds
    0-4, native kernel and torch tiles); an output computed or rounded in bf16 would be off by
    1.5e-3 (the float64 reference rounded to bf16). The bound 2e-6 tells the two apart."""
    q, k, v = (x.detach().bfloat16() for x in make_qkv())
    cu_seqlens = cu_seqlens_from_lengths(ROWS, T)
    o = doc_causal_attention(q, k, v, cu_seqlens, SCALE, backend=backend)
    assert o.dtype == torch.float32 and o.shape == (B, T, H, DV)
    expected = doc_causal_attention(*(x.double() for x in (q, k, v)), cu_seqlens, SCALE,
                                    backend="reference")
    assert_close_rms(expected, o, 2e-6, f"{backend} bf16 -> fp32")


def test_static_shapes_for_two_document_layouts():
    """With cu_seqlens on CPU, "auto" is the blockwise backend (several tiles here)."""
    q, k, v = make_qkv()
    layouts = [[[10, 0, 53, 37], [100]], [[90, 3, 0, 7], [100]]]

    def step(cu_seqlens):
        for x in (q, k, v):
            x.grad = None
        o, max_logit = doc_causal_attention(q, k, v, cu_seqlens, SCALE, return_max_logit=True)
        (o.sum() + max_logit.sum()).backward()

    recs = [record(step, cu_seqlens_from_lengths(rows, T)) for rows in layouts]
    assert_static(*recs)


def _documents(layout) -> list[tuple[int, int]]:
    """(start, length) of every non-empty document over the flattened B*T tokens, written out
    from ROWS (one document per row without cu_seqlens), not from cu_seqlens."""
    docs = []
    for r, row in enumerate(LAYOUTS[layout] or [[T]] * B):
        start = r * T
        for length in row:
            if length:
                docs.append((start, length))
            start += length
        assert start == (r + 1) * T  # the documents fill the row
    return docs


# The cu_seqlens flash attention must get: int32 bounds over the flattened tokens, an empty
# document a repeated bound.
EXPECTED_CU = {"packed": [0, 10, 10, 63, 100, 200], "no_cu_seqlens": [0, 100, 200]}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_wrapper_passes_flattened_documents(monkeypatch, layout, causal):
    """The CUDA flash path cannot run here. A stand-in for varlen_attn checks everything it is
    handed against what the test expects: the tokens flattened to [B*T, H, D] in order (each
    document contiguous, at the offset ROWS puts it), the head dims zero-padded to the larger
    one, cu_seqlens (int32, the bounds written out in EXPECTED_CU), max_q = max_k = T, the scale
    and the window of `causal`. It then attends itself, plain sdpa over each document that ROWS
    defines, so a wrapper that hands over wrong offsets, reordered tokens or badly padded heads,
    or slices the output wrongly, gives another output or fails the stand-in's checks; output
    and gradients must equal the reference backend's. Both head-dim orders (q/k or v padded)."""
    import torch.nn.attention.varlen as varlen

    docs = _documents(layout)
    window = (-1, 0) if causal else (-1, -1)
    calls = []

    def fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale,
                         window_size):
        calls.append((tuple(query.shape), tuple(value.shape), max_q, max_k, window_size))
        width = max(q.shape[-1], v.shape[-1])
        for name, got, x in (("q", query, q), ("k", key, k), ("v", value, v)):
            expected = F.pad(x.detach(), (0, width - x.shape[-1])).reshape(B * T, H, width)
            assert got.shape == expected.shape, (name, got.shape)
            mismatched = (got.detach() != expected).any(dim=(1, 2)).nonzero().flatten()
            assert not len(mismatched), (f"{name}: tokens {mismatched[:8].tolist()} are not the "
                                         f"flattened, zero-padded input's")
        assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
        assert cu_seq_q.tolist() == cu_seq_k.tolist() == EXPECTED_CU[layout], cu_seq_q.tolist()
        assert (max_q, max_k, scale, window_size) == (T, T, SCALE, window)
        pieces = []
        for start, length in docs:
            qd, kd, vd = (x[start:start + length].transpose(0, 1) for x in (query, key, value))
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)
            pieces.append(o.transpose(0, 1))
        return torch.cat(pieces)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(attention, "_varlen_usable", lambda q: True)
    for dqk, dv in ((DQK, DV), (DV, DQK)):
        q, k, v = make_qkv(dqk, dv)
        do = torch.randn(B, T, H, dv)
        ref, ref_max = forward_backward(q, k, v, cu(layout), "reference", do, causal)
        got, got_max = forward_backward(q, k, v, cu(layout), "varlen", do, causal)
        width = max(dqk, dv)
        assert calls == [((B * T, H, width), (B * T, H, width), T, T, window)]
        calls.clear()
        for name in ref:
            assert_close_rms(ref[name], got[name], TOL, f"{name} dqk={dqk} dv={dv}")
        torch.testing.assert_close(got_max, ref_max, rtol=1e-6, atol=1e-6)


def test_varlen_on_cpu_fp32_says_what_to_use():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="backend='blockwise'"):
        doc_causal_attention(q, k, v, None, SCALE, backend="varlen")


def test_segments_backend_names_bad_lengths():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="needs seqlens"):
        segment_attention(q, k, v, cu("packed"), SCALE, True, backend="segments")
    with pytest.raises(ValueError, match=f"summing to B\\*T={B * T}"):
        segment_attention(q, k, v, cu("packed"), SCALE, True, backend="segments",
                          seqlens=segment_lengths("packed")[:-1])


def test_unknown_backend_is_rejected():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="backend"):
        doc_causal_attention(q, k, v, None, SCALE, backend="flash")



@pytest.mark.parametrize("backend", ["blockwise", BLOCKWISE_TORCH, "reference"])
@pytest.mark.parametrize("q_offset, q_len", [(0, 30), (37, 41), (64, 36)])
def test_offset_queries_equal_their_rows_of_full_attention(backend, q_offset, q_len):
    """A fragment of queries (a context-parallel rank's) against the keys up to its end equals
    those rows of the whole rows' attention, gradients too: documents of ROWS cross the fragment
    edges, and the keys' first tile starts before the fragment."""
    q, k, v = make_qkv()
    do = torch.randn(B, T, H, DV)
    rows = slice(q_offset, q_offset + q_len)
    do[:, :rows.start] = 0
    do[:, rows.stop:] = 0  # the loss sees the fragment's rows only
    ref, _ = forward_backward(q, k, v, cu("packed"), "reference", do)
    segments = segment_ids(cu("packed"), B * T).view(B, T)
    keys = slice(0, rows.stop)
    qf, kf, vf = (x.detach()[:, s].requires_grad_() for x, s in ((q, rows), (k, keys), (v, keys)))
    o, max_logit = offset_doc_causal_attention(qf, kf, vf, segments[:, rows], segments[:, keys],
                                               q_offset, SCALE, backend, return_max_logit=True)
    (o * do[:, rows]).sum().backward()
    assert_close_rms(ref["o"][:, rows], o, TOL, "o")
    assert_close_rms(ref["dq"][:, rows], qf.grad, TOL, "dq")
    assert_close_rms(ref["dk"][:, keys], kf.grad, TOL, "dk")
    assert_close_rms(ref["dv"][:, keys], vf.grad, TOL, "dv")
    allowed = attention.dense_mask(segments, B, T, True, q.device)[:, :, rows]
    scores = torch.einsum("bqhd,bkhd->bhqk", q[:, rows], k).detach() * SCALE
    expected_max = scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_logit, expected_max, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["blockwise", BLOCKWISE_TORCH])
@pytest.mark.parametrize("q_offset, q_len", [(0, 30), (37, 41)])
def test_offset_attention_keeps_bf16_keys_and_computes_in_fp32(backend, q_offset, q_len):
    """bf16 q, k, v (a context-parallel rank's queries and gathered keys): the torch tiles
    upcast each tile where it is used, no fp32 copy of the keys (the native kernel, for rows of
    up to 4096 keys, takes fp32 copies), and the gradients come back in bf16 equal to the
    float64 reference's rounded to bf16: measured rel-RMS 5e-9 to 4.4e-5 (seeds 0-2; a few
    rounding ties), where one bf16 rounding step is 1.6e-3 and a mask or tile error 1e-1. The
    bound 2e-4 tells them apart."""
    q, k, v = (x.detach().bfloat16() for x in make_qkv())
    do = torch.randn(B, T, H, DV)
    segments = segment_ids(cu("packed"), B * T).view(B, T)
    rows, keys = slice(q_offset, q_offset + q_len), slice(0, q_offset + q_len)
    grads = {}
    for dtype, name in ((torch.bfloat16, backend), (torch.float64, "reference")):
        xs = [x[:, s].to(dtype).requires_grad_() for x, s in ((q, rows), (k, keys), (v, keys))]
        o = offset_doc_causal_attention(*xs, segments[:, rows], segments[:, keys], q_offset,
                                        SCALE, name)
        (o * do[:, rows].to(o.dtype)).sum().backward()
        grads[name] = o, [x.grad for x in xs]
    (o, got), (expected_o, expected) = grads[backend], grads["reference"]
    assert o.dtype == torch.float32
    assert_close_rms(expected_o, o, 2e-6, "o")
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == torch.bfloat16
        assert_close_rms(e.bfloat16(), g, 2e-4, name)


def test_offset_attention_rejects_queries_past_the_keys():
    q, k, v = make_qkv()
    segments = torch.zeros(B, T, dtype=torch.long)
    with pytest.raises(ValueError, match="q_offset"):
        offset_doc_causal_attention(q[:, :50], k[:, :60], v[:, :60], segments[:, :50],
                                    segments[:, :60], 20, SCALE)

# One gated MLA layer at k3_tiny width, forward + backward over one 64K-token document given as
# cu_seqlens (as packed training gives it: "auto" is the blockwise backend), with QK-Clip's max
# logit recorded. Peak memory is the growth of the process's resident-set high-water mark
# (getrusage ru_maxrss, a fresh process: torch's CPU allocator hands large blocks back to the OS)
# from just before the forward, after imports, the layer and the input exist. The dense mask
# alone would be 4 GiB at this length, the scores 32 GiB. Tiles of 1024 x 1024 (a GPU's, as the
# dry run takes them): memory linear in T holds for any fixed tile, and the default CPU tiles'
# Python loop takes 3 minutes here (these: 20 s, 270 MiB).
MEMORY_PROBE = """
import json, resource, sys, time
import torch
from model.config import k3_tiny
from model.mla import GatedMLA
import model.ops.attention as attention

attention.BLOCK_Q = attention.BLOCK_K = 1024
attention.TILE_ELEMENTS = 2 ** 22

torch.set_num_threads(2)  # both of CI's cores: the suite runs one test at a time
torch.manual_seed(0)
T = int(sys.argv[1])
cfg = k3_tiny()
layer = GatedMLA(cfg)
layer.record_max_logit = True
x = torch.randn(1, T, cfg.hidden_size, requires_grad=True)
cu_seqlens = torch.tensor([0, T])
before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start, start_cpu = time.perf_counter(), time.process_time()
layer(x, cu_seqlens).square().mean().backward()
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
grads = [x.grad] + [p.grad for p in layer.parameters()]
print(json.dumps({"peak_mib": peak_kib / 1024, "seconds": seconds, "cpu_seconds": cpu_seconds,
                  "grads_finite": all(bool(g.isfinite().all()) for g in grads),
                  "grads_nonzero": all(bool(g.abs().sum() > 0) for g in grads),
                  "max_logit": layer.max_logit.tolist()}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mla_layer_at_64k_tokens_fits_in_2_gib():
    repo = REPO
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(65536)], cwd=repo,
                            check=True, capture_output=True, text=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"MLA layer, 64K tokens, forward+backward: peak +{measured['peak_mib']:.0f} MiB, "
          f"{measured['seconds']:.1f} s ({measured['cpu_seconds']:.1f} CPU s)")
    assert measured["grads_finite"] and measured["grads_nonzero"]
    assert len(measured["max_logit"]) == 2
    assert measured["peak_mib"] < 2048, f"peak memory {measured['peak_mib']:.0f} MiB >= 2 GiB"
