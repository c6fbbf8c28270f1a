"""The Hydra tree stays in step with the Python presets and schema."""


import pytest
from omegaconf import OmegaConf

from model.config import PRESETS
from tests.helpers import REPO

CONFIGS = REPO / "configs"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_yaml_equals_python_preset(name):
    on_disk = OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")
    assert OmegaConf.to_container(on_disk) == OmegaConf.to_container(
        OmegaConf.structured(PRESETS[name]())), (
        f"configs/model/{name}.yaml differs from model.config.{name}(): regenerate it")
