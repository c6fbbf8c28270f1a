"""`init_from=PATH`: a run that starts from another run's weights (fine-tuning from a
pre-trained checkpoint) rather than from random ones or its own checkpoints.

PATH is a k3-train run directory (its newest complete checkpoint), one of its checkpoint
directories (checkpoints/step_N) or a k3-export directory. Only the model's parameters and
buffers (the Quantile Balancing biases included) are read, into whatever layout this run has;
the optimizer, the step, the data position and the learning-rate schedule start fresh. The
source's model config must describe the same model: every field that shapes or defines the
weights' meaning must be equal (a mismatch is refused, naming the field); fields that only
choose how the model runs may differ.

A run that already has checkpoints of its own resumes from them instead (checkpoint.resume):
init_from only seeds a run's first start.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from model.config import K3Config
from model.errors import ConfigError

from .checkpoint import COMPLETE, OPTIONS, Checkpointer
from .export import (
    CONFIG_FILE,
    EXPORT_KEYS,
    k3_config_from_dict,
    latest_checkpoint,
    load_exported,
    read_run_config,
)

# Fields that choose how the model runs, not what its weights mean: they may differ between
# the source and this run (a longer context, other kernels, another QB histogram resolution).
EXECUTION_FIELDS = {"name", "max_seq_len", "init_std", "loss_chunk_tokens", "kda.chunk_size",
                    "kda.backend", "mla.backend", "moe.dispatch", "moe.slot_alignment",
                    "moe.qb_estimator", "moe.qb_bins"}


@dataclass
class InitSource:
    path: Path  # the checkpoint or export directory read
    kind: str  # "checkpoint" | "export"
    model: K3Config


def resolve(init_from: str) -> InitSource:
    """What `init_from` names (module docstring), with its model config."""
    path = Path(init_from)
    if (path / CONFIG_FILE).is_file():
        values = json.loads((path / CONFIG_FILE).read_text())
        values = {k: v for k, v in values.items() if k not in EXPORT_KEYS}
        return InitSource(path, "export", k3_config_from_dict(values))
    if (path / COMPLETE).is_file():  # <run>/checkpoints/step_N
        return InitSource(path, "checkpoint", read_run_config(path.parent.parent)[0])
    if (path / ".hydra" / "config.yaml").is_file():
        try:
            checkpoint = latest_checkpoint(path)
        except FileNotFoundError as e:
            raise ConfigError(f"init_from={init_from!r}: {e}") from None
        return InitSource(checkpoint, "checkpoint", read_run_config(path)[0])
    raise ConfigError(f"init_from={init_from!r} is not a k3-train run directory, a complete "
                      f"checkpoint (checkpoints/step_N) or a k3-export directory")


def _flat(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_same_model(source: InitSource, model: K3Config) -> None:
    """Raises ConfigError naming the first field in which the source's model differs."""
    theirs, ours = _flat(asdict(source.model)), _flat(asdict(model))
    for name in sorted(set(theirs) | set(ours)):
        if name in EXECUTION_FIELDS or theirs.get(name) == ours.get(name):
            continue
        raise ConfigError(f"init_from={str(source.path)!r} holds another model: "
                          f"model.{name}={theirs.get(name, '(absent)')!r} there, "
                          f"{ours.get(name, '(absent)')!r} here")


def load_initial_weights(source: InitSource, model: torch.nn.Module,
                         checkpointer: Checkpointer) -> None:
    """The source's weights into `model`, in its layout (`checkpointer` knows it)."""
    if source.kind == "checkpoint":
        checkpointer.load_weights(source.path, model)
        return
    whole = load_exported(source.path).state_dict()
    state = get_model_state_dict(model, options=OPTIONS)
    sharded = checkpointer.sharded
    if sharded is not None:
        state, _ = sharded.wrap(state, {})
    for name, like in state.items():
        value = whole[name].to(like.dtype)
        # Every rank holds the whole tensor: each keeps its own part, nothing is sent.
        state[name] = (distribute_tensor(value, like.device_mesh, like.placements,
                                         src_data_rank=None)
                       if isinstance(like, DTensor) else value.to(like.device))
    if sharded is not None:
        state, _ = sharded.unwrap(state, {})
    set_model_state_dict(model, state, options=OPTIONS)
