"""The whole K3 model: packed documents, multimodal batches, the published size, static shapes."""

import pytest
import torch

from model.batch import K3Batch, VisionInput, cu_seqlens_from_lengths, segment_ids
from model.config import ConfigError, k3_full, k3_tiny, replace
from model.k3 import K3Model
from model.kda import KimiDeltaAttention
from model.mla import GatedMLA
from model.params import count_parameters
from model.vision import pack_visuals, vision_token_count
from tests.helpers.static_shapes import assert_static, record
from tests.helpers.tolerances import assert_close_rms


def _random_tokens(cfg, shape, generator):
    # Ids 5.. avoid the pad and image placeholder ids of k3_tiny.
    return torch.randint(5, cfg.vocab_size, shape, generator=generator)


def _perturb_depth_queries(model):
    """AttnRes queries start at zero, which makes their norms' gradients exactly zero; a small
    perturbation lets every parameter's gradient path be exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mix.query"):
                p.normal_(std=0.1)


def test_mla_packed_equals_each_document_alone():
    torch.manual_seed(0)
    cfg = k3_tiny()
    mla = GatedMLA(cfg)
    lengths = [5, 17, 9, 1]
    x = torch.randn(1, sum(lengths), cfg.hidden_size, requires_grad=True)
    cu = cu_seqlens_from_lengths([lengths], sum(lengths))
    packed = mla(x, cu)
    alone = torch.cat([mla(part, None) for part in x.split(lengths, dim=1)], dim=1)
    assert_close_rms(alone, packed, 1e-5, "MLA packed vs alone")
    (grad_packed,) = torch.autograd.grad(packed.square().sum(), x)
    (grad_alone,) = torch.autograd.grad(alone.square().sum(), x)
    assert_close_rms(grad_alone, grad_packed, 1e-5, "MLA input gradient")


def test_kda_layer_packed_equals_each_document_alone():
    torch.manual_seed(0)
    cfg = k3_tiny()
    kda = KimiDeltaAttention(cfg)
    lengths = [40, 3, 29]  # spans chunks, a very short document, boundaries off the chunk grid
    total = sum(lengths)
    x = torch.randn(1, total, cfg.hidden_size, requires_grad=True)
    cu = cu_seqlens_from_lengths([lengths], total)
    packed = kda(x, cu, segment_ids(cu, total).view(1, total))
    alone = torch.cat([kda(part, None, None) for part in x.split(lengths, dim=1)], dim=1)
    assert_close_rms(alone, packed, 1e-5, "KDA layer packed vs alone")
    (grad_packed,) = torch.autograd.grad(packed.square().sum(), x)
    (grad_alone,) = torch.autograd.grad(alone.square().sum(), x)
    assert_close_rms(grad_alone, grad_packed, 1e-5, "KDA layer input gradient")


def test_language_model_packed_equals_each_document_alone():
    torch.manual_seed(0)
    cfg = k3_tiny()
    model = K3Model(cfg)
    _perturb_depth_queries(model)
    g = torch.Generator().manual_seed(1)
    lengths = [23, 41, 7, 25]
    seq = sum(lengths)
    tokens = _random_tokens(cfg, (1, seq), g)
    labels = tokens.roll(-1, dims=1)
    cu = cu_seqlens_from_lengths([lengths], seq)
    packed = model(K3Batch(tokens, labels, cu), return_logits=True).logits
    pieces = []
    for part in tokens.split(lengths, dim=1):
        batch = K3Batch(part, part.roll(-1, dims=1), torch.tensor([0, part.shape[1]]))
        pieces.append(model(batch, return_logits=True).logits)
    assert_close_rms(torch.cat(pieces, dim=1), packed, 1e-5, "LM logits packed vs alone")


def _multimodal_batch(cfg, generator):
    b, t = 2, 64
    tokens = _random_tokens(cfg, (b, t), generator)
    image = torch.randn(3, 28, 56, generator=generator)
    video = torch.randn(6, 3, 56, 28, generator=generator)  # 6 frames: chunks of 4 and 2
    patches, grid = pack_visuals([image, video], cfg.vision)
    count = sum(vision_token_count(grid, cfg.vision))
    positions = torch.cat([torch.arange(2, 4), torch.arange(t + 5, t + 5 + count - 2)])
    tokens.view(-1)[positions] = cfg.image_token_id
    labels = tokens.roll(-1, dims=1).clone()
    labels.view(-1)[positions] = -100
    labels[:, -1] = -100
    tokens[1, -6:] = cfg.pad_token_id  # padding document at the end of row 1
    labels[1, -7:] = -100
    cu = cu_seqlens_from_lengths([[30, 34], [20, 38, 6]], t)
    return K3Batch(tokens, labels, cu, VisionInput(patches, grid, positions))


def test_tiny_multimodal_forward_backward_reaches_every_parameter():
    torch.manual_seed(0)
    cfg = k3_tiny()
    model = K3Model(cfg)
    _perturb_depth_queries(model)
    batch = _multimodal_batch(cfg, torch.Generator().manual_seed(2))
    out = model(batch)
    loss = out.loss_sum / out.num_tokens
    assert torch.isfinite(loss)
    assert int(out.num_tokens) == int((batch.labels != -100).sum())
    loss.backward()
    missing = [n for n, p in model.named_parameters()
               if p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0]
    assert not missing, f"parameters without a gradient: {missing}"


def test_loss_ignores_image_positions_and_vision_changes_text_loss():
    torch.manual_seed(0)
    cfg = k3_tiny()
    model = K3Model(cfg)
    batch = _multimodal_batch(cfg, torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(batch).loss_sum
        other = K3Batch(batch.tokens, batch.labels, batch.cu_seqlens,
                        VisionInput(batch.vision.patches * -1.0, batch.vision.grid_thw,
                                    batch.vision.token_positions))
        changed = model(other).loss_sum
    assert not torch.isclose(base, changed), "image content must reach the text loss"


def test_layer_pattern_and_config_validation():
    cfg = k3_full()
    kinds = cfg.layer_types()
    mla = [i + 1 for i, k in enumerate(kinds) if k == "mla"]
    assert mla == list(range(4, 93, 4)) + [93]
    assert kinds.count("kda") == 69
    tiny = k3_tiny()
    assert tiny.layer_types()[-1] == "mla" and tiny.num_attnres_blocks >= 2
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k"):
        replace(tiny, moe=replace(tiny.moe, top_k=8)).validate()
    with pytest.raises(ConfigError, match=r"model\.kda\.gate"):
        replace(tiny, kda=replace(tiny.kda, gate="exp")).validate()


def test_full_model_on_meta_matches_published_size():
    with torch.device("meta"):
        model = K3Model(k3_full())
    counts = count_parameters(model)
    assert abs(counts.total / 2.78e12 - 1) < 0.005, counts
    assert abs(counts.active / 104.2e9 - 1) < 0.005, counts


def _kda_layer_trace(layer, x, lengths):
    total = x.shape[1]
    cu = cu_seqlens_from_lengths([lengths], total)

    def run():
        layer(x, cu, segment_ids(cu, total).view(1, total)).sum().backward()

    layer.zero_grad(set_to_none=True)  # so both runs create (not accumulate) gradients
    x.grad = None
    return record(run)


def test_kda_layer_static_shapes_for_two_document_layouts():
    torch.manual_seed(0)
    cfg = k3_tiny()
    layer = KimiDeltaAttention(cfg)
    x = torch.randn(1, 96, cfg.hidden_size, requires_grad=True)
    assert_static(_kda_layer_trace(layer, x, [10, 50, 36]),
                  _kda_layer_trace(layer, x, [70, 2, 24]))


def test_meta_build_materialised_with_init_weights_equals_eager_build():
    """Every parameter and buffer (vision, QB bias and statistics included) comes from
    init_weights: NaN-filled storage after to_empty would survive anywhere it did not reach."""
    cfg = k3_tiny()
    eager = K3Model(cfg, seed=123)
    with torch.device("meta"):
        lazy = K3Model(cfg, seed=123)
    assert all(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*lazy.parameters(), *lazy.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else -1)
    assert lazy.init_weights(123) == 123
    eager_tensors = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    lazy_tensors = {**dict(lazy.named_parameters()), **dict(lazy.named_buffers())}
    assert eager_tensors.keys() == lazy_tensors.keys()
    assert any(".balancer." in n for n in eager_tensors) and any(
        n.startswith("vision.") for n in eager_tensors)
    for name, tensor in eager_tensors.items():
        assert torch.equal(tensor, lazy_tensors[name]), name
    batch = _multimodal_batch(cfg, torch.Generator().manual_seed(4))
    assert torch.equal(eager(batch).loss_sum, lazy(batch).loss_sum)


def test_full_model_builds_on_meta_without_allocating():
    with torch.device("meta"):
        model = K3Model(k3_full())
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert list(model.layers) == [str(i) for i in range(93)]
    assert "layers.92.attn.q_b.weight" in dict(model.named_parameters())


def _head_shard(module, names_by_dim, heads, index):
    """A copy of `module` holding only head block `index` of `heads`: parameters named in
    names_by_dim[0] are cut along dim 0 (head-major rows), those in names_by_dim[1] along dim 1
    (the output projection's columns), as a head-sharded tensor-parallel plan lays them out."""
    import copy

    shard = copy.deepcopy(module)
    for dim, names in names_by_dim.items():
        for name in names:
            owner, _, attr = name.rpartition(".")
            holder = shard.get_submodule(owner) if owner else shard
            full = getattr(holder, attr)
            part = full.detach().chunk(heads, dim=dim)[index].clone()
            setattr(holder, attr, torch.nn.Parameter(part))
    return shard


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_head_sharded_attention_runs_unchanged(kind):
    """Each head block alone, its output projection row-parallel: the partial outputs sum to
    the full layer's output (what TP with use_local_output=True computes)."""
    torch.manual_seed(0)
    cfg = k3_tiny()
    if kind == "kda":
        module = KimiDeltaAttention(cfg)
        rows = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv.weight",
                "k_conv.weight", "v_conv.weight", "beta_proj.weight", "decay_up.weight",
                "decay_bias", "a_log", "gate_proj.weight"]
    else:
        module = GatedMLA(cfg)
        rows = ["q_b.weight", "kv_b.weight", "gate_proj.weight"]
    heads = module.num_heads
    lengths = [40, 3, 21]
    x = torch.randn(1, sum(lengths), cfg.hidden_size)
    cu = cu_seqlens_from_lengths([lengths], sum(lengths))
    segments = segment_ids(cu, sum(lengths)).view(1, -1)
    full = module(x, cu, segments)
    parts = [_head_shard(module, {0: rows, 1: ["o_proj.weight"]}, heads, i)(x, cu, segments)
             for i in range(heads)]
    assert_close_rms(full, sum(parts), 1e-5, f"{kind} head shards")


def test_float64_model_gradients_do_not_depend_on_the_batch_split():
    """A float64 model computes in float64 throughout (model/dtypes.py): the gradient of a batch
    equals the sum of its halves' gradients to round-off (1e-12), as data parallelism needs
    when parallel layouts are compared exactly. A cast to fp32 anywhere shows up here (seen:
    5.7e-7 on KDA's a_log and 5e-7 on the AttnRes queries)."""
    torch.manual_seed(0)
    rows = torch.randint(1, 2048, (4, 33), generator=torch.Generator().manual_seed(7))

    def grads(parts):
        torch.manual_seed(0)
        model = K3Model(k3_tiny()).double()
        for part in parts:
            cu = torch.arange(part.shape[0] + 1) * 32
            batch = K3Batch(part[:, :-1].contiguous(), part[:, 1:].contiguous(), cu)
            model(batch).loss_sum.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    whole, halves = grads([rows]), grads([rows[:2], rows[2:]])
    assert whole.keys() == halves.keys()
    for name, grad in whole.items():
        assert_close_rms(grad, halves[name], 1e-12, name)
