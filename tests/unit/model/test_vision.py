"""MoonViT-V2: patch layout, NaViT packing, position tables, 2-D RoPE, temporal pooling, 2x2 merge,
token counts, parameter count and gradient flow."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import model.ops.attention as attention
from model.batch import segment_ids
from model.config import VisionConfig, k3_tiny
from model.vision import (
    MoonViT,
    build_layout,
    interpolate_pos_table,
    merge_tokens,
    pack_visuals,
    patchify_image,
    patchify_video,
    vision_token_count,
)
from model.vision.encoder import VisionAttention
from model.vision.rope import apply_axial_rope, axial_rope_angles
from tests.helpers.tolerances import assert_close_rms, rel_rms

LM_HIDDEN = 48


@pytest.fixture
def cfg() -> VisionConfig:
    cfg = k3_tiny().vision  # hidden 64, 2 layers, 2 heads x 32, pos table 16, time table 4
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim) == (64, 2, 2, 32)
    return cfg


@pytest.fixture
def model(cfg) -> MoonViT:
    return MoonViT(cfg, LM_HIDDEN)


def _random_patches(cfg: VisionConfig, grids) -> torch.Tensor:
    return torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim)


def _split(x: torch.Tensor, lengths) -> list[torch.Tensor]:
    return list(torch.split(x, list(lengths)))


def _naive_merge(grid: torch.Tensor, m: int) -> torch.Tensor:
    """[h, w, C] -> [(h/m)*(w/m), m*m*C] with explicit loops."""
    h, w, _ = grid.shape
    tokens = []
    for i in range(h // m):
        for j in range(w // m):
            tokens.append(torch.cat([grid[i * m + di, j * m + dj]
                                     for di in range(m) for dj in range(m)]))
    return torch.stack(tokens)


def test_patchify_is_row_major_and_linear_embedding_equals_stride_conv(cfg):
    p = cfg.patch_size
    image = torch.randn(cfg.in_channels, 2 * p, 3 * p)
    patches = patchify_image(image, p)
    naive = torch.stack([image[:, i * p:(i + 1) * p, j * p:(j + 1) * p].reshape(-1)
                         for i in range(2) for j in range(3)])
    assert torch.equal(patches, naive)

    video = torch.randn(3, cfg.in_channels, 2 * p, 2 * p)
    assert torch.equal(patchify_video(video, p),
                       torch.cat([patchify_image(frame, p) for frame in video]))

    weight = torch.randn(cfg.hidden_size, cfg.patch_dim)
    conv = F.conv2d(image[None], weight.view(-1, cfg.in_channels, p, p), stride=p)
    assert_close_rms(conv[0].flatten(1).T, patches @ weight.T, 1e-6, "linear vs conv embedding")


def test_pack_visuals_grid_and_size_check(cfg):
    unit = cfg.patch_size * cfg.merge_size
    patches, grid_thw = pack_visuals(
        [torch.randn(3, 2 * unit, unit), torch.randn(5, 3, unit, 3 * unit)], cfg)
    assert grid_thw.tolist() == [[1, 4, 2], [5, 2, 6]]
    assert patches.shape == (8 + 5 * 12, cfg.patch_dim)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        pack_visuals([torch.randn(3, unit + cfg.patch_size, unit)], cfg)


def test_layout_positions_and_segments(cfg):
    grids = [(1, 2, 4), (6, 2, 2)]  # an image, then a video of chunks of 4 and 2 frames
    layout = build_layout(grids, cfg)
    rows, cols, frames = [], [], []
    for t, h, w in grids:
        for f in range(t):
            for r in range(h):
                for c in range(w):
                    rows.append(r)
                    cols.append(c)
                    frames.append(f % cfg.time_table_size)
    assert layout.rows.tolist() == rows
    assert layout.cols.tolist() == cols
    assert layout.frame_in_chunk.tolist() == frames
    assert layout.cu_seqlens.tolist() == [0, 8, 8 + 16, 8 + 16 + 8]


def test_packed_call_equals_separate_calls(cfg, model):
    grids = [(1, 4, 6), (1, 6, 4), (1, 2, 2), (5, 4, 2), (1, 8, 8)]
    patches = _random_patches(cfg, grids)
    counts = vision_token_count(grids, cfg)
    probe = torch.randn(sum(counts), LM_HIDDEN)

    packed = model(patches, grids)
    (packed * probe).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    separate = []
    for grid, item_patches, item_probe in zip(
            grids, _split(patches, [t * h * w for t, h, w in grids]), _split(probe, counts)):
        out = model(item_patches, [grid])
        (out * item_probe).sum().backward()
        separate.append(out.detach())
    errors = {"output": rel_rms(torch.cat(separate), packed)}
    assert_close_rms(torch.cat(separate), packed, 5e-3, "packed output")
    for name, param in model.named_parameters():
        errors[name] = rel_rms(param.grad, packed_grads[name])
        assert_close_rms(param.grad, packed_grads[name], 5e-3, f"grad {name}")
    print(f"packed vs separate: max rel RMS {max(errors.values()):.2e}")


def test_pos_table_identity_at_native_size_and_bilinear_elsewhere(cfg):
    size, channels = cfg.pos_table_size, 5
    table = torch.randn(size, size, channels)
    assert torch.equal(interpolate_pos_table(table, size, size), table.reshape(-1, channels))

    rows, cols = 6, 22  # shrink one axis, stretch the other
    naive = torch.empty(rows, cols, channels)
    for i in range(rows):
        for j in range(cols):
            # align_corners=False: output centre (i + 0.5) maps to source (i + 0.5) * scale - 0.5
            y = max((i + 0.5) * size / rows - 0.5, 0.0)
            x = max((j + 0.5) * size / cols - 0.5, 0.0)
            y0, x0 = min(int(y), size - 1), min(int(x), size - 1)
            y1, x1 = min(y0 + 1, size - 1), min(x0 + 1, size - 1)
            fy, fx = y - y0, x - x0
            naive[i, j] = ((1 - fy) * ((1 - fx) * table[y0, x0] + fx * table[y0, x1])
                           + fy * ((1 - fx) * table[y1, x0] + fx * table[y1, x1]))
    assert_close_rms(naive.reshape(-1, channels), interpolate_pos_table(table, rows, cols), 1e-6,
                     "bilinear interpolation")


def _rotated_dot(q, k, q_pos, k_pos, head_dim, theta=10000.0):
    positions = torch.tensor([q_pos, k_pos])
    angles = axial_rope_angles(positions[:, 0], positions[:, 1], head_dim, theta)
    rotated = apply_axial_rope(torch.stack([q, k]).unsqueeze(1), angles)[:, 0]
    return (rotated[0] * rotated[1]).sum()


def test_rope_depends_only_on_relative_position(cfg):
    head_dim = cfg.head_dim
    q, k = torch.randn(2, head_dim, dtype=torch.float64).unbind(0)
    base = _rotated_dot(q, k, (3, 7), (1, 2), head_dim)
    for shift in [(5, 0), (0, 9), (11, 4), (-1, -2)]:
        shifted = _rotated_dot(q, k, (3 + shift[0], 7 + shift[1]), (1 + shift[0], 2 + shift[1]),
                               head_dim)
        assert abs(float(shifted - base)) <= 1e-4 * abs(float(base)) + 1e-5, shift
    # Both axes matter: changing only the row or only the column offset changes the score.
    assert abs(float(_rotated_dot(q, k, (4, 7), (1, 2), head_dim) - base)) > 1e-3
    assert abs(float(_rotated_dot(q, k, (3, 8), (1, 2), head_dim) - base)) > 1e-3
    # The row half and the column half are separate: a column shift leaves the row half fixed.
    x = torch.randn(1, 1, head_dim)
    a = apply_axial_rope(x, axial_rope_angles(torch.tensor([2]), torch.tensor([0]), head_dim, 1e4))
    b = apply_axial_rope(x, axial_rope_angles(torch.tensor([2]), torch.tensor([5]), head_dim, 1e4))
    assert torch.equal(a[..., :head_dim // 2], b[..., :head_dim // 2])
    assert not torch.allclose(a[..., head_dim // 2:], b[..., head_dim // 2:])
    assert_close_rms(x.norm(), a.norm(), 1e-6, "rotation keeps the norm")


@pytest.mark.parametrize("frames", [1, 3, 4, 6, 9])
def test_video_chunks_match_explicit_reference(cfg, model, frames):
    """Each chunk of <= 4 frames is encoded as one attention segment, mean-pooled over its frames,
    merged and projected; the reference does each step by hand, one chunk at a time."""
    h, w, span, m = 4, 6, cfg.time_table_size, cfg.merge_size
    patches = _random_patches(cfg, [(frames, h, w)])
    out = model(patches, [(frames, h, w)])
    assert out.shape[0] == math.ceil(frames / span) * (h // m) * (w // m)

    expected = []
    for start in range(0, frames, span):
        count = min(span, frames - start)
        chunk = patches[start * h * w:(start + count) * h * w]
        features = model.encoder(chunk, build_layout([(count, h, w)], cfg))
        pooled = features.view(count, h, w, -1).mean(0)
        expected.append(model.projector(_naive_merge(pooled, m)))
    assert_close_rms(torch.cat(expected), out, 1e-5, f"{frames}-frame video")


def test_identical_frames_differ_from_an_image_only_by_the_time_table(cfg, model):
    """Attention over k identical copies of a frame equals attention over one, so with a zero time
    table a chunk of identical frames must reproduce the single image exactly."""
    h, w = 4, 4
    frame = _random_patches(cfg, [(1, h, w)])
    video = frame.repeat(4, 1)
    image_out = model(frame, [(1, h, w)])
    assert rel_rms(image_out, model(video, [(4, h, w)])) > 1e-2  # the time table breaks symmetry
    with torch.no_grad():
        model.encoder.time_table.zero_()
    assert_close_rms(model(frame, [(1, h, w)]), model(video, [(4, h, w)]), 1e-5, "4 copies")
    assert_close_rms(model(frame, [(1, h, w)]), model(frame.repeat(3, 1), [(3, h, w)]), 1e-5,
                     "3 copies")


def test_position_embedding_matches_a_table_per_frame(cfg, model):
    """Each frame gets its size's resized table, each patch the time-table row of its frame in
    the chunk: the layout's one gather per table against a loop over items and frames, forward
    and the tables' gradients (sizes repeated across images and videos)."""
    grids = [(1, 4, 6), (6, 2, 4), (1, 4, 6), (9, 4, 6), (1, 2, 2), (2, 2, 4)]
    layout = build_layout(grids, cfg)
    encoder = model.encoder
    embedding = encoder.position_embedding(layout)
    expected = []
    for t, h, w in grids:
        table = interpolate_pos_table(encoder.pos_table, h, w)
        expected += [table + encoder.time_table[f % cfg.time_table_size] for f in range(t)]
    expected = torch.cat(expected)
    assert_close_rms(expected, embedding, 1e-6, "position embedding")
    cotangent = torch.randn_like(expected)
    got = torch.autograd.grad(embedding, (encoder.pos_table, encoder.time_table), cotangent)
    want = torch.autograd.grad(expected, (encoder.pos_table, encoder.time_table), cotangent)
    for name, x, ref in zip(("pos_table", "time_table"), got, want, strict=True):
        assert_close_rms(ref, x, 1e-6, f"{name} gradient")


