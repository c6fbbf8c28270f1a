"""The generation engine: batched prompts of different lengths through the model's decode cache
(model/cache.py, model/decode.py), greedy, temperature and top-p sampling reproducible from a
seed, rows finishing at a stop token or their budget, and each sampled token's log-probability
(what RL's importance ratios and on-policy distillation read).

    completions = sample(model, prompts, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    completions[0].tokens, completions[0].logprobs, completions[0].finish_reason
    generate(model, prompts, max_new_tokens=64)      # the new tokens of each prompt, greedy

One prefill call takes every prompt (right-padded, per-row lengths), then one decode call per
new token for the whole batch; a finished row takes padding positions from then on, which
neither its state nor any attention sees. Each step reads the sampled tokens on the host once
(to stop rows and the loop), the one synchronisation of the engine; under a parallel layout the
ranks also agree, with one all-reduce of a flag a step, whether any of them still runs.

The log-probability of a sampled token is under the distribution the sampler draws from before
top-p: softmax(logits / temperature), the model's own (temperature 1) for greedy decoding.
Top-p renormalises within the smallest set of tokens whose probability reaches top_p (at least
the most likely one); it changes which tokens can be drawn, not the reported log-probability.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model.dtypes import upcast
from model.k3 import K3Model
from parallel.data_parallel import gathered_for_decode


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)  # the new tokens, the stop token included
    logprobs: list[float] = field(default_factory=list)  # of each, as the module docstring says
    finish_reason: str = "length"  # "stop" (a stop token) or "length" (max_new_tokens)


def next_token_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-probabilities [B, V] the sampler draws from (before top-p), from logits [B, V], in
    fp32 or wider."""
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(upcast(logits) / scale, dim=-1)


def top_p_filter(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """logprobs [B, V] with -inf outside each row's nucleus: the most likely tokens whose
    probability sums to at least top_p (the most likely one always kept)."""
    if top_p >= 1.0:
        return logprobs
    ordered, order = logprobs.sort(dim=-1, descending=True)
    before = ordered.exp().cumsum(dim=-1) - ordered.exp()  # mass of the more likely tokens
    ordered = ordered.masked_fill(before >= top_p, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(-1, order, ordered)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], their log-probabilities [B]) from next-token logits [B, V]: the argmax for
    temperature 0, else a draw from softmax(logits / temperature) within top_p."""
    logprobs = next_token_distribution(logits, temperature)
    if temperature > 0:
        weights = top_p_filter(logprobs, top_p).exp()
        tokens = torch.multinomial(weights, 1, generator=generator).squeeze(-1)
    else:
        tokens = logprobs.argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _check(model: K3Model, prompts, max_new_tokens: int, temperature: float,
           top_p: float) -> None:
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be an int >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is invalid: must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} is invalid: must be in (0, 1]")
    vocab = model.cfg.vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompts[{i}] has token ids outside the vocabulary [0, {vocab}): "
                             f"{bad[:5]}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens="
                         f"{max_new_tokens} exceeds model.max_seq_len={model.cfg.max_seq_len}")


class _Ranks:
    """The ranks that generate together under a parallel layout: their decode calls are
    collectives (tensor-parallel reductions, expert dispatch), so they take batches of one
    shape (rows and prompt length at their maximum, the added rows empty) and run until every
    rank is done. One process: nothing to agree."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.device = device

    def max(self, *values: int) -> list[int]:
        if self.group is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def all(self, flag: bool) -> bool:
        return not self.max(int(not flag))[0]


class _Rows:
    """The completions being written and which rows still run (active: a device mask). The last
    `idle` rows are a layout's padding (_Ranks): done from the start, never returned."""

    def __init__(self, batch: int, budget: int, stops: set[int], device: torch.device,
                 idle: int = 0):
        self.completions = [Completion() for _ in range(batch)]
        for completion in self.completions[batch - idle:]:
            completion.finish_reason = "stop"
        self.real = batch - idle
        self.budget, self.stops = budget, stops
        self.active = torch.tensor([not self.finished(c) for c in self.completions],
                                   device=device)

    def append(self, tokens: list[list[int]], logprobs: list[list[float]]) -> list[int]:
        """Each row's new tokens, cut after a stop token and at the budget (none for a finished
        row); returns how many each row took."""
        taken = []
        for completion, row_tokens, row_logprobs in zip(self.completions, tokens, logprobs):
            count = 0
            for token, logprob in zip(row_tokens, row_logprobs):
                if completion.finish_reason == "stop" or len(completion.tokens) == self.budget:
                    break
                completion.tokens.append(token)
                completion.logprobs.append(logprob)
                count += 1
                if token in self.stops:
                    completion.finish_reason = "stop"
            taken.append(count)
        self.active &= torch.tensor([not self.finished(c) for c in self.completions],
                                    device=self.active.device)
        return taken

    def finished(self, completion: Completion) -> bool:
        return completion.finish_reason == "stop" or len(completion.tokens) == self.budget

    def done(self) -> bool:
        return all(self.finished(c) for c in self.completions)


