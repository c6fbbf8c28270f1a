"""Fixtures every test may take, and the markers that the test tree's folders imply.

tests/unit (minutes, one process), tests/distributed (spawned gloo worlds), tests/e2e (k3-train,
k3-data and the README's commands as a user runs them), tests/slurm (a real local Slurm
cluster). Everything outside tests/unit is marked `slow`, so `pytest -m "not slow"` is the quick
run; tests/slurm is also marked `slurm`.
"""

import json
import os
from pathlib import Path

import pytest
import torch

# Two CPU cores in CI: one intra-op thread per test process keeps multi-process tests fair.
torch.set_num_threads(int(os.environ.get("K3_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _native_kernels():
    """The native CPU kernels, installed once for every test as k3-train installs them."""
    from model.ops import cpu

    cpu.install()


@pytest.fixture
def torch_forms():
    """The ops' torch forms: fp32 on CPU would take the native kernels, which
    tests/unit/model/test_native_kernels.py holds to the references."""
    from model.ops import dispatch

    with dispatch.kernels_enabled(False):
        yield

pytest_plugins = ["tests.helpers.slurm_fixtures"]


@pytest.fixture(scope="session")
def sample_data_dir(tmp_path_factory):
    """The bundled sample run through the data pipeline once per test session."""
    from data_pipeline.config import DataConfig
    from data_pipeline.pipeline import ensure_prepared

    out = tmp_path_factory.mktemp("sample_data")
    ensure_prepared(DataConfig(output_dir=str(out), progress=False))
    return out


_FOLDER_MARKS = {"distributed": ("slow",), "e2e": ("slow",), "slurm": ("slow", "slurm")}


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    for item in items:
        folder = Path(item.fspath).resolve().relative_to(tests).parts[0]
        for mark in _FOLDER_MARKS.get(folder, ()):
            item.add_marker(mark)


@pytest.fixture(scope="session")
def sample_run(sample_data_dir):
    """The conftest's pipeline run on the sample, with its ledger and kept documents."""
    from data_pipeline.config import DataConfig
    from data_pipeline.records import read_jsonl, read_ledger

    out = Path(sample_data_dir)
    cfg = DataConfig(output_dir=str(out), progress=False)  # what sample_data_dir ran
    kept = {}  # document id -> (shard prefix, sequence, docs.jsonl record)
    for docs_path in sorted([*(out / "shards").glob("*/*.docs.jsonl"),
                             *(out / "validation").glob("*/*.docs.jsonl")]):  # held-out split
        prefix = Path(str(docs_path)[:-len(".docs.jsonl")])
        for seq, d in enumerate(read_jsonl(docs_path)):
            kept[d["id"]] = (prefix, seq, d)
    return {"cfg": cfg, "out": out, "kept": kept,
            "summary": json.loads((out / "summary.json").read_text()),
            "ledger": {r["id"]: r for r in read_ledger(out)}}
