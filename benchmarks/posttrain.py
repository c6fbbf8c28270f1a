"""Colocated post-training on one process: rollout and training time per iteration side by
side, and the share of time that pausing and resuming episodes (partial rollouts) costs.

    PYTHONPATH=. python -m benchmarks.posttrain [--model k3_tiny] [--prompts 8] [--samples 4]
        [--prompt-tokens 32] [--new-tokens 64] [--pause-every 16 32] [--repeats 3]

The episodes are prompts of random tokens sampled at temperature 1 without a stop token, so
each takes exactly --new-tokens tokens (a fixed amount of work), scored by a stand-in reward.
Per setting (the fastest of --repeats runs, one thread, the model's weights fixed so that only
the rollout schedule differs):

- rollout: every episode generated in one go (`rollout.iteration_tokens=0`);
- paused every N: the same episodes advanced N tokens an iteration, each continuation
  re-reading its context (prompt + tokens so far) into a fresh cache (the tokens are checked to
  equal the uninterrupted ones: row seeds make the draws independent of the pauses);
- training: one RL optimizer step on the finished groups (forward and backward of every row).

It prints the times, training / rollout, and the pause overhead (paused rollout - rollout)
as a share of a whole iteration (rollout + training).
"""

from __future__ import annotations

import argparse
import time

import torch

from model.config import PRESETS
from train.config import TrainConfig
from train.loop import build_parallel_model, train_step
from train.optim.factory import set_lr
from train.posttrain.episodes import Episode
from train.posttrain.objective import Objective, rows_of
from train.posttrain.rollout import ColocatedEngine, Scoring, advance
from train.posttrain.tasks import Task

TASK = Task(id="t", domain="math", prompt="", verifier="judge", budget=64)


class _Ids:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _reward(task, response: str) -> float:  # differs between samples: nonzero advantages
    return (sum(map(int, response.split())) % 11) / 10


def _episodes(prompts: int, samples: int, prompt_tokens: int, vocab: int) -> list[Episode]:
    g = torch.Generator().manual_seed(0)
    heads = [torch.randint(20, vocab, (prompt_tokens,), generator=g).tolist()
             for _ in range(prompts)]
    return [Episode(i, i // samples, "t", "math", list(heads[i // samples]))
            for i in range(prompts * samples)]


def _rollout(model, args, pause_every: int) -> tuple[float, list[Episode]]:
    engine = ColocatedEngine(model, temperature=1.0, top_p=1.0, stop_token_ids=[])
    scoring = Scoring({"t": TASK}, _Ids(), "", _reward, budget_penalty=0.0, max_turns=1)
    episodes = _episodes(args.prompts, args.samples, args.prompt_tokens, model.cfg.vocab_size)
    seq = args.prompt_tokens + args.new_tokens
    start = time.perf_counter()
    while not all(e.done for e in episodes):
        advance([e for e in episodes if not e.done], engine, scoring, 1, args.new_tokens,
                pause_every, seq, None)
    return time.perf_counter() - start, episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="k3_tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pause-every", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = TrainConfig(model=PRESETS[args.model](), device="cpu")
    cfg.model.vision = None
    cfg.stage.seq_len = args.prompt_tokens + args.new_tokens
    cfg.stage.micro_batch_size = args.samples
    cfg.posttrain = "rl"
    model, precision, parallel, optimizers = build_parallel_model(cfg, None, torch.device("cpu"))
    set_lr(optimizers, 1e-5)
    whole, episodes = min((_rollout(model, args, 0) for _ in range(args.repeats)),
                          key=lambda r: r[0])
    objective = Objective("rl", 0.2, 1.0)
    rows = rows_of([episodes[i:i + args.samples]
                    for i in range(0, len(episodes), args.samples)])
    trains = []
    for _ in range(args.repeats):
        batches = objective.micro_batches(rows, 0, 1, args.samples, cfg.stage.seq_len,
                                          cfg.model.pad_token_id, 0, -1, torch.device("cpu"))
        start = time.perf_counter()
        train_step(model, optimizers, batches, torch.device("cpu"), precision, parallel,
                   cfg.optim, loss_of=objective.loss_of)
        trains.append(time.perf_counter() - start)
    train = min(trains)
    n = len(episodes)
    print(f"{args.model}: {args.prompts} prompts x {args.samples} samples, "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens each, fp32, 1 thread")
    print(f"rollout (no pauses)        {whole:7.2f} s   {n * args.new_tokens / whole:7.0f} tok/s")
    print(f"training step              {train:7.2f} s   training / rollout {train / whole:.2f}")
    for every in args.pause_every:
        # The weights moved during the timings above: pauses are compared with a fresh
        # uninterrupted rollout of the same weights.
        base, base_eps = min((_rollout(model, args, 0) for _ in range(args.repeats)),
                             key=lambda r: r[0])
        paused, paused_eps = min((_rollout(model, args, every) for _ in range(args.repeats)),
                                 key=lambda r: r[0])
        same = all(a.tokens == b.tokens for a, b in zip(base_eps, paused_eps))
        share = (paused - base) / (base + train)
        print(f"paused every {every:3d} tokens   {paused:7.2f} s   vs {base:.2f} s unpaused: "
              f"{paused / base:.2f}x rollout, {100 * share:+.1f}% of an iteration "
              f"({args.new_tokens // every - 1} resumes per episode; same tokens: {same})")


if __name__ == "__main__":
    main()
