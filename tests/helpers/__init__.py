"""Helpers the tests share: the repository's paths, tolerances, spawned worlds, k3-train runs."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
GOLDEN = REPO / "tests" / "golden"