def test_merge_matches_naive_loop(cfg):
    grids = [(1, 4, 6), (6, 2, 4), (1, 6, 2)]
    layout = build_layout(grids, cfg)
    chunk_grids = [(h, w) for t, h, w in grids for _ in range(math.ceil(t / cfg.time_table_size))]
    pooled = torch.randn(sum(h * w for h, w in chunk_grids), 7)
    expected = [_naive_merge(chunk.view(h, w, -1), cfg.merge_size) for chunk, (h, w) in
                zip(_split(pooled, [h * w for h, w in chunk_grids]), chunk_grids)]
    assert torch.equal(merge_tokens(pooled, layout.merge_index), torch.cat(expected))


def test_token_count_matches_output_length(cfg, model):
    grids = [(1, 2, 2), (7, 4, 2), (1, 6, 8), (4, 2, 6), (2, 2, 2)]
    counts = vision_token_count(torch.tensor(grids), cfg)
    assert counts == [1, 2 * 2, 12, 3, 1]
    with torch.no_grad():
        assert model(_random_patches(cfg, grids), grids).shape == (sum(counts), LM_HIDDEN)
    with pytest.raises(ValueError, match="multiples of merge_size"):
        vision_token_count([(1, 3, 2)], cfg)


def test_default_config_parameter_count():
    with torch.device("meta"):
        model = MoonViT(VisionConfig(), lm_hidden=7168)
    total = sum(p.numel() for p in model.parameters())
    encoder = sum(p.numel() for p in model.encoder.parameters())
    print(f"MoonViT-V2 default: encoder {encoder:,}, projector {total - encoder:,}, "
          f"total {total:,}")
    assert 0.38e9 <= encoder <= 0.42e9
    assert 0.35e9 <= total <= 0.45e9


