"""Post-training's configuration: bad values refused by name before anything starts, the task
selection (domains, effort levels, a first few), teacher routing by domain, and rollout engines
loaded from `package.module:attr` (a factory of the config) with clear errors."""

from __future__ import annotations

import pytest

from model.errors import ConfigError
from train.config import TrainConfig, validate_train_config
from train.posttrain.config import TeacherConfig
from train.posttrain.evaluation import eval_sample, select_tasks
from train.posttrain.rollout import ColocatedEngine, load_engine
from train.posttrain.tasks import Task
from train.posttrain.teachers import TeacherRouting

TASKS = [Task(id=f"{d}-{e}-{i}", domain=d, prompt="p", verifier="exact_match", answer="1",
              budget=8, effort=e)
         for d in ("math", "string") for e in ("low", "high") for i in range(3)]


def _cfg(mode: str = "rl", **changes) -> TrainConfig:
    cfg = TrainConfig()
    cfg.posttrain, cfg.device = mode, "cpu"
    for path, value in changes.items():
        target = cfg
        *parents, leaf = path.split("__")
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return cfg


@pytest.mark.parametrize("mode, changes, message", [
    ("bogus", {}, "posttrain='bogus' is invalid"),
    ("rl", {"rollout__temperature": 0.0}, "rollout.temperature=0.0 is invalid"),
    ("rl", {"rollout__samples_per_prompt": 0}, "rollout.samples_per_prompt=0 is invalid"),
    ("rl", {"rollout__max_staleness": -2}, "rollout.max_staleness=-2 is invalid"),
    ("rl", {"rl__clip": 1.5}, "rl.clip=1.5 is invalid"),
    ("rl", {"parallel__pipeline": 2}, "parallel.pipeline and parallel.context 1"),
    ("mopd", {}, r"mopd.teachers=\[\] is invalid"),
    ("mopd", {"mopd__kl": "forward", "mopd__teachers": [TeacherConfig("t", ["math"])]},
     "mopd.kl='forward' is invalid"),
    ("mopd", {"mopd__teachers": [TeacherConfig("a", ["math"]), TeacherConfig("b", ["math"])]},
     r"domain 'math' is already mopd.teachers\[0\]'s"),
])
def test_bad_post_training_settings_are_refused_by_name(mode, changes, message):
    cfg = _cfg(mode, **changes)
    with pytest.raises(ConfigError, match=message):
        validate_train_config(cfg, world_size=2 if cfg.parallel.pipeline > 1 else 1,
                              data=False)


def test_a_post_training_step_has_no_global_batch_to_split_over_ranks():
    """Its rows are the groups its rollouts finish: a global batch of 4 rows of 4 need not
    split over two data-parallel ranks."""
    cfg = _cfg("rl", stage__global_batch_size=4, stage__micro_batch_size=4)
    assert validate_train_config(cfg, world_size=2, data=False) is cfg
    cfg.posttrain = "none"
    with pytest.raises(ConfigError, match="stage.global_batch_size=4 is invalid"):
        validate_train_config(cfg, world_size=2, data=False)


def test_tasks_are_selected_by_domain_effort_and_count():
    assert [t.id for t in select_tasks(TASKS, ["string"], ["high"], 0, "f")] == [
        "string-high-0", "string-high-1", "string-high-2"]
    assert len(select_tasks(TASKS, [], ["low"], 4, "f")) == 4
    assert select_tasks(TASKS, [], [], 0, "f") == TASKS
    with pytest.raises(ConfigError, match=r"select no task .*its domains: \['math', 'string'\]"):
        select_tasks(TASKS, ["code"], [], 0, "f")
    sample = eval_sample(TASKS, 5, seed=3)
    assert len(sample) == 5 and sample == eval_sample(TASKS, 5, seed=3)
    assert sample != eval_sample(TASKS, 5, seed=4) and eval_sample(TASKS, 50, 3) == TASKS


def test_teachers_are_routed_by_domain():
    routing = TeacherRouting([TeacherConfig("a", ["math"]), TeacherConfig("b", ["string",
                                                                            "code"])])
    assert [routing(d) for d in ("math", "string", "code")] == [0, 1, 1]
    with pytest.raises(ConfigError, match="no teacher owns domain 'chess'"):
        routing("chess")
    TeacherRouting([TeacherConfig("a", ["math", "string"])]).check_tasks(TASKS, "f")
    with pytest.raises(ConfigError, match=r"tasks of domains \['string'\] that no teacher"):
        TeacherRouting([TeacherConfig("a", ["math"])]).check_tasks(TASKS, "f")


class Engine:
    """An external engine stand-in, made from the config."""

    def __init__(self, cfg):
        self.cfg = cfg

    def generate(self, contexts, budgets, row_seeds, row_offsets):
        return []

    def sync_weights(self, version):
        pass


def test_rollout_engines_load_by_name():
    cfg = _cfg("rl")
    assert isinstance(load_engine(cfg, None, []), ColocatedEngine)
    cfg.rollout.engine = f"{__name__}:Engine"
    engine = load_engine(cfg, None, [])
    assert isinstance(engine, Engine) and engine.cfg is cfg
    cfg.rollout.engine = f"{__name__}:TASKS"
    with pytest.raises(ConfigError, match=r"made a list without \['generate', 'sync_weights'\]"):
        load_engine(cfg, None, [])
    cfg.rollout.engine = "no_such_module:Engine"
    with pytest.raises(ConfigError, match="module no_such_module does not import"):
        load_engine(cfg, None, [])
