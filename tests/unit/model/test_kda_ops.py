"""kda_chunk (chunkwise, static shapes) against kda_recurrent (the reference recurrence):
outputs, final states and gradients of every input, for the gates, betas and document layouts
the model produces. Each case runs every CPU form: the torch chunk form that is exact for any gate
(lower_bound=None), its factorised sub-tiles for K3's gate bounded at -5, and the native
recurrence that `auto` takes for fp32 on a CPU (model/ops/cpu), with that bound."""

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import model.ops.kda as kda_ops
import model.ops.kda.chunk as kda_chunk_form
from model.batch import cu_seqlens_from_lengths
from model.config import KDAConfig, k3_tiny, replace
from model.kda import KimiDeltaAttention
from model.ops import cpu
from model.ops.kda import kda_chunk, kda_recurrent
from tests.helpers.static_shapes import assert_static, record
from tests.helpers.tolerances import assert_close_rms

TOL = 5e-3  # fp32 outputs and states; gradients held to the same bound
H, K, V = 2, 32, 32
BOUND = -5.0  # K3's gate


@pytest.fixture(params=["exact", "bounded", "native"])
def lower_bound(request):
    """The bound to pass kda_chunk, with the native kernels on for the native form only."""
    if request.param == "native":
        assert cpu.available()
    with cpu.native_kernels(request.param == "native"):
        yield None if request.param == "exact" else BOUND


@pytest.fixture(params=["torch", "native"])
def cpu_form(request):
    """The torch chunk forms or the native recurrence, for the tests that pick their bound."""
    with cpu.native_kernels(request.param == "native"):
        yield request.param


