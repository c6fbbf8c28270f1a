"""What a person watching a run reads besides the step figures: the time left, and the plot of the
whole run (training.png)."""

from __future__ import annotations

from collections import deque
from pathlib import Path


class Eta:
    """Seconds left: the remaining steps at the mean time of the last `window` steps (the
    evaluations and checkpoints they included are in that time)."""

    def __init__(self, total_steps: int, window: int = 20):
        self.total_steps = total_steps
        self.times: deque[float] = deque(maxlen=window)

    def update(self, step: int, seconds: float) -> float:
        self.times.append(seconds)
        return (self.total_steps - step) * sum(self.times) / len(self.times)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


PANELS = (  # (title, [(row key, label)], log-scale y)
    ("loss", [("loss", "training"), ("val_loss", "validation")], False),
    ("learning rate", [("lr", "lr")], False),
    ("gradient norm", [("grad_norm", "before clipping")], True),
    ("expert-load CV", [("moe/cv_mean", "mean over layers"), ("moe/cv_max", "max")], False),
    ("throughput (tokens/s)", [("tokens_per_s", "tokens/s")], False),
)


POSTTRAIN_PANELS = (
    ("reward", [("reward", "sampled"), ("eval_reward", "greedy (eval)")], False),
    ("KL", [("kl", "per token")], False),
    ("response length", [("response_length", "model tokens")], False),
    ("time per step (s)", [("rollout_time_s", "rollout"), ("train_time_s", "training")], False),
)


def plot_run(rows: list[dict], path: Path) -> None:
    """training.png: one panel per figure of PANELS (POSTTRAIN_PANELS for a post-training run),
    against the step. Rows without a figure (not logged that step, or non-finite and stored as
    a string) are left out of its line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = POSTTRAIN_PANELS if any("rollout_time_s" in r for r in rows) else PANELS
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, series, log_y) in zip(axes, panels):
        for key, label in series:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float)]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, label=label,
                        marker="o" if key in ("val_loss", "eval_reward") else None)
        if log_y and ax.lines:
            ax.set_yscale("log")
        if len(ax.lines) > 1:
            ax.legend()
        ax.set(xlabel="step", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
