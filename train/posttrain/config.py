"""Configuration of on-policy post-training (`posttrain=rl|mopd`): the rollouts, the RL
objective and the teachers of multi-teacher on-policy distillation (docs/posttraining.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.errors import ConfigError

MODES = ("none", "rl", "mopd")
KL_FORMS = ("sampled", "full")


@dataclass
class RolloutConfig:
    # The task set (JSONL, train.posttrain.tasks); bundled://tasks/tasks.jsonl is the demo's.
    tasks: str = "bundled://tasks/tasks.jsonl"
    # Only these domains and effort levels of it (empty: all): a specialist's share.
    domains: list[str] = field(default_factory=list)
    efforts: list[str] = field(default_factory=list)
    max_tasks: int = 0  # the first this many of those, in file order (0: all)
    # Every eval.every steps (and before the first), greedy answers to this many tasks (a fixed
    # seeded sample of the selected ones): the policy's reward without sampling noise. 0: none.
    eval_tasks: int = 32
    # The tokenizer the student was trained with; null: init_from's run's (its data config).
    tokenizer: str | None = None
    chat_template: str | None = None  # a Jinja file or tokenizer_config.json; null: K3's
    prompts_per_step: int = 8  # groups in flight: prompts sampled together each iteration
    samples_per_prompt: int = 4  # episodes per prompt (the group of the advantages)
    max_new_tokens: int = 64  # an episode's model tokens at most (tool observations not counted)
    # Model tokens an episode may take in one iteration; past them it is paused and continues
    # in the next iteration with the weights of then (partial rollouts). 0: never paused.
    iteration_tokens: int = 0
    max_turns: int = 4  # tool-call turns an episode may take before it must answer
    temperature: float = 1.0
    top_p: float = 1.0
    # colocated: the training ranks generate with the current weights; "package.module:attr":
    # an external rollout engine (train.posttrain.rollout.RolloutEngine), e.g. a vLLM client.
    engine: str = "colocated"
    # Tokens sampled by weights more than this many optimizer steps old are left out of the
    # loss (-1: never); the importance ratio corrects the rest.
    max_staleness: int = -1


@dataclass
class RLConfig:
    clip: float = 0.2  # the importance ratio's clipping range 1 +- clip
    # Past a task's token budget the reward falls linearly, by at most this much at twice the
    # budget (length control: effort levels are budgets).
    budget_penalty: float = 0.5
    judge: str | None = None  # "package.module:attr", the LLM judge of `verifier: judge` tasks


@dataclass
class TeacherConfig:
    path: str = "???"  # a k3-train run, one of its checkpoints or a k3-export directory
    domains: list[str] = field(default_factory=list)  # the task domains it teaches


@dataclass
class MOPDConfig:
    teachers: list[TeacherConfig] = field(default_factory=list)
    # full: the exact KL(student || teacher) over the vocabulary at every response token;
    # sampled: log p_s(y) - log p_t(y) at the sampled tokens, as a per-token advantage. Both at
    # rollout.temperature (the distribution the student sampled from).
    kl: str = "sampled"
    reward_weight: float = 0.0  # weight of the outcome reward's group advantage beside the KL


def _fail(path: str, value, valid: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: {valid}")


def validate_posttrain(mode: str, rollout: RolloutConfig, rl: RLConfig, mopd: MOPDConfig,
                       topology) -> None:
    """The post-training fields, before any process group or model exists."""
    if mode not in MODES:
        _fail("posttrain", mode, f"must be one of {list(MODES)}")
    if mode == "none":
        return
    for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "max_turns"):
        if getattr(rollout, name) < 1:
            _fail(f"rollout.{name}", getattr(rollout, name), "must be >= 1")
    if rollout.max_tasks < 0:
        _fail("rollout.max_tasks", rollout.max_tasks, "must be >= 0 (0: every selected task)")
    if rollout.eval_tasks < 0:
        _fail("rollout.eval_tasks", rollout.eval_tasks, "must be >= 0 (0: no evaluation)")
    if rollout.iteration_tokens < 0:
        _fail("rollout.iteration_tokens", rollout.iteration_tokens, "must be >= 0 (0: no pauses)")
    if not rollout.temperature > 0:
        _fail("rollout.temperature", rollout.temperature,
              "must be > 0: on-policy training samples (greedy rollouts give a group identical "
              "answers)")
    if not 0 < rollout.top_p <= 1:
        _fail("rollout.top_p", rollout.top_p, "must be in (0, 1]")
    if rollout.max_staleness < -1:
        _fail("rollout.max_staleness", rollout.max_staleness, "must be >= 0, or -1 (never)")
    if not 0 < rl.clip < 1:
        _fail("rl.clip", rl.clip, "must be in (0, 1)")
    if rl.budget_penalty < 0:
        _fail("rl.budget_penalty", rl.budget_penalty, "must be >= 0")
    if topology is not None and (topology.pp > 1 or topology.cp > 1):
        _fail("posttrain", mode, "runs under data, tensor and expert parallelism "
              "(parallel.pipeline and parallel.context 1): rollouts decode, which pipeline and "
              "context-parallel layouts do not")
    if mode == "mopd":
        if mopd.kl not in KL_FORMS:
            _fail("mopd.kl", mopd.kl, f"must be one of {list(KL_FORMS)}")
        if not mopd.teachers:
            _fail("mopd.teachers", [], "needs at least one teacher: [{path: RUN_OR_EXPORT, "
                  "domains: [DOMAIN, ...]}, ...]")
        if mopd.reward_weight < 0:
            _fail("mopd.reward_weight", mopd.reward_weight, "must be >= 0")
        owner: dict[str, int] = {}
        for i, teacher in enumerate(mopd.teachers):
            if not teacher.domains:
                _fail(f"mopd.teachers[{i}].domains", [], "must name the domains it teaches")
            for domain in teacher.domains:
                if domain in owner:
                    _fail(f"mopd.teachers[{i}].domains", teacher.domains,
                          f"domain {domain!r} is already mopd.teachers[{owner[domain]}]'s: "
                          f"each domain has one teacher")
                owner[domain] = i
