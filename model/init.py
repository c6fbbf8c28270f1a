"""Layout-independent initial values: each element a function of (seed, parameter name, index).

A rank of a large layout holds a part of each parameter: a pipeline stage's layers, its home
experts, an FSDP2 or tensor-parallel shard. So that it can initialise exactly that part, equal
to what the whole model built in one process holds there, without building the rest, every
initial value is computed from its element's flat index in the logical (full) tensor by a
counter-based generator (splitmix64 over the index, keyed by the seed and the parameter's
name), instead of drawn from a stream whose position depends on everything drawn before it.

`Rule`s say what a parameter starts as (`Normal`, `Uniform`, `Constant`, or `Mapped`: a
function of a uniform draw); `fill_(param, rule, key, index)` writes the values at `index`, the
global index of each local element along each dimension (None: the whole tensor).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def _int64(x: int) -> int:
    """A 64-bit pattern as the signed value torch's int64 holds."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 tensors read as unsigned (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def parameter_key(seed: int, name: str) -> int:
    """The generator key of one parameter: its values depend on the seed and its name only."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return _int64(int.from_bytes(digest[:8], "little"))


def uniform(key: int, index: torch.Tensor) -> torch.Tensor:
    """float64 in (0, 1) for int64 `index` (any shape): the top 53 bits of the hash, centred."""
    z = _splitmix64(index * _GOLDEN + key)
    return (_shift_right(z, 11).to(torch.float64) + 0.5) * 2.0**-53


def normal(key: int, index: torch.Tensor) -> torch.Tensor:
    """float64 standard normal for int64 `index`: Box-Muller on the draws 2i and 2i + 1."""
    radius = torch.sqrt(-2.0 * torch.log(uniform(key, 2 * index)))
    return radius * torch.cos((2.0 * math.pi) * uniform(key, 2 * index + 1))


class Rule:
    """What a parameter starts as; `values(key, index)` -> float64 values at flat `index`."""

    def values(self, key: int, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Normal(Rule):
    std: float
    mean: float = 0.0

    def values(self, key: int, index: torch.Tensor) -> torch.Tensor:
        return normal(key, index) * self.std + self.mean


@dataclass(frozen=True)
class Uniform(Rule):
    low: float
    high: float

    def values(self, key: int, index: torch.Tensor) -> torch.Tensor:
        return uniform(key, index) * (self.high - self.low) + self.low


@dataclass(frozen=True)
class Constant(Rule):
    value: float

    def values(self, key: int, index: torch.Tensor) -> torch.Tensor:
        return torch.full(index.shape, self.value, dtype=torch.float64, device=index.device)


@dataclass(frozen=True)
class Mapped(Rule):
    """fn(u) of a uniform draw u in (0, 1), element-wise (float64 in, float64 out)."""

    fn: Callable[[torch.Tensor], torch.Tensor]

    def values(self, key: int, index: torch.Tensor) -> torch.Tensor:
        return self.fn(uniform(key, index))


# (the tensor to write, the logical shape, each dimension's global index of its elements or None)
LocalPart = tuple[torch.Tensor, Sequence[int], Sequence[torch.Tensor] | None]
# locate(name, param) -> the part of a parameter this process holds (parallel layouts).
Locate = Callable[[str, torch.nn.Parameter], LocalPart]

ZEROS = Constant(0.0)
ONES = Constant(1.0)

# Elements filled per pass: bounds the int64 index and float64 temporaries of a large shard.
_ELEMENTS_PER_PASS = 1 << 24


def _flat_index(shape: Sequence[int], index: Sequence[torch.Tensor],
                device: torch.device) -> torch.Tensor:
    """Flat positions in a contiguous tensor of `shape` of the grid index[0] x index[1] x ..."""
    flat = torch.zeros((), dtype=torch.long, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = -1
        flat = flat + index[dim].to(device=device, dtype=torch.long).view(view) * stride
        stride *= shape[dim]
    return flat


@torch.no_grad()
def fill_(local: torch.Tensor, rule: Rule, key: int, shape: Sequence[int],
          index: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Writes into `local` (a plain tensor) the values `rule` gives the logical tensor of
    `shape` at the grid `index` (one int64 vector per dimension: the global position of each
    local row, column, ...; None: `local` is the whole tensor). In passes along dim 0, so a
    large shard never holds more than a few million int64 indices at once."""
    if local.is_meta:  # nothing to write (a model built on meta is initialised later)
        return local
    if index is None:
        index = [torch.arange(n) for n in shape]
    if local.dim() == 0:
        local.copy_(rule.values(key, torch.zeros((), dtype=torch.long, device=local.device)))
        return local
    rows = max(1, _ELEMENTS_PER_PASS // max(1, math.prod(local.shape[1:])))
    for start in range(0, local.shape[0], rows):
        part = [index[0][start:start + rows], *index[1:]]
        flat = _flat_index(shape, part, local.device)
        local[start:start + rows].copy_(rule.values(key, flat))
    return local


def random_seed() -> int:
    """A seed drawn from torch's global CPU generator, so that torch.manual_seed decides it."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def reset_(module: torch.nn.Module, seed: int | None = None) -> None:
    """A module's own parameters from its `init_rules()` (keyed by their names in the module):
    the modules' `reset_parameters`. Nothing on the meta device (and no seed drawn there)."""
    rules = module.init_rules()
    if all(getattr(module, leaf).is_meta for leaf in rules):
        return
    seed = random_seed() if seed is None else seed
    for leaf, rule in rules.items():
        param = getattr(module, leaf)
        fill_(param.data, rule, parameter_key(seed, leaf), param.shape)
