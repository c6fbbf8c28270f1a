"""The analytic FLOP count (k3-plan, MFU) against torch's FlopCounterMode on small configs."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from model.batch import K3Batch
from model.config import k3_tiny, replace
from model.k3 import K3Model
from model.vision.moonvit import MoonViT
from train.flops import forward_flops_per_token, training_flops_per_token, vision_forward_flops

aten = torch.ops.aten


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs):
    # torch has no formula for grouped_mm: every row of `a` meets one [K, N] expert matrix.
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _grouped_mm_backward_free(*args, **kwargs):
    return 0


def _cpu_sdpa(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _cpu_sdpa_backward(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
                       **kwargs):
    return sdpa_backward_flop_count(grad_out_shape, q_shape, k_shape, v_shape)


# torch registers the CUDA attention kernels only; the CPU one gets the same formula.
CUSTOM = {aten._grouped_mm: _grouped_mm,
          aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
          aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward}


@pytest.mark.parametrize("seq_len", [64, 256])
def test_analytic_flops_match_flop_counter(torch_forms, seq_len):
    """On the torch forms: FlopCounterMode cannot see inside the native CPU kernels (KDA's
    recurrence, attention)."""
    torch.manual_seed(0)
    # Full logits: the chunked loss recomputes the head's logits in backward, which (like
    # activation checkpointing) is extra work, not model FLOPs.
    cfg = replace(k3_tiny(), vision=None, loss_chunk_tokens=0)
    model = K3Model(cfg)
    batch_size = 2
    tokens = torch.randint(5, cfg.vocab_size, (batch_size, seq_len))
    batch = K3Batch(tokens, tokens.roll(-1, dims=1), None)
    forward = FlopCounterMode(display=False, custom_mapping=CUSTOM)
    with forward:
        out = model(batch)
    total = FlopCounterMode(display=False, custom_mapping=CUSTOM)
    with total:
        out = model(batch)
        out.loss_sum.backward()
    n = batch_size * seq_len
    # The masked dense attention kernel computes the full T x T score matrix, and on CPU it
    # runs with v zero-padded to the q/k head dim (model/ops/attention.py), which costs extra.
    m = cfg.mla
    cpu_v_padding = (2 * m.num_heads * seq_len * (m.qk_head_dim - m.v_head_dim)
                     * cfg.layer_types().count("mla"))
    expected_forward = forward_flops_per_token(cfg, seq_len, causal=False) + cpu_v_padding
    assert forward.get_total_flops() / n == pytest.approx(expected_forward, rel=1e-3)
    # Training = 3x forward is the MFU convention (backward = 2x forward for every matmul);
    # attention backward really costs 2.5x its forward, so the measured total is a little more.
    measured_ratio = total.get_total_flops() / forward.get_total_flops()
    assert 3.0 <= measured_ratio <= 3.1, f"(forward+backward)/forward = {measured_ratio:.3f}"
    assert training_flops_per_token(cfg, seq_len) == 3 * forward_flops_per_token(cfg, seq_len)


def test_vision_flops_match_flop_counter():
    """Images of two sizes and a video of 6 frames (a chunk of 4 and one of 2): the patch
    embedding, blocks, per-segment attention and projector as FlopCounterMode counts them."""
    torch.manual_seed(0)
    cfg = k3_tiny()
    vision = MoonViT(cfg.vision, cfg.hidden_size)
    grid_thw = [[1, 4, 6], [6, 2, 4], [1, 8, 8]]
    patches = torch.randn(sum(t * h * w for t, h, w in grid_thw), cfg.vision.patch_dim)
    counter = FlopCounterMode(display=False, custom_mapping=CUSTOM)
    with counter:
        vision(patches, torch.tensor(grid_thw))
    assert counter.get_total_flops() == vision_forward_flops(cfg, grid_thw)
    assert vision_forward_flops(cfg, []) == 0
