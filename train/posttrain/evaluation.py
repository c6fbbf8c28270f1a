"""Which tasks a post-training run samples (`rollout.domains`, `rollout.efforts`: a specialist's
share of a task set; `rollout.max_tasks`: a quick experiment's few), and its greedy
evaluation: every `eval.every` steps the policy answers a fixed seeded sample of those tasks
(`rollout.eval_tasks`) at temperature 0, so that the logged `eval_reward` and `eval_passed`
follow the policy itself, not the luck of the iteration's draws."""

from __future__ import annotations

import random

from model.errors import ConfigError

from .episodes import Episode
from .rollout import ColocatedEngine, Scoring, advance, gather_episodes


def select_tasks(tasks: list, domains: list[str], efforts: list[str], max_tasks: int,
                 path: str) -> list:
    """The tasks of the given domains and effort levels (empty: any), the first `max_tasks` of
    them (0: all)."""
    chosen = [t for t in tasks if (not domains or t.domain in domains)
              and (not efforts or t.effort in efforts)][:max_tasks or None]
    if not chosen:
        raise ConfigError(f"rollout.domains={domains} and rollout.efforts={efforts} select no task "
                          f"of rollout.tasks={path!r} (its domains: "
                          f"{sorted({t.domain for t in tasks})}, efforts: "
                          f"{sorted({str(t.effort) for t in tasks})})")
    return chosen


def eval_sample(tasks: list, count: int, seed: int) -> list:
    """`count` of the tasks (all when fewer), the same for every run with this seed."""
    order = list(range(len(tasks)))
    random.Random(seed).shuffle(order)
    return [tasks[i] for i in sorted(order[:count])]


def evaluate(model, tasks: list, prompts, scoring: Scoring, stop_token_ids: list[int],
             max_new_tokens: int, seq_len: int, encode, dp_rank: int, dp: int) -> dict:
    """Greedy episodes of `tasks` (each data-parallel rank its share): their mean reward and
    the share that passed their verifier."""
    episodes = [Episode(i, i, t.id, t.domain, prompts(t),
                        messages=[{"role": "user", "content": t.prompt}])
                for i, t in enumerate(tasks)]
    mine = episodes[dp_rank::dp]
    greedy = ColocatedEngine(model, temperature=0.0, top_p=1.0, stop_token_ids=stop_token_ids)
    advance(mine, greedy, scoring, 0, max_new_tokens, 0, seq_len, encode)
    done = gather_episodes(mine)
    return {"eval_reward": sum(e.reward for e in done) / len(done),
            "eval_passed": sum(e.outcome == "passed" for e in done) / len(done)}
