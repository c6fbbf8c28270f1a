"""The native CPU kernels (model/ops/cpu) against the plain references: forward and backward,
strided views, infinities and NaN, any thread count, and the torch forms wherever a kernel does
not apply. The KDA recurrence's other cases (gates, betas, document layouts, autocast,
activation checkpointing) are in tests/unit/model/test_kda_ops.py."""

import warnings

import pytest
import torch

from model.activations import situ_glu, situ_glu_halves, situ_glu_reference
from model.attnres import depth_mix, depth_mix_reference
from model.batch import cu_seqlens_from_lengths
from model.head import IGNORE_INDEX, chunked_linear_cross_entropy
from model.kda import kda_inputs, kda_inputs_reference
from model.norms import rms_norm
from model.ops import cpu, dispatch
from model.ops.cpu import attention as cpu_attention
from model.ops.cpu import bindings, build
from model.ops.kda import kda_chunk, kda_recurrent
from model.short_conv import doc_causal_conv1d_silu, doc_causal_conv1d_silu_reference
from tests.helpers.tolerances import assert_close_rms, rel_rms


def _values() -> torch.Tensor:
    """Dense around 0, wide up to +-1e4, the extremes fp32 holds, infinities, NaN, zeros and
    subnormal-sized inputs."""
    return torch.cat([torch.linspace(-10, 10, 161), torch.linspace(-1e4, 1e4, 41),
                      torch.tensor([-3e38, -1e30, 1e30, 3e38, float("inf"), -float("inf"),
                                    float("nan"), 0.0, -0.0, 1e-30, 1e-40])])


def _with_grads(fn, inputs, cotangent):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(cotangent)
    return out, *(t.grad for t in leaves)


def _assert_like_torch(fn, inputs, what):
    """fn's native results against its torch forms (the reference's forward, the recomputing
    backward) on the same inputs: non-finite values in the same places, the rest within 1e-6
    relative RMS, as the compiled kernels are held."""
    torch.manual_seed(0)
    cotangent = torch.randn(fn(*inputs).shape)
    got = _with_grads(fn, inputs, cotangent)
    with dispatch.kernels_enabled(False):
        expected = _with_grads(fn, inputs, cotangent)
    names = ["out", *(f"d input {i}" for i in range(len(inputs)))]
    for name, ref, x in zip(names, expected, got, strict=True):
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(x)), f"{what}: {name} non-finite elsewhere"
        assert torch.equal(ref.isnan(), x.isnan()), f"{what}: {name} NaN elsewhere"
        assert torch.equal(ref[~finite & ~ref.isnan()], x[~finite & ~x.isnan()])
        assert_close_rms(ref[finite], x[finite], 1e-6, f"{what}: {name}")


def test_the_kernels_build_on_this_machine():
    assert cpu.available()


def _assert_situ_glu_like_torch(gate, up, what):
    assert bindings.situ_glu_forward(gate, up, 4.0, 25.0) is not None, f"{what}: not native"
    _assert_like_torch(situ_glu, (gate, up), f"SiTU-GLU {what}")


def test_situ_glu_matches_the_reference_on_every_layout():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 4096, 64) * 4
    _assert_situ_glu_like_torch(gate, up, "contiguous [4096, 64]")
    fused = torch.randn(3, 100, 2 * 48) * 8  # the MLP's [gate | up] projection: strided halves
    assert bindings.situ_glu_forward(*fused.chunk(2, dim=-1), 4.0, 25.0) is not None
    _assert_like_torch(situ_glu_halves, (fused,), "SiTU-GLU of the halves of [3, 100, 96]")
    _assert_situ_glu_like_torch(*torch.randn(2, 37) * 3, "one dim")
    grid = _values()
    gate, up = (t.contiguous() for t in torch.meshgrid(grid, grid, indexing="ij"))
    _assert_situ_glu_like_torch(gate, up, "grid with extremes, inf and NaN")
    assert situ_glu(gate, up)[torch.isfinite(gate) & torch.isfinite(up)].abs().max() <= 100.0


def _documents(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                        for row in lengths])


def _assert_conv_like_torch(x, weight, segments, what):
    assert bindings.conv_silu_forward(x, weight, segments) is not None, f"{what}: not native"
    _assert_like_torch(lambda x, w: doc_causal_conv1d_silu(x, w, segments), (x, weight),
                       f"short conv {what}")


