"""Rollouts: episodes advanced by a rollout engine, through their tool calls, until they answer,
run out of tokens, or spend the iteration's budget (then they pause, to continue in a later
iteration: partial rollouts).

A `RolloutEngine` continues token sequences and reports, per new token, its log-probability and
the version of the weights that sampled it:

- `ColocatedEngine` (`rollout.engine=colocated`): the training ranks themselves, with the
  current weights, through train.generate.sample under the training layout (each data-parallel
  rank its own episodes, tensor-parallel peers together). Every token is of the current version.
- An external engine (`rollout.engine=package.module:attr`, e.g. a client of a vLLM or SGLang
  server): `attr(cfg)` returns an object with the same two methods. It may lag behind the
  trainer; the versions it reports let the loss weight (importance ratio) or drop
  (`rollout.max_staleness`) off-policy tokens.

Sampling is batch-invariant (row seeds): an episode's draws depend on the run's seed, the
episode and its position only, so an episode continues the same way whichever rank, batch or
restart it continues on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from model.errors import ConfigError

from ..generate import sample
from .environments import make_environment, observe
from .episodes import OBSERVATION, Episode
from .plugins import load_plugin
from .rewards import budget_penalty, outcome_reward
from .tool_turns import parse_tool_calls, tool_observation_text, tool_turn_messages


@dataclass
class Generated:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]  # of each token
    finish_reason: str  # "stop" (a stop token ended the turn) | "length" (the budget)


class RolloutEngine(Protocol):
    def generate(self, contexts: list[list[int]], budgets: list[int], row_seeds: list[int],
                 row_offsets: list[int]) -> list[Generated]:
        """Each context's continuation of at most its budget of tokens, ended by a stop token
        (included) or the budget; called on every rank together (a rank may have none). A
        row's draws come from its seed, numbered from its offset (the tokens it already drew)."""

    def sync_weights(self, version: int) -> None:
        """The trainer's weights after `version` optimizer steps are the ones to sample with."""


class ColocatedEngine:
    """The model being trained generates, under its training layout."""

    def __init__(self, model: torch.nn.Module, temperature: float, top_p: float,
                 stop_token_ids: Sequence[int]):
        self.model, self.temperature, self.top_p = model, temperature, top_p
        self.stop_token_ids = list(stop_token_ids)
        self.version = 0

    def generate(self, contexts, budgets, row_seeds, row_offsets) -> list[Generated]:
        self.model.eval()  # no Quantile Balancing counts from rollouts
        try:
            completions = sample(self.model, contexts, budgets, self.temperature, self.top_p,
                                 stop_token_ids=self.stop_token_ids, row_seeds=row_seeds,
                                 row_offsets=row_offsets)
        finally:
            self.model.train()
        return [Generated(c.tokens, c.logprobs, [self.version] * len(c.tokens),
                          c.finish_reason) for c in completions]

    def sync_weights(self, version: int) -> None:
        self.version = version  # the weights are the trainer's own


def load_engine(cfg, model: torch.nn.Module, stop_token_ids: Sequence[int]) -> RolloutEngine:
    spec = cfg.rollout.engine
    if spec == "colocated":
        return ColocatedEngine(model, cfg.rollout.temperature, cfg.rollout.top_p,
                               stop_token_ids)
    engine = load_plugin(spec, "rollout.engine", cfg)
    missing = [m for m in ("generate", "sync_weights") if not callable(getattr(engine, m, None))]
    if missing:
        raise ConfigError(f"rollout.engine={spec!r} made a {type(engine).__name__} without "
                          f"{missing}: give colocated or package.module:attr, attr(cfg) making "
                          f"a RolloutEngine")
    return engine


def episode_seed(seed: int, episode: Episode) -> int:
    """The row seed of an episode: the run's seed and the episode (its draws are numbered by
    its model tokens, so a paused episode continues as it would have)."""
    return (seed << 32) ^ episode.uid


@dataclass
class Scoring:
    tasks: dict  # task id -> Task
    tokenizer: object
    chat_template: str
    judge: Callable | None
    budget_penalty: float
    max_turns: int


