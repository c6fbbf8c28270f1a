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

Row seeds (`row_seeds=`, one per prompt) make sampling batch-invariant: a row's draws come from
a counter-based hash of its seed, its token index and the vocabulary index (Gumbel-max), not
from a generator shared by the batch, so its completion does not depend on which other rows it
is decoded with or on which rank (what RL needs for a data-parallel run to sample what one
process samples, and a resumed episode to continue as it would have).
"""

from __future__ import annotations

import contextlib
import itertools
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


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A bijective 32-bit integer hash (xor-shift-multiply) of ints or int64 tensors holding
    values below 2**32; the products stay below 2**59, so int64 never overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def row_seed_keys(row_seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """Each row seed (any int) folded into a 32-bit key [B] (int64)."""
    keys = []
    for seed in row_seeds:
        seed &= (1 << 64) - 1
        keys.append(_mix32((seed & _MASK32) ^ _mix32((seed >> 32) ^ 0x9E3779B9)))
    return torch.tensor(keys, dtype=torch.long, device=device)


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor | int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] (float64) of the rows' keys [B] at their token indices `steps`
    ([B] or one for all): a function of (key, step, vocabulary index) only."""
    at_step = _mix32(keys ^ _mix32(torch.as_tensor(steps, device=keys.device) & _MASK32))
    ids = _mix32(torch.arange(vocab, device=keys.device, dtype=torch.long) ^ 0x85EBCA6B)
    uniform = (_mix32(at_step[:, None] ^ ids[None, :]).double() + 0.5) / 2.0 ** 32
    return -torch.log(-torch.log(uniform))


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None, row_keys: torch.Tensor | None = None,
                step: torch.Tensor | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], their log-probabilities [B]) from next-token logits [B, V]: the argmax for
    temperature 0, else a draw from softmax(logits / temperature) within top_p: from
    `generator`, or with `row_keys` (row_seed_keys) by Gumbel-max at each row's token index
    `step` ([B] or one for all)."""
    logprobs = next_token_distribution(logits, temperature)
    if temperature > 0 and row_keys is not None:
        noise = gumbel_noise(row_keys, step, logprobs.shape[-1])
        tokens = (top_p_filter(logprobs, top_p).double() + noise).argmax(dim=-1)
    elif temperature > 0:
        weights = top_p_filter(logprobs, top_p).exp()
        tokens = torch.multinomial(weights, 1, generator=generator).squeeze(-1)
    else:
        tokens = logprobs.argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _budgets(prompts, max_new_tokens) -> list[int]:
    """Each prompt's budget of new tokens: `max_new_tokens` an int for all, or one per prompt."""
    many = not isinstance(max_new_tokens, int)
    budgets = list(max_new_tokens) if many else [max_new_tokens] * len(prompts)
    if len(budgets) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(budgets)} budgets for {len(prompts)} prompts: "
                         f"give an int or one budget per prompt")
    for i, budget in enumerate(budgets):
        if not isinstance(budget, int) or budget < 0:
            where = f"max_new_tokens[{i}]" if many else "max_new_tokens"
            raise ValueError(f"{where}={budget!r} is invalid: must be an int >= 0")
    return budgets


