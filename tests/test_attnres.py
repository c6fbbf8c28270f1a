"""Block Attention Residuals: uniform mixing at init, and the block schedule (SPEC 4) against a
naive version that rebuilds every block from an explicit list of sublayer outputs."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.attnres import BlockState, DepthMix
from tests.tolerances import assert_close_rms


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
