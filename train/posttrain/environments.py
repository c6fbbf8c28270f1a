"""Tool environments of RL episodes: what answers the model's tool calls.

An environment shows its tools as JSON schemas (the OpenAI function format that
data_pipeline.chat's `tools=` takes), is reset for each task, answers each call with an
observation (text) and saves its state as JSON, so that a paused episode resumes exactly from a
checkpoint. `observe(env, call)` is how an episode asks: a call that could not be parsed or names
a tool the environment lacks gets an error observation, and the run goes on.

Bundled: "calculator" (`Calculator`). Any other name is "package.module:attribute" of a user's
own environment, made by calling the attribute with no arguments.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
from dataclasses import dataclass, field
from typing import Protocol

from data_pipeline.tool_schemas import CALCULATE
from model.errors import ConfigError

from .plugins import load_plugin
from .tasks import Task


@dataclass(frozen=True)
class ToolCall:
    """One call the model made. `id`: the call's id as the model wrote it (K3:
    functions.NAME:INDEX); `error`: why the call could not be parsed (then `arguments` is empty,
    and `name` too when the id was unreadable)."""

    id: str
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None


class Environment(Protocol):
    def tools(self) -> list[dict]:
        """The JSON schemas of the tools it answers."""

    def reset(self, task: Task) -> None:
        """Starts the episode of `task`."""

    def step(self, call: ToolCall) -> str:
        """The observation of a well-formed call of one of its tools (what the tool returns)."""

    def state_dict(self) -> dict:
        """Its state as JSON-serialisable data."""

    def load_state_dict(self, state: dict) -> None:
        """Restores a state_dict()."""


_METHODS = ("tools", "reset", "step", "state_dict", "load_state_dict")


def observe(env: Environment, call: ToolCall) -> str:
    """The observation the episode shows for `call`: an error for a malformed call or one naming
    a tool `env` does not have (`env` never sees those), else env.step(call)."""
    if call.error is not None:
        return f"error: the tool call could not be read: {call.error}"
    names = [tool["function"]["name"] for tool in env.tools()]
    if call.name not in names:
        return f"error: there is no tool {call.name!r}; the tools are {names}"
    observation = env.step(call)
    if not isinstance(observation, str):
        raise TypeError(f"{type(env).__qualname__}.step returned the "
                        f"{type(observation).__name__} {observation!r}: an observation is text")
    return observation


# ------------------------------------------------------------------ the calculator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100  # of every number and intermediate result

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(Exception):
    """An expression the calculator does not compute; the message says why."""


def calculate(expression: str) -> str:
    """The value of an arithmetic expression on ints and floats, as text ("12", "3.5"), or
    "error: ..." saying why it was refused. Evaluated from its syntax tree (never eval), with
    limits on the expression's length, the exponent and the size of every number, so that
    9**9**9 is refused instead of computed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a null byte
        return "error: not an arithmetic expression"
    try:
        value = _evaluate(tree.body)
    except _Refused as e:
        return f"error: {e}"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return f"error: a number past {MAX_MAGNITUDE:.0e}"
    return str(value)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise _Refused(f"the exponent {right} is past the limit of {MAX_EXPONENT}")
        return _checked(_BINARY[type(node.op)](left, right))
    raise _Refused("only numbers, + - * / // % ** and parentheses are allowed")


def _checked(value) -> int | float:
    if not isinstance(value, int | float):  # (-8) ** 0.5 is complex
        raise _Refused("the result is not a real number")
    if math.isnan(value) or abs(value) > MAX_MAGNITUDE:
        raise _Refused(f"a number past {MAX_MAGNITUDE:.0e}")
    return value


class Calculator:
    """The "calculator" environment: one tool, calculate(expression). Its state is the calls
    made so far: their count and each call's expression and result."""

    def __init__(self):
        self.history: list[dict] = []

    def tools(self) -> list[dict]:
        return [copy.deepcopy(CALCULATE)]

    def reset(self, task: Task) -> None:
        self.history = []

    def step(self, call: ToolCall) -> str:
        expression = call.arguments.get("expression")
        if set(call.arguments) != {"expression"} or not isinstance(expression, str):
            result = "error: calculate takes one argument, expression (a string)"
        else:
            result = calculate(expression)
        self.history.append({"expression": expression, "result": result})
        return result

    def state_dict(self) -> dict:
        return {"calls": len(self.history), "history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: dict) -> None:
        history = state.get("history") if isinstance(state, dict) else None
        if not isinstance(history, list) or state.get("calls") != len(history):
            raise ValueError(f"calculator state {state!r} is invalid: {{'calls': n, 'history': "
                             "[n {'expression', 'result'} entries]}")
        self.history = copy.deepcopy(history)


# ------------------------------------------------------------------ by name

BUNDLED = {"calculator": Calculator}


def make_environment(name: str) -> Environment:
    """The environment `name` names: a bundled one ("calculator") or "package.module:attribute"
    of your own (a class or factory called with no arguments). Raises ConfigError naming it when
    it is neither, does not import, or lacks an environment's methods."""
    if name in BUNDLED:
        return BUNDLED[name]()
    if ":" not in name:
        raise ConfigError(f"environment {name!r} is invalid: one of {sorted(BUNDLED)}, or "
                          "'package.module:Class' of your own")
    env = load_plugin(name, "environment")
    missing = [m for m in _METHODS if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"environment {name!r} made a {type(env).__name__} without the "
                          f"methods {missing} of an environment ({', '.join(_METHODS)})")
    return env