def test_short_conv_matches_the_reference_at_document_boundaries():
    torch.manual_seed(0)
    x, weight = torch.randn(4, 512, 64) * 3, torch.randn(64, 4) / 2
    # Documents of 1, 2 and 3 tokens (shorter than the kernel), a row of one document.
    lengths = [[1, 2, 3, 506], [300, 212], [77, 223, 212], [512]]
    _assert_conv_like_torch(x, weight, _documents(lengths), "the demo's shape")
    _assert_conv_like_torch(x, weight, None, "one document per row")
    _assert_conv_like_torch(x[:, :2].contiguous(), weight, None, "rows shorter than the kernel")
    x = torch.randn(2, 40, 24)
    x[0, 9, 3], x[0, 20, 5], x[1, 30, 7] = float("inf"), float("nan"), -float("inf")
    _assert_conv_like_torch(x, torch.randn(24, 4), _documents([[10, 30], [31, 9]]),
                            "inf and NaN, one just before a document starts")


def _assert_norm_like_torch(x, weight, what):
    assert bindings.rms_norm_forward(x, weight, 1e-5) is not None, f"{what}: not native"
    inputs = (x,) if weight is None else (x, weight)
    _assert_like_torch(lambda x, w=None: rms_norm(x, w, 1e-5), inputs, f"RMSNorm {what}")


def test_rms_norm_matches_the_reference_on_every_layout():
    torch.manual_seed(0)
    weight = 1 + 0.1 * torch.randn(64)
    x = torch.randn(4, 512, 64) * torch.logspace(-3, 2, 512)[:, None]  # eps matters for some
    _assert_norm_like_torch(x, weight, "the demo's shape, rows from 1e-3 to 1e2")
    _assert_norm_like_torch(torch.randn(4096, 2, 32) * 3, 1 + 0.1 * torch.randn(32),
                            "KDA's head-wise norm")
    _assert_norm_like_torch(torch.randn(300, 48), None, "without a weight")
    _assert_norm_like_torch(x[..., :48], weight[:48], "the first 48 columns of wider rows")
    x = torch.randn(6, 40)
    x[1, 3], x[4, 0] = float("inf"), float("nan")
    _assert_norm_like_torch(x, torch.rand(40) + 0.5, "a row with inf, one with NaN")


