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
(to stop rows and the loop), the one synchronisation of the engine.

The log-probability of a sampled token is under the distribution the sampler draws from before
top-p: softmax(logits / temperature), the model's own (temperature 1) for greedy decoding.
Top-p renormalises within the smallest set of tokens whose probability reaches top_p (at least
the most likely one); it changes which tokens can be drawn, not the reported log-probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model.dtypes import upcast
from model.k3 import K3Model


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


@torch.no_grad()
def sample(model: K3Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
           stop_token_ids: Sequence[int] = ()) -> list[Completion]:
    """Each prompt's completion: the new tokens, their log-probabilities and why it ended
    (module docstring). The same seed and prompts give the same completions."""
    _check(model, prompts, max_new_tokens, temperature, top_p)
    device = model.embed.weight.device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.full((batch, max(len(p) for p in prompts)), model.cfg.pad_token_id,
                        device=device)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = torch.tensor(list(prompt), device=device)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    stops = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    completions = [Completion() for _ in prompts]
    if max_new_tokens == 0:
        return completions
    cache = model.new_cache(batch)
    logits = model.decode(tokens, cache, lengths=lengths)
    logits = logits[torch.arange(batch, device=device), lengths - 1]  # each row's last token
    active = torch.ones(batch, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        new, logprobs = sample_next(logits, temperature, top_p, generator)
        stopped = torch.isin(new, stops)
        # The one host read of a step: the tokens, their log-probabilities, which rows stopped.
        for i, (token, logprob, is_active, stop) in enumerate(zip(
                new.tolist(), logprobs.tolist(), active.tolist(), stopped.tolist())):
            if is_active:
                completions[i].tokens.append(token)
                completions[i].logprobs.append(logprob)
                if stop:
                    completions[i].finish_reason = "stop"
        active &= ~stopped
        if step == max_new_tokens - 1 or all(c.finish_reason == "stop" for c in completions):
            break
        # A finished row takes a padding position (length 0): nothing of it is seen.
        logits = model.decode(new[:, None], cache, lengths=active.long())[:, 0]
    return completions


def generate(model: K3Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
    """The new tokens of each prompt (`sample`'s completions' tokens)."""
    return [c.tokens for c in sample(model, prompts, max_new_tokens, temperature, top_p, seed,
                                     stop_token_ids)]
