"""Episodes and the pool of those in flight: what a post-training checkpoint saves of its
rollouts, so that a run killed mid-iteration resumes every unfinished episode with the same
tokens, log-probabilities, weight versions and environment state.

An episode is one sample of a task's prompt: the prompt's token ids, then everything after it
(the model's tokens and the tool observations an environment answered with). Each token after
the prompt records the log-probability it was sampled with and the version of the weights that
sampled it (the optimizer steps taken before; -1 for an observation's tokens, which the loss
never sees). A group is the `samples_per_prompt` episodes of one prompt: its advantages are
normalised over its rewards, so it trains once all of them are finished.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

OBSERVATION = -1  # the weight version of a tool observation's tokens


@dataclass
class Episode:
    uid: int  # unique in the run
    group: int  # the prompt instance it samples (unique in the run)
    task_id: str
    domain: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_start: int = 0  # where in `tokens` the model's current turn began
    turns: int = 0  # tool-call turns taken
    pauses: int = 0  # iterations it was paused at the end of
    finish_reason: str | None = None  # None: in flight; "stop" (answered) | "length"
    reward: float = 0.0  # the outcome's reward minus the budget penalty, once finished
    outcome: str = ""  # the verifier's verdict (passed, failed, timeout, memory, judged)
    over_budget: bool = False  # more model tokens than the task's budget
    env_state: dict | None = None  # the tool environment's state_dict (None: not started)
    # The conversation so far as chat messages (the user's turn, the tool turns taken): what
    # the chat template renders the next tool results after.
    messages: list[dict] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def model_tokens(self) -> int:
        return sum(v != OBSERVATION for v in self.versions)

    def append(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(f"episode {self.uid}: {len(tokens)} tokens, {len(logprobs)} "
                             f"log-probabilities and {len(versions)} versions")
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += versions

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(values: dict) -> Episode:
        return Episode(**values)


@dataclass
class EpisodePool:
    """The episodes in flight and where the task stream stands: the same on every rank."""

    seed: int
    epoch: int = 0
    cursor: int = 0  # tasks of this epoch's order taken
    next_uid: int = 0
    next_group: int = 0
    episodes: list[Episode] = field(default_factory=list)

    def task_order(self, count: int) -> list[int]:
        """This epoch's order of the `count` tasks (a seeded shuffle)."""
        order = list(range(count))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def refill(self, tasks, groups: int, samples: int, prompt_of) -> int:
        """Starts new groups (each `samples` episodes of the next task's prompt) until `groups`
        are in flight; returns how many it started. `prompt_of(task)`: its token ids."""
        started = 0
        while len({e.group for e in self.episodes}) < groups:
            order = self.task_order(len(tasks))
            if self.cursor == len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            task = tasks[order[self.cursor]]
            self.cursor += 1
            prompt = prompt_of(task)
            for _ in range(samples):
                self.episodes.append(Episode(self.next_uid, self.next_group, task.id,
                                             task.domain, list(prompt),
                                             messages=[{"role": "user",
                                                        "content": task.prompt}]))
                self.next_uid += 1
            self.next_group += 1
            started += 1
        return started

    def take_finished_groups(self) -> list[list[Episode]]:
        """The groups whose every episode is finished, removed from the pool (in group order)."""
        by_group: dict[int, list[Episode]] = {}
        for e in self.episodes:
            by_group.setdefault(e.group, []).append(e)
        finished = [g for _, g in sorted(by_group.items()) if all(e.done for e in g)]
        taken = {e.uid for g in finished for e in g}
        self.episodes = [e for e in self.episodes if e.uid not in taken]
        return finished

    def replace(self, updated: list[Episode]) -> None:
        """The pool's episodes with these uids replaced by the given ones."""
        by_uid = {e.uid: e for e in updated}
        self.episodes = [by_uid.get(e.uid, e) for e in self.episodes]

    def state_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "episodes"},
                "episodes": [e.to_json() for e in self.episodes]}

    @staticmethod
    def from_state_dict(state: dict) -> EpisodePool:
        values = dict(state)
        episodes = [Episode.from_json(e) for e in values.pop("episodes")]
        return EpisodePool(**values, episodes=episodes)