def _kda_layer_inputs(rows: int = 2048, H: int = 2, K: int = 32) -> tuple[torch.Tensor, ...]:
    """q, k [4, rows / 4, H, K], beta logits [4, rows / 4, H], z like q, a_log [H] as the KDA
    layer hands them over: heads of zero norm, of norms just below and above F.normalize's eps
    (1e-6; one element of 2^-20 or 2^-19, norms that every summation order gets exactly), inf
    and NaN."""
    torch.manual_seed(0)
    lead = (4, rows // 4)
    q, k = torch.randn(*lead, H, K), torch.randn(*lead, H, K) * 3
    q[0, 0], q[0, 1], k[0, 2] = 0.0, 0.0, 0.0
    q[0, 1, :, 0], k[0, 2, :, 1] = 2.0 ** -20, 2.0 ** -19
    q[1, 3, 1, 5], k[2, 4, 0, 3], k[3, 5, 1, 0] = float("nan"), float("inf"), 3e38
    beta_logits, z = torch.randn(*lead, H) * 4, torch.randn(*lead, H, K) * 3
    return q, k, beta_logits, z, torch.randn(H) * 0.5


def _kda_inputs_flat(*inputs):
    return torch.cat([x.flatten() for x in kda_inputs(*inputs, "lower_bound", -5.0)])


def test_kda_inputs_match_the_reference():
    """q and k normalised (zero norms, norms below and at eps, inf and NaN), beta and the bounded
    gate: the native pass against the reference's torch ops, forward and backward (a_log's
    gradient sums over every token and channel)."""
    for what, inputs in {"the demo's layer": _kda_layer_inputs(),
                         "head size 24, 3 heads": _kda_layer_inputs(400, 3, 24)}.items():
        assert bindings.kda_inputs_usable(*inputs), what
        _assert_like_torch(_kda_inputs_flat, inputs, f"KDA inputs, {what}")
    assert not bindings.kda_inputs_usable(*(x.detach()[:1, :0] for x in _kda_layer_inputs()[:4]),
                                        torch.zeros(3)), "a_log of another head count"


def test_kda_inputs_take_the_reference_where_the_kernel_does_not_apply(monkeypatch):
    inputs = _kda_layer_inputs(64)
    q, k, beta_logits, z, a_log = inputs
    cases = {"bf16": [x.bfloat16() for x in inputs],
             "q not contiguous": [q.transpose(0, 1), *inputs[1:]],
             "tensor subclass": [x.as_subclass(_Subclass) for x in inputs]}
    for what, tensors in cases.items():
        assert not bindings.kda_inputs_usable(*tensors), what
    for kind in ("kimi_linear", "lower_bound"):
        tensors = cases["q not contiguous"] if kind == "lower_bound" else inputs
        for x, y in zip(kda_inputs(*tensors, kind, -5.0),
                        kda_inputs_reference(*tensors, kind, -5.0), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=kind)
    # A backward the kernel refuses goes through the reference's autograd.
    monkeypatch.setattr(bindings, "kda_inputs_backward", lambda *args: None)
    _assert_like_torch(_kda_inputs_flat, inputs, "KDA inputs, the backward's fallback")


def _loss_inputs(tokens: int = 300, d: int = 24, vocab: int = 1000):
    """hidden [tokens, d] (rows from 0.01 to 300: logits up to ~1e4, where exp overflows without
    the max), weight [vocab, d], labels with every 7th ignored."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, d) * torch.logspace(-2, 2.5, tokens)[:, None]
    labels = torch.randint(0, vocab, (tokens,))
    labels[::7] = IGNORE_INDEX
    return hidden, torch.randn(vocab, d), labels


def test_chunked_loss_matches_its_torch_form():
    """The head's log-sum-exp and softmax gradient as one pass per row against torch's ops:
    the loss and both gradients, chunks of 96 rows (the last one short), an ignored label on
    every 7th token; a NaN row gives NaN where torch's does."""
    hidden, weight, labels = _loss_inputs()
    assert bindings.log_sum_exp_rows(torch.randn(4, 8), torch.empty(4))

    def loss(h, w):
        return chunked_linear_cross_entropy(h, w, labels, 96)

    _assert_like_torch(loss, (hidden, weight), "chunked loss")
    hidden[5, 3] = float("nan")
    _assert_like_torch(loss, (hidden, weight), "chunked loss, a NaN row")


def test_log_sum_exp_rows_is_torch_logsumexp():
    """Rows of logits up to 1e4, one holding +inf, one all -inf, one holding a NaN."""
    torch.manual_seed(0)
    x = torch.randn(6, 3000) * torch.tensor([1.0, 50, 1, 1, 1e4, 1])[:, None]
    x[1, 3], x[2], x[3, 0] = float("inf"), -float("inf"), float("nan")
    out = torch.empty(6)
    assert bindings.log_sum_exp_rows(x, out)
    expected = torch.logsumexp(x, -1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0, equal_nan=True)


def test_the_softmax_gradient_refuses_labels_outside_the_vocabulary():
    logits, lse, scale = torch.randn(3, 10), torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match=r"1 labels outside the vocabulary \[0, 10\)"):
        bindings.softmax_grad_rows_(logits, lse, torch.tensor([0, 10, 9]), scale)
    for what, args in {"bf16 logits": (logits.bfloat16(), lse, scale),
                       "columns of wider logits": (torch.randn(3, 20)[:, :10], lse, scale)
                       }.items():
        assert not bindings.log_sum_exp_rows(args[0], torch.empty(3)), what
        assert not bindings.softmax_grad_rows_(args[0], args[1], torch.zeros(3, dtype=torch.int64),
                                             args[2]), what