def _prefill(model: K3Model, prompts: Sequence[Sequence[int]], width: int):
    """(cache, each row's next-token logits [B, V]) after the prompts right-padded to
    `width`; width 0 (every prompt empty): an empty cache and no logits."""
    cache = model.new_cache(len(prompts))
    if width == 0:
        return cache, None
    device = model.embed.weight.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = _padded([list(p) for p in prompts], model.cfg.pad_token_id, device, width)
    logits = model.decode(tokens, cache, lengths=lengths, last_only=True)
    return cache, logits[:, 0]


def _padded(rows: list[list[int]], pad: int, device, width: int = 1) -> torch.Tensor:
    """rows right-padded to the longest, at least `width`."""
    out = torch.full((len(rows), max(width, *(len(r) for r in rows))), pad, device=device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, device=device, dtype=out.dtype)
    return out


def _masked(logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """logits [B, ...] with the rows not `active` zeroed."""
    return torch.where(active.view(-1, *[1] * (logits.dim() - 1)), logits, 0.0)


@torch.no_grad()
def sample(model: K3Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
           stop_token_ids: Sequence[int] = (), draft: K3Model | None = None,
           speculative_tokens: int = 0,
           group: dist.ProcessGroup | None = None) -> list[Completion]:
    """Each prompt's completion: the new tokens, their log-probabilities and why it ended
    (module docstring). The same seed and prompts give the same completions. With a `draft`
    model (the same vocabulary) and speculative_tokens = k > 0, each round the draft proposes k
    tokens that `model` verifies in one call (train/speculative.py): the completions are
    distributed as without it (greedy: the same tokens).

    Under a parallel layout every rank of `group` (None: the default group, when
    torch.distributed is initialized) calls this with the same arguments but its own prompts:
    tensor-parallel peers the same ones (they sample the same tokens from the same seed), data-
    and expert-parallel ranks theirs (pass each its own seed for independent draws)."""
    _check(model, prompts, max_new_tokens, temperature, top_p)
    if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise ValueError(f"speculative_tokens={speculative_tokens!r} is invalid: must be an int "
                         f">= 0")
    if speculative_tokens > 0 and draft is None:
        raise ValueError(f"speculative_tokens={speculative_tokens} needs a draft model")
    if speculative_tokens > 0:
        # Rejected drafts leave their slots behind as padding (DecodeCache.rewind): a round
        # takes k + 1 of them and yields at least one token.
        longest, limit = max(len(p) for p in prompts), min(model.cfg.max_seq_len,
                                                            draft.cfg.max_seq_len)
        if longest - 1 + max_new_tokens * (speculative_tokens + 1) > limit:
            raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens="
                             f"{max_new_tokens} rounds of speculative_tokens="
                             f"{speculative_tokens} + 1 slots may exceed max_seq_len={limit} "
                             f"(the model's or the draft's): fewer speculative_tokens or "
                             f"max_new_tokens")
    if max_new_tokens == 0:
        return [Completion() for _ in prompts]
    device = model.embed.weight.device
    ranks = _Ranks(group, device)
    real = len(prompts)
    batch, width = ranks.max(real, max(len(p) for p in prompts))
    prompts = [*prompts, *[[]] * (batch - real)]  # a layout's padding rows: empty
    rows = _Rows(batch, max_new_tokens, set(stop_token_ids), device, idle=batch - real)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    with contextlib.ExitStack() as gathered:
        for m in (model, draft):
            if m is not None:
                gathered.enter_context(gathered_for_decode(m))
        if speculative_tokens > 0:
            from .speculative import speculative_rounds

            speculative_rounds(model, draft, prompts, width, rows, speculative_tokens,
                               temperature, top_p, generator, ranks)
        else:
            _plain_rounds(model, prompts, width, rows, temperature, top_p, generator, ranks)
    return rows.completions[:rows.real]


def _plain_rounds(model: K3Model, prompts, width: int, rows: _Rows, temperature: float,
                  top_p: float, generator, ranks: _Ranks) -> None:
    """Fills `rows` a token per step until every rank's rows are done."""
    cache, logits = _prefill(model, prompts, width)
    logits = _masked(logits, rows.active)
    while True:
        new, logprobs = sample_next(logits, temperature, top_p, generator)
        # The one host read of a step: the tokens and their log-probabilities.
        rows.append([[t] for t in new.tolist()], [[lp] for lp in logprobs.tolist()])
        if ranks.all(rows.done()):
            return
        # A finished row takes a padding position (length 0): nothing of it is seen.
        logits = _masked(model.decode(new[:, None], cache, lengths=rows.active.long(),
                                      last_only=True)[:, 0], rows.active)


def generate(model: K3Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_token_ids: Sequence[int] = (), draft: K3Model | None = None,
             speculative_tokens: int = 0,
             group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """The new tokens of each prompt (`sample`'s completions' tokens)."""
    return [c.tokens for c in sample(model, prompts, max_new_tokens, temperature, top_p, seed,
                                     stop_token_ids, draft, speculative_tokens, group)]
