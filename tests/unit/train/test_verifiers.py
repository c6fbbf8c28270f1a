"""Verifiers (train/posttrain/verifiers.py): exact match, and Python unit tests run in a limited
subprocess: correct code passes, wrong code fails with its assertion, an endless loop and an
unbounded allocation are refused within their limits, and none of it reaches this process."""

from __future__ import annotations

import pytest

from train.posttrain.verifiers import exact_match, python_unit_tests

ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def test_exact_match_ignores_only_whitespace_runs():
    assert exact_match("  42 \n", "42") == 1.0
    assert exact_match("the  answer", "the answer") == 1.0
    assert exact_match("42.0", "42") == 0.0


def test_correct_code_passes_and_wrong_code_fails_with_its_assertion():
    assert python_unit_tests(ADD, TESTS).reason == "passed"
    verdict = python_unit_tests("def add(a, b):\n    return a - b\n", TESTS)
    assert (verdict.reward, verdict.reason) == (0.0, "failed")
    assert "AssertionError" in verdict.detail


@pytest.mark.timeout(60)
def test_a_run_past_its_time_is_refused():
    verdict = python_unit_tests("while True:\n    pass\n", TESTS, timeout_s=2.0)
    assert (verdict.reward, verdict.reason) == (0.0, "timeout")


@pytest.mark.timeout(60)
def test_an_unbounded_allocation_is_refused_and_this_process_is_untouched():
    verdict = python_unit_tests("blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n",
                                TESTS, timeout_s=20.0, memory_mb=256)
    assert (verdict.reward, verdict.reason) == (0.0, "memory")
    assert python_unit_tests(ADD, TESTS).reward == 1.0  # the next verdict runs as before


def test_the_candidate_runs_isolated_in_an_empty_directory():
    verdict = python_unit_tests("import os\nFILES = os.listdir('.')\n",
                                "assert FILES == ['candidate.py'], FILES\n")
    assert verdict.reason == "passed", verdict.detail
