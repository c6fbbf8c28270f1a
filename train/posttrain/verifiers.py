"""Verifiers: rewards for RL from checkable answers.

- `exact_match(answer, reference)`: 1.0 when the answer, stripped and with its whitespace runs
  collapsed, equals the reference's, else 0.0.
- `python_unit_tests(code, tests)`: runs the candidate code and then the tests (plain `assert`
  statements) in a fresh `python -I` subprocess in an empty temporary directory, under a
  wall-clock limit, a CPU-time limit and an address-space limit; reward 1.0 when it exits
  cleanly, 0.0 otherwise, with the reason (passed, failed, timeout, memory). A run that loops,
  allocates without bound or crashes the interpreter ends its own process only.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MEMORY_ERROR_EXIT = 3  # the harness's exit code for a MemoryError


@dataclass
class Verdict:
    reward: float
    reason: str  # passed | failed | timeout | memory (| judged: rewards.outcome_reward)
    detail: str = ""  # the end of the run's stderr, for a failure


def exact_match(answer: str, reference: str) -> float:
    return float(" ".join(answer.split()) == " ".join(reference.split()))


# Runs the candidate and its tests in one namespace; a MemoryError becomes its own exit code (an
# exhausted address space is the candidate's fault, not a failed assertion).
_HARNESS = f"""
import sys
source = open(sys.argv[1]).read()
try:
    exec(compile(source, "candidate", "exec"), {{"__name__": "__candidate__"}})
except MemoryError:
    sys.exit({MEMORY_ERROR_EXIT})
"""


def python_unit_tests(code: str, tests: str, timeout_s: float = 5.0,
                      memory_mb: int = 512) -> Verdict:
    """Reward of `code` against `tests` (module docstring)."""
    if not timeout_s > 0 or memory_mb < 64:
        raise ValueError(f"timeout_s={timeout_s}, memory_mb={memory_mb} are invalid: need "
                         f"timeout_s > 0 and memory_mb >= 64 (the interpreter's own start)")
    limit = memory_mb << 20
    cpu_s = max(1, int(timeout_s))

    def limits() -> None:  # in the child, before it runs Python
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))

    with tempfile.TemporaryDirectory(prefix="k3-verify-") as work:
        source = Path(work) / "candidate.py"
        source.write_text(f"{code}\n\n{tests}\n")
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _HARNESS, str(source)],
                                  cwd=work, capture_output=True, text=True, timeout=timeout_s,
                                  preexec_fn=limits, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return Verdict(0.0, "timeout", f"ran past {timeout_s} s")
    if done.returncode == 0:
        return Verdict(1.0, "passed")
    if done.returncode == MEMORY_ERROR_EXIT:
        return Verdict(0.0, "memory", f"exceeded {memory_mb} MiB")
    if done.returncode < 0:  # killed by a signal: SIGXCPU past the CPU limit
        return Verdict(0.0, "timeout", f"signal {-done.returncode}")
    return Verdict(0.0, "failed", done.stderr[-2000:])
