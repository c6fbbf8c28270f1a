"""Rollouts (train/posttrain/rollout.py, episodes.py): a tool-using episode with the calculator
(the call parsed from the generated turn, the observation appended with version -1, the
environment's state kept, the answer verified); an episode paused every few tokens and saved and
reloaded as a checkpoint does between iterations ends exactly as the uninterrupted one, each
token with the version of the weights that sampled it; the colocated engine continues a paused
episode with the tokens one call would have drawn; the pool's task stream and groups."""

from __future__ import annotations

import functools
import json

from data_pipeline.chat import K3_CHAT_TEMPLATE, encode_rendered
from data_pipeline.tokenizer import train_tokenizer
from model.config import k3_tiny, replace
from model.k3 import K3Model
from train.posttrain.episodes import OBSERVATION, Episode, EpisodePool
from train.posttrain.loop import Prompts
from train.posttrain.rollout import ColocatedEngine, Generated, Scoring, advance
from train.posttrain.tasks import Task

SEQ = 512  # the calculator's schema in the prompt: ~230 tokens of this small vocabulary
TOOL_TURN = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.calculate:0'
             '<|tool_call_argument_begin|>{"expression": "2 + 3"}<|tool_call_end|>'
             '<|tool_calls_section_end|><|im_end|>')
ADD = Task(id="add", domain="math", prompt="What is 2 + 3?", verifier="exact_match",
           answer="5", budget=40, environment="calculator")


@functools.cache
def _tokenizer():
    texts = ["What is 2 + 3? It is 5. calculate the expression, functions and tools."] * 20
    return train_tokenizer(texts, vocab_size=320, min_frequency=1)


class Scripted:
    """An external engine stand-in: each assistant turn continues a scripted text (the turn's
    number read from the context's assistant headers), with made-up log-probabilities and the
    version it was told, minus `lag`."""

    def __init__(self, turns: list[str], lag: int = 0):
        tok = _tokenizer()
        self.scripts = [encode_rendered(tok, text) for text in turns]
        self.header, self.middle = (tok.token_to_id("<|im_assistant|>"),
                                    tok.token_to_id("<|im_middle|>"))
        self.version, self.lag = 1, lag  # the trainer's weights after one step

    def generate(self, contexts, budgets, row_seeds, row_offsets):
        out = []
        for context, budget in zip(contexts, budgets, strict=True):
            script = self.scripts[context.count(self.header) - 1]
            done = len(context) - 1 - max(i for i, t in enumerate(context) if t == self.middle)
            tokens = script[done:done + budget]
            ended = done + len(tokens) == len(script)
            out.append(Generated(tokens, [-0.5 - 0.01 * (done + i) for i in range(len(tokens))],
                                 [self.version - self.lag] * len(tokens),
                                 "stop" if ended else "length"))
        return out

    def sync_weights(self, version: int) -> None:
        self.version = version


def _scoring() -> Scoring:
    return Scoring({ADD.id: ADD}, _tokenizer(), K3_CHAT_TEMPLATE, None, budget_penalty=0.5,
                   max_turns=2)


def _pool(samples: int = 2) -> EpisodePool:
    pool = EpisodePool(seed=1)
    pool.refill([ADD], groups=1, samples=samples,
                prompt_of=Prompts(_tokenizer(), K3_CHAT_TEMPLATE))
    return pool


def _run(pool: EpisodePool, engine, iteration_tokens: int,
         reload: bool) -> tuple[int, EpisodePool]:
    """Iterations until every episode is done (each ends with the weights' next version, the
    first at version 1; with
    `reload` the pool goes through JSON as a checkpoint between them): (how many, the pool)."""
    encode = functools.partial(encode_rendered, _tokenizer())
    for iteration in range(1, 50):
        live = [e for e in pool.episodes if not e.done]
        advance(live, engine, _scoring(), 1, 64, iteration_tokens, SEQ, encode)
        engine.sync_weights(iteration + 1)
        if reload:
            pool = EpisodePool.from_state_dict(json.loads(json.dumps(pool.state_dict())))
        if all(e.done for e in pool.episodes):
            return iteration, pool
    raise AssertionError("the episodes never finished")


def test_a_tool_episode_calls_the_calculator_and_answers():
    pool = _pool()
    _, pool = _run(pool, Scripted([TOOL_TURN, "5<|im_end|>"]), 0, reload=False)
    for e in pool.episodes:
        assert (e.finish_reason, e.reward, e.outcome, e.turns) == ("stop", 1.0, "passed", 1)
        assert e.env_state == {"calls": 1, "history": [{"expression": "2 + 3", "result": "5"}]}
        observed = [i for i, v in enumerate(e.versions) if v == OBSERVATION]
        text = _tokenizer().decode(e.tokens[observed[0]:observed[-1] + 1],
                                   skip_special_tokens=False)
        assert text.startswith("<|im_system|>tool<|im_middle|>") and "5" in text
        assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
        assert [m["role"] for m in e.messages] == ["user", "assistant", "tool"]
        assert e.model_tokens == len(e.tokens) - len(observed) and not e.over_budget


