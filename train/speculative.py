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

One target call a round: the row's last accepted token (not yet in the target's cache) and the k
drafts, k + 1 positions whose logits are p_1 .. p_{k+1}. Both models decode the round with
checkpoints (the KDA states after each position) and each row rewinds to its last accepted
token (`DecodeCache.rewind`): nothing is recomputed; a rejected draft's slot stays behind as
padding. The draft's cache lags by its pending tokens: the round's new token, and the last draft
when all k were kept (the draft never decoded it).
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
    prompts right-padded to `width`. The ranks of a layout decode calls of the same widths."""
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"draft has vocab_size={draft.cfg.vocab_size}, the model "
                         f"{model.cfg.vocab_size}: a draft proposes the model's tokens")
    greedy = temperature == 0
    device, pad = rows.active.device, model.cfg.pad_token_id
    # Every prompt but its last token is prefilled; the last is fed with the first round.
    heads = [list(p[:-1]) for p in prompts]
    target_cache, draft_cache = (_prefill(m, heads, width - 1)[0] for m in (model, draft))
    last = torch.tensor([p[-1] if p else pad for p in prompts], device=device)
    pending = [[p[-1]] if p else [] for p in prompts]  # accepted, not in the draft's cache yet
    while not ranks.all(rows.done()):
        active = rows.active.clone()
        live = [not rows.finished(i) for i in range(len(rows.completions))]
        ones = active.long()
        # The draft: its pending tokens, then each draft but the last.
        lags = ranks.max(max(len(x) for x, a in zip(pending, live) if a) if any(live) else 1)[0]
        fed = _padded([x if a else [] for x, a in zip(pending, live)], pad, device, lags)
        counts = torch.tensor([len(x) for x in pending], device=device) * active
        q_logits = _next_logits(draft, fed, draft_cache, counts, active)
        drafts, q = [], []
        for j in range(k):
            q.append(_processed(q_logits, temperature, top_p))
            drafts.append(_draw(q[-1], greedy, generator))
            if j < k - 1:
                q_logits = _next_logits(draft, drafts[-1][:, None], draft_cache, ones, active)
        drafts_t = torch.stack(drafts, dim=1)
        # The target: the last accepted token and the drafts, p_1 .. p_{k+1} in one call.
        p_logits = _masked(model.decode(torch.cat([last[:, None], drafts_t], dim=1),
                                        target_cache, lengths=ones * (k + 1),
                                        checkpoints=True), active)
        n, token = verify(_processed(p_logits, temperature, top_p), torch.stack(q, dim=1),
                          drafts_t, greedy, generator)
        # Log-probabilities as plain sampling reports them (before top-p).
        reported = next_token_distribution(p_logits, temperature)
        new = torch.cat([drafts_t, token[:, None]], dim=1)
        new[torch.arange(len(new)), n] = token  # the kept drafts, then the row's own token
        logprobs = reported.gather(-1, new[..., None]).squeeze(-1)
        kept, new_rows = n.tolist(), new.tolist()  # the round's host reads
        tokens = [row[:m + 1] for row, m in zip(new_rows, kept)]
        rows.append(tokens, [row[:m + 1] for row, m in zip(logprobs.tolist(), kept)])
        if ranks.all(rows.done()):
            return
        target_cache.rewind((n + 1) * ones)
        draft_cache.rewind((lags + n.clamp(max=k - 1)) * ones)
        last = token
        pending = [[row[k - 1], row[m]] if m == k else [row[m]]
                   for row, m in zip(new_rows, kept)]


def _next_logits(model: K3Model, tokens: torch.Tensor, cache, lengths: torch.Tensor,
                 active: torch.Tensor) -> torch.Tensor:
    """Next-token logits [B, V] after each row's last token of a call with checkpoints; zeros
    for rows not `active`."""
    logits = model.decode(tokens, cache, lengths=lengths, last_only=True, checkpoints=True)
    return _masked(logits[:, 0], active)
