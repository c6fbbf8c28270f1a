"""Rewards (train/posttrain/rewards.py): each verifier path of outcome_reward, a judge loaded
by name and its score checked, and the budget penalty's numbers."""

from __future__ import annotations

import math

import pytest

from model.errors import ConfigError
from train.posttrain.rewards import budget_penalty, load_judge, outcome_reward
from train.posttrain.tasks import Task

ADD = Task("add-1", "math", "What is 7 + 5?", "exact_match", 8, answer="12")
INC = Task("code-1", "code", "Write inc(x).", "python_unit_tests", 64,
           tests="assert inc(1) == 2\nassert inc(-1) == 0\n")
ESSAY = Task("essay-1", "writing", "Describe a bridge.", "judge", 32, rubric="its material")
RIGHT = "def inc(x):\n    return x + 1\n"
WRONG = "def inc(x):\n    return x - 1\n"


@pytest.mark.parametrize("response, reward", [
    ("12", 1.0), ("  12\n", 1.0), ("It is 12", 0.0), ("12.0", 0.0), ("", 0.0)])
def test_exact_match_takes_the_whole_stripped_response_as_the_answer(response, reward):
    verdict = outcome_reward(ADD, response)
    assert (verdict.reward, verdict.reason) == (reward, "passed" if reward else "failed")


@pytest.mark.parametrize("response, reason", [
    (RIGHT, "passed"),
    (WRONG, "failed"),
    (f"Here it is:\n```python\n{RIGHT}```\nIt adds one.", "passed"),
    (f"```py\n{RIGHT}```", "passed"),
    (f"```\n{RIGHT}```", "passed"),
    (f"A first try:\n```python\n{WRONG}```\nFixed:\n```python\n{RIGHT}```", "passed"),
    (f"```python\n{RIGHT}```\nOops:\n```python\n{WRONG}```", "failed"),  # the last block counts
    (f"```python\n{RIGHT}", "failed"),  # an unclosed fence: the whole text, not Python
])
def test_python_unit_tests_run_the_last_fenced_block_or_the_whole_response(response, reason):
    verdict = outcome_reward(INC, response)
    assert (verdict.reward, verdict.reason) == (float(reason == "passed"), reason)


def test_a_judge_scores_the_task_and_response_it_is_given():
    seen = []

    def judge(task, response):
        seen.append((task.id, response))
        return 0.75

    verdict = outcome_reward(ESSAY, "A stone bridge.", judge)
    assert (verdict.reward, verdict.reason) == (0.75, "judged")
    assert seen == [("essay-1", "A stone bridge.")]


def test_a_judge_task_without_a_judge_names_the_task():
    with pytest.raises(ConfigError, match="task 'essay-1' is scored by a judge"):
        outcome_reward(ESSAY, "A stone bridge.")


class OffScale:
    def __init__(self, score):
        self.score = score

    def __call__(self, task, response):
        return self.score


@pytest.mark.parametrize("score", [math.nan, 1.5, -0.1, True, "0.5", None])
def test_a_judge_score_outside_0_1_names_the_judge(score):
    with pytest.raises(ValueError, match=rf"judge {__name__}\.OffScale scored task 'essay-1' "):
        outcome_reward(ESSAY, "A stone bridge.", OffScale(score))


JUDGES = '''
class Strict:
    def __call__(self, task, response):
        return float(response.strip() == task.answer)


def make_lenient():
    return lambda task, response: 1.0


def half(task, response):
    return 0.5


NOT_CALLABLE = 3


def broken():
    raise RuntimeError("no model server")


class NeedsServer:
    def __init__(self, url):
        self.url = url
'''


@pytest.fixture
def judges(tmp_path, monkeypatch):
    (tmp_path / "my_judges.py").write_text(JUDGES)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_load_judge_makes_a_class_or_factory_and_takes_a_callable_as_it_is(judges):
    assert outcome_reward(ADD, "12", load_judge("my_judges:Strict")).reward == 1.0
    assert type(load_judge("my_judges:Strict")).__name__ == "Strict"
    assert load_judge("my_judges:make_lenient")(ADD, "no") == 1.0
    assert load_judge("my_judges:half")(ADD, "12") == 0.5


@pytest.mark.parametrize("spec, message", [
    ("my_judges", "judge 'my_judges' is invalid: must be 'package.module:attribute'"),
    ("my_judges:", "judge 'my_judges:' is invalid"),
    ("no_such_module:judge", "judge 'no_such_module:judge': module no_such_module does not "
                             "import"),
    ("my_judges:missing", "judge 'my_judges:missing': module my_judges has no attribute "
                          "'missing'"),
    ("my_judges:NOT_CALLABLE", "judge 'my_judges:NOT_CALLABLE' is not callable (it is the int "
                               "3)"),
    ("my_judges:broken", "judge 'my_judges:broken': calling broken() failed: RuntimeError: no "
                         "model server"),
    ("my_judges:NeedsServer", "judge 'my_judges:NeedsServer': calling NeedsServer() failed: "
                              "TypeError: NeedsServer.__init__() missing 1 required positional "
                              "argument: 'url'"),
])
def test_load_judge_names_the_spec_it_cannot_load(judges, spec, message):
    with pytest.raises(ConfigError) as e:
        load_judge(spec)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("length, budget, weight, penalty", [
    (0, 8, 0.5, 0.0), (8, 8, 0.5, 0.0),  # within the budget
    (9, 8, 1.0, 0.125), (12, 8, 0.5, 0.25), (16, 8, 0.5, 0.5),  # linear past it
    (40, 8, 0.5, 0.5), (1000, 32, 0.2, 0.2),  # capped at the weight
    (48, 32, 0.0, 0.0),
])
def test_budget_penalty_is_linear_past_the_budget_and_capped(length, budget, weight, penalty):
    assert budget_penalty(length, budget, weight) == pytest.approx(penalty, abs=1e-15)


@pytest.mark.parametrize("length, budget, weight", [
    (8, 0, 0.5), (-1, 8, 0.5), (8, 8, -0.1), (8, 8, math.nan), (8, 8, math.inf)])
def test_budget_penalty_refuses_invalid_arguments(length, budget, weight):
    with pytest.raises(ValueError, match="are invalid"):
        budget_penalty(length, budget, weight)
