"""The training half of an iteration: finished groups -> training rows on each data-parallel
rank -> the RL or MOPD loss of each micro-batch (a `loss_of` for train.loop.train_step).

A row is one episode, prompt and all, right-padded to the step's width: the longest episode of
the global batch rounded up to a multiple of WIDTH_MULTIPLE (at most `stage.seq_len`; every
rank's rows are as wide, for the collectives of sequence and expert parallelism). Position t
predicts token t + 1; it carries a loss when that token is the model's (not the prompt's, not a tool
observation's) and was sampled by weights at most `rollout.max_staleness` steps old. The loss is
averaged over those tokens of the whole global batch (the loop divides by their count).

- RL: the clipped importance-ratio surrogate with each episode's group-normalised advantage.
- MOPD, `mopd.kl=full`: the exact KL(student || teacher) at every such token, against the
  teacher of the episode's domain; `mopd.kl=sampled`: the surrogate with each token's own
  advantage -(log p_rollout(y) - log p_teacher(y)). Either plus `mopd.reward_weight` times the
  RL surrogate of the outcome reward.

Every rank runs the same number of micro-batches (rows of a short rank are padding), and every
teacher that any rank's micro-batch needs runs on all ranks: their forwards are collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model.batch import K3Batch
from model.head import IGNORE_INDEX

from .episodes import OBSERVATION, Episode
from .losses import (
    group_advantages,
    policy_gradient_per_token,
    token_logprobs,
    token_reverse_kl,
)

WIDTH_MULTIPLE = 64  # a multiple of every power-of-two count of sequence-parallel shards up to it


@dataclass
class Row:
    episode: Episode
    advantage: float  # its group-normalised reward
    teacher: int  # the index of its domain's teacher (-1: RL, none)


def rows_of(groups: list[list[Episode]], teacher_of=None) -> list[Row]:
    """Training rows of finished groups, in group order."""
    rows = []
    for group in groups:
        advantages = group_advantages(torch.tensor([[e.reward for e in group]],
                                                   dtype=torch.float64))[0].tolist()
        for e, advantage in zip(group, advantages):
            rows.append(Row(e, advantage, -1 if teacher_of is None else teacher_of(e.domain)))
    return rows


def _fresh(versions: list[int], version: int, max_staleness: int) -> list[bool]:
    """Which of an episode's tokens the loss trains on: the model's, recent enough."""
    return [v != OBSERVATION and (max_staleness < 0 or version - v <= max_staleness)
            for v in versions]


def trained_tokens(rows: list[Row], version: int, max_staleness: int) -> int:
    """The loss tokens of the global batch of `rows`."""
    return sum(sum(_fresh(r.episode.versions, version, max_staleness)) for r in rows)


@dataclass
class _Side:
    """What a micro-batch's loss needs beside its tokens and labels."""

    targets: torch.Tensor  # [b, S] the next token at every position (0 where none)
    rollout_logprobs: torch.Tensor  # [b, S]
    advantages: torch.Tensor  # [b, S]
    teachers: torch.Tensor  # [b] (-1: padding or none)
    needed: list[int]  # teachers some rank's micro-batch i needs


