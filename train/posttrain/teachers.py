"""The teachers of multi-teacher on-policy distillation: each a k3-train run, checkpoint or
k3-export (any size, saved under any layout) with the task domains it owns, built under the
student's layout (sharded as the student is: tensor-parallel heads, FSDP2 units, experts) and
run forward-only in eval mode."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from model.errors import ConfigError

from ..checkpoint import Checkpointer
from ..init_from import load_initial_weights, resolve


class TeacherRouting:
    """domain -> the index of the teacher that owns it (mopd.teachers order)."""

    def __init__(self, teachers):
        self.owner = {domain: i for i, t in enumerate(teachers) for domain in t.domains}

    def __call__(self, domain: str) -> int:
        if domain not in self.owner:
            raise ConfigError(f"no teacher owns domain {domain!r}: add it to the domains of one "
                              f"of mopd.teachers (owned: {sorted(self.owner)})")
        return self.owner[domain]

    def check_tasks(self, tasks, path: str) -> None:
        """Every domain of the task set has its teacher."""
        missing = sorted({t.domain for t in tasks} - set(self.owner))
        if missing:
            raise ConfigError(f"rollout.tasks={path!r} has tasks of domains {missing} that no "
                              f"teacher owns: add them to mopd.teachers[*].domains")


def load_teachers(cfg, topology, device: torch.device, rank: int,
                  world_size: int) -> list[torch.nn.Module]:
    """Each of cfg.mopd.teachers under this rank's layout, its weights loaded."""
    from ..loop import build_layout_model

    models = []
    for i, teacher in enumerate(cfg.mopd.teachers):
        source = resolve(teacher.path)
        if source.model.vocab_size != cfg.model.vocab_size:
            raise ConfigError(f"mopd.teachers[{i}].path={teacher.path!r} has vocab_size="
                              f"{source.model.vocab_size}, the student {cfg.model.vocab_size}: "
                              f"a teacher scores the student's tokens (the same tokenizer)")
        teacher_cfg = dataclasses.replace(cfg, model=source.model, activation_checkpointing=False)
        model, _, parallel = build_layout_model(teacher_cfg, topology, device)
        reader = Checkpointer(Path(teacher.path), keep_last=1, rank=rank, world_size=world_size,
                              sharded=parallel.sharded_state)
        load_initial_weights(source, model, reader)
        model.eval().requires_grad_(False)
        models.append(model)
    return models
