"""Tool environments (train/posttrain/environments.py): the calculator's results and refusals
(never an exception, never a huge computation), its state saved and resumed exactly, how an
episode asks an environment (observe), and environments made by name."""

from __future__ import annotations

import json

import pytest

from model.errors import ConfigError
from train.posttrain.environments import (
    CALCULATE,
    Calculator,
    ToolCall,
    calculate,
    make_environment,
    observe,
)
from train.posttrain.tasks import Task

TASK = Task("calc-1", "math", "What is 347 * 26?", "exact_match", 64, answer="9022",
            environment="calculator")


def _call(expression, name="calculate") -> ToolCall:
    return ToolCall("functions.calculate:0", name, {"expression": expression})


@pytest.mark.parametrize("expression, result", [
    ("7 + 5", "12"), ("347 * 26", "9022"), ("(2 + 3) * 4", "20"), ("2 + 3 * 4", "14"),
    ("7 / 2", "3.5"), ("6 / 3", "2.0"), ("7 // 2", "3"), ("-7 % 3", "2"), ("2 ** 10", "1024"),
    ("2 ** -1", "0.5"), ("1.5 * 4", "6.0"), ("-(3 - 10)", "7"), (" 12 ", "12"),
    ("10 ** 100", str(10 ** 100)),
])
def test_the_calculator_evaluates_arithmetic(expression, result):
    assert calculate(expression) == result


@pytest.mark.timeout(10)  # 9**9**9 computed would take far longer
@pytest.mark.parametrize("expression, error", [
    ("9**9**9", "error: the exponent 387420489 is past the limit of 100"),
    ("2 ** 101", "error: the exponent 101 is past the limit of 100"),
    ("10 ** 100 * 10", "error: a number past 1e+100"),
    ("1e300", "error: a number past 1e+100"),
    ("1 / 0", "error: division by zero"),
    ("5 % 0", "error: division by zero"),
    ("(-8) ** 0.5", "error: the result is not a real number"),
    ("__import__('os').system('true')",
     "error: only numbers, + - * / // % ** and parentheses are allowed"),
    ("x + 1", "error: only numbers, + - * / // % ** and parentheses are allowed"),
    ("True + 1", "error: only numbers, + - * / // % ** and parentheses are allowed"),
    ("1 < 2", "error: only numbers, + - * / // % ** and parentheses are allowed"),
    ("1 +", "error: not an arithmetic expression"),
    ("", "error: not an arithmetic expression"),
    ("1\x00", "error: not an arithmetic expression"),
    ("1+" * 100 + "1", "error: the expression is longer than 200 characters"),
])
def test_the_calculator_refuses_with_an_error_observation(expression, error):
    assert calculate(expression) == error


def test_calculator_steps_are_recorded_and_bad_arguments_answered():
    env = Calculator()
    env.reset(TASK)
    assert env.tools() == [CALCULATE]
    assert env.step(_call("347 * 26")) == "9022"
    assert env.step(ToolCall("c", "calculate", {"expr": "1"})) == \
        "error: calculate takes one argument, expression (a string)"
    assert env.step(_call(5)) == "error: calculate takes one argument, expression (a string)"
    assert env.state_dict() == {"calls": 3, "history": [
        {"expression": "347 * 26", "result": "9022"},
        {"expression": None, "result": "error: calculate takes one argument, expression (a "
                                       "string)"},
        {"expression": 5, "result": "error: calculate takes one argument, expression (a "
                                    "string)"}]}
    env.reset(TASK)
    assert env.state_dict() == {"calls": 0, "history": []}


def test_a_saved_calculator_resumes_exactly():
    env = Calculator()
    env.reset(TASK)
    for expression in ("1 + 2", "1 / 0", "2 ** 3"):
        env.step(_call(expression))
    saved = json.loads(json.dumps(env.state_dict()))  # as a checkpoint holds it
    resumed = Calculator()
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == env.state_dict() == saved
    assert saved["calls"] == 3 and saved["history"][1] == {"expression": "1 / 0",
                                                           "result": "error: division by zero"}
    assert resumed.step(_call("6 * 7")) == env.step(_call("6 * 7")) == "42"
    assert resumed.state_dict() == env.state_dict()
    saved["history"].append({"expression": "x", "result": "y"})  # the saved copy is not shared
    assert resumed.state_dict()["calls"] == 4


@pytest.mark.parametrize("state", [{}, {"calls": 2, "history": []}, {"calls": 0}, []])
def test_an_invalid_calculator_state_is_refused(state):
    with pytest.raises(ValueError, match="calculator state .* is invalid"):
        Calculator().load_state_dict(state)


def test_observe_answers_malformed_and_unknown_calls_without_the_environment():
    env = Calculator()
    env.reset(TASK)
    broken = ToolCall("", "", error="its id is not functions.NAME:INDEX")
    assert observe(env, broken) == \
        "error: the tool call could not be read: its id is not functions.NAME:INDEX"
    assert observe(env, _call("1 + 1", name="search")) == \
        "error: there is no tool 'search'; the tools are ['calculate']"
    assert env.state_dict()["calls"] == 0  # neither reached the calculator
    assert observe(env, _call("1 + 1")) == "2"
    assert env.state_dict()["calls"] == 1


ENVIRONMENTS = '''
class Echo:
    def tools(self):
        return [{"type": "function", "function": {"name": "echo", "parameters": {}}}]

    def reset(self, task):
        self.said = []

    def step(self, call):
        self.said.append(call.arguments["text"])
        return self.said[-1] if call.arguments["text"] != "number" else 5

    def state_dict(self):
        return {"said": list(self.said)}

    def load_state_dict(self, state):
        self.said = list(state["said"])


class Mute:
    def tools(self):
        return []

    def reset(self, task):
        pass
'''


@pytest.fixture
def user_environments(tmp_path, monkeypatch):
    (tmp_path / "my_environments.py").write_text(ENVIRONMENTS)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_make_environment_makes_the_bundled_calculator_and_a_users_class(user_environments):
    assert isinstance(make_environment("calculator"), Calculator)
    echo = make_environment("my_environments:Echo")
    echo.reset(TASK)
    assert observe(echo, ToolCall("e", "echo", {"text": "hello"})) == "hello"
    with pytest.raises(TypeError, match="Echo.step returned the int 5: an observation is text"):
        observe(echo, ToolCall("e", "echo", {"text": "number"}))


@pytest.mark.parametrize("name, message", [
    ("calculater", "environment 'calculater' is invalid: one of ['calculator'], or "
                   "'package.module:Class' of your own"),
    ("my_environments:Mute", "environment 'my_environments:Mute' made a Mute without the "
                             "methods ['step', 'state_dict', 'load_state_dict']"),
    ("my_environments:Nowhere", "environment 'my_environments:Nowhere': module my_environments "
                                "has no attribute 'Nowhere'"),
    ("no_such_module:Env", "environment 'no_such_module:Env': module no_such_module does not "
                           "import"),
])
def test_make_environment_names_what_it_cannot_make(user_environments, name, message):
    with pytest.raises(ConfigError) as e:
        make_environment(name)
    assert str(e.value).startswith(message)
