"""On-policy post-training under the layouts: one iteration of RL, of MOPD with the full KL and
of MOPD with the sampled-token KL (two teachers, one per domain) on two data-parallel ranks, on
two tensor-parallel ranks with sequence parallelism and on two expert-parallel FSDP2 ranks
(student and teachers sharded alike) equals one process (float64 k3_tiny): the rollouts (each
rank samples its share of the episodes; tensor-parallel peers the same ones) give the same
tokens, log-probabilities and rewards, and the optimizer step the same loss, KL and gradients
(within 1e-9; measured at most 4.4e-14). Under tensor parallelism the full KL reads the
vocabulary-sharded logits of student and teachers; under FSDP2 the rollouts decode before the
first training forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.parallel_harness import layout, logical, spawn, tiny_config
from train.loop import build_layout_model, build_parallel_model, train_step
from train.optim.factory import set_lr
from train.posttrain.episodes import Episode
from train.posttrain.objective import Objective, rows_of
from train.posttrain.rollout import ColocatedEngine, Scoring, advance, gather_episodes
from train.posttrain.tasks import Task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOL = 1e-9
SEQ = 32
GROUPS, SAMPLES, NEW = 3, 2, 6
MODES = [("rl", "sampled"), ("mopd", "full"), ("mopd", "sampled")]
LAYOUTS = {"dp2": dict(data=2), "tp2_sp": dict(tensor=2, sequence_parallel=True),
           "ep2_fsdp2": dict(data=2, expert=2, data_shard="full")}
SHARES = {"dp2": 2, "tp2_sp": 1, "ep2_fsdp2": 2}  # data-parallel ranks: their micro-batches
TASKS = {f"t{g}": Task(id=f"t{g}", domain="ab"[g % 2], prompt="", verifier="judge", budget=4)
         for g in range(GROUPS)}


class _Digits:
    """A stand-in tokenizer: the ids as text."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _judge(task, response: str) -> float:
    """A reward that differs between samples: the response's ids' sum modulo 7, scaled."""
    return (sum(map(int, response.split())) % 7) / 6


def _config(mode: str, **parallel):
    cfg = layout(tiny_config("adamw", "fp64"), **parallel)
    cfg.stage.seq_len, cfg.stage.micro_batch_size = SEQ, 2
    cfg.posttrain = mode
    return cfg


