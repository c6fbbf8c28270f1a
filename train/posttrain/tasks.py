"""RL task sets: the prompts of on-policy RL with what scores their responses.

A task set is a JSONL file, one task per line:

    id           str, unique in the file
    domain       str: what the task exercises ("math", "string", "code", ...)
    prompt       str: the user's message
    verifier     "exact_match" (needs `answer`), "python_unit_tests" (needs `tests`, assert
                 statements run after the response's code) or "judge" (an LLM judge scores the
                 response; `answer` and `rubric` are optional hints for it)
    budget       int > 0: the response's token budget, the task's effort level (what the model
                 generates in the episode, tool calls included; rewards.budget_penalty)
    answer       str: the reference answer
    tests        str: the unit tests of a python_unit_tests task
    rubric       str: what a judge looks for
    environment  str: the tool environment of the episode (environments.make_environment);
                 absent or null: no tools
    tools        list of tool JSON schemas shown to the model; absent or null: the environment's
                 own (environment.tools()); needs an environment to answer them
    effort       str: a label of the budget (the bundled set's low | medium | high | max)
    solution     str: a reference response (the bundled code tasks' solutions, for checking
                 their tests), never shown to the model

Any other field is an error, so that a misspelled optional field is not silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from model.errors import ConfigError

VERIFIERS = ("exact_match", "python_unit_tests", "judge")


@dataclass(frozen=True)
class Task:
    id: str
    domain: str
    prompt: str
    verifier: str
    budget: int
    answer: str | None = None
    tests: str | None = None
    rubric: str | None = None
    environment: str | None = None
    tools: list[dict] | None = None
    effort: str | None = None
    solution: str | None = None

    def to_json(self) -> dict:
        """The task's JSON object (its set fields), as a task file holds it."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, record: dict, where: str = "task") -> Task:
        """The task of a JSON object; `where` names it in errors (a task file's "path:line").
        Raises ConfigError naming the field and what is valid."""
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: a task is a JSON object, got {type(record).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown fields {unknown}; a task's fields are "
                              f"{[f.name for f in dataclasses.fields(cls)]}")
        for name in ("id", "domain", "prompt", "verifier"):
            _check_text(record, name, where, required=True)
        for name in ("answer", "tests", "rubric", "environment", "effort", "solution"):
            _check_text(record, name, where, required=False)
        if record["verifier"] not in VERIFIERS:
            raise ConfigError(f"{where}: verifier={record['verifier']!r} is invalid: one of "
                              f"{', '.join(VERIFIERS)}")
        needed = {"exact_match": "answer", "python_unit_tests": "tests"}.get(record["verifier"])
        if needed and record.get(needed) is None:
            raise ConfigError(f"{where}: {needed} is missing: verifier={record['verifier']} "
                              "needs it")
        if "budget" not in record:
            raise ConfigError(f"{where}: budget is missing: the response's token budget, an "
                              "int > 0")
        budget = record["budget"]
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ConfigError(f"{where}: budget={budget!r} is invalid: an int > 0 (tokens)")
        _check_tools(record, where)
        return cls(**record)


def _check_text(record: dict, name: str, where: str, required: bool) -> None:
    value = record.get(name)
    if value is None:
        if required:
            raise ConfigError(f"{where}: {name} is missing: a non-empty string")
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {name}={value!r} is invalid: a non-empty string")


def _check_tools(record: dict, where: str) -> None:
    tools = record.get("tools")
    if tools is None:
        return
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConfigError(f"{where}: tools={tools!r} is invalid: a list of tool JSON schemas "
                          "(objects)")
    if record.get("environment") is None:
        raise ConfigError(f"{where}: tools is set without an environment: nothing would answer "
                          "the calls (set environment, or drop tools)")


def load_tasks(path: str | Path) -> list[Task]:
    """The tasks of the JSONL file at `path` (blank lines skipped). Raises ConfigError naming
    `path:line` and the field for a malformed line or task, a duplicate id or a file without
    tasks."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task file {path}: no such file")
    tasks: list[Task] = []
    lines: dict[str, int] = {}  # id -> the line that defined it
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"task file {path}: not UTF-8 text ({e})") from e
    # split("\n"), not splitlines(): a JSON string may hold U+2028, which splitlines() breaks at
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: malformed JSON ({e})") from e
        task = Task.from_json(record, where)
        if task.id in lines:
            raise ConfigError(f"{where}: id={task.id!r} is a duplicate: line {lines[task.id]} "
                              "has the same id")
        lines[task.id] = number
        tasks.append(task)
    if not tasks:
        raise ConfigError(f"task file {path}: no tasks (every line is blank)")
    return tasks
