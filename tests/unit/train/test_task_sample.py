"""The bundled RL task set and its SFT conversations (data_pipeline/sample/tasks/, written by
data_pipeline/make_sample.py): every task loads with a right answer (recomputed here from its
prompt), every code task's solution passes its tests and a wrong constant fails them, the
conversations answer other prompts exactly as the verifiers accept (calculator calls included),
configs/data/tasks_sft.yaml reads and keeps every one, and make_sample rewrites the bundled
sample byte for byte."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from data_pipeline.chat import K3_CHAT_TEMPLATE, render_chat
from data_pipeline.config import SAMPLE_DIR, DataConfig, from_dict, resolve_path
from data_pipeline.make_sample import make_sample
from data_pipeline.pipeline import run_pipeline
from data_pipeline.sources import list_source_files
from train.posttrain.environments import Calculator, calculate, observe
from train.posttrain.rewards import outcome_reward
from train.posttrain.tasks import load_tasks
from train.posttrain.tool_turns import parse_tool_calls

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "data"
TASKS = SAMPLE_DIR / "tasks" / "tasks.jsonl"
SFT = SAMPLE_DIR / "tasks" / "sft.jsonl"
EFFORT_BUDGETS = {"low": 8, "medium": 16, "high": 32, "max": 64}
FENCED = re.compile(r"```python\n(.*)\n```", re.DOTALL)


def expected_answer(prompt: str) -> str:
    """The answer of an arithmetic or word question, computed from its prompt."""
    if arithmetic := re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", prompt):
        a, op, b = int(arithmetic[1]), arithmetic[2], int(arithmetic[3])
        return str({"+": a + b, "-": a - b, "*": a * b}[op])
    word = re.search(r"'([a-z]+)'", prompt)[1]
    for start, answer in [("Reverse the word", word[::-1]),
                          ("Write the word", word.upper()),
                          ("What is the first letter", word[0]),
                          ("What is the last letter", word[-1]),
                          ("How many letters", str(len(word)))]:
        if prompt.startswith(start):
            return answer
    raise AssertionError(f"no expected answer for {prompt!r}")


# what each requested function returns for some arguments, given the prompt's constant k
BEHAVIOUR = {
    "shift": lambda k: [((5,), 5 + k), ((-k,), 0)],
    "scale": lambda k: [((4,), 4 * k), ((0,), 0)],
    "repeat": lambda k: [(("xy",), "xy" * k), (("",), "")],
    "is_multiple": lambda k: [((7 * k,), True), ((7 * k + 1,), False), ((k + 1,), False)],
}


def check_function(prompt: str, code: str) -> None:
    """`code` defines the function `prompt` asks for, behaving as asked."""
    name = re.match(r"Write a Python function (\w+)\(", prompt)[1]
    k = int(re.findall(r"\d+", prompt)[-1])
    scope: dict = {}
    exec(code, scope)  # the bundled sample's own code
    for arguments, result in BEHAVIOUR[name](k):
        assert scope[name](*arguments) == result, (prompt, code, arguments)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_bundled_tasks_load_with_right_answers_and_budgets_by_effort():
    tasks = load_tasks(TASKS)
    assert len(tasks) == 396
    assert Counter(t.domain for t in tasks) == {"math": 180, "string": 200, "code": 16}
    assert Counter(t.effort for t in tasks) == {"low": 140, "medium": 160, "high": 40, "max": 56}
    assert all(t.budget == EFFORT_BUDGETS[t.effort] for t in tasks)
    for task in tasks:
        if task.verifier == "exact_match":
            assert task.answer == expected_answer(task.prompt), task
    with_tools = [t for t in tasks if t.environment is not None]
    assert len(with_tools) == 40
    for task in with_tools:  # three-digit operands, the calculator's answer
        assert (task.environment, task.tools, task.effort) == ("calculator", None, "max")
        expression = task.prompt.removeprefix("What is ").removesuffix("?")
        assert re.fullmatch(r"\d{3} [-+*] \d{3}", expression)
        assert calculate(expression) == task.answer


@pytest.mark.timeout(120)
def test_every_code_tasks_solution_passes_its_tests_and_another_constant_fails_them():
    code = [t for t in load_tasks(TASKS) if t.domain == "code"]
    assert {t.verifier for t in code} == {"python_unit_tests"}
    assert {re.match(r"Write a Python function (\w+)", t.prompt)[1] for t in code} == \
        set(BEHAVIOUR)
    for task in code:
        check_function(task.prompt, task.solution)
        k = int(re.findall(r"\d+", task.prompt)[-1])
        verdict = outcome_reward(task, f"```python\n{task.solution}\n```")
        assert verdict.reason == "passed", (task, verdict.detail)
        wrong = task.solution.replace(f" {k}", f" {k + 1}")
        assert wrong != task.solution
        assert outcome_reward(task, wrong).reason == "failed", task


def test_the_conversations_answer_other_prompts_as_the_verifiers_accept():
    conversations = _records(SFT)
    assert len(conversations) == 1992
    assert len({c["id"] for c in conversations}) == len(conversations)
    prompts = [c["messages"][0]["content"] for c in conversations]
    assert len(set(prompts)) == len(prompts)
    assert not set(prompts) & {t.prompt for t in load_tasks(TASKS)}
    kinds = Counter()
    for conversation in conversations:
        (question, *_, final) = conversation["messages"]
        assert (question["role"], final["role"]) == ("user", "assistant")
        if question["content"].startswith("Write a Python function"):
            kinds["code"] += 1
            check_function(question["content"], FENCED.fullmatch(final["content"])[1])
        else:
            kinds["tools" if "tools" in conversation else "answer"] += 1
            assert final["content"] == expected_answer(question["content"])
    assert kinds == {"code": 140, "tools": 300, "answer": 1552}


def test_the_calculator_conversations_parse_and_compute_as_an_episode_would():
    calculator_convs = [c for c in _records(SFT) if "tools" in c]
    for conversation in calculator_convs:
        question, calls, result, final = conversation["messages"]
        assert conversation["tools"] == Calculator().tools()
        text, spans = render_chat([question, calls], K3_CHAT_TEMPLATE, conversation["tools"])
        (call,) = parse_tool_calls(text[spans[-1][0]:spans[-1][1]])
        assert call.error is None and call.name == "calculate"
        assert call.arguments["expression"] + "?" == question["content"].removeprefix("What is ")
        assert observe(Calculator(), call) == result["content"] == final["content"]


def _config(name: str) -> DataConfig:
    return from_dict(DataConfig, yaml.safe_load((CONFIGS / name).read_text()), "data").validate()


def test_the_tasks_sft_config_reads_only_the_conversations():
    config = _config("tasks_sft.yaml")
    (source,) = config.sources
    assert (source.name, source.modality, source.format) == ("tasks_sft", "chat", "jsonl")
    assert list_source_files(resolve_path(source.path), source.format, source.glob,
                             "data.sources[0].path") == (str(SAMPLE_DIR / "tasks"), ["sft.jsonl"])
    assert (config.output_dir, config.validation_fraction, config.tokenizer.path) == \
        ("outputs/data/tasks_sft", 0.05, "outputs/data/sample/tokenizer.json")
    chat = _config("chat_sample.yaml")
    assert dataclasses.replace(config, name=chat.name, sources=chat.sources,
                               output_dir=chat.output_dir,
                               validation_fraction=chat.validation_fraction) == chat


@pytest.mark.timeout(300)
def test_k3_data_keeps_every_conversation(tmp_path):
    """Curated with a tokenizer of their own (the pre-training sample's is the config's): none
    is refused or a duplicate (dedup ignores operators, hence no "2 + 0" beside "2 - 0")."""
    config = dataclasses.replace(_config("tasks_sft.yaml"), output_dir=str(tmp_path / "out"),
                                 progress=False)
    config.tokenizer.path = None
    summary = run_pipeline(config)
    assert summary["input"]["records"] == summary["outcomes"]["kept"] == 1992
    assert summary["outcomes"]["duplicate"] == summary["outcomes"]["quarantined"] == {}


@pytest.mark.timeout(300)
def test_make_sample_rewrites_the_bundled_sample_byte_for_byte(tmp_path):
    make_sample(tmp_path / "sample")
    files = sorted(p.relative_to(SAMPLE_DIR) for p in SAMPLE_DIR.rglob("*") if p.is_file())
    assert sorted(p.relative_to(tmp_path / "sample")
                  for p in (tmp_path / "sample").rglob("*") if p.is_file()) == files
    for rel in files:
        assert (tmp_path / "sample" / rel).read_bytes() == (SAMPLE_DIR / rel).read_bytes(), rel
    assert sum((SAMPLE_DIR / rel).stat().st_size for rel in files) < 3e6
