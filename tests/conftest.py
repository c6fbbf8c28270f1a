import os

import pytest
import torch

# Two CPU cores in CI: one intra-op thread per test process keeps multi-process tests fair.
torch.set_num_threads(int(os.environ.get("K3_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def torch_forms():
    """The autograd functions' torch forms: fp32 on CPU would take the native kernels, which
    tests/test_native_kernels.py holds to the references."""
    from model.ops import native

    with native.native_kernels(False):
        yield

pytest_plugins = ["tests.slurm_fixtures"]


@pytest.fixture(scope="session")
def sample_data_dir(tmp_path_factory):
    """The bundled sample run through the data pipeline once per test session."""
    from data_pipeline.config import DataConfig
    from data_pipeline.pipeline import ensure_prepared

    out = tmp_path_factory.mktemp("sample_data")
    ensure_prepared(DataConfig(output_dir=str(out), progress=False))
    return out
