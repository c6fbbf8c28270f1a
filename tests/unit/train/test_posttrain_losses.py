"""Post-training losses (train/posttrain/losses.py) against plain float64 references: the
reverse KL and its gradient, the sampled estimate's mean against the full KL within its
standard error, group advantages, and the clipped policy-gradient loss's gradient against a
hand-derived case."""

from __future__ import annotations

import math

import pytest
import torch

from train.posttrain.losses import (
    group_advantages,
    policy_gradient_loss,
    reverse_kl,
    sampled_reverse_kl,
)


def _logits(seed: int, shape=(2, 5, 11)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * 2


def test_reverse_kl_equals_the_float64_definition_and_its_gradient():
    student = _logits(0).requires_grad_()
    teacher = _logits(1)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    temperature = 0.7
    got = reverse_kl(student, teacher, mask, temperature)
    terms = []
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                p = torch.softmax(student[b, t] / temperature, -1)
                q = torch.softmax(teacher[b, t] / temperature, -1)
                terms.append(sum(p[v] * (p[v] / q[v]).log() for v in range(11)))
    reference = torch.stack(terms).mean()
    assert torch.allclose(got, reference, rtol=1e-12, atol=0)
    grad, = torch.autograd.grad(got, student)
    ref_grad, = torch.autograd.grad(reference, student)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert torch.all(grad[~mask] == 0)  # masked positions give nothing
    assert float(reverse_kl(teacher, teacher, mask)) == pytest.approx(0.0, abs=1e-14)


def test_the_sampled_estimate_averages_to_the_full_kl():
    """200000 draws y ~ p_s at one position: the mean of log p_s(y) - log p_t(y) is the full
    KL within 4 standard errors (measured 0.13; the teacher's own log-probability at the
    same draws, a wrong estimate, is hundreds away)."""
    student, teacher = _logits(2, (1, 1, 11)), _logits(3, (1, 1, 11))
    full = float(reverse_kl(student, teacher, torch.ones(1, 1, dtype=torch.bool)))
    draws = torch.multinomial(torch.softmax(student[0, 0], -1), 200000, replacement=True,
                              generator=torch.Generator().manual_seed(4))
    estimates = sampled_reverse_kl(student.expand(200000, 1, 11), teacher.expand(200000, 1, 11),
                                   draws[:, None])[:, 0]
    error = abs(float(estimates.mean()) - full) / float(estimates.std() / math.sqrt(200000))
    assert error < 4, (float(estimates.mean()), full, error)


def test_group_advantages_normalise_within_each_prompts_samples():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))


def test_policy_gradient_loss_gradient_matches_the_hand_derived_case():
    """Two tokens, advantage +1 and -1, ratios 1.1 (inside the clip range) and 0.7 (below
    1 - 0.2 with a negative advantage: clipped, no gradient). Loss = -(1.1 * 1 + 0.8 * -1) / 2;
    d/dlogprob of the first = -ratio * A / 2 = -0.55, of the second 0."""
    rollout = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    logprobs = (rollout + torch.log(torch.tensor([[1.1, 0.7]], dtype=torch.float64)))
    logprobs.requires_grad_()
    advantages = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss = policy_gradient_loss(logprobs, rollout, advantages, mask, clip=0.2)
    assert float(loss.detach()) == pytest.approx(-(1.1 - 0.8) / 2, rel=1e-12)
    grad, = torch.autograd.grad(loss, logprobs)
    assert torch.allclose(grad, torch.tensor([[-0.55, 0.0]], dtype=torch.float64), atol=1e-12)


def test_reverse_kl_equals_trls_generalized_jsd_at_beta_one():
    """TRL's GKD loss at beta=1 is KL(student || teacher) averaged over the labelled tokens
    (optional: where TRL is installed)."""
    pytest.importorskip("trl")
    try:
        from trl import GKDTrainer
    except ImportError:  # newer TRL keeps it among the experimental trainers
        from trl.experimental.gkd import GKDTrainer
    student, teacher = _logits(0), _logits(1)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    labels = torch.where(mask, 0, -100)
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=1.0,
                                             temperature=0.7)
    torch.testing.assert_close(reverse_kl(student, teacher, mask, temperature=0.7),
                               theirs.to(torch.float64), rtol=1e-6, atol=1e-9)
