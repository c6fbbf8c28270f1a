"""The README's main job: `k3-train` with no arguments, on a fresh directory, on 2 CPU cores."""

import shutil
import subprocess
import time

import pytest

from tests.train_helpers import read_metrics, train_env

pytestmark = pytest.mark.slow


def test_readme_demo_finishes_in_five_minutes_and_learns(tmp_path):
    k3_train = shutil.which("k3-train")
    assert k3_train, "k3-train is not installed: pip install -e . (the README's first command)"
    start = time.time()
    # Exactly the README command, in an empty working directory (outputs/ lands there).
    out = subprocess.run([k3_train], cwd=tmp_path, env=train_env(threads=2),
                         capture_output=True, text=True, timeout=600)
    elapsed = time.time() - start
    assert out.returncode == 0, out.stderr[-3000:]
    assert elapsed < 300, f"the demo took {elapsed:.0f} s"
    rows = read_metrics(tmp_path / "outputs" / "k3_tiny")
    tenth = max(1, len(rows) // 10)
    first = sum(r["loss"] for r in rows[:tenth]) / tenth
    last = sum(r["loss"] for r in rows[-tenth:]) / tenth
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}"
    print(f"demo: {len(rows)} steps in {elapsed:.0f} s, loss {first:.3f} -> {last:.3f}")
