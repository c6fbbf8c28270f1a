"""The training half of post-training (train/posttrain/objective.py) on a float64 k3_tiny: which
positions carry a loss (the model's tokens, not the prompt's or a tool observation's, not
stale ones), the RL and both MOPD losses against plain references computed from the model's
logits, and each row scored against its own domain's teacher."""

from __future__ import annotations

import functools

import pytest
import torch

from model.batch import K3Batch
from model.config import k3_tiny, replace
from model.head import IGNORE_INDEX
from model.k3 import K3Model
from train.posttrain.episodes import OBSERVATION, Episode
from train.posttrain.objective import Objective, Row, rows_of, trained_tokens

SEQ = 24


@functools.cache
def _model(seed: int, extra_layers: int = 0) -> K3Model:
    cfg = k3_tiny()
    cfg = replace(cfg, vision=None, moe=replace(cfg.moe, dispatch="loop"),
                  num_layers=cfg.num_layers + extra_layers)
    return K3Model(cfg, seed=seed).double()


def _episode(uid: int, domain: str, n_prompt: int, n_new: int, seed: int) -> Episode:
    g = torch.Generator().manual_seed(seed)
    e = Episode(uid, uid // 2, f"t{uid}", domain, torch.randint(20, 2000, (n_prompt,),
                                                                 generator=g).tolist())
    e.append(torch.randint(20, 2000, (n_new,), generator=g).tolist(),
             (-torch.rand(n_new, generator=g, dtype=torch.float64) * 3).tolist(), [0] * n_new)
    e.finish_reason, e.reward = "stop", float(torch.rand((), generator=g))
    return e


def _rows(domains=("a", "a", "b", "b")) -> list[Row]:
    episodes = [_episode(i, d, 5 + i % 4, 7 + 2 * (i % 4), seed=i) for i, d in enumerate(domains)]
    groups = [episodes[i:i + 2] for i in range(0, len(episodes), 2)]
    return rows_of(groups, {"a": 0, "b": 1}.get)


def _batch(objective: Objective, rows, **kw):
    args = dict(dp_rank=0, dp=1, micro=len(rows), seq_len=SEQ, pad_id=0, version=0,
                max_staleness=-1, device=torch.device("cpu"))
    return objective.micro_batches(rows, **{**args, **kw})


def _log_softmax(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        logits = model(K3Batch(tokens, tokens, None), return_logits=True).logits
    return torch.log_softmax(logits, dim=-1)


def test_the_loss_is_on_the_models_fresh_tokens_only():
    """Prompt [4 tokens], then two model tokens of version 0, a two-token tool observation and
    one token of version 1, trained at version 1: position t predicts token t + 1, so positions
    3, 4 and 7 predict the model's tokens; with max_staleness 0 the version-0 ones drop out."""
    e = Episode(0, 0, "t", "a", [10, 11, 12, 13])
    e.append([20, 21], [-0.5, -0.25], [0, 0])
    e.append([30, 31], [0.0, 0.0], [OBSERVATION, OBSERVATION])
    e.append([22], [-1.0], [1])
    e.finish_reason = "stop"
    row = Row(e, 0.5, -1)
    objective = Objective("rl", 0.2, 1.0)
    [mb] = _batch(objective, [row], version=1)
    labels = mb.labels[0].tolist()
    assert labels[:8] == [IGNORE_INDEX] * 3 + [20, 21, IGNORE_INDEX, IGNORE_INDEX, 22]
    assert set(labels[8:]) == {IGNORE_INDEX}
    assert mb.tokens[0, :9].tolist() == [10, 11, 12, 13, 20, 21, 30, 31, 22]
    side = objective.sides[0]
    assert side.rollout_logprobs[0, 3:8].tolist() == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert side.targets[0, :8].tolist() == [11, 12, 13, 20, 21, 30, 31, 22]
    [stale] = _batch(objective, [row], version=1, max_staleness=0)
    assert (stale.labels[0] != IGNORE_INDEX).nonzero().flatten().tolist() == [7]
    assert trained_tokens([row], 1, 0) == 1 and trained_tokens([row], 1, -1) == 3


def test_rows_take_group_normalised_advantages_and_their_domains_teacher():
    rows = _rows()
    for pair in (rows[:2], rows[2:]):
        rewards = torch.tensor([r.episode.reward for r in pair], dtype=torch.float64)
        expected = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        assert [r.advantage for r in pair] == pytest.approx(expected.tolist(), abs=1e-12)
    assert [r.teacher for r in rows] == [0, 0, 1, 1]


@pytest.mark.parametrize("mode, kl", [("rl", "sampled"), ("mopd", "sampled"), ("mopd", "full")])
def test_the_losses_equal_their_definitions_row_by_row(mode, kl):
    """loss_of's sum over a micro-batch of four rows (two domains, two teachers, one of them
    deeper than the student) equals, to 1e-12, the definition computed from each model's
    log-softmax row by row (rollout log-probabilities within ~0.3 of the student's, so some
    ratios clip): the clipped surrogate with the group advantage (RL), with -(log p_rollout -
    log p_teacher) of the row's own teacher (sampled MOPD), or the exact KL to it (full MOPD);
    and its gradient flows."""
    student, teachers = _model(0), [_model(1), _model(2, extra_layers=4)]  # one larger
    rows = _rows()
    objective = Objective(mode, 0.2, 1.0, kl, 0.0, teachers)
    [mb] = _batch(objective, rows)
    side = objective.sides[0]
    log_s = _log_softmax(student, mb.tokens)
    # Rollout log-probabilities near the student's own (ratios near 1, some clipped).
    g = torch.Generator().manual_seed(5)
    side.rollout_logprobs = (log_s.gather(-1, side.targets[..., None])[..., 0]
                             + 0.3 * torch.randn(side.targets.shape, generator=g,
                                                 dtype=torch.float64))
    loss = objective.loss_of(student, 0, mb)
    expected = torch.zeros((), dtype=torch.float64)
    for r, row in enumerate(rows):
        mask = mb.labels[r] != IGNORE_INDEX
        lp = log_s[r].gather(-1, side.targets[r, :, None])[:, 0]
        log_t = _log_softmax(teachers[row.teacher], mb.tokens[r:r + 1])[0]
        teacher_lp = log_t.gather(-1, side.targets[r, :, None])[:, 0]
        ratio = (lp - side.rollout_logprobs[r]).exp()
        if mode == "mopd" and kl == "full":
            per_token = (log_s[r].exp() * (log_s[r] - log_t)).sum(-1)
        else:
            advantage = (torch.full_like(lp, row.advantage) if mode == "rl"
                         else teacher_lp - side.rollout_logprobs[r])
            per_token = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
        expected = expected + per_token[mask].sum()
    assert abs(loss.item() - expected.item()) <= 1e-12 * max(1.0, abs(expected.item()))
    loss.backward()
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    student.zero_grad(set_to_none=True)


def test_teachers_run_only_for_micro_batches_that_need_them():
    """Rows of domain b only in the second micro-batch of rank 1 of 2: teacher 1 runs in that
    micro-batch on both ranks (its forward is a collective), teacher 0 where any rank has a."""
    rows = _rows(("a", "a", "a", "a", "b", "a", "a", "b"))
    objective = Objective("mopd", 0.2, 1.0, "sampled", 0.0, [_model(1), _model(2)])
    for rank in range(2):
        _batch(objective, rows, dp_rank=rank, dp=2, micro=2)
        # rank 0 takes rows 0, 2, 4, 6; rank 1 rows 1, 3, 5, 7
        assert [s.needed for s in objective.sides] == [[0], [0, 1]]
