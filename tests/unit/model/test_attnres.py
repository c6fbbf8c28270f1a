"""Block Attention Residuals: uniform mixing at init, the depth mix's autograd function against
its plain reference (forward, gradients of every source, the query and the norm weight; dtypes;
what it saves), and the block schedule (SPEC 4) against a naive version that rebuilds every
block from an explicit list of sublayer outputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.attnres import BlockState, DepthMix, depth_mix, depth_mix_reference
from tests.helpers.tolerances import assert_close_rms
from train.saved_activations import SavedBytes

EPS = 1e-5


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), d=st.integers(2, 16), seed=st.integers(0, 1000))
def test_zero_query_mixes_uniformly(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    sources = [torch.randn(3, d, generator=g) * (i + 1) for i in range(n)]
    mix = DepthMix(d, 1e-5)
    out = mix(sources)
    assert torch.allclose(out, torch.stack(sources).mean(0), atol=1e-6)


def test_mix_is_softmax_over_normalised_keys():
    torch.manual_seed(0)
    d = 8
    mix = DepthMix(d, 1e-5)
    with torch.no_grad():
        mix.query.normal_()
        mix.norm_weight.uniform_(0.5, 1.5)
    sources = [torch.randn(4, d) * s for s in (0.1, 1.0, 10.0)]
    keys = [s / s.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * mix.norm_weight
            for s in sources]
    logits = torch.stack([k @ mix.query for k in keys])
    weights = torch.softmax(logits, 0)
    expected = sum(w[:, None] * s for w, s in zip(weights, sources))
    assert_close_rms(expected, mix(sources), 1e-6, "depth mix")


def _mix_inputs(num_sources, dtype):
    """Sources [2, 40, 64] from 1e-3 to 1e2 in scale (eps matters for the smallest rows), a
    query large enough that the weights are far from uniform, a norm weight around 1."""
    gen = torch.Generator().manual_seed(num_sources)
    scale = torch.logspace(-3, 2, 40, dtype=torch.float64)[:, None]
    sources = [torch.randn(2, 40, 64, dtype=torch.float64, generator=gen) * scale * (i + 1)
               for i in range(num_sources)]
    query = torch.randn(64, dtype=torch.float64, generator=gen)
    weight = torch.rand(64, dtype=torch.float64, generator=gen) + 0.5
    grad_out = torch.randn(2, 40, 64, dtype=torch.float64, generator=gen)
    return [s.to(dtype) for s in sources], query, weight, grad_out.to(dtype)


def _mix_and_grads(fn, sources, query, weight, grad_out, param_dtype):
    leaves = [x.detach().clone().requires_grad_() for x in sources]
    query, weight = (p.detach().to(param_dtype).requires_grad_() for p in (query, weight))
    out = fn(leaves, query, weight, EPS)
    out.backward(grad_out)
    return [out, query.grad, weight.grad, *(x.grad for x in leaves)]


@pytest.mark.parametrize("num_sources", [1, 2, 9])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_depth_mix_matches_reference(num_sources, dtype, tol, torch_forms):
    inputs = _mix_inputs(num_sources, dtype)
    fast = _mix_and_grads(depth_mix, *inputs, dtype)
    reference = _mix_and_grads(depth_mix_reference, *inputs, dtype)
    assert torch.equal(fast[0], reference[0])  # the same ops in the same order
    names = ["output", "query grad", "norm weight grad",
             *(f"source {i} grad" for i in range(num_sources))]
    for name, ref, got in zip(names, reference, fast):
        assert got.dtype == ref.dtype == dtype, name
        assert_close_rms(ref, got, tol, f"{dtype}: {name}")


def test_depth_mix_of_bf16_sources_computes_in_fp32(torch_forms):
    """bf16 sources, fp32 parameters: the fp32 mix of the same values, rounded once."""
    sources, query, weight, grad_out = _mix_inputs(9, torch.bfloat16)
    fast = _mix_and_grads(depth_mix, sources, query, weight, grad_out, torch.float32)
    in_fp32 = _mix_and_grads(depth_mix, [s.float() for s in sources], query, weight,
                             grad_out.float(), torch.float32)
    for i, (fp32, got) in enumerate(zip(in_fp32, fast)):
        assert torch.equal(got, fp32.to(got.dtype)), i
    assert fast[0].dtype == fast[3].dtype == torch.bfloat16 and fast[1].dtype == torch.float32


def test_depth_mix_saves_the_sources_and_two_values_per_row():
    sources, query, weight, _ = _mix_inputs(3, torch.float32)
    sources = [s.requires_grad_() for s in sources]
    params = [query.float().requires_grad_(), weight.float().requires_grad_()]
    with SavedBytes([*params, *sources]) as saved:  # the sources are alive anyway
        depth_mix(sources, *params, EPS)
    with SavedBytes([*params, *sources]) as saved_by_reference:
        depth_mix_reference(sources, *params, EPS)
    rows = 3 * 2 * 40
    assert saved.bytes == 2 * rows * 4  # the weights and 1 / rms, fp32
    assert saved_by_reference.bytes >= 2 * rows * 64 * 4  # the stacked values and the keys


def _naive_sources(embedding, outputs, layer, block_size, stage):
    """Sources of a mix, rebuilt from scratch. outputs[(l, 'attn'|'mlp')] are sublayer outputs.

    stage 'attn' at layer l, 'mlp' at layer l, or 'out' after the last layer. A block n >= 1 is
    the sum of both sublayer outputs of layers [(n-1)B, nB); block 0 is the embedding.
    """
    def group_sum(start, stop):
        return sum(outputs[(j, s)] for j in range(start, stop) for s in ("attn", "mlp")
                   if (j, s) in outputs)

    current = layer // block_size
    if stage == "attn":
        if layer == 0:
            return None  # no completed block: the layer sees the embedding itself
        if layer % block_size == 0:  # the previous group is complete and still the partial
            blocks = [embedding] + [group_sum(g * block_size, (g + 1) * block_size)
                                    for g in range(current - 1)]
            return blocks + [group_sum((current - 1) * block_size, current * block_size)]
        blocks = [embedding] + [group_sum(g * block_size, (g + 1) * block_size)
                                for g in range(current)]
        return blocks + [group_sum(current * block_size, layer)]
    blocks = [embedding] + [group_sum(g * block_size, (g + 1) * block_size)
                            for g in range(current)]
    # 'mlp': the partial holds this layer's attention output; 'out': the whole last group.
    return blocks + [group_sum(current * block_size, layer + 1)]


def test_block_schedule_matches_naive_lists():
    torch.manual_seed(0)
    d, num_layers, block_size = 6, 7, 3
    emb = torch.randn(5, d)
    attn_w = [torch.randn(d, d) * 0.3 for _ in range(num_layers)]
    mlp_w = [torch.randn(d, d) * 0.3 for _ in range(num_layers)]
    attn_mix = [DepthMix(d, 1e-5) for _ in range(num_layers)]
    mlp_mix = [DepthMix(d, 1e-5) for _ in range(num_layers)]
    out_mix = DepthMix(d, 1e-5)
    with torch.no_grad():
        for m in attn_mix + mlp_mix + [out_mix]:
            m.query.normal_()

    state = BlockState(emb, block_size)
    for l in range(num_layers):  # as DecoderLayer.forward does it
        state.start_layer(l)
        h = attn_mix[l](state.sources()) if l else state.sources()[-1]
        a = torch.tanh(h @ attn_w[l])
        state.partial = a if state.partial is None else state.partial + a
        state.partial = state.partial + torch.tanh(mlp_mix[l](state.sources()) @ mlp_w[l])
    fast = out_mix(state.sources())

    outputs = {}
    for l in range(num_layers):
        sources = _naive_sources(emb, outputs, l, block_size, "attn")
        h = emb if sources is None else attn_mix[l](sources)
        outputs[(l, "attn")] = torch.tanh(h @ attn_w[l])
        sources = _naive_sources(emb, outputs, l, block_size, "mlp")
        outputs[(l, "mlp")] = torch.tanh(mlp_mix[l](sources) @ mlp_w[l])
    naive = out_mix(_naive_sources(emb, outputs, num_layers - 1, block_size, "out"))
    assert_close_rms(naive, fast, 1e-6, "AttnRes schedule")
    # 7 layers in blocks of 3: embedding, two completed blocks and a partial one at the output.
    assert len(state.blocks) == 3


def test_full_model_has_nine_sources_at_output():
    """K3: 93 layers in blocks of 12 -> 8 blocks (the last partial) + the embedding."""
    state = BlockState(torch.zeros(1, 2), 12)
    for l in range(93):
        state.start_layer(l)
        state.partial = torch.zeros(1, 2)
    assert len(state.sources()) == 9
