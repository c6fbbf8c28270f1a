"""The process layout: validated sizes, megatron-core's process groups, DeviceMeshes on them.

One object owns the layout. `Topology.from_config` checks every size against the world size and
the model before any process group exists; `initialize()` lets megatron-core
`parallel_state.initialize_model_parallel` create the groups in Megatron's rank order
tp-cp-ep-dp-pp and wraps those same groups in DeviceMeshes (`DeviceMesh.from_group`), so DTensor,
FSDP2 and pipelining communicate over exactly the groups megatron-core made. Nothing else in the
project creates process groups.

Rank layout (fastest-varying first), per pipeline stage of tp*cp*dp = etp*ep*edp ranks:

    dense:   rank = tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i)),  dp_i = rep_i*dp_shard + shard_i
    experts: rank = etp_i + etp*(ep_i + ep*(edp_i + edp*pp_i)),  edp_i = rep_i*edp_shard + shard_i

HSDP splits megatron's one data-parallel dimension as dp_replicate (outer) x dp_shard (inner):
shard groups are contiguous runs of the data-parallel ranks, replica groups are strided. That is
megatron's partial distributed optimizer (`num_distributed_optimizer_instances` = dp_replicate:
each instance is a contiguous block of the dp x cp ranks) and torchtitan's
(dp_replicate, dp_shard) mesh order, so `mesh("dp_replicate", "dp_shard")` is the 2-D mesh
FSDP2 takes for HSDP, with the shard dimension on the closer ranks.
"""

from __future__ import annotations

import datetime
import itertools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from model.config import K3Config
from model.errors import ConfigError

from .config import ParallelConfig

MEGATRON_ORDER = "tp-cp-ep-dp-pp"
DATA_SHARD_MODES = ("none", "optimizer", "full")
FSDP_PARAM_DTYPES = ("compute", "master")  # see ParallelConfig.fsdp_param_dtype
CONTEXT_LAYOUTS = ("zigzag", "contiguous")  # see ParallelConfig.context_layout
EXPERT_DISPATCH = ("moonep", "dynamic")
MOONEP_TRANSPORTS = ("collective", "symm_mem")
BACKENDS = ("auto", "gloo", "nccl")
# Schedule -> the virtual_stages (stages per rank) it runs with: (least, most; None: any).
PIPELINE_SCHEDULES = {"1F1B": (1, 1), "Interleaved1F1B": (2, None), "ZBVZeroBubble": (2, 2),
                      "DualPipeV": (2, 2)}

# Atomic dimensions of each family, fastest-varying first (the strides of the layout above).
_DENSE_ATOMS = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
_EXPERT_ATOMS = ("etp", "ep", "edp_shard", "edp_replicate", "pp")
# Flattened dimensions: their atoms outer to inner (a flattened index lists ranks ascending).
_COMPOSITES = {"dp": ("dp_replicate", "dp_shard"),
               "dp_cp": ("dp_replicate", "dp_shard", "cp"),
               "dp_shard_cp": ("dp_shard", "cp"),
               # Every rank of a pipeline stage: under expert x tensor parallelism each tensor-
               # parallel rank routes its own tokens, so Quantile Balancing sums over all.
               "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),
               # The expert-data ranks: under HSDP replicas (outer) of shard groups (inner).
               "edp": ("edp_replicate", "edp_shard")}
DIMS = ("pp", "dp_replicate", "dp_shard", "dp", "cp", "tp", "dp_cp", "dp_shard_cp",
        "dp_cp_tp", "ep", "etp", "edp", "edp_shard", "edp_replicate")