def test_depth_mix_is_as_exact_as_the_reference():
    """Within 1e-6 of the float64 result, or twice the fp32 torch forms' own error where that
    is larger (the norm weight's and the query's gradients sum with cancellation)."""
    torch.manual_seed(0)
    x = torch.randn(4, 512, 64) * 3
    query, weight = torch.randn(64), 1 + 0.1 * torch.randn(64)
    for n in (2, 3, 5):
        sources = [x.roll(i, dims=1) * (i + 1) for i in range(n)]
        inputs = (*sources, query, weight)

        def mix(*a):
            return depth_mix(list(a[:-2]), a[-2], a[-1], 1e-5)

        assert bindings.depth_mix_forward(sources, query, weight, 1e-5) is not None
        cotangent = torch.randn(4, 512, 64)
        truth = _with_grads(lambda *a: depth_mix_reference(list(a[:-2]), a[-2], a[-1], 1e-5),
                            [t.double() for t in inputs], cotangent.double())
        got = _with_grads(mix, inputs, cotangent)
        with dispatch.kernels_enabled(False):
            plain = _with_grads(mix, inputs, cotangent)
        for i, (exact, ref, mine) in enumerate(zip(truth, plain, got, strict=True)):
            tol = max(1e-6, 2 * rel_rms(exact, ref))
            assert_close_rms(exact, mine, tol, f"depth mix of {n}: result {i}")


def test_depth_mix_propagates_nan_like_the_torch_forms():
    sources = [torch.randn(6, 32) for _ in range(3)]
    sources[1][2, 5] = float("nan")
    query, weight = torch.randn(32), torch.rand(32) + 0.5
    got = depth_mix(sources, query, weight, 1e-5)
    with dispatch.kernels_enabled(False):
        expected = depth_mix(sources, query, weight, 1e-5)
    assert torch.equal(got.isnan(), expected.isnan()) and got.isnan()[2].all()
    assert_close_rms(expected[~expected.isnan()], got[~got.isnan()], 1e-6, "finite rows")


def _kda_inputs(T: int, H: int, K: int, V: int, num_states: int) -> list[torch.Tensor]:
    """q, k, v, g (K3's gate), beta and initial states as the KDA layer feeds them."""
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1) for _ in range(2))
    g = -5 * torch.sigmoid(2 * torch.randn(1, T, H, K))
    return [q, k, torch.randn(1, T, H, V), g, torch.rand(1, T, H),
            torch.randn(num_states, H, K, V)]


def _kda(cu_seqlens, lower_bound=-5.0):
    """kda_chunk as the layer calls it, with the final states as a second output."""
    def run(q, k, v, g, beta, initial_state):
        o, state = kda_chunk(q, k, v, g, beta, initial_state=initial_state,
                             output_final_state=True, cu_seqlens=cu_seqlens,
                             lower_bound=lower_bound)
        return o, state
    return run


def _with_grads_of_two(fn, inputs, cotangents):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    torch.autograd.backward(outputs, cotangents)
    return *outputs, *(t.grad for t in leaves)


@pytest.mark.parametrize("K, V", [(16, 24), (32, 32), (128, 128)])
def test_kda_recurrence_is_as_exact_as_the_reference(K, V):
    """Output, final states and every gradient within 1e-6 of the float64 recurrence, or twice
    the fp32 torch recurrence's own error where that is larger: documents longer than a
    checkpoint segment (64 tokens) and exactly one, of one token and empty, initial states."""
    torch.manual_seed(0)
    lengths = [1, 150, 0, 64, 45]
    T, H = sum(lengths), 2
    cu_seqlens = cu_seqlens_from_lengths([lengths], T)
    inputs = _kda_inputs(T, H, K, V, len(lengths))
    assert bindings.kda_usable(*inputs)
    cotangents = [torch.randn(1, T, H, V), torch.randn(len(lengths), H, K, V)]
    reference = _kda_reference(cu_seqlens)
    truth = _with_grads_of_two(reference, [t.double() for t in inputs],
                               [c.double() for c in cotangents])
    plain = _with_grads_of_two(reference, inputs, cotangents)
    got = _with_grads_of_two(_kda(cu_seqlens), inputs, cotangents)
    names = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    for name, exact, ref, mine in zip(names, truth, plain, got, strict=True):
        assert mine.dtype == torch.float32, name
        tol = max(1e-6, 2 * rel_rms(exact, ref))
        assert_close_rms(exact, mine, tol, f"KDA K={K} V={V}: {name}")


def _kda_reference(cu_seqlens):
    def run(q, k, v, g, beta, initial_state):
        return kda_recurrent(q, k, v, g, beta, initial_state=initial_state,
                             output_final_state=True, cu_seqlens=cu_seqlens)
    return run