def test_gradients_reach_every_parameter(cfg, model):
    size = cfg.pos_table_size  # a native-size image touches every position-table entry
    grids = [(1, size, size), (cfg.time_table_size, 2, 4), (1, 2, 2)]
    out = model(_random_patches(cfg, grids), grids)
    (out * torch.randn_like(out)).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} gets no gradient"
    assert (model.encoder.pos_table.grad.abs().sum(-1) > 0).all()
    assert (model.encoder.time_table.grad.abs().sum(-1) > 0).all()


def _dense_vision_attention(attn: VisionAttention, x, angles, cu_seqlens):
    """The encoder's attention as it was before the blockwise op: sdpa with a dense [P, P]
    same-segment mask."""
    segments = segment_ids(cu_seqlens, x.shape[0])
    mask = segments[:, None] == segments[None, :]
    heads = (x.shape[0], attn.num_heads, attn.head_dim)
    q = apply_axial_rope(attn.q_proj(x).view(heads), angles)
    k = apply_axial_rope(attn.k_proj(x).view(heads), angles)
    v = attn.v_proj(x).view(heads)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask)
    return attn.o_proj(o.transpose(0, 1).flatten(1))


@pytest.mark.parametrize("lengths_known", [False, True], ids=["blockwise", "segments"])
def test_attention_equals_the_dense_masked_version(cfg, monkeypatch, lengths_known):
    """Several tiles over the packed patches, segment ends off the tile grid: the blockwise
    per-image attention, and with the segments' lengths given (the encoder's way) the
    per-length groups, give the dense-mask result, forward and backward."""
    monkeypatch.setattr(attention, "BLOCK_Q", 16)
    monkeypatch.setattr(attention, "BLOCK_K", 40)
    grids = [(1, 4, 6), (6, 2, 2), (1, 2, 2), (1, 6, 4)]  # segments 24, 16, 8, 4, 24 patches
    layout = build_layout(grids, cfg)
    attn = VisionAttention(cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    angles = axial_rope_angles(layout.rows, layout.cols, cfg.head_dim, cfg.rope_theta)
    x = torch.randn(layout.num_patches, cfg.hidden_size, requires_grad=True)
    probe = torch.randn(layout.num_patches, cfg.hidden_size)
    results = []
    seqlens = layout.seqlens if lengths_known else None
    for fn in (_dense_vision_attention, functools.partial(VisionAttention.forward,
                                                          seqlens=seqlens)):
        out = fn(attn, x, angles, layout.cu_seqlens)
        grads = torch.autograd.grad((out * probe).sum(), [x, *attn.parameters()])
        results.append([out, *grads])
    names = ["output", "grad x"] + [f"grad {n}" for n, _ in attn.named_parameters()]
    for name, ref, got in zip(names, *results):
        assert_close_rms(ref, got, 5e-3, name)