def make_inputs(B, T, gate="k3", beta_range=(0.0, 1.0), num_states=None):
    """Leaf tensors as the KDA layer feeds them: q, k L2-normalised per head, g = log decay."""
    q = F.normalize(torch.randn(B, T, H, K), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    if gate == "k3":  # SPEC 2: g = -5 * sigmoid(exp(A_h) * z)
        g = -5 * torch.sigmoid(2 * torch.randn(B, T, H, K))
    elif gate == "floor":
        g = torch.full((B, T, H, K), -5.0)
    elif gate == "kimi_linear":  # g = -exp(A_h) * softplus(z), unbounded below
        A = torch.linspace(0, 4, H).view(H, 1)  # head 0 mild, the last head extreme
        g = -A.exp() * F.softplus(4 * torch.randn(B, T, H, K))
    else:
        raise ValueError(gate)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(B, T, H)
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if num_states is not None:
        inputs["initial_state"] = torch.randn(num_states, H, K, V)
    return {name: x.requires_grad_() for name, x in inputs.items()}


def run(fn, inputs, cotangents, **kwargs):
    """Output, final state and the gradient of every input for sum(o * do) + sum(state * ds)."""
    for x in inputs.values():
        x.grad = None
    o, state = fn(**inputs, output_final_state=True, **kwargs)
    loss = (o * cotangents["o"]).sum() + (state * cotangents["state"]).sum()
    loss.backward()
    # An input that reaches no output (an empty document) gets no .grad: its gradient is zero.
    grads = {f"d{name}": torch.zeros_like(x) if x.grad is None else x.grad
             for name, x in inputs.items()}
    return {"o": o, "state": state, **grads}


def cotangents_for(inputs, num_states):
    v = inputs["v"]
    return {"o": torch.randn_like(v), "state": torch.randn(num_states, H, K, V)}


def assert_all_close(ref, got):
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.isfinite(got[name]).all(), f"{name} not finite"
        assert_close_rms(ref[name], got[name], TOL, name)


def compare_chunk_to_recurrent(inputs, num_states, lower_bound=None, **kwargs):
    cot = cotangents_for(inputs, num_states)
    ref = run(kda_recurrent, inputs, cot, **kwargs)
    got = run(functools.partial(kda_chunk, lower_bound=lower_bound), inputs, cot, **kwargs)
    assert_all_close(ref, got)
    return ref, got


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_matches_recurrent_with_ragged_tail_and_initial_state(chunk_size, lower_bound):
    inputs = make_inputs(B=2, T=100, num_states=2)  # 100 is not a multiple of either chunk
    compare_chunk_to_recurrent(inputs, 2, lower_bound, chunk_size=chunk_size)


def test_chunk_matches_recurrent_without_initial_state(lower_bound):
    inputs = make_inputs(B=1, T=70)
    compare_chunk_to_recurrent(inputs, 1, lower_bound)


@pytest.mark.parametrize("gate", ["floor", "k3"])
def test_gate_at_the_lower_bound(gate, lower_bound):
    inputs = make_inputs(B=1, T=130, gate=gate, num_states=1)
    if gate == "floor":  # every token at the bound: each 16-token tile decays by exactly exp(-80)
        assert (inputs["g"] == BOUND).all()
    compare_chunk_to_recurrent(inputs, 1, lower_bound)


@pytest.mark.parametrize("beta_range", [(1e-4, 1e-3), (0.999, 1.0)], ids=["near0", "near1"])
def test_beta_extremes(beta_range, lower_bound):
    inputs = make_inputs(B=1, T=130, beta_range=beta_range, num_states=1)
    compare_chunk_to_recurrent(inputs, 1, lower_bound)


def test_unbounded_kimi_linear_gate_stays_finite_and_matches(cpu_form):
    inputs = make_inputs(B=1, T=150, gate="kimi_linear", num_states=1)
    g = inputs["g"].detach()
    # The test needs decays that underflow: a 16-token tile sums far below exp(-80).
    assert g.min() < -100 and g[0, :16].sum(0).min() < -500
    compare_chunk_to_recurrent(inputs, 1)


def spy_on_forms(monkeypatch):
    """Records which torch form kda_chunk runs: "exact" (_intra_chunk) or "bounded"."""
    calls = []
    exact, bounded = kda_chunk_form._intra_chunk, kda_chunk_form._BoundedIntraChunk

    def exact_spy(*args):
        calls.append("exact")
        return exact(*args)

    class BoundedSpy:
        @staticmethod
        def apply(*args):
            calls.append("bounded")
            return bounded.apply(*args)

    monkeypatch.setattr(kda_chunk_form, "_intra_chunk", exact_spy)
    monkeypatch.setattr(kda_chunk_form, "_BoundedIntraChunk", BoundedSpy)
    return calls


@pytest.mark.parametrize("gate, lower_bound, form", [
    ("kimi_linear", None, "exact"),
    ("k3", BOUND, "bounded"),
    ("k3", -8.0, "exact"),  # looser than the safe range [-5, 0): no fp32 headroom to factorise
])
def test_each_gate_takes_its_form(monkeypatch, torch_forms, gate, lower_bound, form):
    calls = spy_on_forms(monkeypatch)
    inputs = make_inputs(B=1, T=70, gate=gate, num_states=1)
    compare_chunk_to_recurrent(inputs, 1, lower_bound)
    assert calls == [form]


def test_gate_below_the_bound_is_clamped_to_it(cpu_form):
    """lower_bound is a promise; the bounded forms hold g at the bound where a gate breaks it
    (finite, and the recurrence of the clamped gate, with no gradient where it clamped)."""
    inputs = make_inputs(B=1, T=130, gate="kimi_linear", num_states=1)
    assert (inputs["g"] < BOUND).float().mean() > 0.2
    cot = cotangents_for(inputs, 1)

    def recurrent_of_clamped(g, **kwargs):
        return kda_recurrent(g=g.clamp(min=BOUND), **kwargs)

    ref = run(recurrent_of_clamped, inputs, cot)
    got = run(functools.partial(kda_chunk, lower_bound=BOUND), inputs, cot)
    assert_all_close(ref, got)
    assert (got["dg"][inputs["g"].detach() < BOUND] == 0).all()


def test_lower_bound_must_be_negative():
    inputs = {name: x.detach() for name, x in make_inputs(B=1, T=20).items()}
    with pytest.raises(ValueError, match="lower_bound"):
        kda_chunk(**inputs, lower_bound=0.0)


@pytest.mark.parametrize("gate, bound", [("lower_bound", BOUND), ("kimi_linear", None)])
def test_layer_passes_only_the_k3_gate_bound(gate, bound):
    seen = []

    def recording_kda_chunk(*args, **kwargs):
        seen.append(kwargs["lower_bound"])
        return kda_chunk(*args, **kwargs)

    cfg = k3_tiny()
    cfg = replace(cfg, kda=KDAConfig(**{**cfg.kda.__dict__, "gate": gate}))
    layer = KimiDeltaAttention(cfg)
    layer.chunk_op = recording_kda_chunk
    x = torch.randn(1, 40, cfg.hidden_size)
    layer(x, None, None)
    layer(x, torch.tensor([0, 15, 40]), torch.tensor([[0] * 15 + [1] * 25]))
    assert seen == [bound, bound]


# Uneven documents: shorter than a chunk, one over several chunks, unaligned boundaries, and a
# layout with an empty document (its final state is its initial state).
@pytest.mark.parametrize("lengths", [(5, 150, 30, 17), (40, 0, 70, 1)])
def test_packed_documents_equal_each_document_alone(lengths, lower_bound):
    T = sum(lengths)
    cu_seqlens = cu_seqlens_from_lengths([list(lengths)], T)
    N = len(lengths)
    inputs = make_inputs(B=1, T=T, num_states=N)
    cot = cotangents_for(inputs, N)
    packed = run(functools.partial(kda_chunk, lower_bound=lower_bound), inputs, cot,
                 cu_seqlens=cu_seqlens)

    alone = {name: [] for name in packed}
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc = {name: x.detach()[:, start:end].clone() for name, x in inputs.items()
               if name != "initial_state"}
        doc["initial_state"] = inputs["initial_state"].detach()[n:n + 1].clone()
        doc = {name: x.requires_grad_() for name, x in doc.items()}
        doc_cot = {"o": cot["o"][:, start:end], "state": cot["state"][n:n + 1]}
        result = run(kda_recurrent, doc, doc_cot)
        for name, x in result.items():
            alone[name].append(x)
    alone = {name: torch.cat(xs, dim=0 if name in ("state", "dinitial_state") else 1)
             for name, xs in alone.items()}
    assert_all_close(alone, packed)
    # The packed reference agrees as well (the same document split, done by kda_recurrent).
    assert_all_close(run(kda_recurrent, inputs, cot, cu_seqlens=cu_seqlens), packed)


def test_packed_documents_final_states_without_initial_states(lower_bound):
    lengths = (5, 150, 30, 17)
    T = sum(lengths)
    cu_seqlens = cu_seqlens_from_lengths([list(lengths)], T)
    inputs = make_inputs(B=1, T=T)
    cot = cotangents_for(inputs, len(lengths))
    ref = run(kda_recurrent, inputs, cot, cu_seqlens=cu_seqlens)
    got = run(functools.partial(kda_chunk, lower_bound=lower_bound), inputs, cot,
              cu_seqlens=cu_seqlens)
    assert_all_close(ref, got)


# Training's case (no states in or out): documents share chunks and are separated by masks.
# Several documents inside one chunk, one over several chunks, empty slots as the loader pads.
@pytest.mark.parametrize("lengths", [(5, 150, 30, 17), (3, 4, 0, 9, 2, 60, 0, 0, 1),
                                     (64, 64, 1, 63)])
def test_packed_documents_without_states_equal_each_document_alone(lengths, lower_bound):
    T = sum(lengths)
    cu_seqlens = cu_seqlens_from_lengths([list(lengths)], T)
    inputs = make_inputs(B=1, T=T)
    do = torch.randn_like(inputs["v"])

    def outputs_and_grads(fn, **kwargs):
        for x in inputs.values():
            x.grad = None
        o, state = fn(**inputs, **kwargs)
        assert state is None
        (o * do).sum().backward()
        return {"o": o, **{f"d{n}": x.grad.clone() for n, x in inputs.items()}}

    ref = outputs_and_grads(kda_recurrent, cu_seqlens=cu_seqlens)
    for chunk_size in (16, 64):
        got = outputs_and_grads(kda_chunk, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                lower_bound=lower_bound)
        assert_all_close(ref, got)


@pytest.mark.parametrize("lower_bound", [None, BOUND], ids=["exact", "bounded"])
def test_packed_documents_without_states_cost_no_padding(torch_forms, lower_bound):
    """Empty document slots must not grow the work: the chunked buffer is ceil(T / C) chunks."""
    T, chunk = 96, 32
    many_slots = cu_seqlens_from_lengths([[40, 56] + [0] * 60], T)
    inputs = make_inputs(B=1, T=T)
    rec = record(lambda: kda_chunk(**inputs, cu_seqlens=many_slots, chunk_size=chunk,
                                   lower_bound=lower_bound))
    chunk_dims = {shape[2] for _, shapes in rec.trace for shape in shapes
                  if isinstance(shape, tuple) and len(shape) == 5 and shape[:2] == (1, H)}
    assert chunk_dims == {T // chunk}, chunk_dims


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_rows_that_start_documents_run_side_by_side_and_equal_the_packed_sequence(
        chunk_size, lower_bound):
    """`rows` (K3Batch's layout: every row starts a document) batches the rows: the same
    outputs and gradients as the one packed sequence and as the recurrence; rows of 48 tokens
    split into whole chunks of 16 only, so chunks of 32 keep the packed sequence."""
    seq = 48
    rows = [[5, 30, 13], [seq], [10, 0, 14, 24]]
    T = seq * len(rows)
    cu_seqlens = cu_seqlens_from_lengths(rows, seq)
    inputs = make_inputs(B=1, T=T)
    do = torch.randn_like(inputs["v"])

    def outputs_and_grads(fn, **kwargs):
        for x in inputs.values():
            x.grad = None
        o, _ = fn(**inputs, cu_seqlens=cu_seqlens, **kwargs)
        (o * do).sum().backward()
        return {"o": o, **{f"d{n}": x.grad.clone() for n, x in inputs.items()}}

    chunked = functools.partial(kda_chunk, chunk_size=chunk_size, lower_bound=lower_bound)
    ref = outputs_and_grads(kda_recurrent)
    packed = outputs_and_grads(chunked)
    side_by_side = outputs_and_grads(chunked, rows=len(rows))
    assert_all_close(ref, side_by_side)
    for name in packed:
        assert_close_rms(packed[name], side_by_side[name], 1e-6, name)
    if cpu.kernels_in_use():  # the recurrence runs each document on its own, rows or not
        return
    rec = record(lambda: chunked(**inputs, cu_seqlens=cu_seqlens, rows=len(rows)))
    batches = {shape[:3] for _, shapes in rec.trace for shape in shapes
               if isinstance(shape, tuple) and len(shape) == 5 and shape[1] == H}
    if seq % chunk_size == 0:
        assert batches == {(len(rows), H, seq // chunk_size)}
    else:  # one packed sequence, its last chunk padded
        assert batches == {(1, H, -(-T // chunk_size))}


def test_static_shapes_without_states_for_two_document_layouts(lower_bound):
    T = 202
    inputs = make_inputs(B=1, T=T)

    def step(cu_seqlens):
        for x in inputs.values():
            x.grad = None
        kda_chunk(**inputs, cu_seqlens=cu_seqlens, lower_bound=lower_bound)[0].sum().backward()

    recs = [record(step, cu_seqlens_from_lengths([list(lengths)], T))
            for lengths in [(5, 150, 30, 17), (100, 2, 50, 50)]]
    assert_static(*recs)


def test_static_shapes_for_two_document_layouts(lower_bound):
    T = 202
    layouts = [(5, 150, 30, 17), (100, 2, 50, 50)]
    inputs = make_inputs(B=1, T=T, num_states=len(layouts[0]))

    def step(cu_seqlens):
        for x in inputs.values():
            x.grad = None  # a second backward would accumulate (add_) instead of assigning
        o, state = kda_chunk(**inputs, output_final_state=True, cu_seqlens=cu_seqlens,
                             lower_bound=lower_bound)
        (o.sum() + state.sum()).backward()

    recs = [record(step, cu_seqlens_from_lengths([list(lengths)], T)) for lengths in layouts]
    assert_static(*recs)


def test_recurrent_matches_the_spec_matrix_form():
    """S_t = (I - b k k^T) Diag(a) S_{t-1} + b k v^T, o_t = S_t^T q_t / sqrt(d_k), written out
    with explicit matrices, guards the reference itself."""
    inputs = make_inputs(B=1, T=12, num_states=1)
    q, k, v, g, beta, h0 = (x.detach().double() for x in inputs.values())
    S = h0[0]
    expected = torch.empty(12, H, V, dtype=torch.double)
    eye = torch.eye(K, dtype=torch.double)
    for t in range(12):
        for h in range(H):
            kt = k[0, t, h, :, None]
            M = (eye - beta[0, t, h] * kt @ kt.T) @ torch.diag(g[0, t, h].exp())
            S[h] = M @ S[h] + beta[0, t, h] * kt @ v[0, t, h, None, :]
            expected[t, h] = S[h].T @ q[0, t, h] / K ** 0.5
    o, state = kda_recurrent(**inputs, output_final_state=True)
    assert_close_rms(expected, o[0], 1e-6, "o")
    assert_close_rms(S, state[0], 1e-6, "state")


def test_dtypes_and_optional_final_state(lower_bound):
    inputs = {name: x.detach().bfloat16() for name, x in make_inputs(B=1, T=40).items()}
    for fn in (functools.partial(kda_chunk, lower_bound=lower_bound), kda_recurrent):
        o, state = fn(**inputs)
        assert o.dtype == torch.bfloat16 and state is None
        _, state = fn(**inputs, output_final_state=True)
        assert state.dtype == torch.float32 and state.shape == (1, H, K, V)


def assert_wrapped_equals_plain(wrap, lower_bound, T=100):
    """kda_chunk called through wrap(chunk, **inputs) gives bitwise the plain call's output,
    final state and every input's gradient, all fp32."""
    inputs = make_inputs(B=1, T=T, num_states=1)
    cotangents = {"o": torch.randn(1, T, H, V), "state": torch.randn(1, H, K, V)}
    chunk = functools.partial(kda_chunk, lower_bound=lower_bound)
    plain = run(chunk, inputs, cotangents)
    wrapped = run(functools.partial(wrap, chunk), inputs, cotangents)
    for name, value in plain.items():
        assert wrapped[name].dtype == value.dtype == torch.float32, name
        torch.testing.assert_close(wrapped[name], value, rtol=0, atol=0, msg=name)


def test_bf16_autocast_leaves_the_fp32_island_alone(lower_bound):
    # Autocast would run the intra-chunk matmuls in bf16; the state pass's out= matmuls are not
    # autocast and would then get mixed dtypes. A forward inside autocast computes as without
    # it, so its backward (outside autocast, as the training loop runs it) does too.
    def forward_in_autocast(chunk, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return chunk(**kwargs)

    assert_wrapped_equals_plain(forward_in_autocast, lower_bound)


def test_under_activation_checkpointing(lower_bound):
    # torch.utils.checkpoint unpacks each saved tensor once: the backward reads them once.
    def checkpointed(chunk, **kwargs):
        return torch.utils.checkpoint.checkpoint(chunk, use_reentrant=False, **kwargs)

    assert_wrapped_equals_plain(checkpointed, lower_bound, T=70)


def test_output_takes_in_place_ops(lower_bound):
    # The output is a tensor of its own, not a view of the autograd function's result (autograd
    # refuses in-place ops on those): a caller may scale it in place and still differentiate.
    inputs = make_inputs(B=1, T=70)
    o, _ = kda_chunk(**inputs, lower_bound=lower_bound)
    o.mul_(2).sum().backward()
    ref = make_inputs(B=1, T=70)
    for name, x in ref.items():
        x.data.copy_(inputs[name].detach())
    (2 * kda_chunk(**ref, lower_bound=lower_bound)[0]).sum().backward()
    for name, x in inputs.items():
        torch.testing.assert_close(x.grad, ref[name].grad, rtol=0, atol=0, msg=name)


def test_argument_validation():
    inputs = {name: x.detach() for name, x in make_inputs(B=2, T=20).items()}
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk(**inputs, chunk_size=24)
    with pytest.raises(ValueError, match="B=1"):
        kda_chunk(**inputs, cu_seqlens=torch.tensor([0, 10, 40]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk(**inputs, initial_state=torch.zeros(1, H, K, V))
    with pytest.raises(ValueError, match="backend"):
        kda_chunk(**inputs, backend="triton")
    packed = {name: x[:1] for name, x in inputs.items()}
    with pytest.raises(ValueError, match="rows=2 is invalid: needs cu_seqlens"):
        kda_chunk(**packed, rows=2)
    with pytest.raises(ValueError, match="rows=3 is invalid"):
        kda_chunk(**packed, cu_seqlens=torch.tensor([0, 10, 20]), rows=3)


def _fla_kernels_importable() -> bool:
    """fla's Triton kernels load (fla-core and triton: a GPU machine); fla-core alone, as the dev
    extra installs it on a CPU machine, does not."""
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_fla_kernels_importable(), reason="fla's kernels are importable")
def test_fla_backend_without_fla_says_so():
    inputs = {name: x.detach() for name, x in make_inputs(B=1, T=20).items()}
    with pytest.raises(RuntimeError, match="fla-core"):
        kda_chunk(**inputs, backend="fla")


def test_fla_backend_gets_fla_arguments(monkeypatch):
    """The fla dispatch (exercised on a GPU only) with a stand-in that checks what fla's
    chunk_kda is given: fp32 initial states, safe_gate with the bound, the static varlen mode."""
    calls = []

    def fake_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None,
                       output_final_state=False, safe_gate=False, lower_bound=None,
                       cu_seqlens=None, use_graph=False, chunk_size=64):
        calls.append({"safe_gate": safe_gate, "lower_bound": lower_bound, "use_graph": use_graph,
                      "chunk_size": chunk_size, "h0_dtype": initial_state.dtype})
        return kda_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state,
                             cu_seqlens)

    monkeypatch.setattr(kda_ops, "_fla_chunk_kda", lambda: fake_chunk_kda)
    inputs = {name: x.detach() for name, x in make_inputs(B=1, T=40, num_states=2).items()}
    inputs["initial_state"] = inputs["initial_state"].bfloat16()
    cu_seqlens = torch.tensor([0, 15, 40])
    o, state = kda_chunk(**inputs, output_final_state=True, cu_seqlens=cu_seqlens,
                         backend="fla", lower_bound=-5.0, chunk_size=32)
    assert calls == [{"safe_gate": True, "lower_bound": -5.0, "use_graph": True,
                      "chunk_size": 32, "h0_dtype": torch.float32}]
    expected, _ = kda_chunk(**inputs, output_final_state=True, cu_seqlens=cu_seqlens,
                            backend="torch")
    assert_close_rms(expected, o, TOL, "o")
    # A bound looser than the safe range does not select the safe-gate kernel.
    kda_chunk(**inputs, cu_seqlens=cu_seqlens, backend="fla", lower_bound=-8.0, chunk_size=32)
    assert calls[1]["safe_gate"] is False and calls[1]["lower_bound"] is None
    # auto on CPU stays on the torch path even when fla is importable.
    kda_chunk(**inputs, cu_seqlens=cu_seqlens)
    assert len(calls) == 2