def _episodes() -> list[Episode]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(20, 2000, (5 + 3 * k,), generator=g).tolist() for k in range(GROUPS)]
    return [Episode(uid, uid // SAMPLES, f"t{uid // SAMPLES}", TASKS[f"t{uid // SAMPLES}"].domain,
                    list(prompts[uid // SAMPLES])) for uid in range(GROUPS * SAMPLES)]


def _iteration(mode: str, kl: str, topology, shares: int = 1, **parallel) -> dict:
    """One colocated iteration: rollouts, then the step; its figures and first gradients.
    `shares`: one process trains the micro-batches of that many data-parallel ranks one after
    the other (the MoE's routing of a micro-batch depends on the rows it holds: the
    reference of a layout holds the same rows together)."""
    cfg = _config(mode, **parallel)
    cpu = torch.device("cpu")
    model, precision, plan, optimizers = build_parallel_model(cfg, topology, cpu)
    set_lr(optimizers, cfg.optim.lr)
    teachers = []
    if mode == "mopd":
        for seed in (7, 8):
            teacher = build_layout_model(dataclasses.replace(cfg, seed=seed), topology, cpu)[0]
            teachers.append(teacher.eval().requires_grad_(False))
    dp = 1 if topology is None else topology.dp
    dp_rank = 0 if topology is None else topology.rank_in("dp")
    mine = _episodes()[dp_rank::dp]
    engine = ColocatedEngine(model, temperature=1.0, top_p=1.0, stop_token_ids=[7])
    scoring = Scoring(TASKS, _Digits(), "", _judge, budget_penalty=0.25, max_turns=1)
    advance(mine, engine, scoring, seed=11, max_new_tokens=NEW, iteration_tokens=0,
            seq_len=SEQ, encode=None)
    episodes = gather_episodes(mine)
    groups = [[e for e in episodes if e.group == g] for g in range(GROUPS)]
    rows = rows_of(groups, {"a": 0, "b": 1}.get if mode == "mopd" else None)
    objective = Objective(mode, 0.2, 1.0, kl, 0.0, teachers)
    batches, sides = [], []
    for share in range(dp_rank, dp_rank + shares):
        batches += objective.micro_batches(rows, share, max(dp, shares),
                                           cfg.stage.micro_batch_size, SEQ, 0, 0, -1, cpu)
        sides += objective.sides
    objective.sides = sides
    grads = {}

    def keep(m):
        grads.update({n: logical(p, p.grad, topology) for n, p in m.named_parameters()})

    result = train_step(model, optimizers, batches, cpu, precision, plan, cfg.optim,
                        on_gradients=keep, loss_of=objective.loss_of)
    return {"tokens": [e.tokens for e in episodes], "logprobs": [e.logprobs for e in episodes],
            "rewards": [e.reward for e in episodes], "loss": float(result.loss),
            "kl": float(plan.sum_loss_tokens(objective.kl_sum.reshape(1))), "grads": grads}


def _errors(ref: dict, got: dict) -> dict:
    def rel(a: float, b: float, floor: float = 1e-30) -> float:
        return abs(a - b) / max(abs(a), floor)

    grad = max((got["grads"][n] - g).norm().item() / max(g.norm().item(), 1e-30)
               for n, g in ref["grads"].items())
    logprobs = max(abs(a - b) for x, y in zip(ref["logprobs"], got["logprobs"])
                   for a, b in zip(x, y))
    return {"same_tokens": ref["tokens"] == got["tokens"],
            "same_rewards": ref["rewards"] == got["rewards"], "logprobs": logprobs,
            "grad": grad,
            # On-policy, RL's KL estimate is rounding noise around 0, and so is its loss when
            # the episodes are equally long (a group's advantages sum to 0): errors absolute.
            "loss": rel(ref["loss"], got["loss"], floor=1.0),
            "kl": rel(ref["kl"], got["kl"], floor=1.0)}


def _world(rank: int, world: int, reference: str) -> dict:
    from parallel.topology import Topology

    refs = torch.load(reference, weights_only=False)
    out = {}
    for name, parallel in LAYOUTS.items():
        for mode, kl in MODES:
            cfg = _config(mode, **parallel)
            topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
            got = _iteration(mode, kl, topology, **parallel)
            topology.destroy()
            out[f"{name}/{mode}/{kl}"] = _errors(refs[f"{name}/{mode}/{kl}"], got)
    return out


def test_rl_and_mopd_iterations_under_dp2_and_tp2_equal_one_process(tmp_path):
    # One process ignores the layout: the references differ only in the micro-batches held.
    by_shares = {(shares, mode, kl): _iteration(mode, kl, None, shares)
                 for shares in sorted(set(SHARES.values())) for mode, kl in MODES}
    refs = {f"{name}/{mode}/{kl}": by_shares[shares, mode, kl]
            for name, shares in SHARES.items() for mode, kl in MODES}
    for ref in refs.values():  # not degenerate: rewards differ within groups, gradients flow
        assert len(set(ref["rewards"])) > GROUPS
        assert sum(g.norm().item() for g in ref["grads"].values()) > 1e-3
    torch.save(refs, tmp_path / "reference.pt")
    got = spawn(_world, 2, tmp_path / "world", str(tmp_path / "reference.pt"))
    for case, errors in got.items():
        assert errors["same_tokens"] and errors["same_rewards"], (case, errors)
        assert all(errors[k] <= TOL for k in ("logprobs", "loss", "kl", "grad")), (case, errors)