class Objective:
    def __init__(self, mode: str, clip: float, temperature: float, kl: str = "sampled",
                 reward_weight: float = 0.0, teachers: list[torch.nn.Module] = ()):
        self.mode, self.clip, self.temperature = mode, clip, temperature
        self.kl, self.reward_weight, self.teachers = kl, reward_weight, list(teachers)
        self.sides: list[_Side] = []
        self.kl_sum: torch.Tensor | None = None  # the step's summed per-token KL estimate

    def micro_batches(self, rows: list[Row], dp_rank: int, dp: int, micro: int, seq_len: int,
                      pad_id: int, version: int, max_staleness: int,
                      device: torch.device) -> list[K3Batch]:
        """This rank's micro-batches of the global `rows` (every dp-th row from its own); the
        loss's side tensors are kept for loss_of."""
        longest = max(len(r.episode.prompt) + len(r.episode.tokens) for r in rows)
        width = min(seq_len, math.ceil(longest / WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
        if longest > seq_len:
            raise ValueError(f"an episode has {longest} tokens, more than stage.seq_len="
                             f"{seq_len}")
        per_rank = math.ceil(len(rows) / dp)
        count = math.ceil(per_rank / micro)
        shares = [rows[r::dp] + [None] * (count * micro - len(rows[r::dp])) for r in range(dp)]
        self.sides, self.kl_sum = [], torch.zeros((), dtype=torch.float64, device=device)
        batches = []
        for i in range(count):
            mine = shares[dp_rank][i * micro:(i + 1) * micro]
            needed = sorted({row.teacher for share in shares
                             for row in share[i * micro:(i + 1) * micro]
                             if row is not None and row.teacher >= 0})
            batch, side = _tensors(mine, width, pad_id, version, max_staleness)
            side.needed = needed
            batches.append(batch.to(device))
            self.sides.append(_Side(*(t.to(device) for t in (side.targets,
                                                            side.rollout_logprobs,
                                                            side.advantages, side.teachers)),
                                    needed))
        return batches

    def loss_of(self, model: torch.nn.Module, i: int, mb: K3Batch) -> torch.Tensor:
        """The micro-batch's loss summed over its loss tokens."""
        side = self.sides[i]
        mask = mb.labels != IGNORE_INDEX
        logits = _logits(model, mb)
        logprobs = token_logprobs(logits, side.targets, self.temperature)
        if self.mode == "rl":
            per_token = policy_gradient_per_token(logprobs, side.rollout_logprobs,
                                                  side.advantages, self.clip)
            estimate = side.rollout_logprobs - logprobs.detach()
        elif self.kl == "full":
            kl = self._by_teacher(side, mb, lambda t: token_reverse_kl(logits, t,
                                                                        self.temperature))
            per_token, estimate = kl, kl.detach()
        else:
            teacher_lp = self._by_teacher(side, mb, lambda t: token_logprobs(
                t, side.targets, self.temperature))
            estimate = side.rollout_logprobs - teacher_lp
            per_token = policy_gradient_per_token(logprobs, side.rollout_logprobs, -estimate,
                                                  self.clip)
        if self.mode == "mopd" and self.reward_weight > 0:
            per_token = per_token + self.reward_weight * policy_gradient_per_token(
                logprobs, side.rollout_logprobs, side.advantages, self.clip)
        self.kl_sum = self.kl_sum + (estimate.double() * mask).sum()
        return (per_token * mask).sum()

    def _by_teacher(self, side: _Side, mb: K3Batch, per_token) -> torch.Tensor:
        """per_token(teacher logits) [b, S] of each row's own teacher (every needed teacher runs
        forward-only on the whole micro-batch; rows of none get zeros)."""
        out = torch.zeros(side.targets.shape, dtype=torch.float64, device=side.targets.device)
        for k in side.needed:
            with torch.no_grad():
                teacher_logits = _logits(self.teachers[k], mb)
            value = per_token(teacher_logits)
            out = torch.where(side.teachers[:, None] == k, value.to(out.dtype), out)
        return out


def _logits(model: torch.nn.Module, mb: K3Batch) -> torch.Tensor:
    """The model's logits [b, S, V] (vocabulary-sharded under tensor parallelism) through its
    forward (which a layout's hooks wrap); its own token loss is given no labels."""
    blank = K3Batch(mb.tokens, torch.full_like(mb.labels, IGNORE_INDEX), None)
    return model(blank, return_logits=True).logits


def _tensors(rows: list[Row | None], seq_len: int, pad_id: int, version: int,
             max_staleness: int) -> tuple[K3Batch, _Side]:
    b = len(rows)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_len), IGNORE_INDEX, dtype=torch.long)
    targets = torch.zeros((b, seq_len), dtype=torch.long)
    rollout = torch.zeros((b, seq_len), dtype=torch.float64)
    advantages = torch.zeros((b, seq_len), dtype=torch.float64)
    teachers = torch.full((b,), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        if row is None:
            continue
        e = row.episode
        seq = e.prompt + e.tokens
        n, start = len(seq), len(e.prompt) - 1  # position start predicts the first new token
        tokens[r, :n] = torch.tensor(seq)
        targets[r, :n - 1] = torch.tensor(seq[1:])
        if not e.tokens:
            continue
        trained = torch.tensor(_fresh(e.versions, version, max_staleness), dtype=torch.bool)
        span = slice(start, start + len(e.tokens))
        labels[r, span] = torch.where(trained, torch.tensor(e.tokens), IGNORE_INDEX)
        rollout[r, span] = torch.tensor(e.logprobs, dtype=torch.float64)
        advantages[r, span] = row.advantage
        teachers[r] = row.teacher
    return K3Batch(tokens, labels, None), _Side(targets, rollout, advantages, teachers, [])
