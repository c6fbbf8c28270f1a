"""The README's demo (`k3-train`, k3_tiny on the bundled sample, CPU): step time, MFU against the
matmul probe and peak RSS of the whole process, for this checkout and, side by side in the same
run, for a baseline commit (checked out into a temporary git worktree).

    python -m benchmarks.demo_step --steps 20 --baseline 40c8bbd [--threads 2] [--compile]
        [--fused] [--profile] [--phases] [--ops] [--settings] [--compile-cost]
        [--widths HIDDEN ...]

Each checkout prepares its own copy of the sample in a first run (its data format may differ),
then trains `--steps` steps with checkpoints, W&B and the plot off; the first two steps are
warm-up and not counted. MFU is the median over the steps of this checkout's model FLOPs of
each step (train/flops.py: the text's and MoonViT's on the step's images, as the loop logs them)
over its time, against the best fp32 matmul probe of this benchmark process at the same
thread count, taken before and after the runs (the loop's own MFU divides by one probe at its
start-up, which a busy moment skews). `--compile` adds a row for this checkout with
`compile=true`, `--fused` one with `fused_kernels=true` (model/ops/fused.py); `--profile`
prints the torch profiler's top operators for one step of this checkout; `--phases` splits this
checkout's `train_step` into the model's forwards, the optimizer step and the rest (backwards,
clipping, balancers), on the same prefetched batches, with `--fused` for eager and compiled
kernels alternated in that one process (the side-by-side figure: separate runs differ by up to
20% on a shared machine); `--ops` counts the operators one `train_step` dispatches, by caller
(a figure that does not move with the machine's load); `--settings` runs torch ops, the
native kernels and native + fused kernels, with the demo's micro-batches, the whole global batch
as one and half of it, back to back on the same batches in one process; `--compile-cost` times
the first fused step with an empty and with a warm inductor cache, in two fresh processes;
`--widths 64 128 256` times the eager step with the model at those hidden sizes (heads, low
ranks and MLPs scaled with it) in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2


def _run(cmd: list[str], checkout: Path, env: dict, log: Path) -> int:
    """Runs one k3-train process; returns its own peak RSS in KiB (wait4, not the children's
    running maximum)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed in {checkout}:\n{log.read_text()[-2000:]}")
    return usage.ru_maxrss


def run_demo(checkout: Path, work: Path, steps: int, threads: int,
             extra: tuple[str, ...] = ()) -> dict:
    """The demo's first run (curation + 1 step) and then a run of `steps` on the prepared data:
    median step time and MFU of the second, peak RSS of both."""
    work.mkdir(parents=True)
    train = [sys.executable, "-m", "train.cli", f"data.output_dir={work / 'data'}",
             "checkpoint.every=0", "checkpoint.save_at_end=false", "logging.wandb=false",
             "logging.plot=false"]
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS=str(threads),
               WANDB_MODE="disabled")
    first_rss = _run(train + [f"run_dir={work / 'first'}", "steps=1"], checkout, env,
                     work / "first.log")
    run_dir = work / "run"
    rss = _run(train + [f"run_dir={run_dir}", f"steps={steps}", *extra], checkout, env,
               work / "run.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[WARMUP_STEPS:]]
    return {"step_time_s": statistics.median(times), "fastest_s": min(times),
            "times": times, "model_flops": [r.get("model_flops") for r in rows[WARMUP_STEPS:]],
            "rss_first_gib": first_rss / 2**20, "rss_gib": rss / 2**20,
            "losses": [r["loss"] for r in rows]}


def _mfu(flops: list[float], times: list[float], peak: float) -> tuple[float, float]:
    """(median, best) of the steps' model FLOPs over their times, as shares of `peak`: the steps
    with images do more work than those without."""
    rates = [f / t for f, t in zip(flops, times, strict=True)]
    return statistics.median(rates) / peak, max(rates) / peak


def _demo_config(data_dir: str | None = None):
    """The README demo's config; `data_dir` replaces where its prepared data goes."""
    import dataclasses

    from hydra import compose, initialize_config_dir

    from train.cli import CONFIG_DIR, register_configs, to_train_config

    register_configs()
    with initialize_config_dir(CONFIG_DIR, version_base=None):
        cfg = to_train_config(compose("train"))
    if data_dir is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, output_dir=data_dir))