def test_kda_recurrence_propagates_nan_like_the_reference():
    torch.manual_seed(0)
    lengths = [70, 30]
    cu_seqlens = cu_seqlens_from_lengths([lengths], 100)
    q, k, v, g, beta, states = _kda_inputs(100, 2, 32, 32, 2)
    v[0, 40, 1, 3] = float("nan")  # document 0, head 1, value channel 3
    o, state = _kda(cu_seqlens)(q, k, v, g, beta, states)
    o_ref, state_ref = _kda_reference(cu_seqlens)(q, k, v, g, beta, states)
    for got, ref in ((o, o_ref), (state, state_ref)):
        assert torch.equal(got.isnan(), ref.isnan())
        assert_close_rms(ref[~ref.isnan()], got[~got.isnan()], 1e-6, "finite values")
    # The value channel's column of the state, to the document's end.
    assert o[0, 40:70, 1, 3].isnan().all() and o.isnan().sum() == 30


def test_kda_recurrence_rejects_invalid_document_bounds():
    inputs = [t.detach() for t in _kda_inputs(40, 2, 32, 32, 1)[:5]]
    for bad in ([0, 30, 20, 40], [0, 30], [5, 40]):
        with pytest.raises(ValueError, match=rf"cu_seqlens \[{bad[0]}, .* is invalid"):
            kda_chunk(*inputs, cu_seqlens=torch.tensor(bad))


def _attention_inputs(B=2, T=300, H=2):
    q, k = (torch.randn(B, H, T, 24) for _ in range(2))
    v = torch.randn(B, H, T, 16)
    segments = torch.repeat_interleave(torch.tensor([0.0, 1, 2]), torch.tensor([90, 10, 200]))
    return q, k, v, segments.expand(B, T).contiguous()


def test_attention_leaves_unsorted_document_ids_and_long_rows_to_the_tiles(monkeypatch):
    from model.ops import attention

    q, k, v, segments = _attention_inputs()
    assert bindings.attention_forward(q, k, v, segments, segments, 0.2, True, 0) is not None
    unsorted = segments.flip(-1).contiguous()
    assert bindings.attention_forward(q, k, v, unsorted, unsorted, 0.2, True, 0) is None
    calls = []
    monkeypatch.setattr(bindings, "attention_forward",
                        lambda *a: calls.append(a[0].shape) or None)
    o_tiles, _ = attention._BlockwiseAttention.apply(q, k, v, unsorted, unsorted, 0.2, True, 0)
    monkeypatch.setattr(cpu_attention, "NATIVE_MAX_KEYS", 299)
    attention._BlockwiseAttention.apply(q, k, v, segments, segments, 0.2, True, 0)
    assert len(calls) == 1  # the 300-key rows never reached the kernel
    monkeypatch.undo()
    with dispatch.kernels_enabled(False):
        expected, _ = attention._BlockwiseAttention.apply(q, k, v, unsorted, unsorted, 0.2,
                                                          True, 0)
    assert torch.equal(o_tiles, expected)


def test_loss_row_kernels_do_not_depend_on_the_thread_count():
    """The LM head's native passes (log-sum-exp, softmax gradient) alone: the chunked loss
    around them also runs torch's matmuls, whose BLAS splits its reductions by thread count on
    some CPUs (AVX-512 machines), so its gradients are only as thread-invariant as that."""
    hidden, weight, labels = _loss_inputs(2048, 64, 2048)  # above the kernels' grain
    logits = hidden @ weight.T
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            lse = torch.empty(logits.shape[0])
            assert dispatch.call("log_sum_exp_rows", logits, lse)
            grad = logits.clone()
            scale = torch.full_like(lse, 0.5)
            assert dispatch.call("softmax_grad_rows_", grad, lse, labels.clamp(min=0), scale)
            runs.append((lse, grad))
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(*runs, strict=True):
        assert torch.equal(one, many)