def test_an_episode_paused_and_reloaded_every_iteration_ends_as_an_uninterrupted_one():
    """Three model tokens an iteration, the pool saved and reloaded between iterations: the
    same tokens, log-probabilities, environment state and reward as one iteration, paused at
    each iteration's end, every token of the version of the iteration that sampled it (the
    engine lags one version: off-policy tokens are recorded as such)."""
    turns = [TOOL_TURN, "5<|im_end|>"]
    _, whole = _run(_pool(), Scripted(turns), 0, reload=False)
    iterations, paused = _run(_pool(), Scripted(turns, lag=1), 3, reload=True)
    assert iterations > 5
    for a, b in zip(whole.episodes, paused.episodes, strict=True):
        assert (a.tokens, a.logprobs, a.env_state, a.reward) == (b.tokens, b.logprobs,
                                                                  b.env_state, b.reward)
        assert b.pauses == iterations - 1 and a.pauses == 0
        model_versions = [v for v in b.versions if v != OBSERVATION]
        assert model_versions == [k // 3 for k in range(len(model_versions))]


@functools.cache
def _model() -> K3Model:
    cfg = k3_tiny()
    return K3Model(replace(cfg, vision=None, moe=replace(cfg.moe, dispatch="loop")),
                   seed=0).double()


class _Digits:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_the_colocated_engine_continues_a_paused_episode_as_one_call_would():
    """Sampled episodes paused every 2 tokens (the same weights throughout) take the tokens and
    log-probabilities of one uninterrupted call (re-prefilled context, draws numbered by the
    episode's model tokens)."""
    task = Task(id="t", domain="math", prompt="", verifier="exact_match", answer="1", budget=4)
    scoring = Scoring({"t": task}, _Digits(), K3_CHAT_TEMPLATE, None, 0.5, 1)

    def episodes():
        return [Episode(uid, 0, "t", "math", [5, 9, 300 + uid]) for uid in range(3)]

    engine = ColocatedEngine(_model(), temperature=1.0, top_p=0.9, stop_token_ids=[])
    whole = episodes()
    advance(whole, engine, scoring, 3, 7, 0, SEQ, None)
    paused = episodes()
    for _ in range(4):
        advance([e for e in paused if not e.done], engine, scoring, 3, 7, 2, SEQ, None)
    for a, b in zip(whole, paused, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == 7 and b.pauses == 3
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-12
    assert len({tuple(e.tokens) for e in whole}) == 3  # the episodes draw apart


def test_the_pool_fills_groups_from_a_seeded_task_order_and_trains_whole_groups():
    tasks = [Task(id=f"t{i}", domain="math", prompt=f"{i}", verifier="exact_match", answer="1",
                  budget=4) for i in range(3)]
    pool = EpisodePool(seed=4)
    assert pool.refill(tasks, groups=2, samples=3, prompt_of=lambda t: [1, 2]) == 2
    assert len(pool.episodes) == 6 and [e.group for e in pool.episodes] == [0] * 3 + [1] * 3
    for e in pool.episodes[:4]:
        e.finish_reason = "stop"
    [group] = pool.take_finished_groups()
    assert [e.uid for e in group] == [0, 1, 2] and len(pool.episodes) == 3
    assert pool.refill(tasks, groups=2, samples=3, prompt_of=lambda t: [1, 2]) == 1
    # The third task ends the epoch; the fourth group starts the next one's order.
    pool.refill(tasks, groups=3, samples=1, prompt_of=lambda t: [1, 2])
    order = [tasks[i].id for i in pool.task_order(3)]
    assert pool.epoch == 1 and [e.task_id for e in pool.episodes][-1] == order[0]
    again = EpisodePool.from_state_dict(json.loads(json.dumps(pool.state_dict())))
    assert again == pool


def test_the_colocated_engine_samples_with_the_version_it_was_given():
    engine = ColocatedEngine(_model(), temperature=1.0, top_p=1.0, stop_token_ids=[])
    assert engine.generate([[5, 9]], [2], [1], [0])[0].versions == [0, 0]
    engine.sync_weights(3)
    [g] = engine.generate([[5, 9]], [3], [1], [0])
    assert g.versions == [3] * 3 and len(g.tokens) == 3
