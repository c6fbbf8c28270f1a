"""`k3-train posttrain=rl|mopd`: colocated on-policy post-training. Each iteration:

1. rollout: new groups fill the pool up to `rollout.prompts_per_step`; the rollout engine
   continues every unfinished episode (each data-parallel rank its share), through tool calls,
   until it answers, runs out of tokens or spends `rollout.iteration_tokens` (it pauses);
   finished episodes are scored (verifier or judge, minus the budget penalty);
2. train: the groups whose episodes are all finished become the step's rows, the RL or MOPD
   loss (objective.py) takes one optimizer step (none when no group finished);
3. the engine gets the new weights' version; the pool (paused episodes with their tokens,
   log-probabilities, versions and environment state) is saved with the checkpoint, so a killed
   run resumes every episode where it was.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from data_pipeline.chat import (
    K3_CHAT_TEMPLATE,
    encode_prompt,
    encode_rendered,
    load_chat_template,
)
from data_pipeline.config import resolve_path
from data_pipeline.tokenizer import load_tokenizer
from model.errors import ConfigError

from ..checkpoint import Checkpointer
from ..checkpoint_integrity import resume_checkpoint
from ..config import TrainConfig
from ..generate_cli import run_tokenizer_path
from ..init_from import load_initial_weights
from ..init_from import resolve as resolve_init_source
from ..loop import (
    NonFiniteLossError,
    build_parallel_model,
    checkpoint_and_stop,
    finish_run,
    inject_rank_failure,
    run_guard,
    set_scheduled_lr,
    start_run,
    train_step,
)
from ..metrics import MetricsLogger
from ..rank_state import rank_file
from ..signals import EXIT_DONE, EXIT_PREEMPTED, PreemptionFlag
from ..step_stats import peak_memory_gb
from .environments import make_environment
from .episodes import OBSERVATION, EpisodePool
from .evaluation import eval_sample, evaluate, select_tasks
from .objective import Objective, rows_of, trained_tokens
from .rewards import load_judge
from .rollout import Scoring, advance, gather_episodes, load_engine
from .tasks import load_tasks
from .teachers import TeacherRouting, load_teachers

log = logging.getLogger("k3.posttrain")
STOP_TOKENS = ("<|im_end|>", "<eod>")  # the end of the assistant's turn; of a document


def _tokenizer_path(cfg: TrainConfig) -> Path:
    if cfg.rollout.tokenizer is not None:
        return Path(cfg.rollout.tokenizer)
    if cfg.init_from is None:
        raise ConfigError("rollout.tokenizer is needed without init_from (the tokenizer the "
                          "student was trained with)")
    source = resolve_init_source(cfg.init_from)
    if source.kind == "export":
        raise ConfigError(f"init_from={cfg.init_from!r} is an export: give rollout.tokenizer="
                          f"PATH (the tokenizer.json its run was trained with)")
    return run_tokenizer_path(source.path.parent.parent)


class Prompts:
    """Each task's prompt: its user turn (and its environment's tools) rendered with the chat
    template's generation prompt."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template

    def __call__(self, task) -> list[int]:
        tools = task.tools
        if tools is None and task.environment is not None:
            tools = make_environment(task.environment).tools()
        return encode_prompt([{"role": "user", "content": task.prompt}], self.tokenizer,
                             self.template, tools=tools)


def _check_lengths(cfg: TrainConfig, tasks, prompts: Prompts) -> None:
    longest = max(tasks, key=lambda t: len(prompts(t)))
    need = len(prompts(longest)) + cfg.rollout.max_new_tokens
    if need > cfg.stage.seq_len:
        raise ConfigError(f"stage.seq_len={cfg.stage.seq_len} is too short: task "
                          f"{longest.id!r}'s prompt ({need - cfg.rollout.max_new_tokens} tokens) "
                          f"+ rollout.max_new_tokens={cfg.rollout.max_new_tokens} need {need}")


