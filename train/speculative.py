"""Speculative decoding with a draft model (Leviathan et al. 2023; Chen et al. 2023): each
round the draft proposes k tokens one by one from its own cache, the target scores them in one
decode call, and each row keeps the longest prefix the rule below accepts plus one token of the
target's, so the completions are distributed exactly as the target's own sampling (greedy: the
same tokens).

The rule, with p_j and q_j the target's and the draft's next-token distributions at draft
position j (after temperature and top-p, as plain sampling draws from them): draft token d_j is
kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the row's next token
is drawn from max(0, p_j - q_j) renormalised, and when all k are kept from p_{k+1}. Greedy keeps
d_j while it is the target's argmax, then takes the target's argmax.

Rolling back: a row's caches must end at its last kept token, while the proposal and the
verification wrote all k. The caches are snapshotted before each round and, unless every row
kept everything, restored and fed the kept tokens with the new one (per-row lengths): KDA's
states and convolution tails end where they should by recomputing those positions (at most
k + 1 per row), not from per-position states, which the chunk form does not return.
"""

from __future__ import annotations

import torch

from model.k3 import K3Model

from .generate import (
    _masked,
    _padded,
    _prefill,
    _Ranks,
    _Rows,
    next_token_distribution,
    top_p_filter,
)


def verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, greedy: bool,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept drafts per row n [B], the row's next token [B]) from the target's log-probabilities
    p [B, k + 1, V], the draft's q [B, k, V] (-inf outside a nucleus) and its tokens drafts
    [B, k] (module docstring)."""
    B, k = drafts.shape
    target = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    if greedy:
        kept = target == p[:, :k].amax(dim=-1)
    else:
        ratio = (target - q.gather(-1, drafts[..., None]).squeeze(-1)).exp()
        uniform = torch.rand(B, k, generator=generator, device=p.device, dtype=ratio.dtype)
        kept = uniform < ratio
    n = kept.long().cumprod(dim=-1).sum(dim=-1)  # the leading kept ones
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, n]
    if greedy:
        return n, p_next.argmax(dim=-1)
    # q of the position after the last draft is 0: its residual is p_{k+1} itself.
    q_next = torch.cat([q, torch.full_like(q[:, :1], float("-inf"))], dim=1)[rows, n]
    residual = (p_next.exp() - q_next.exp()).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next.exp())
    return n, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


def _processed(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """What the sampler draws from: log-probabilities after temperature and top-p."""
    return top_p_filter(next_token_distribution(logits, temperature), top_p)


def _draw(logprobs: torch.Tensor, greedy: bool, generator) -> torch.Tensor:
    if greedy:
        return logprobs.argmax(dim=-1)
    return torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)


def speculative_rounds(model: K3Model, draft: K3Model, prompts, width: int, rows: _Rows, k: int,
                       temperature: float, top_p: float, generator, ranks: _Ranks) -> None:
    """Fills `rows` (train.generate) round by round until every rank's rows are done; the
    prompts right-padded to `width`. The ranks of a layout take the same branch and widths."""
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"draft has vocab_size={draft.cfg.vocab_size}, the model "
                         f"{model.cfg.vocab_size}: a draft proposes the model's tokens")
    greedy = temperature == 0

    def last(m: K3Model, tokens, cache, lengths) -> torch.Tensor:
        """Next-token logits after each row's last token; zeros for finished rows."""
        return _masked(m.decode(tokens, cache, lengths=lengths, last_only=True)[:, 0],
                       rows.active)

    target_cache, p_next = _prefill(model, prompts, width)
    draft_cache, q_next = _prefill(draft, prompts, width)
    p_next, q_next = _masked(p_next, rows.active), _masked(q_next, rows.active)
    while not ranks.all(rows.done()):
        lengths = rows.active.long()
        target_snapshot, draft_snapshot = target_cache.snapshot(), draft_cache.snapshot()
        drafts, q = [], []
        for _ in range(k):
            q.append(_processed(q_next, temperature, top_p))
            drafts.append(_draw(q[-1], greedy, generator))
            q_next = last(draft, drafts[-1][:, None], draft_cache, lengths)
        drafts_t = torch.stack(drafts, dim=1)
        scored = _masked(model.decode(drafts_t, target_cache, lengths=lengths * k),
                         rows.active)
        p_logits = torch.cat([p_next[:, None], scored], dim=1)  # p_1 .. p_{k+1}
        n, token = verify(_processed(p_logits, temperature, top_p), torch.stack(q, dim=1),
                          drafts_t, greedy, generator)
        # Log-probabilities as plain sampling reports them (before top-p).
        reported = next_token_distribution(p_logits, temperature)
        new = torch.cat([drafts_t, token[:, None]], dim=1)
        new[torch.arange(len(new)), n] = token  # the kept drafts, then the row's own token
        logprobs = reported[:, :k + 1].gather(-1, new[..., None]).squeeze(-1)
        kept = n.tolist()  # the round's host read
        tokens = [row[:m + 1] for row, m in zip(new.tolist(), kept)]
        taken = rows.append(tokens, [row[:m + 1] for row, m in zip(logprobs.tolist(), kept)])
        if ranks.all(rows.done()):
            return
        # Finished rows take padding positions from here on.
        counts = torch.tensor(taken, device=n.device) * rows.active
        if ranks.all(all(m == k for m in kept)):  # every draft kept: the caches end at d_k
            fed, counts = token[:, None], rows.active.long()
        else:  # back to the round's start, then the kept tokens and the new one
            target_cache = model.new_cache(len(kept), from_snapshot=target_snapshot)
            draft_cache = draft.new_cache(len(kept), from_snapshot=draft_snapshot)
            fed = _padded([row[:c] for row, c in zip(tokens, taken)], model.cfg.pad_token_id,
                          n.device, ranks.max(max(taken))[0])
        p_next = last(model, fed, target_cache, counts)
        q_next = last(draft, fed, draft_cache, counts)
