"""Each rank's side state in a checkpoint (loader position, RNG streams) as a JSON file: reading
it back can only produce numbers and strings, never run code (a pickle could)."""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path

import numpy as np
import torch


def _tensor_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _text_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": _tensor_text(torch.get_rng_state()),
             "python": [version, list(mt), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = [_tensor_text(s.cpu()) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_text_tensor(state["torch"]))
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_tensor(s) for s in state["cuda"]])


def rank_file(ckpt: Path, rank: int) -> Path:
    return ckpt / f"rank{rank:05d}.json"


def write_rank_state(path: Path, state: dict) -> None:
    """`state` (JSON-serialisable) plus this process's RNG streams."""
    with open(path, "w") as f:
        json.dump({**state, "rng": rng_state()}, f)
        f.flush()
        os.fsync(f.fileno())


def read_rank_state(path: Path) -> dict:
    """Restores the RNG streams written with the state; returns the rest of it."""
    try:
        state = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a rank state file ({e})") from e
    set_rng_state(state.pop("rng"))
    return state
