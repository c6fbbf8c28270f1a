"""Losses of on-policy post-training, on single-device logits.

- `reverse_kl`: KL(student || teacher) per token, averaged over the masked positions; the
  full-vocabulary form of multi-teacher on-policy distillation (`mopd.kl=full`).
- `sampled_reverse_kl`: its one-sample estimate at the student's own sampled tokens,
  log p_s(y_t) - log p_t(y_t), the per-token signal of `mopd.kl=sampled` (used as a negative
  advantage); its mean over y ~ p_s is the full KL.
- `group_advantages` and `policy_gradient_loss`: GRPO-style group-normalised advantages over the
  samples of one prompt, and the clipped importance-ratio objective against the rollout's
  log-probabilities.

Logits are divided by `temperature` first (the distribution the samples were drawn from); every
reduction runs in fp32 or wider. The per-token forms (`token_logprobs`, `token_reverse_kl`,
`policy_gradient_per_token`) also take the vocabulary-sharded logits (DTensor) of a
tensor-parallel LM head, inside its loss context (torch's loss_parallel: a sharded log-softmax
and cross entropy, the vocabulary sum reduced over the shards), and return plain [B, T] tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from model.dtypes import upcast


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} is invalid: must be > 0")
    x = upcast(logits) / temperature
    if not isinstance(x, DTensor):
        return torch.log_softmax(x, dim=-1)
    # Vocabulary shards: from DTensor's own ops (max and sum over the shards reduced), not
    # aten's log-softmax, whose loss_parallel backward passes the gradient through unchanged
    # (it is only right beneath loss_parallel's cross entropy).
    shifted = x - x.detach().amax(dim=-1, keepdim=True)
    return shifted - shifted.exp().sum(dim=-1, keepdim=True).log()


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A per-token result as a plain tensor (a DTensor's reduced, replicated value)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at tokens [B, T] (ids in the vocabulary), [B, T]."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} is invalid: must be > 0")
    flat = (upcast(logits) / temperature).flatten(0, -2)
    per_token = F.cross_entropy(flat, tokens.reshape(-1), reduction="none")
    return -_whole(per_token).view(tokens.shape)


def token_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """KL(p_s || p_t) [B, T] of each position, p = softmax(logits / temperature)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits {list(student_logits.shape)} and teacher_logits "
                         f"{list(teacher_logits.shape)} must have one shape [B, T, V]")
    log_s = _log_probs(student_logits, temperature)
    log_t = _log_probs(teacher_logits, temperature)
    return _whole((log_s.exp() * (log_s - log_t)).sum(dim=-1))


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values [...] over mask [...] (0 for an empty mask)."""
    weights = mask.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """Token mean over `mask` [B, T] of KL(p_s || p_t), p = softmax(logits / temperature) of
    student and teacher logits [B, T, V]; differentiable in the student's logits (the teacher's
    are a target: pass them detached)."""
    return _masked_mean(token_reverse_kl(student_logits, teacher_logits, temperature), mask)


def sampled_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p_s(y) - log p_t(y) [B, T] at the sampled tokens y [B, T] (the student's own
    samples): an unbiased one-sample estimate of each position's KL(p_s || p_t)."""
    return (token_logprobs(student_logits, tokens, temperature)
            - token_logprobs(teacher_logits, tokens, temperature))


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, G] of G samples for each of P prompts -> (r - the group's mean) / (its
    standard deviation + eps); a group whose samples score alike gets zero advantages."""
    rewards = upcast(rewards)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def policy_gradient_per_token(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                              advantages: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """The clipped surrogate of each token, negated for minimisation, [B, T]:
    -min(r A, clip(r, 1 - clip, 1 + clip) A) with r = exp(logprobs - rollout_logprobs) the
    importance ratio of the current policy's log-probabilities [B, T] against those the tokens
    were sampled with, and A the advantages [B, T] (a sequence's, repeated over its tokens, or
    each token's own)."""
    ratio = (upcast(logprobs) - upcast(rollout_logprobs).detach()).exp()
    advantages = upcast(advantages).detach()
    clipped = ratio.clamp(1 - clip, 1 + clip)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def policy_gradient_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                         advantages: torch.Tensor, mask: torch.Tensor,
                         clip: float = 0.2) -> torch.Tensor:
    """`policy_gradient_per_token` averaged over `mask` [B, T]."""
    return _masked_mean(policy_gradient_per_token(logprobs, rollout_logprobs, advantages, clip),
                        mask)
