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


@pytest.mark.parametrize("stage, precision", [("sft", "auto"), ("sft_qat", "mxfp4_qat")])
def test_post_training_stages_select_their_data_precision_and_start(stage, precision):
    """stage=sft / sft_qat compose the chat set, the precision, the pre-trained run to start from
    and a run directory of their own; the command line still overrides them."""
    from hydra import compose, initialize_config_dir

    import train.cli  # noqa: F401  (registers the schema)
    from train.config import TrainConfig, validate_train_config

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"stage={stage}"])
        mine = compose(config_name="train", overrides=[f"stage={stage}", "run_dir=mine",
                                                       "epochs=1", "data=sample"])
    assert (cfg.stage.name, cfg.data.name, cfg.precision.name) == (stage, "chat_sample", precision)
    assert cfg.init_from == "outputs/k3_tiny" and cfg.run_dir == f"outputs/k3_tiny_{stage}"
    assert cfg.epochs == 5 and cfg.stage.long_docs.num_docs == 0
    assert (mine.run_dir, mine.epochs, mine.data.name) == ("mine", 1, "sample")
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))
    typed.init_from = None  # the demo's pre-training run is not here
    validate_train_config(typed, world_size=1, data=False)


@pytest.mark.parametrize("parallel, world", [(dict(tensor=2), 2), (dict(pipeline=2), 2),
                                             (dict(context=2), 2)])
def test_per_document_loss_is_refused_where_the_layout_cannot_weigh_tokens(parallel, world):
    from model.errors import ConfigError
    from train.config import ParallelConfig, TrainConfig, validate_train_config

    cfg = TrainConfig(parallel=ParallelConfig(**parallel))
    cfg.stage.loss_normalization = "sequence"
    cfg.stage.global_batch_size = 4
    cfg.stage.micro_batch_size = 1
    with pytest.raises(ConfigError, match="stage.loss_normalization='sequence' is invalid"):
        validate_train_config(cfg, world_size=world, data=False)
    cfg.parallel = ParallelConfig(data=2)  # data parallelism weighs them
    validate_train_config(cfg, world_size=2, data=False)
    cfg.stage.loss_normalization = "conversation"
    with pytest.raises(ConfigError, match="stage.loss_normalization='conversation'"):
        validate_train_config(cfg, world_size=2, data=False)