def test_results_do_not_depend_on_the_thread_count():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 512, 256) * 4  # above the kernels' parallel grain
    x, weight = torch.randn(4, 512, 64), torch.randn(64, 4)
    segments = _documents([[100, 412], [512], [3, 509], [256, 256]])
    cases = [(situ_glu, (gate, up), torch.randn(512, 256)),
             (lambda x, w: doc_causal_conv1d_silu(x, w, segments), (x, weight),
              torch.randn(4, 512, 64)),  # the weight's gradient sums over 2048 rows
             (lambda x, w: rms_norm(x, w, 1e-5), (x, torch.rand(64) + 0.5),
              torch.randn(4, 512, 64)),
             (lambda a, b, q: depth_mix([a, b], q, torch.ones(64), 1e-5),
              (x, x.flip(1), torch.randn(64)), torch.randn(4, 512, 64))]
    cases.append((_kda_inputs_flat, _kda_layer_inputs(), torch.randn(3 * 2048 * 2 * 32 + 4096)))
    kda_cu_seqlens = cu_seqlens_from_lengths([[100, 30, 200, 70]], 400)
    kda = _kda(kda_cu_seqlens)
    cases.append((lambda *a: torch.cat([o.flatten() for o in kda(*a)]),
                  _kda_inputs(400, 2, 32, 32, 4), torch.randn(400 * 2 * 32 + 4 * 2 * 32 * 32)))
    from model.ops.attention import _BlockwiseAttention

    q, k, v, ids = _attention_inputs()
    cases.append((lambda q, k, v: _BlockwiseAttention.apply(q, k, v, ids, ids, 0.2, True, 0)[0],
                  (q, k, v), torch.randn(2, 2, 300, 16)))
    threads = torch.get_num_threads()
    try:
        for fn, inputs, cotangent in cases:
            runs = []
            for n in (1, 3):
                torch.set_num_threads(n)
                runs.append(_with_grads(fn, inputs, cotangent))
            for one, many in zip(*runs, strict=True):  # bitwise, NaN where NaN
                torch.testing.assert_close(one, many, rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(threads)


class _Subclass(torch.Tensor):
    pass


def test_torch_forms_run_where_the_kernels_do_not_apply():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 64, 32) * 4
    cases = {"bf16": (gate.bfloat16(), up.bfloat16()), "float64": (gate.double(), up.double()),
             "every other column": (gate[:, ::2], up[:, ::2]),
             "tensor subclass": (gate.as_subclass(_Subclass), up.as_subclass(_Subclass)),
             "shapes differ": (gate, up[:1])}
    for what, (g, u) in cases.items():
        assert bindings.situ_glu_forward(g, u, 4.0, 25.0) is None, what
    g, u = cases["every other column"]  # the halves of every other column of [gate | up]
    assert torch.equal(situ_glu_halves(torch.cat([gate, up], -1)[:, ::2]),
                       situ_glu_reference(g, u))
    x, weight, segments = torch.randn(2, 16, 8), torch.randn(8, 4), _documents([[6, 10], [16]])
    conv_cases = {"bf16": (x.bfloat16(), weight, segments),
                  "x not contiguous": (x.transpose(0, 1), weight, segments[:, :2].T),
                  "int32 ids": (x, weight, segments.int()), "weight rows != channels":
                  (x, weight[:4], segments)}
    for what, (xx, w, seg) in conv_cases.items():
        assert bindings.conv_silu_forward(xx, w, seg) is None, what
    for what, (xx, w) in {"bf16 x": (x.bfloat16(), torch.ones(8)),
                          "weight of another width": (x, torch.ones(4)),
                          "weight not contiguous": (x, torch.ones(8, 2)[:, 0]),
                          "every other column": (x[..., ::2], torch.ones(4))}.items():
        assert bindings.rms_norm_forward(xx, w, 1e-5) is None, what
    assert bindings.rms_norm_forward(x, torch.ones(8), 1e-5) is not None
    xx, w, seg = conv_cases["int32 ids"]
    assert torch.equal(doc_causal_conv1d_silu(xx, w, seg),
                       doc_causal_conv1d_silu_reference(xx, w, seg))
    with dispatch.kernels_enabled(False):
        assert not cpu.kernels_in_use()
        assert dispatch.call("situ_glu_forward", gate, up, 4.0, 25.0) is None
        gate_up = torch.cat([gate, up], dim=-1)
        assert torch.equal(situ_glu_halves(gate_up), situ_glu_reference(*gate_up.chunk(2, -1)))


