"""RL task files (train/posttrain/tasks.py): every field parsed into the task's attributes, each
malformed line refused with an error naming path:line and the field, and the JSON round trip
that checkpoints use."""

from __future__ import annotations

import json
import re

import pytest

from model.errors import ConfigError
from train.posttrain.tasks import Task, load_tasks

CALCULATE = {"type": "function", "function": {"name": "calculate", "parameters": {}}}
GOOD = [
    {"id": "add-1", "domain": "math", "prompt": "What is 7 + 5?", "verifier": "exact_match",
     "answer": "12", "budget": 8, "effort": "low"},
    {"id": "code-1", "domain": "code", "prompt": "Write inc(x).", "verifier": "python_unit_tests",
     "tests": "assert inc(1) == 2\n", "solution": "def inc(x):\n    return x + 1", "budget": 64},
    {"id": "essay-1", "domain": "writing", "prompt": "Describe a bridge.", "verifier": "judge",
     "rubric": "mentions its material", "budget": 32},
    {"id": "calc-1", "domain": "math", "prompt": "What is 347 * 26?", "verifier": "exact_match",
     "answer": "9022", "budget": 64, "environment": "calculator", "tools": [CALCULATE]},
]


def _write(tmp_path, lines: list) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return str(path)


def test_every_field_becomes_a_typed_attribute_and_blank_lines_are_skipped(tmp_path):
    tasks = load_tasks(_write(tmp_path, [GOOD[0], "", GOOD[1], "   ", *GOOD[2:]]))
    assert [t.id for t in tasks] == ["add-1", "code-1", "essay-1", "calc-1"]
    add, code, essay, calc = tasks
    assert (add.prompt, add.verifier, add.answer, add.budget, add.effort) == \
        ("What is 7 + 5?", "exact_match", "12", 8, "low")
    assert (add.tests, add.environment, add.tools) == (None, None, None)
    assert (code.tests, code.solution, code.budget) == \
        ("assert inc(1) == 2\n", "def inc(x):\n    return x + 1", 64)
    assert (essay.verifier, essay.rubric, essay.answer) == ("judge", "mentions its material", None)
    assert (calc.environment, calc.tools) == ("calculator", [CALCULATE])


def test_the_json_round_trip_is_exact_and_drops_unset_fields(tmp_path):
    tasks = load_tasks(_write(tmp_path, GOOD))
    saved = json.loads(json.dumps([t.to_json() for t in tasks]))
    assert saved == GOOD  # the file's objects, no null fields added
    assert [Task.from_json(record) for record in saved] == tasks


def _with(**changes) -> dict:
    record = {**GOOD[0], **changes}
    return {k: v for k, v in record.items() if v is not None}


@pytest.mark.parametrize("line, message", [
    ('{"id": "b", "prompt": ', "malformed JSON"),
    ("[1, 2]", "a task is a JSON object, got list"),
    (_with(id=None), "id is missing"),
    (_with(id=""), "id='' is invalid: a non-empty string"),
    (_with(domain=None), "domain is missing"),
    (_with(prompt=5), "prompt=5 is invalid: a non-empty string"),
    (_with(verifier="regex"), "verifier='regex' is invalid: one of exact_match, "
                              "python_unit_tests, judge"),
    (_with(answer=None), "answer is missing: verifier=exact_match needs it"),
    (_with(verifier="python_unit_tests"), "tests is missing: verifier=python_unit_tests needs "
                                          "it"),
    (_with(answer=12), "answer=12 is invalid"),
    (_with(budget=None), "budget is missing"),
    (_with(budget=0), "budget=0 is invalid: an int > 0"),
    (_with(budget=8.0), "budget=8.0 is invalid"),
    (_with(budget="8"), "budget='8' is invalid"),
    (_with(budget=True), "budget=True is invalid"),
    (_with(environment=3), "environment=3 is invalid"),
    (_with(environment="calculator", tools={"name": "calculate"}), "tools={'name': 'calculate'} "
                                                                    "is invalid"),
    (_with(tools=[CALCULATE]), "tools is set without an environment"),
    (_with(anwser="12"), "unknown fields ['anwser']"),
])
def test_a_malformed_task_names_its_line_and_field(tmp_path, line, message):
    path = _write(tmp_path, [GOOD[1], "", line])
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}:3: ")) as e:
        load_tasks(path)
    assert message in str(e.value)


def test_a_duplicate_id_names_both_lines(tmp_path):
    path = _write(tmp_path, [GOOD[0], GOOD[1], {**GOOD[2], "id": "add-1"}])
    with pytest.raises(ConfigError) as e:
        load_tasks(path)
    assert str(e.value) == f"{path}:3: id='add-1' is a duplicate: line 1 has the same id"


@pytest.mark.parametrize("content, message", [
    ("", "no tasks (every line is blank)"),
    ("\n  \n", "no tasks (every line is blank)"),
    (b"\xff\xfe{}\n", "not UTF-8 text"),
])
def test_a_file_without_tasks_is_refused(tmp_path, content, message):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(ConfigError, match=re.escape(f"task file {path}: {message}")):
        load_tasks(path)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_tasks(tmp_path / "nowhere.jsonl")


def test_a_prompt_may_hold_a_line_separator(tmp_path):
    """U+2028 inside a JSON string is one line for JSONL (str.splitlines would split it)."""
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_with(prompt="a\u2028b"), ensure_ascii=False) + "\n")
    assert load_tasks(path)[0].prompt == "a\u2028b"