def _figures(rows, trained: int, version: int) -> dict:
    """The iteration's rollout figures from its trained episodes."""
    episodes = [r.episode for r in rows]
    if not episodes:
        return {"finished_episodes": 0}
    lags = [version - v for e in episodes for v in e.versions if v != OBSERVATION]
    return {"reward": sum(e.reward for e in episodes) / len(episodes),
            "passed": sum(e.outcome == "passed" for e in episodes) / len(episodes),
            "response_length": sum(e.model_tokens for e in episodes) / len(episodes),
            "budget_hits": sum(e.over_budget for e in episodes) / len(episodes),
            "finished_episodes": len(episodes), "trained_tokens": trained,
            "stale_tokens": len(lags) - trained, "weight_lag": sum(lags) / max(len(lags), 1)}


def posttrain(cfg: TrainConfig) -> int:
    """Runs (or resumes) on-policy post-training; returns the process exit code."""
    env, topology, run_dir = start_run(cfg, data=False)
    layout = topology if env.world_size > 1 else None
    model, precision, parallel, optimizers = build_parallel_model(cfg, layout, env.device)
    dp = topology.dp
    dp_rank = topology.rank_in("dp") if env.world_size > 1 else 0
    tasks_path = resolve_path(cfg.rollout.tasks)
    tasks = select_tasks(load_tasks(tasks_path), cfg.rollout.domains, cfg.rollout.efforts,
                         cfg.rollout.max_tasks, cfg.rollout.tasks)
    tokenizer = load_tokenizer(_tokenizer_path(cfg))
    template = (load_chat_template(cfg.rollout.chat_template) if cfg.rollout.chat_template
                else K3_CHAT_TEMPLATE)
    prompts = Prompts(tokenizer, template)
    _check_lengths(cfg, tasks, prompts)
    routing = None
    teachers: list = []
    if cfg.posttrain == "mopd":
        routing = TeacherRouting(cfg.mopd.teachers)
        routing.check_tasks(tasks, cfg.rollout.tasks)
        teachers = load_teachers(cfg, layout, env.device, env.rank, env.world_size)
    scoring = Scoring({t.id: t for t in tasks}, tokenizer, template,
                      load_judge(cfg.rl.judge) if cfg.rl.judge else None,
                      cfg.rl.budget_penalty, cfg.rollout.max_turns)
    stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    engine = load_engine(cfg, model, stops)
    objective = Objective(cfg.posttrain, cfg.rl.clip, cfg.rollout.temperature, cfg.mopd.kl,
                          cfg.mopd.reward_weight, teachers)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep_last, env.rank,
                        env.world_size, parallel.sharded_state)
    step, pool = 0, EpisodePool(seed=cfg.seed)
    latest, fallbacks = resume_checkpoint(ckpt) if cfg.checkpoint.resume else (None, [])
    if latest is not None:
        step = ckpt.load(latest, model, optimizers, lambda state: None, verified=True)
        # The pool is rank 0's (the same on every rank when it was saved).
        pool = EpisodePool.from_state_dict(
            json.loads(rank_file(latest, 0).read_text())["posttrain"])
        log.info("resumed from %s at step %d: %d episodes in flight", latest, step,
                 len(pool.episodes))
    elif cfg.init_from is not None:
        source = resolve_init_source(cfg.init_from)
        load_initial_weights(source, model, ckpt)
    metrics = MetricsLogger(run_dir, env.rank, cfg.logging, cfg.steps, step,
                            run_config=asdict(cfg))
    if latest is None and cfg.init_from is not None:
        source = resolve_init_source(cfg.init_from)
        metrics.note("init/source", f"{source.kind} {source.path.resolve()}")
    if fallbacks:
        metrics.note("resume/rejected_checkpoints", " | ".join(fallbacks))
    engine.sync_weights(step)
    encode = functools.partial(encode_rendered, tokenizer)
    eval_tasks = eval_sample(tasks, cfg.rollout.eval_tasks, cfg.seed + 1)

    def evaluated(at: int) -> dict:
        if not eval_tasks or cfg.eval.every <= 0:
            return {}
        if at != cfg.steps and at % cfg.eval.every:
            return {}
        return evaluate(model, eval_tasks, prompts, scoring, stops, cfg.rollout.max_new_tokens,
                        cfg.stage.seq_len, encode, dp_rank, dp)

    if latest is None and (baseline := evaluated(0)):  # the policy before any step
        metrics.log({"step": 0, **baseline})
    preempt = PreemptionFlag()
    nonfinite_in_a_row, exit_code = 0, EXIT_DONE
    if env.is_main:
        log.info("%s post-training of %s for %d steps: %d tasks from %s, %d prompts x %d "
                 "samples in flight, layout: %s", cfg.posttrain, cfg.model.name, cfg.steps,
                 len(tasks), tasks_path, cfg.rollout.prompts_per_step,
                 cfg.rollout.samples_per_prompt, topology.describe())
    with run_guard(topology, preempt, lambda: step):
        while step < cfg.steps:
            t0 = time.perf_counter()
            lr = set_scheduled_lr(cfg, optimizers, step)
            pool.refill(tasks, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt,
                        prompts)
            live = {e.uid for e in pool.episodes if not e.done}
            resumed = sum(e.pauses > 0 for e in pool.episodes if e.uid in live)
            before = sum(e.model_tokens for e in pool.episodes)
            mine = [e for e in pool.episodes if e.uid in live][dp_rank::dp]
            advance(mine, engine, scoring, cfg.seed, cfg.rollout.max_new_tokens,
                    cfg.rollout.iteration_tokens, cfg.stage.seq_len, encode)
            pool.replace(gather_episodes(mine))
            generated = sum(e.model_tokens for e in pool.episodes) - before
            paused = sum(not e.done for e in pool.episodes if e.uid in live)
            inject_rank_failure(step, env.rank)  # the fault tests: a kill mid-iteration
            t1 = time.perf_counter()
            rows = rows_of(pool.take_finished_groups(), routing)
            result, trained = None, trained_tokens(rows, step, cfg.rollout.max_staleness)
            if rows:
                batches = objective.micro_batches(
                    rows, dp_rank, dp, cfg.stage.micro_batch_size, cfg.stage.seq_len,
                    cfg.model.pad_token_id, step, cfg.rollout.max_staleness, env.device)
                result = train_step(model, optimizers, batches, env.device, precision,
                                    parallel, cfg.optim, loss_of=objective.loss_of)
                kl = parallel.sum_loss_tokens(objective.kl_sum.reshape(1))
            step += 1
            engine.sync_weights(step)
            finite = result is None or result.finite
            nonfinite_in_a_row = 0 if finite else nonfinite_in_a_row + 1
            t2 = time.perf_counter()
            row = {"step": step, "lr": lr, **_figures(rows, trained, step - 1),
                   "paused_episodes": paused,
                   "resumed_episodes": resumed, "generated_tokens": generated,
                   "rollout_time_s": t1 - t0, "train_time_s": t2 - t1, "step_time_s": t2 - t0,
                   "peak_mem_gb": peak_memory_gb(env.device), "skipped": not finite}
            if result is not None:
                row.update(loss=float(result.loss), grad_norm=float(result.grad_norm),
                           kl=float(kl) / max(trained, 1))
            row.update(evaluated(step))
            if (step % cfg.logging.log_every == 0 or step == cfg.steps or not finite
                    or "eval_reward" in row):
                metrics.log(row)
            if nonfinite_in_a_row >= cfg.max_nonfinite_in_a_row:
                raise NonFiniteLossError(
                    f"{nonfinite_in_a_row} steps in a row had a non-finite loss or gradient "
                    f"(last at step {step}); stopping. Lower optim.lr or check the rewards.")
            # The pool (rank 0's copy: every rank holds the same) goes with the checkpoint.
            if checkpoint_and_stop(cfg, step, env, preempt, run_dir, ckpt, model, optimizers,
                                   lambda: {"posttrain": pool.state_dict()} if env.is_main
                                   else {}):
                exit_code = EXIT_PREEMPTED
                break
        finish_run(cfg, metrics, run_dir, step, env)
    return exit_code

