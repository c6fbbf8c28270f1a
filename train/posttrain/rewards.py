"""Rewards of an RL episode: the outcome of the response against its task, and the length
penalty past the task's token budget (its effort level).

- `outcome_reward(task, response, judge)`: the task's verifier on the response (verifiers.py),
  or the score of an LLM judge for verifier=judge tasks.
- `budget_penalty(length, budget, weight)`: 0 within the budget, then linear in the overshoot,
  reaching `weight` at twice the budget and capped there.
- `load_judge("package.module:attribute")`: a user's judge, a callable (task, response) ->
  score in [0, 1].
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Protocol

from model.errors import ConfigError

from .plugins import load_plugin
from .tasks import Task
from .verifiers import Verdict, exact_match, python_unit_tests

# The last fenced block of a response (```python, ```py or a bare fence) is its code.
_FENCED_CODE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class Judge(Protocol):
    def __call__(self, task: Task, response: str) -> float:
        """The response's score in [0, 1]."""


def load_judge(spec: str) -> Judge:
    """The judge `spec` ("package.module:attribute") names: a class or factory that takes no
    arguments is called to make it, any other callable is the judge itself. Raises ConfigError
    naming the spec when it does not import or names nothing callable."""
    judge = load_plugin(spec, "judge")
    if not callable(judge):
        raise ConfigError(f"judge {spec!r} is not callable (it is the {type(judge).__name__} "
                          f"{judge!r}): a judge is called as judge(task, response) -> score in "
                          "[0, 1]")
    return judge


def outcome_reward(task: Task, response: str, judge: Judge | None = None) -> Verdict:
    """The verdict on `response`, the text of the episode's final assistant turn (its content,
    without special tokens):

    - exact_match: the whole response is the final answer, compared with task.answer with the
      surrounding whitespace ignored and inner whitespace runs collapsed ("12", not "It is 12").
    - python_unit_tests: the response's code (the last fenced ```python block when it has one,
      else the whole text) run before task.tests in a limited subprocess.
    - judge: judge(task, response), a number in [0, 1] (reason "judged").

    Raises ConfigError for a judge task without a judge (naming the task) and ValueError for a
    judge's score that is not a number in [0, 1] (naming the judge)."""
    if task.verifier == "exact_match":
        reward = exact_match(response, task.answer)
        return Verdict(reward, "passed" if reward else "failed")
    if task.verifier == "python_unit_tests":
        return python_unit_tests(_code_of(response), task.tests)
    if task.verifier != "judge":
        raise ValueError(f"task {task.id!r}: verifier={task.verifier!r} is invalid")
    if judge is None:
        raise ConfigError(f"task {task.id!r} is scored by a judge (verifier=judge), but no "
                          "judge is configured")
    score = judge(task, response)
    if isinstance(score, bool) or not isinstance(score, numbers.Real) \
            or not 0 <= score <= 1:  # NaN fails the range too
        raise ValueError(f"judge {_name(judge)} scored task {task.id!r} {score!r}: a judge's "
                         "score is a number in [0, 1]")
    return Verdict(float(score), "judged")


def budget_penalty(length: int, budget: int, weight: float) -> float:
    """The penalty (>= 0, to subtract from the reward) of a response of `length` tokens for a
    task of `budget` tokens: 0 within the budget, past it weight * min(1, (length - budget) /
    budget)."""
    if budget <= 0 or length < 0 or not (weight >= 0 and math.isfinite(weight)):
        raise ValueError(f"length={length}, budget={budget}, weight={weight} are invalid: need "
                         "length >= 0, budget > 0 and a finite weight >= 0")
    return weight * min(1.0, max(0, length - budget) / budget)


def _code_of(response: str) -> str:
    blocks = _FENCED_CODE.findall(response)
    return blocks[-1] if blocks else response


def _name(judge: Judge) -> str:
    made = judge if hasattr(judge, "__qualname__") else type(judge)
    return f"{made.__module__}.{made.__qualname__}"