def _fail(path: str, value, valid: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: {valid}")


def check_model_fits(model: K3Config, tp: int, ep: int, etp: int, pp: int, virtual_stages: int,
                     path: str = "model") -> None:
    """The model's sizes must split evenly over the layout; ConfigError names the fields."""
    tp_split = {f"{path}.kda.num_heads": model.kda.num_heads,
                f"{path}.mla.num_heads": model.mla.num_heads,
                f"{path}.vocab_size": model.vocab_size}  # vocab-parallel embedding and head
    if model.num_dense_layers > 0:
        tp_split[f"{path}.dense_intermediate"] = model.dense_intermediate
    if model.moe.num_shared_experts > 0:  # shared experts: column then row parallel
        tp_split[f"{path}.moe.expert_intermediate"] = model.moe.expert_intermediate
    for name, value in tp_split.items():
        if value % tp:
            _fail(name, value, f"must be divisible by parallel.tensor={tp} "
                  "(tensor parallelism splits it across ranks)")
    if model.moe.num_experts % ep:
        _fail(f"{path}.moe.num_experts", model.moe.num_experts,
              f"must be divisible by parallel.expert={ep}")
    if model.moe.expert_intermediate % etp:
        _fail(f"{path}.moe.expert_intermediate", model.moe.expert_intermediate,
              f"must be divisible by parallel.expert_tensor={etp}")
    stages = pp * virtual_stages
    if model.num_layers < stages:
        _fail(f"{path}.num_layers", model.num_layers,
              f"must be >= parallel.pipeline*virtual_stages = {pp}*{virtual_stages} = {stages} "
              "(every stage holds at least one layer; the split may be uneven)")


def expert_tensor_size(parallel: ParallelConfig) -> int:
    """parallel.expert_tensor with -1 resolved: the tensor-parallel size without expert
    parallelism (Megatron's default, the experts split like the dense MLP), 1 with it (each
    tensor-parallel rank then routes its own tokens to whole experts)."""
    if parallel.expert_tensor != -1:
        return parallel.expert_tensor
    return parallel.tensor if parallel.expert == 1 else 1


@dataclass
class Topology:
    """Sizes of every parallel dimension (all >= 1) and, after `initialize()`, their groups."""

    world_size: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    etp: int
    edp: int
    data_shard: str = "none"
    context_layout: str = "zigzag"
    sequence_parallel: bool = False  # effective: requested and tp > 1
    virtual_stages: int = 1
    pipeline_schedule: str = "1F1B"
    expert_dispatch: str = "moonep"
    moonep_transport: str = "collective"
    timeout_s: float = 600.0
    # Set by initialize(); not part of the layout's identity.
    rank: int | None = field(default=None, init=False, compare=False)
    device_type: str | None = field(default=None, init=False, compare=False)
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _own_groups: list = field(default_factory=list, init=False, repr=False, compare=False)
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _roll_call_group: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def initialized(self) -> bool:
        """Whether initialize() has created this layout's groups in this process."""
        return self.rank is not None

    @property
    def dp(self) -> int:
        """Megatron's data-parallel size (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    # ---- validation (no process group) ----

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int,
                    model: K3Config | None = None) -> Topology:
        """Validates `parallel` (and the model against it); raises ConfigError naming the fields."""
        p = parallel
        if world_size < 1:
            _fail("world_size", world_size, "must be >= 1")
        for name in ("tensor", "context", "pipeline", "expert", "data_replicate",
                     "virtual_stages"):
            if getattr(p, name) < 1:
                _fail(f"parallel.{name}", getattr(p, name), "must be >= 1")
        if p.expert_tensor != -1 and p.expert_tensor < 1:
            _fail("parallel.expert_tensor", p.expert_tensor,
                  "must be >= 1, or -1 for parallel.tensor without expert parallelism (1 with it)")
        etp = expert_tensor_size(p)
        if p.tensor > 1 and p.expert == 1 and etp == 1:
            # Every tensor-parallel rank would hold every expert whole.
            _fail("parallel.expert_tensor", p.expert_tensor,
                  f"must be > 1 with parallel.tensor={p.tensor} and parallel.expert=1: split the "
                  "experts over the tensor-parallel ranks (expert_tensor, -1 for tensor) or "
                  "over expert-parallel ones (expert)")
        if p.data != -1 and p.data < 1:
            _fail("parallel.data", p.data, "must be >= 1, or -1 for what the world size leaves")
        if p.expert_dispatch not in EXPERT_DISPATCH:
            _fail("parallel.expert_dispatch", p.expert_dispatch,
                  f"must be one of {list(EXPERT_DISPATCH)}")
        if p.moonep.transport not in MOONEP_TRANSPORTS:
            _fail("parallel.moonep.transport", p.moonep.transport,
                  f"must be one of {list(MOONEP_TRANSPORTS)}")
        if p.moonep.alignment < 1:
            _fail("parallel.moonep.alignment", p.moonep.alignment, "must be >= 1")
        if p.pipeline_schedule not in PIPELINE_SCHEDULES:
            _fail("parallel.pipeline_schedule", p.pipeline_schedule,
                  f"must be one of {list(PIPELINE_SCHEDULES)}")
        least, most = PIPELINE_SCHEDULES[p.pipeline_schedule]
        vs = p.virtual_stages
        if vs < least or (most is not None and vs > most):
            need = f"== {least}" if least == most else f">= {least}"
            _fail("parallel.virtual_stages", vs,
                  f"must be {need} with parallel.pipeline_schedule={p.pipeline_schedule}")
        if vs > 1 and p.pipeline == 1:
            _fail("parallel.virtual_stages", vs,
                  "must be 1 with parallel.pipeline=1 (virtual stages interleave pipeline ranks)")
        if p.backend not in BACKENDS:
            _fail("parallel.backend", p.backend, f"must be one of {list(BACKENDS)}")
        if not p.timeout_s > 0:
            _fail("parallel.timeout_s", p.timeout_s, "must be > 0 (seconds)")
        if p.data_shard not in DATA_SHARD_MODES:
            _fail("parallel.data_shard", p.data_shard, f"must be one of {list(DATA_SHARD_MODES)}")
        if p.context_layout not in CONTEXT_LAYOUTS:
            _fail("parallel.context_layout", p.context_layout,
                  f"must be one of {list(CONTEXT_LAYOUTS)}")
        if p.fsdp_param_dtype not in FSDP_PARAM_DTYPES:
            _fail("parallel.fsdp_param_dtype", p.fsdp_param_dtype,
                  f"must be one of {list(FSDP_PARAM_DTYPES)}")
        if model is not None:  # before the world size: a model that cannot split fails first
            check_model_fits(model, tp=p.tensor, ep=p.expert, etp=etp,
                             pp=p.pipeline, virtual_stages=vs)
        model_parallel = p.tensor * p.context * p.pipeline
        if p.data == -1:
            if world_size % model_parallel:
                _fail("parallel.tensor*context*pipeline", model_parallel,
                      f"must divide the world size {world_size} (tensor={p.tensor}, "
                      f"context={p.context}, pipeline={p.pipeline})")
            data = world_size // model_parallel
        else:
            data = p.data
            if data * model_parallel != world_size:
                _fail("parallel.data", p.data,
                      f"data*tensor*context*pipeline must equal the world size {world_size} "
                      f"(tensor={p.tensor}, context={p.context}, pipeline={p.pipeline})")
        if data % p.data_replicate:
            _fail("parallel.data_replicate", p.data_replicate,
                  f"must divide parallel.data={data} (HSDP: replicas x shards)")
        if p.data_replicate > 1 and p.data_shard == "none":
            _fail("parallel.data_replicate", p.data_replicate,
                  "must be 1 with parallel.data_shard=none (replicas only mean something when "
                  "optimizer state or parameters are sharded: use optimizer or full)")
        stage_ranks = data * p.context * p.tensor
        expert_span = p.expert * etp
        if stage_ranks % expert_span:
            _fail("parallel.expert*expert_tensor", expert_span,
                  f"must divide the ranks of one pipeline stage, data*context*tensor = "
                  f"{data}*{p.context}*{p.tensor} = {stage_ranks} (expert_data = "
                  f"data*context*tensor/(expert*expert_tensor) must be an integer)")
        edp = stage_ranks // expert_span
        if p.data_replicate > 1 and edp % p.data_replicate:
            # megatron-core's partial distributed optimizer splits the expert-data ranks into the
            # same replicas: each replica must hold whole expert-parallel groups.
            _fail("parallel.data_replicate", p.data_replicate,
                  f"must divide expert_data = data*context*tensor/(expert*expert_tensor) = {edp} "
                  f"(every replica holds whole expert groups)")
        topo = cls(world_size=world_size, pp=p.pipeline, dp_replicate=p.data_replicate,
                   dp_shard=data // p.data_replicate, cp=p.context, tp=p.tensor, ep=p.expert,
                   etp=etp, edp=edp, data_shard=p.data_shard, context_layout=p.context_layout,
                   # Sequence parallelism shards activations over the tensor-parallel ranks, so
                   # it is meaningless (and ignored) without them; the default stays "on".
                   sequence_parallel=bool(p.sequence_parallel) and p.tensor > 1,
                   virtual_stages=vs, pipeline_schedule=p.pipeline_schedule,
                   expert_dispatch=p.expert_dispatch, moonep_transport=p.moonep.transport,
                   timeout_s=float(p.timeout_s))
        return topo

    # ---- rank arithmetic (no process group; the tests' oracle is megatron's RankGenerator) ----

    def _atom_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp_shard": self.dp_shard,
                "dp_replicate": self.dp_replicate, "pp": self.pp, "etp": self.etp,
                "ep": self.ep, "edp_shard": self.edp // self.dp_replicate,
                "edp_replicate": self.dp_replicate}

    def _strides(self, family: tuple[str, ...]) -> dict[str, int]:
        sizes, strides, stride = self._atom_sizes(), {}, 1
        for atom in family:
            strides[atom] = stride
            stride *= sizes[atom]
        return strides

    def _family(self, dims: tuple[str, ...]) -> tuple[str, ...]:
        atoms = [a for d in dims for a in _COMPOSITES.get(d, (d,))]
        if len(set(atoms)) != len(atoms):
            raise ValueError(f"mesh dims {dims} overlap")
        if all(a in _DENSE_ATOMS for a in atoms):
            return _DENSE_ATOMS
        if all(a in _EXPERT_ATOMS for a in atoms):
            return _EXPERT_ATOMS
        raise ValueError(f"mesh dims {dims} mix the dense layout {_DENSE_ATOMS} with the expert "
                         f"layout {_EXPERT_ATOMS} (only pp is shared)")

    def _check_dims(self, dims: tuple[str, ...]) -> None:
        for d in dims:
            if d not in DIMS:
                raise ValueError(f"unknown parallel dimension {d!r}; known: {list(DIMS)}")

    def size(self, name: str) -> int:
        self._check_dims((name,))
        sizes = self._atom_sizes()
        return math.prod(sizes[a] for a in _COMPOSITES.get(name, (name,)))

    def coordinate(self, name: str, rank: int) -> int:
        """`rank`'s index along `name` (composites: the flattened index, outer atoms first)."""
        self._check_dims((name,))
        atoms = _COMPOSITES.get(name, (name,))
        strides, sizes = self._strides(self._family((name,))), self._atom_sizes()
        index = 0
        for atom in atoms:
            index = index * sizes[atom] + (rank // strides[atom]) % sizes[atom]
        return index

    def mesh_ranks(self, dims: tuple[str, ...], rank: int) -> torch.Tensor:
        """Global ranks of the n-D sub-mesh over `dims` that contains `rank` (other coordinates
        fixed), shaped [size(d) for d in dims]."""
        self._check_dims(dims)
        strides, sizes = self._strides(self._family(dims)), self._atom_sizes()
        atoms = [a for d in dims for a in _COMPOSITES.get(d, (d,))]
        base = rank - sum(((rank // strides[a]) % sizes[a]) * strides[a] for a in atoms)
        ranks = [base + sum(i * strides[a] for i, a in zip(index, atoms, strict=True))
                 for index in itertools.product(*(range(sizes[a]) for a in atoms))]
        return torch.tensor(ranks, dtype=torch.int).reshape([self.size(d) for d in dims])

    def ranks(self, name: str, rank: int | None = None) -> list[int]:
        """Global ranks of the group along `name` that holds `rank` (default: this rank)."""
        return self.mesh_ranks((name,), self._this_rank() if rank is None else rank).tolist()

    def all_groups(self, name: str) -> list[list[int]]:
        """Every group along `name`, ordered by their lowest rank."""
        groups = {tuple(self.ranks(name, r)) for r in range(self.world_size)}
        return [list(g) for g in sorted(groups)]

    # ---- process groups and meshes ----

    def initialize(self, device_type: str = "cpu") -> Topology:
        """Creates the groups with megatron-core (the default process group must exist, with
        this topology's world size) and checks each against the rank arithmetic above."""
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            raise RuntimeError("Topology.initialize needs torch.distributed.init_process_group "
                               "first (train.distributed.init_distributed)")
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"the world has {dist.get_world_size()} ranks but the layout was "
                              f"validated for {self.world_size}")
        if (self.moonep_transport == "symm_mem" and device_type != "cuda"
                and dist.get_backend() != "fake"):  # a dry run's stand-in needs no device
            _fail("parallel.moonep.transport", "symm_mem",
                  f"needs CUDA (symmetric memory); device is {device_type}: use collective")
        if ps.model_parallel_is_initialized():
            raise RuntimeError("megatron-core's parallel state is already initialized; "
                               "destroy() the previous Topology first")
        self.rank, self.device_type = dist.get_rank(), device_type
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=(self.virtual_stages if self.virtual_stages > 1
                                                  else None),
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            num_distributed_optimizer_instances=self.dp_replicate,
            distributed_timeout_minutes=self.timeout_s / 60,
            order=MEGATRON_ORDER,
            # Gloo copies of the data-parallel groups serve megatron's own optimizer only (not
            # used here), and the fake backend of the 1024-rank tests cannot create them.
            create_gloo_process_groups=False,
        )
        g = {"tp": ps.get_tensor_model_parallel_group(),
             "cp": ps.get_context_parallel_group(),
             "pp": ps.get_pipeline_model_parallel_group(),
             "dp": ps.get_data_parallel_group(),
             "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
             "dp_cp_tp": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
             "ep": ps.get_expert_model_parallel_group(),
             "etp": ps.get_expert_tensor_parallel_group(),
             "edp": ps.get_expert_data_parallel_group()}
        if self.dp_replicate > 1:
            # Megatron's partial distributed optimizer: each instance is a contiguous block of
            # the dp x cp ranks (= our dp_shard x cp), and the inter-instance group joins the
            # same position in every block (= our dp_replicate; megatron builds it once, from
            # the expert-data ranks, because every replica holds whole expert groups).
            g["dp_shard_cp"] = ps.get_data_parallel_group(with_context_parallel=True,
                                                          partial_data_parallel=True)
            g["dp_replicate"] = ps.get_inter_distributed_optimizer_instance_group()
            # The same partial optimizer over the expert-data ranks: contiguous shard groups,
            # and the replica groups are the dense ones (the same ranks, see above).
            g["edp_shard"] = ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)
        else:
            g["dp_shard_cp"] = g["dp_cp"]
            # Megatron has no size-1 replica group; only this rank takes part in its own.
            g["dp_replicate"] = self._create_group([self.rank], local=True)
            g["edp_shard"] = g["edp"]
        g["edp_replicate"] = g["dp_replicate"]
        if self.dp_replicate == 1:
            g["dp_shard"] = g["dp"]
        elif self.cp == 1:
            g["dp_shard"] = g["dp_shard_cp"]
        else:
            # Megatron has no shard group without cp: cut each of its data-parallel groups
            # (RankGenerator's lists) into the contiguous runs the partial optimizer uses.
            gen = ps.RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=self.cp,
                                   order=MEGATRON_ORDER)
            for dp_ranks in gen.get_ranks("dp"):
                for i in range(self.dp_replicate):
                    run = dp_ranks[i * self.dp_shard:(i + 1) * self.dp_shard]
                    group = self._create_group(run)
                    if self.rank in run:
                        g["dp_shard"] = group
        for name, group in g.items():
            got = dist.get_process_group_ranks(group)
            if got != self.ranks(name):
                raise RuntimeError(f"the {name} group {got} differs from the layout's "
                                   f"{self.ranks(name)} (rank {self.rank})")
        self._groups = g
        # The roll call's own gloo group (CPU, whatever the training backend), made now while
        # every rank is alive; the fake backend of the large-layout tests has no gloo.
        if dist.get_backend() != "fake":
            self._roll_call_group = self._create_group(list(range(self.world_size)),
                                                       backend="gloo")
        return self

    def _create_group(self, ranks: list[int], local: bool = False, backend: str | None = None):
        from megatron.core import parallel_state as ps

        group = ps.create_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s),
                                backend=backend, use_local_synchronization=local,
                                group_desc="K3_TOPOLOGY")
        if self.rank in ranks:
            self._own_groups.append(group)
        return group

    def unresponsive_ranks(self, timeout_s: float | None = None) -> list[int]:
        """After a collective failed (a timeout, a lost peer): the global ranks that do not
        answer a roll call within `timeout_s` (default parallel.timeout_s). Every rank sends
        its number to every other one on the roll-call group and waits for theirs; healthy
        ranks reach the roll call once their own collectives have failed too. Point-to-point
        rather than gloo's `monitored_barrier`: that one reports on rank 0 alone, so a hung
        rank 0 would leave every other rank with nothing to name."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        me = self._this_rank()
        group = self._roll_call_group
        token = torch.tensor([me])
        others = [r for r in range(self.world_size) if r != me]
        sends = {r: dist.isend(token, r, group=group) for r in others}
        answers = {r: dist.irecv(torch.empty_like(token), r, group=group) for r in others}
        deadline = time.monotonic() + timeout_s

        def arrived(work) -> bool:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError:  # timed out, or the peer's connection is gone
                return False
            return True

        missing = [r for r, work in answers.items() if not arrived(work)]
        # Our token must reach every rank that answered before this rank may go on (and close
        # the group's connections); those to missing ranks never complete.
        for r in others:
            if r not in missing:
                arrived(sends[r])
        return missing

    def _this_rank(self) -> int:
        if self.rank is None:
            raise RuntimeError("Topology.initialize() has not run on this process")
        return self.rank

    def group(self, name: str):
        self._check_dims((name,))
        self._this_rank()
        return self._groups[name]

    def rank_in(self, name: str) -> int:
        """This rank's coordinate along `name` (its rank within `group(name)`)."""
        return self.coordinate(name, self._this_rank())

    def mesh(self, *dims: str) -> DeviceMesh:
        """A 1-D or n-D DeviceMesh over `dims`, made from the megatron-core groups (no new
        process group), e.g. mesh("dp_replicate", "dp_shard") for HSDP, mesh("dp", "tp")."""
        if not dims:
            raise ValueError("mesh() needs at least one dimension")
        if dims not in self._meshes:
            self._check_dims(dims)
            self._family(dims)
            groups = [self.group(d) for d in dims]
            if len(dims) == 1:
                mesh = DeviceMesh.from_group(groups[0], self.device_type, mesh_dim_names=dims)
            else:
                mesh = DeviceMesh.from_group(groups, self.device_type,
                                             mesh=self.mesh_ranks(dims, self.rank),
                                             mesh_dim_names=dims)
            self._meshes[dims] = mesh
        return self._meshes[dims]

    def describe(self) -> str:
        line = (f"world {self.world_size} = pp{self.pp} x dp{self.dp} (replicate "
                f"{self.dp_replicate} x shard {self.dp_shard}, {self.data_shard}) x cp{self.cp} "
                f"x tp{self.tp}{' +sp' if self.sequence_parallel else ''}; experts edp{self.edp} "
                f"x ep{self.ep} x etp{self.etp} ({self.expert_dispatch}); pipeline "
                f"{self.pipeline_schedule} x{self.virtual_stages}; order {MEGATRON_ORDER}")
        if self.rank is not None:
            coords = " ".join(f"{d}{self.rank_in(d)}" for d in ("pp", "dp", "cp", "tp", "ep"))
            line += f"; rank {self.rank}: {coords}"
        return line

    def destroy(self) -> None:
        """Drops megatron-core's parallel state and the groups this object made; the default
        process group stays (train.distributed.shutdown ends it). No-op before initialize()."""
        if not self.initialized:
            return
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        for group in self._own_groups:
            dist.destroy_process_group(group)
        self._own_groups, self._groups, self._meshes = [], {}, {}
        self._roll_call_group = None
        self.rank = self.device_type = None
