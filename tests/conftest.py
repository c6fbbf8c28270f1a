import os

import pytest
import torch

# Two CPU cores in CI: one intra-op thread per test process keeps multi-process tests fair.
torch.set_num_threads(int(os.environ.get("K3_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

pytest_plugins = ["tests.slurm_fixtures"]