def _check(model: K3Model, prompts, budgets: list[int], temperature: float, top_p: float,
           layout: bool, row_seeds, row_offsets) -> None:
    if not prompts and not layout:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {len(prompts)} prompts: give "
                         f"one per prompt")
    if row_offsets is not None and (row_seeds is None or len(row_offsets) != len(prompts)):
        raise ValueError("row_offsets needs row_seeds and one offset per prompt")
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
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        if len(prompt) + budget > model.cfg.max_seq_len:
            raise ValueError(f"prompts[{i}] ({len(prompt)} tokens) + its max_new_tokens={budget} "
                             f"exceeds model.max_seq_len={model.cfg.max_seq_len}")


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

    def __init__(self, budgets: list[int], stops: set[int], device: torch.device,
                 idle: int = 0):
        self.real = len(budgets)
        self.completions = [Completion() for _ in range(self.real + idle)]
        for completion in self.completions[self.real:]:
            completion.finish_reason = "stop"
        self.budgets, self.stops = [*budgets, *[0] * idle], stops
        self.active = torch.tensor([not self.finished(i) for i in range(len(self.completions))],
                                   device=device)

    def append(self, tokens: list[list[int]], logprobs: list[list[float]]) -> list[int]:
        """Each row's new tokens, cut after a stop token and at the budget (none for a finished
        row); returns how many each row took."""
        taken = []
        for i, (row_tokens, row_logprobs) in enumerate(zip(tokens, logprobs)):
            completion, count = self.completions[i], 0
            for token, logprob in zip(row_tokens, row_logprobs):
                if self.finished(i):
                    break
                completion.tokens.append(token)
                completion.logprobs.append(logprob)
                count += 1
                if token in self.stops:
                    completion.finish_reason = "stop"
            taken.append(count)
        self.active &= torch.tensor([not self.finished(i) for i in range(len(self.completions))],
                                    device=self.active.device)
        return taken

    def finished(self, row: int) -> bool:
        completion = self.completions[row]
        return completion.finish_reason == "stop" or len(completion.tokens) == self.budgets[row]

    def done(self) -> bool:
        return all(self.finished(i) for i in range(len(self.completions)))


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
def sample(model: K3Model, prompts: Sequence[Sequence[int]],
           max_new_tokens: int | Sequence[int], temperature: float = 0.0, top_p: float = 1.0,
           seed: int = 0, stop_token_ids: Sequence[int] = (), draft: K3Model | None = None,
           speculative_tokens: int = 0, group: dist.ProcessGroup | None = None,
           row_seeds: Sequence[int] | None = None,
           row_offsets: Sequence[int] | None = None) -> list[Completion]:
    """Each prompt's completion: the new tokens, their log-probabilities and why it ended
    (module docstring); `max_new_tokens` for every prompt or one budget per prompt. The same
    seed and prompts give the same completions; `row_seeds` (one per prompt) instead of `seed`:
    each row's completion from its own seed, whatever the batch (module docstring), its draws
    numbered from its `row_offsets` entry (default 0: a row continuing a sequence sampled with
    the same seed passes the tokens already drawn, and draws what one call would have). With a
    `draft`
    model (the same vocabulary) and speculative_tokens = k > 0, each round the draft proposes k
    tokens that `model` verifies in one call (train/speculative.py): the completions are
    distributed as without it (greedy: the same tokens).

    Under a parallel layout every rank of `group` (None: the default group, when
    torch.distributed is initialized) calls this with the same arguments but its own prompts:
    tensor-parallel peers the same ones (they sample the same tokens from the same seed), data-
    and expert-parallel ranks theirs (pass each its own seed for independent draws), possibly
    none (the rank takes part in the others' calls)."""
    device = model.embed.weight.device
    ranks = _Ranks(group, device)
    budgets = _budgets(prompts, max_new_tokens)
    _check(model, prompts, budgets, temperature, top_p, ranks.group is not None, row_seeds,
           row_offsets)
    if speculative_tokens > 0 and row_seeds is not None:
        raise ValueError("row_seeds is not supported with speculative decoding: its acceptance "
                         "draws come from the batch's generator (`seed`)")
    if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise ValueError(f"speculative_tokens={speculative_tokens!r} is invalid: must be an int "
                         f">= 0")
    if speculative_tokens > 0 and draft is None:
        raise ValueError(f"speculative_tokens={speculative_tokens} needs a draft model")
    if speculative_tokens > 0:
        # Rejected drafts leave their slots behind as padding (DecodeCache.rewind): a round
        # takes k + 1 of them and yields at least one token.
        limit = min(model.cfg.max_seq_len, draft.cfg.max_seq_len)
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            if len(prompt) - 1 + budget * (speculative_tokens + 1) > limit:
                raise ValueError(f"prompts[{i}] ({len(prompt)} tokens) + max_new_tokens={budget} "
                                 f"rounds of speculative_tokens={speculative_tokens} + 1 slots "
                                 f"may exceed max_seq_len={limit} (the model's or the draft's): "
                                 f"fewer speculative_tokens or max_new_tokens")
    real = len(prompts)
    batch, width, most = ranks.max(real, max((len(p) for p in prompts), default=0),
                                   max(budgets, default=0))
    if most == 0:  # no rank has a token to generate
        return [Completion() for _ in prompts]
    prompts = [*prompts, *[[]] * (batch - real)]  # a layout's padding rows: empty
    rows = _Rows(budgets, set(stop_token_ids), device, idle=batch - real)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    row_keys = row_steps = None
    if row_seeds is not None:
        row_keys = row_seed_keys([*row_seeds, *[0] * (batch - real)], device)
        offsets = [*(row_offsets if row_offsets is not None else [0] * real),
                   *[0] * (batch - real)]
        row_steps = torch.tensor(offsets, dtype=torch.long, device=device)
    with contextlib.ExitStack() as gathered:
        for m in (model, draft):
            if m is not None:
                gathered.enter_context(gathered_for_decode(m))
        if speculative_tokens > 0:
            from .speculative import speculative_rounds

            speculative_rounds(model, draft, prompts, width, rows, speculative_tokens,
                               temperature, top_p, generator, ranks)
        else:
            _plain_rounds(model, prompts, width, rows, temperature, top_p, generator, ranks,
                          row_keys, row_steps)
    return rows.completions[:rows.real]


def _plain_rounds(model: K3Model, prompts, width: int, rows: _Rows, temperature: float,
                  top_p: float, generator, ranks: _Ranks, row_keys: torch.Tensor | None,
                  row_steps: torch.Tensor | None) -> None:
    """Fills `rows` a token per step until every rank's rows are done."""
    cache, logits = _prefill(model, prompts, width)
    logits = _masked(logits, rows.active)
    for step in itertools.count():
        at = None if row_steps is None else row_steps + step
        new, logprobs = sample_next(logits, temperature, top_p, generator, row_keys, at)
        # The one host read of a step: the tokens and their log-probabilities.
        rows.append([[t] for t in new.tolist()], [[lp] for lp in logprobs.tolist()])
        if ranks.all(rows.done()):
            return
        # A finished row takes a padding position (length 0): nothing of it is seen.
        logits = _masked(model.decode(new[:, None], cache, lengths=rows.active.long(),
                                      last_only=True)[:, 0], rows.active)


def generate(model: K3Model, prompts: Sequence[Sequence[int]],
             max_new_tokens: int | Sequence[int],
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_token_ids: Sequence[int] = (), draft: K3Model | None = None,
             speculative_tokens: int = 0,
             group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """The new tokens of each prompt (`sample`'s completions' tokens)."""
    return [c.tokens for c in sample(model, prompts, max_new_tokens, temperature, top_p, seed,
                                     stop_token_ids, draft, speculative_tokens, group)]