def _any_rank(flag: bool) -> bool:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)], device=_device())
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return bool(t.item())


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def advance(episodes: list[Episode], engine: RolloutEngine, scoring: Scoring, seed: int,
            max_new_tokens: int, iteration_tokens: int, seq_len: int,
            encode: Callable[[str], list[int]]) -> list[Episode]:
    """Runs this rank's unfinished `episodes` (in place) until each is finished or has taken
    `iteration_tokens` model tokens this iteration (0: no limit), which pauses it; returns the
    ones paused. Every rank calls this together. `encode`: rendered chat text -> token ids."""
    spent = {e.uid: 0 for e in episodes}
    paused: dict[int, Episode] = {}
    while True:
        want = []
        for e in episodes:
            if e.done or e.uid in paused:
                continue
            room = min(max_new_tokens - e.model_tokens, seq_len - len(e.prompt) - len(e.tokens))
            if room <= 0:
                _finish(e, "length", scoring)
            elif iteration_tokens and spent[e.uid] >= iteration_tokens:
                e.pauses += 1
                paused[e.uid] = e
            else:
                want.append((e, room if not iteration_tokens
                             else min(room, iteration_tokens - spent[e.uid])))
        if not _any_rank(bool(want)):
            return list(paused.values())
        generated = engine.generate([e.prompt + e.tokens for e, _ in want],
                                    [budget for _, budget in want],
                                    [episode_seed(seed, e) for e, _ in want],
                                    [e.model_tokens for e, _ in want])
        for (e, _), g in zip(want, generated, strict=True):
            e.append(g.tokens, g.logprobs, g.versions)
            spent[e.uid] += len(g.tokens)
            if g.finish_reason == "stop":
                _end_turn(e, scoring, seq_len, encode)


def _end_turn(e: Episode, scoring: Scoring, seq_len: int,
              encode: Callable[[str], list[int]]) -> None:
    """The model ended a turn: its tool calls answered (the observation appended, the next
    turn begins), or, without any, the episode answered."""
    task = scoring.tasks[e.task_id]
    if task.environment is None or e.turns >= scoring.max_turns:
        _finish(e, "stop", scoring)
        return
    text = scoring.tokenizer.decode(e.tokens[e.turn_start:], skip_special_tokens=False)
    calls = parse_tool_calls(text)
    if not calls:
        _finish(e, "stop", scoring)
        return
    env = make_environment(task.environment)
    if e.env_state is None:
        env.reset(task)
    else:
        env.load_state_dict(e.env_state)
    observations = [observe(env, call) for call in calls]
    e.env_state = env.state_dict()
    tools = task.tools if task.tools is not None else env.tools()
    observed = encode(tool_observation_text(calls, observations, scoring.chat_template,
                                            e.messages, tools))
    e.messages = e.messages + tool_turn_messages(calls, observations, e.messages)
    e.turns += 1
    if len(e.prompt) + len(e.tokens) + len(observed) >= seq_len:
        _finish(e, "length", scoring)  # no room left to answer
        return
    e.append(observed, [0.0] * len(observed), [OBSERVATION] * len(observed))
    e.turn_start = len(e.tokens)


def _finish(e: Episode, reason: str, scoring: Scoring) -> None:
    """Ends the episode and scores its last turn's text (the answer)."""
    task = scoring.tasks[e.task_id]
    answer = scoring.tokenizer.decode(e.tokens[e.turn_start:], skip_special_tokens=True)
    verdict = outcome_reward(task, answer, scoring.judge)
    length = e.model_tokens
    e.finish_reason, e.outcome = reason, verdict.reason
    e.over_budget = length > task.budget
    e.reward = verdict.reward - budget_penalty(length, task.budget, scoring.budget_penalty)


def gather_episodes(mine: list[Episode]) -> list[Episode]:
    """Every rank's episodes (tensor-parallel peers hold the same ones: each uid once)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(mine)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [e.to_json() for e in mine])
    by_uid = {}
    for part in gathered:
        for values in part:
            by_uid.setdefault(values["uid"], Episode.from_json(values))
    return [by_uid[uid] for uid in sorted(by_uid)]