def test_kda_takes_the_torch_chunk_form_where_the_recurrence_does_not_apply():
    torch.manual_seed(0)
    inputs = [t.detach() for t in _kda_inputs(40, 2, 32, 32, 1)]
    cases = {"bf16": [t.bfloat16() for t in inputs], "float64": [t.double() for t in inputs],
             "bf16 initial state": [*inputs[:5], inputs[5].bfloat16()],
             "tensor subclass": [t.as_subclass(_Subclass) for t in inputs]}
    for what, tensors in cases.items():
        assert not bindings.kda_usable(*tensors), what
        kwargs = {"initial_state": tensors[5], "output_final_state": True, "lower_bound": -5.0}
        got = kda_chunk(*tensors[:5], **kwargs)
        expected = kda_chunk(*tensors[:5], **kwargs, backend="torch")
        for x, y in zip(got, expected, strict=True):
            assert torch.equal(x, y), what


def _assert_torch_forms_after_one_warning(monkeypatch, match: str):
    """With what monkeypatch broke, installing the kernels warns once (`match`), registers
    none and the torch forms run; undone, the kernels build and install again."""
    bindings.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match=match):
            assert cpu.install() == ()
        gate_up = torch.randn(16, 2 * 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, not per call
            assert torch.equal(situ_glu_halves(gate_up),
                               situ_glu_reference(*gate_up.chunk(2, dim=-1)))
    finally:
        monkeypatch.undo()
        bindings.library.cache_clear()
    assert cpu.install()


def test_without_a_compiler_the_torch_forms_run_after_one_warning(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    _assert_torch_forms_after_one_warning(monkeypatch,
                                          "native CPU kernels unavailable.*/nonexistent/cc")


def test_a_cache_directory_that_cannot_be_made_leaves_the_torch_forms(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("K3_NATIVE_CACHE", str(tmp_path / "file" / "cache"))
    _assert_torch_forms_after_one_warning(monkeypatch, "building them failed.*Not a directory")


def test_a_cache_directory_of_others_is_not_used(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # what a umask would have kept back
    monkeypatch.setenv("K3_NATIVE_CACHE", str(shared))
    _assert_torch_forms_after_one_warning(monkeypatch, "is not this user's own directory")


def test_the_next_process_loads_the_built_library_without_compiling(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_NATIVE_CACHE", str(tmp_path))
    bindings.library.cache_clear()
    try:
        assert cpu.available()
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"  # no partial file left behind

        def no_compiler(*args, **kwargs):
            raise AssertionError("compiled again")

        monkeypatch.setattr(build.subprocess, "run", no_compiler)
        bindings.library.cache_clear()
        assert cpu.available()
    finally:
        monkeypatch.undo()
        bindings.library.cache_clear()


def test_a_library_that_does_not_load_leaves_the_torch_forms(monkeypatch):
    def refuse(path):
        raise OSError(f"{path}: undefined symbol: _ZGVeN16v_tanhf")

    monkeypatch.setattr(build.ctypes, "CDLL", refuse)
    _assert_torch_forms_after_one_warning(monkeypatch, "does not load.*undefined symbol")


def test_the_start_up_log_names_the_kernels_that_run():
    from types import SimpleNamespace

    from train.config import TrainConfig
    from train.loop import kernels_in_use

    cpu, fp32 = torch.device("cpu"), SimpleNamespace(dtype=None, fp64=False)
    assert kernels_in_use(TrainConfig(), fp32, cpu) == "native CPU"
    assert kernels_in_use(TrainConfig(fused_kernels=True, compile=True), fp32, cpu) == (
        "native CPU + fused (compiled) + compiled sublayers")
    bf16 = SimpleNamespace(dtype=torch.bfloat16, fp64=False)
    assert kernels_in_use(TrainConfig(), bf16, cpu) == "torch ops"
    assert kernels_in_use(TrainConfig(), SimpleNamespace(dtype=None, fp64=True), cpu) == (
        "torch ops")
    assert kernels_in_use(TrainConfig(fused_kernels=True), fp32, torch.device("cuda")) == (
        "fused (compiled)")
    with dispatch.kernels_enabled(False):
        assert kernels_in_use(TrainConfig(), fp32, cpu) == "torch ops"
