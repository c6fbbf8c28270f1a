"""The README's main job: `k3-train` with no arguments, on a fresh directory, on 2 CPU cores.

How fast it runs is measured by benchmarks/demo_step.py, not asserted here: a timed assertion
fails on a loaded machine whatever the code does."""

import shutil
import subprocess

import pytest

from tests.helpers.train_helpers import read_metrics, train_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def test_readme_demo_learns(tmp_path):
    k3_train = shutil.which("k3-train")
    assert k3_train, "k3-train is not installed: pip install -e . (the README's first command)"
    # Exactly the README command, in an empty working directory (outputs/ lands there).
    out = subprocess.run([k3_train], cwd=tmp_path, env=train_env(threads=2),
                         capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "outputs" / "k3_tiny")
    tenth = max(1, len(rows) // 10)
    first = sum(r["loss"] for r in rows[:tenth]) / tenth
    last = sum(r["loss"] for r in rows[-tenth:]) / tenth
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}"
    print(f"demo: {len(rows)} steps, loss {first:.3f} -> {last:.3f}")
