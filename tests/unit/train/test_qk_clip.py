"""QK-Clip (train/optim/qk_clip.py) on a small gated-MLA logit computation (SPEC 3 and 7)."""

from __future__ import annotations

import torch

from tests.helpers.static_shapes import assert_static, record
from train.optim.qk_clip import qk_clip_

H, NOPE, ROPE, V = 4, 16, 8, 12
Q_LORA, KV_LORA, T = 24, 20, 10


def _max_logits(q_b, kv_b, cq, ckv, k_rope) -> torch.Tensor:
    """Per-head max causal pre-softmax logit, as gated MLA computes it (NoPE, shared k_rope)."""
    q = (cq @ q_b.T).view(T, H, NOPE + ROPE)
    k_nope = (ckv @ kv_b.T).view(T, H, NOPE + V)[..., :NOPE]
    logits = (torch.einsum("ihd,jhd->hij", q[..., :NOPE], k_nope)
              + torch.einsum("ihd,jd->hij", q[..., NOPE:], k_rope)) / (NOPE + ROPE) ** 0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).amax(dim=(1, 2))


def _setup():
    # Heads of growing magnitude, so that a tau between them clips some and spares others.
    head_scale = torch.arange(1, H + 1, dtype=torch.float32).repeat_interleave(NOPE + ROPE)
    q_b = torch.randn(H * (NOPE + ROPE), Q_LORA) * head_scale[:, None]
    kv_b = torch.randn(H * (NOPE + V), KV_LORA)
    cq, ckv, k_rope = torch.randn(T, Q_LORA), torch.randn(T, KV_LORA), torch.randn(T, ROPE)
    return q_b, kv_b, cq, ckv, k_rope


def test_clipped_heads_reach_tau_and_others_are_untouched():
    q_b, kv_b, cq, ckv, k_rope = _setup()
    k_rope_before = k_rope.clone()
    before = _max_logits(q_b, kv_b, cq, ckv, k_rope)
    tau = float(before.sort().values[H // 2 - 1:H // 2 + 1].mean())  # half the heads above
    clipped = before > tau
    assert 0 < int(clipped.sum()) < H

    q_b0, kv_b0 = q_b.clone(), kv_b.clone()
    count = qk_clip_(q_b, kv_b, before, tau, H, NOPE, ROPE, V)
    after = _max_logits(q_b, kv_b, cq, ckv, k_rope)

    assert int(count) == int(clipped.sum())
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau),
                               rtol=1e-4, atol=0)  # every logit of a clipped head scales by gamma
    assert torch.equal(after[~clipped], before[~clipped])
    assert torch.equal(k_rope, k_rope_before)

    q_heads, q_heads0 = q_b.view(H, NOPE + ROPE, -1), q_b0.view(H, NOPE + ROPE, -1)
    kv_heads, kv_heads0 = kv_b.view(H, NOPE + V, -1), kv_b0.view(H, NOPE + V, -1)
    gamma = torch.where(clipped, tau / before, torch.ones(H))[:, None, None]
    torch.testing.assert_close(q_heads[:, :NOPE], q_heads0[:, :NOPE] * gamma.sqrt())
    torch.testing.assert_close(q_heads[:, NOPE:], q_heads0[:, NOPE:] * gamma)
    torch.testing.assert_close(kv_heads[:, :NOPE], kv_heads0[:, :NOPE] * gamma.sqrt())
    assert torch.equal(kv_heads[:, NOPE:], kv_heads0[:, NOPE:])  # v rows
    assert torch.equal(q_heads[~clipped], q_heads0[~clipped])
    assert torch.equal(kv_heads[~clipped], kv_heads0[~clipped])


def test_nothing_above_tau_changes_nothing():
    q_b, kv_b, cq, ckv, k_rope = _setup()
    max_logits = _max_logits(q_b, kv_b, cq, ckv, k_rope)
    q_b0, kv_b0 = q_b.clone(), kv_b.clone()
    count = qk_clip_(q_b, kv_b, max_logits, float(max_logits.max()) + 1.0, H, NOPE, ROPE, V)
    assert int(count) == 0 and torch.equal(q_b, q_b0) and torch.equal(kv_b, kv_b0)


def test_no_host_sync():
    q_b, kv_b, cq, ckv, k_rope = _setup()
    max_logits = _max_logits(q_b, kv_b, cq, ckv, k_rope)
    assert_static(record(qk_clip_, q_b, kv_b, max_logits, 1e9, H, NOPE, ROPE, V),
                  record(qk_clip_, q_b, kv_b, max_logits, 0.0, H, NOPE, ROPE, V))