def text_flops_per_step(cfg=None) -> float:
    """Model FLOPs of one step's text (this checkout's count, as the loop's MFU uses) for `cfg`
    (default the demo's)."""
    from train.flops import training_flops_per_token

    cfg = cfg or _demo_config()
    tokens = cfg.stage.global_batch_size * cfg.stage.seq_len
    return training_flops_per_token(cfg.model, cfg.stage.seq_len) * tokens


def matmul_peak(threads: int) -> float:
    """The best fp32 matmul rate of this process at `threads` threads (FLOP/s)."""
    import torch

    from train.flops import _matmul_probe

    torch.set_num_threads(threads)
    return _matmul_probe(torch.device("cpu"), seconds=3.0, windows=10)


@dataclasses.dataclass
class _Loop:
    cfg: Any  # the demo's TrainConfig, its data in a temporary directory
    model: Any
    optimizers: list
    global_batches: list  # `steps` global batches, the demo's micro-batches
    run: Callable[[list], None]  # the loop's own train_step on one global batch
    prefetch: Callable[[int], list]  # the same `steps` global batches in micro-batches of n rows


@contextlib.contextmanager
def _loop_on_prefetched_batches(threads: int, steps: int):
    """The loop's model (layout, precision, optimizers) for the demo config, its data prepared in
    a temporary directory, and `steps` global batches read ahead."""
    import torch

    from train.data import build_loader

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _demo_config(f"{tmp}/data")
        model, optimizers, run = _train_step_of(cfg)

        def prefetch(micro_batch_size: int) -> list:
            stage = dataclasses.replace(cfg.stage, micro_batch_size=micro_batch_size)
            batches = iter(build_loader(dataclasses.replace(cfg, stage=stage), dp_rank=0,
                                        dp_size=1))
            accum = stage.global_batch_size // micro_batch_size
            return [[next(batches) for _ in range(accum)] for _ in range(steps)]

        yield _Loop(cfg, model, optimizers, prefetch(cfg.stage.micro_batch_size), run, prefetch)


def _train_step_of(cfg) -> tuple[Any, list, Callable[[list], None]]:
    """The loop's model, optimizers and its own train_step on one global batch, on CPU, in the
    process settings k3-train makes (host allocator, deterministic algorithms, native kernels)."""
    import torch

    from model.ops import cpu
    from train.host_allocator import keep_freed_host_memory
    from train.loop import build_parallel_model, seed_everything, train_step

    keep_freed_host_memory()
    cpu.install()
    seed_everything(cfg.seed, cfg.deterministic)
    device = torch.device("cpu")
    model, precision, parallel, optimizers = build_parallel_model(cfg, None, device)

    def run(micro_batches) -> None:
        train_step(model, optimizers, micro_batches, device, precision, parallel, cfg.optim)

    return model, optimizers, run


def profile_one_step(threads: int) -> None:
    """Top operators (self CPU time) of one training step of this checkout's demo config."""
    from torch.profiler import ProfilerActivity, profile

    with _loop_on_prefetched_batches(threads, steps=2) as loop:
        loop.run(loop.global_batches[0])  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loop.run(loop.global_batches[1])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _caller_in_repo() -> str:
    """Where an operator was called from: the innermost frame in this repository's code
    (file:function), or the autograd engine for a built-in backward formula."""
    import torch

    node = torch._C._current_autograd_node()
    if node is not None and not isinstance(node, torch.autograd.function.BackwardCFunction):
        return "autograd engine (built-in backward formulas)"
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(REPO) and "site-packages" not in path.parts:
            return f"{path.relative_to(REPO)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside the repository"


def op_counts(threads: int, top: int = 12) -> None:
    """The ATen operators (views included) that one `train_step` of the demo dispatches, by the
    code that called them and by operator. Unlike its times the count does not move with the
    machine's load; on CPU each operator costs a few microseconds of dispatch whatever its
    size, which at k3_tiny's width is a real share of the step."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    by_caller, by_op = collections.Counter(), collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            by_caller[_caller_in_repo()] += 1
            by_op[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with _loop_on_prefetched_batches(threads, steps=2) as loop:
        loop.run(loop.global_batches[0])  # warm-up: lazily built state is not counted
        with Count():
            loop.run(loop.global_batches[1])
    total = sum(by_op.values())
    print(f"ATen operators dispatched by one train_step: {total}")
    print(f"by caller (top {top}):")
    for caller, n in by_caller.most_common(top):
        print(f"  {n:7d} {n / total:6.1%}  {caller}")
    print(f"by operator (top {top}): " + ", ".join(f"{op} {n}" for op, n in by_op.most_common(top)))


def phase_times(threads: int, steps: int = 4, passes: int = 3, fused: bool = False) -> None:
    """The loop's own `train_step` on `steps` prefetched global batches, `passes` times over the
    same batches: the fastest time of each step, of its micro-batches' forwards (model hooks)
    and of its optimizer step (optimizer hooks); the remainder is the backwards, clipping, the
    balancers' update and zeroing the gradients. `fused` alternates every pass between eager
    and compiled kernels (fused_kernels; an untimed pass compiles them first)."""
    import time

    from model.ops.fused import enable_fused_kernels

    spans = {"forward": 0.0, "optimizer": 0.0}
    began = {}

    def opening(name):
        return lambda *_: began.__setitem__(name, time.perf_counter())

    def closing(name):
        return lambda *_: spans.__setitem__(
            name, spans[name] + time.perf_counter() - began[name])

    with _loop_on_prefetched_batches(threads, steps) as loop:
        run, global_batches = loop.run, loop.global_batches
        loop.model.register_forward_pre_hook(opening("forward"))
        loop.model.register_forward_hook(closing("forward"))
        for opt in loop.optimizers:
            opt.register_step_pre_hook(opening("optimizer"))
            opt.register_step_post_hook(closing("optimizer"))
        modes = (False, True) if fused else (False,)
        if fused:
            enable_fused_kernels(True)
            for micro_batches in global_batches:  # compiles the kernels
                run(micro_batches)
        best = {mode: [{"step": math.inf, "forward": math.inf, "optimizer": math.inf}
                       for _ in global_batches] for mode in modes}
        for _ in range(passes):
            for mode in modes:
                enable_fused_kernels(mode)
                for fastest, micro_batches in zip(best[mode], global_batches):
                    spans.update(forward=0.0, optimizer=0.0)
                    start = time.perf_counter()
                    run(micro_batches)
                    times = {"step": time.perf_counter() - start, **spans}
                    for key, value in times.items():
                        fastest[key] = min(fastest[key], value)
    for mode in modes:
        kernels = "compiled" if mode else "eager"
        print(f"train_step phases, {threads} threads, {kernels} kernels, fastest of {passes} "
              "passes [ms]:")
        print(f"{'step':<5} {'images':>6} {'whole':>8} {'forwards':>9} {'optimizer':>10} "
              f"{'rest':>8}")
        for i, (fastest, micro_batches) in enumerate(zip(best[mode], global_batches)):
            images = sum(0 if mb.vision is None else len(mb.vision.grid_thw)
                         for mb in micro_batches)
            rest = fastest["step"] - fastest["forward"] - fastest["optimizer"]
            print(f"{i:<5} {images:>6} {fastest['step'] * 1e3:>8.1f} "
                  f"{fastest['forward'] * 1e3:>9.1f} {fastest['optimizer'] * 1e3:>10.1f} "
                  f"{rest * 1e3:>8.1f}")
    if fused:
        eager, compiled = (sum(f["step"] for f in best[mode]) for mode in modes)
        print(f"whole steps, summed: eager {eager:.3f} s, compiled {compiled:.3f} s "
              f"({eager / compiled:.2f}x)")


# The kernels a setting runs: torch ops only, the native CPU kernels (the default), and those
# with the compiled kernels of fused_kernels=true for the rest.
_KERNELS = {"torch": (False, False), "native": (True, False), "native+fused": (True, True)}


@contextlib.contextmanager
def _kernels(name: str):
    from model.ops.cpu import native_kernels
    from model.ops.fused import enable_fused_kernels

    use_native, fused = _KERNELS[name]
    enable_fused_kernels(fused)
    try:
        with native_kernels(use_native):
            yield
    finally:
        enable_fused_kernels(False)


def settings_side_by_side(threads: int, steps: int = 4, passes: int = 5) -> None:
    """Torch ops, native and native + fused kernels (model/ops/cpu, fused_kernels), with
    the demo's micro-batches, the whole global batch as one micro-batch and half of it, on the
    same `steps` prefetched global batches in one process: all settings run back to back on each
    batch, their order reversed every pass (the machine's drift between separate runs is larger
    than these differences), with MFU against the best matmul probe before and after."""
    import time

    from train.flops import vision_training_flops

    peaks = [matmul_peak(threads)]
    with _loop_on_prefetched_batches(threads, steps) as loop:
        whole = loop.cfg.stage.global_batch_size
        batches = {loop.cfg.stage.micro_batch_size: loop.global_batches}
        for size in (whole // 2, whole):
            if size not in batches:
                batches[size] = loop.prefetch(size)
        settings = [(kernels, size) for kernels in _KERNELS for size in batches]
        for kernels, size in settings:  # warm-up; compiles the fused kernels
            with _kernels(kernels):
                for micro_batches in batches[size]:
                    loop.run(micro_batches)
        times = {setting: [] for setting in settings}
        for p in range(passes):
            for i in range(steps):
                for kernels, size in settings if p % 2 == 0 else settings[::-1]:
                    with _kernels(kernels):
                        start = time.perf_counter()
                        loop.run(batches[size][i])
                        times[kernels, size].append(time.perf_counter() - start)
        text = text_flops_per_step()  # and MoonViT's on each step's images:
        flops = [text + vision_training_flops(loop.cfg.model, micro_batches)
                 for micro_batches in loop.global_batches]
    peaks.append(matmul_peak(threads))
    peak = max(peaks)
    print(f"train_step settings side by side, {threads} threads, {passes} passes x {steps} global "
          f"batches; matmul probe {peaks[0] / 1e9:.1f} / {peaks[1] / 1e9:.1f} GFLOP/s (MFU uses "
          f"the best); model FLOPs per step " + ", ".join(f"{f / 1e9:.2f}" for f in flops) + " G")
    print(f"{'kernels':<13} {'micro-batch':>11} {'median [s]':>11} {'fastest':>8} {'MFU':>6} "
          f"{'MFU best':>9} {'vs first':>9}")
    first = statistics.median(times[settings[0]])
    for (kernels, size), values in times.items():
        median = statistics.median(values)
        mfu, best = _mfu(flops * passes, values, peak)
        print(f"{kernels:<13} {f'{size} rows':>11} {median:>11.3f} {min(values):>8.3f} "
              f"{mfu:>6.1%} {best:>9.1%} {first / median:>8.2f}x")


def _widened(model, width: int):
    """The demo's model at hidden size `width`: the head counts, low ranks and MLP sizes scaled
    with it, the head dims, depth, vocabulary and vision tower kept."""
    factor = width / model.hidden_size

    def scaled(value: int) -> int:
        if (value * factor) % 1:
            raise ValueError(f"--widths: {width} does not scale {model.name}'s size {value} "
                             f"to a whole number (use a multiple of {model.hidden_size // 2})")
        return int(value * factor)

    kda, mla, moe = model.kda, model.mla, model.moe
    return dataclasses.replace(
        model, name=f"{model.name}@{width}", hidden_size=width,
        dense_intermediate=scaled(model.dense_intermediate),
        kda=dataclasses.replace(kda, num_heads=scaled(kda.num_heads),
                                decay_rank=scaled(kda.decay_rank)),
        mla=dataclasses.replace(mla, num_heads=scaled(mla.num_heads),
                                q_lora_rank=scaled(mla.q_lora_rank),
                                kv_lora_rank=scaled(mla.kv_lora_rank)),
        moe=dataclasses.replace(moe, latent_dim=scaled(moe.latent_dim),
                                expert_intermediate=scaled(moe.expert_intermediate)))


def widths_side_by_side(threads: int, widths: list[int], steps: int = 4,
                        passes: int = 3) -> None:
    """The demo's eager train_step with the model at other hidden sizes, on the same `steps`
    prefetched global batches in one process, the widths alternated on each batch and their
    order reversed every pass: how much of the step is per-operator cost that does not grow
    with the arithmetic (the operators a step dispatches hardly depend on the width)."""
    import time

    import torch

    from train.flops import vision_training_flops

    peaks = [matmul_peak(threads)]
    with _loop_on_prefetched_batches(threads, steps) as loop:
        runs, flops, params = {}, {}, {}
        for width in widths:
            cfg = dataclasses.replace(loop.cfg, model=_widened(loop.cfg.model, width))
            torch.manual_seed(cfg.seed)
            model, _, runs[width] = _train_step_of(cfg)
            params[width] = sum(p.numel() for p in model.parameters())
            text = text_flops_per_step(cfg)
            flops[width] = [text + vision_training_flops(cfg.model, micro_batches)
                            for micro_batches in loop.global_batches]
            for micro_batches in loop.global_batches:  # warm-up
                runs[width](micro_batches)
        times = {width: [] for width in widths}
        for p in range(passes):
            for micro_batches in loop.global_batches:
                for width in widths if p % 2 == 0 else widths[::-1]:
                    start = time.perf_counter()
                    runs[width](micro_batches)
                    times[width].append(time.perf_counter() - start)
    peaks.append(matmul_peak(threads))
    peak = max(peaks)
    print(f"eager train_step of the demo's model at other widths, {threads} threads, {passes} "
          f"passes x {steps} global batches; matmul probe {peaks[0] / 1e9:.1f} / "
          f"{peaks[1] / 1e9:.1f} GFLOP/s (MFU uses the best)")
    print(f"{'hidden':>6} {'params':>11} {'GFLOP/step':>11} {'median [s]':>11} {'fastest':>8} "
          f"{'MFU':>6} {'MFU best':>9}")
    for width in widths:
        mfu, best = _mfu(flops[width] * passes, times[width], peak)
        print(f"{width:>6} {params[width]:>11,} {statistics.median(flops[width]) / 1e9:>11.2f} "
              f"{statistics.median(times[width]):>11.3f} {min(times[width]):>8.3f} {mfu:>6.1%} "
              f"{best:>9.1%}")


def first_fused_step(threads: int) -> None:
    """This process's first train_step with fused kernels in the fast setting (the global batch
    as one micro-batch), after an eager one: its time, the next step's, and the graphs dynamo
    compiled, as one JSON line (for compile_cost)."""
    import time

    from torch._dynamo.utils import counters

    from model.ops.fused import enable_fused_kernels

    with _loop_on_prefetched_batches(threads, steps=1) as loop:
        batch = loop.prefetch(loop.cfg.stage.global_batch_size)[0]
        loop.run(batch)  # eager: first-use costs outside the timing
        enable_fused_kernels(True)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            loop.run(batch)
            times.append(time.perf_counter() - start)
    print(json.dumps({"first_s": times[0], "next_s": times[1],
                      "graphs": counters["stats"]["unique_graphs"]}))


def compile_cost(threads: int) -> None:
    """What the fused kernels' compile costs a demo run: the first fused step in a process with
    an empty inductor cache (TORCHINDUCTOR_CACHE_DIR; its vector-ISA probe included, inductor's
    precompiled header lives outside it and is built once per machine), then in a second process
    that finds the kernels in that cache."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for state in ("empty", "warm"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.demo_step",
                                  "--first-fused-step", "--threads", str(threads)], cwd=REPO,
                                 env=env, check=True, capture_output=True, text=True).stdout
            rows.append((state, json.loads(out.strip().splitlines()[-1])))
    print(f"fused kernels' compile in the demo's fast setting (the global batch as one "
          f"micro-batch), {threads} threads")
    print(f"{'cache':<6} {'first fused step [s]':>20} {'graphs':>7} {'next step [s]':>14}")
    for state, r in rows:
        print(f"{state:<6} {r['first_s']:>20.1f} {r['graphs']:>7} {r['next_s']:>14.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", help="git commit to measure side by side")
    parser.add_argument("--compile", action="store_true",
                        help="also measure this checkout with compile=true")
    parser.add_argument("--fused", action="store_true",
                        help="also measure this checkout with fused_kernels=true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--phases", action="store_true",
                        help="only time the phases of this checkout's train_step")
    parser.add_argument("--ops", action="store_true",
                        help="only count the operators one train_step dispatches")
    parser.add_argument("--settings", action="store_true",
                        help="only compare torch/native/fused kernels and micro-batch sizes "
                             "in one process")
    parser.add_argument("--widths", type=int, nargs="+", metavar="HIDDEN",
                        help="only time the eager step with the model at these hidden sizes "
                             "(the demo's is 64), in one process")
    parser.add_argument("--compile-cost", action="store_true",
                        help="only measure the fused kernels' compile, cold and warm")
    parser.add_argument("--first-fused-step", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_fused_step:
        first_fused_step(args.threads)
        return
    if args.compile_cost:
        compile_cost(args.threads)
        return
    if args.widths:
        widths_side_by_side(args.threads, args.widths)
        return
    if args.settings:
        settings_side_by_side(args.threads)
        return
    if args.phases:
        phase_times(args.threads, fused=args.fused)
        return
    if args.ops:
        op_counts(args.threads)
        return
    results = {}
    peaks = [matmul_peak(args.threads)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.baseline:
            base = tmp / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline],
                           cwd=REPO, check=True, capture_output=True)
            try:
                results[f"baseline {args.baseline}"] = run_demo(base, tmp / "b", args.steps,
                                                                args.threads)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO,
                               check=True, capture_output=True)
        results["this checkout"] = run_demo(REPO, tmp / "c", args.steps, args.threads)
        if args.compile:
            results["compile=true"] = run_demo(REPO, tmp / "compiled", args.steps, args.threads,
                                               ("compile=true",))
        if args.fused:
            results["fused_kernels=true"] = run_demo(REPO, tmp / "fused", args.steps,
                                                     args.threads, ("fused_kernels=true",))
    peaks.append(matmul_peak(args.threads))
    peak, flops = max(peaks), results["this checkout"]["model_flops"]
    print(f"k3-train demo, {args.steps} steps ({WARMUP_STEPS} warm-up), {args.threads} threads")
    text = text_flops_per_step()
    print(f"matmul probe: {peaks[0] / 1e9:.1f} GFLOP/s before, {peaks[1] / 1e9:.1f} after (MFU "
          f"uses the best); model FLOPs per step {statistics.median(flops) / 1e9:.2f} G at the "
          f"median (this checkout's count of each step, the text's {text / 1e9:.2f} G and "
          f"MoonViT's on the step's images; for a baseline too: the same data order)")
    print("MFU: the median and the best of the steps' model FLOPs over their times")
    print("peak RSS [GiB]: 'first' = the first run (curation + 1 step), 'train' = training on "
          "the prepared data")
    print(f"{'checkout':<22} {'step [s]':>9} {'fastest':>8} {'MFU':>7} {'MFU best':>9} "
          f"{'RSS first':>10} {'RSS train':>10} {'last loss':>10}")
    for name, r in results.items():
        mfu, best = _mfu(flops, r["times"], peak)
        print(f"{name:<22} {r['step_time_s']:>9.3f} {r['fastest_s']:>8.3f} {mfu:>7.1%} "
              f"{best:>9.1%} {r['rss_first_gib']:>10.2f} {r['rss_gib']:>10.2f} "
              f"{r['losses'][-1]:>10.4f}")
    print("losses of the first steps (results must not change):")
    for name, r in results.items():
        print(f"{name:<22} " + " ".join(f"{loss:.6f}" for loss in r["losses"][:3]))
    if args.baseline:
        base, cur = results[f"baseline {args.baseline}"], results["this checkout"]
        gap = max(abs(a - b) for a, b in zip(base["losses"][:3], cur["losses"][:3]))
        print(f"first losses: max |this - baseline| = {gap:.3g} (as logged in metrics.jsonl)")
        print(f"speed-up {base['step_time_s'] / cur['step_time_s']:.2f}x, "
              f"training RSS {cur['rss_gib'] / base['rss_gib']:.2f}x of the baseline")
    if args.profile:
        profile_one_step(args.threads)


if __name__ == "__main__":
    main()
