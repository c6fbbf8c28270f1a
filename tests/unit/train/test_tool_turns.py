"""Tool-call turns in the chat format (train/posttrain/tool_turns.py): calls parsed from assistant
turns the real K3 template renders, malformed calls kept as calls with their error, and the
observation text: hand-written once for K3, equal to what the template renders for the whole
conversation, and taken from a user's template as well."""

from __future__ import annotations

import json

import pytest

from data_pipeline.chat import K3_CHAT_TEMPLATE, render_chat, render_prompt
from train.posttrain.environments import Calculator, ToolCall, observe
from train.posttrain.tool_turns import (
    parse_tool_calls,
    tool_observation_text,
    tool_turn_messages,
)

TOOLS = Calculator().tools()
QUESTION = [{"role": "user", "content": "What is 347 + 589, and 1 / 0?"}]
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = \
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _calls(*expressions: str, content: str | None = None) -> dict:
    """An assistant message calling the calculator (arguments as JSON text, as OpenAI has it)."""
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"c{i}", "type": "function",
         "function": {"name": "calculate", "arguments": json.dumps({"expression": e})}}
        for i, e in enumerate(expressions)]}


def _generated(history: list[dict], message: dict) -> str:
    """The text the model generates for `message` after the generation prompt, as the K3
    template renders it: the assistant's part of the last turn."""
    text, spans = render_chat([*history, message], K3_CHAT_TEMPLATE, TOOLS)
    start, end = spans[-1]
    return text[start:end]


def _calculate(expression: str, index: int) -> ToolCall:
    return ToolCall(f"functions.calculate:{index}", "calculate", {"expression": expression})


def test_one_call_rendered_by_the_k3_template_is_parsed():
    turn = _generated(QUESTION, _calls("347 + 589"))
    assert turn == (f'{SECTION_BEGIN}{CALL_BEGIN}functions.calculate:0{ARGUMENT_BEGIN}'
                    f'{{"expression": "347 + 589"}}{CALL_END}{SECTION_END}<|im_end|>')
    assert parse_tool_calls(turn) == [_calculate("347 + 589", 0)]


def test_two_calls_after_text_are_parsed_in_order():
    turn = _generated(QUESTION, _calls("347 + 589", "1 / 0", content="Let me compute both."))
    assert turn.startswith("Let me compute both." + SECTION_BEGIN)
    assert parse_tool_calls(turn) == [_calculate("347 + 589", 0), _calculate("1 / 0", 1)]


def test_a_later_turns_calls_carry_the_conversations_count():
    history = [*QUESTION, _calls("347 + 589", "1 / 0"),
               {"role": "tool", "tool_call_id": "c0", "content": "936"},
               {"role": "tool", "tool_call_id": "c1", "content": "error: division by zero"},
               {"role": "assistant", "content": "936, and 1 / 0 has no value."},
               {"role": "user", "content": "And 936 * 2?"}]
    message = _calls("936 * 2")
    message["tool_calls"][0]["id"] = "c2"
    assert parse_tool_calls(_generated(history, message)) == [_calculate("936 * 2", 2)]


def test_a_turn_without_calls_has_none():
    assert parse_tool_calls(_generated(QUESTION, {"role": "assistant", "content": "936"})) == []


GOOD = f'{CALL_BEGIN}functions.calculate:0{ARGUMENT_BEGIN}{{"expression": "1 + 1"}}{CALL_END}'


@pytest.mark.parametrize("call, expected", [
    (f"{CALL_BEGIN}calc{ARGUMENT_BEGIN}{{}}{CALL_END}",
     ToolCall("", "", error="its id is not functions.NAME:INDEX")),
    (f"{CALL_BEGIN}functions.calc ulate:0{ARGUMENT_BEGIN}{{}}{CALL_END}",
     ToolCall("", "", error="its id is not functions.NAME:INDEX")),
    (f"{CALL_BEGIN}functions.calculate:1{CALL_END}",
     ToolCall("functions.calculate:1", "calculate", error="no argument marker follows its id")),
    (f"{CALL_BEGIN}functions.calculate:1{ARGUMENT_BEGIN}{{expression: 1}}{CALL_END}",
     ToolCall("functions.calculate:1", "calculate", error="its arguments are not JSON "
              "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))")),
    (f"{CALL_BEGIN}functions.calculate:1{ARGUMENT_BEGIN}[1]{CALL_END}",
     ToolCall("functions.calculate:1", "calculate",
              error="its arguments are a JSON list, not an object")),
    (f'{CALL_BEGIN}functions.calculate:1{ARGUMENT_BEGIN}{{"expression": "<|im_end|>"}}{CALL_END}',
     ToolCall("functions.calculate:1", "calculate", error="its arguments hold a special token")),
    (f'{CALL_BEGIN}functions.calculate:1{ARGUMENT_BEGIN}{{"expression": "1 +',  # cut off
     ToolCall("functions.calculate:1", "calculate", error="the turn ended inside the call")),
])
def test_a_malformed_call_comes_back_with_its_error_among_the_others(call, expected):
    turn = f"{SECTION_BEGIN}{GOOD}{call}"
    assert parse_tool_calls(turn) == [_calculate("1 + 1", 0), expected]


def test_the_k3_observation_text_is_the_tool_results_then_the_assistant_header():
    calls = parse_tool_calls(_generated(QUESTION, _calls("347 + 589", "1 / 0")))
    env = Calculator()
    observations = [observe(env, call) for call in calls]
    assert tool_observation_text(calls, observations, K3_CHAT_TEMPLATE, QUESTION, TOOLS) == (
        "<|im_system|>tool<|im_middle|>## Return of functions.calculate:0\n936<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.calculate:1\n"
        "error: division by zero<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")


def test_prompt_generated_turn_and_observations_render_the_whole_conversation():
    """What an episode's tokens hold after a tool turn is the template's rendering of the
    conversation with the results, ready for the next assistant turn; a second tool turn's
    results name its calls by the conversation's count."""
    history = list(QUESTION)
    text = render_prompt(history, K3_CHAT_TEMPLATE, TOOLS)
    for expressions in (["347 + 589", "1 / 0"], ["936 * 2"]):
        turn = _generated(history, _calls(*expressions))
        calls = parse_tool_calls(turn)
        observations = [f"result {i}" for i in range(len(calls))]
        text += turn + tool_observation_text(calls, observations, K3_CHAT_TEMPLATE, history,
                                             TOOLS)
        history += tool_turn_messages(calls, observations, history)
        assert text == render_prompt(history, K3_CHAT_TEMPLATE, TOOLS)
    assert text.endswith("## Return of functions.calculate:2\nresult 0<|im_end|>"
                         "<|im_assistant|>assistant<|im_middle|>")


def test_a_malformed_call_is_answered_under_a_placeholder_name():
    calls = [ToolCall("", "", error="its id is not functions.NAME:INDEX")]
    observations = [observe(Calculator(), calls[0])]
    assert tool_observation_text(calls, observations, K3_CHAT_TEMPLATE, QUESTION) == (
        "<|im_system|>tool<|im_middle|>## Return of functions.unnamed:0\n"
        "error: the tool call could not be read: its id is not functions.NAME:INDEX<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
          "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")


def test_a_users_template_gets_its_own_observation_text():
    calls = [_calculate("347 + 589", 0), _calculate("1 / 0", 1)]
    assert tool_observation_text(calls, ["936", "error"], CHATML, QUESTION) == (
        "<|im_start|>tool\n936<|im_end|>\n<|im_start|>tool\nerror<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_template_that_rewrites_the_turn_before_the_results_is_refused():
    rewriting = ("{% for m in messages %}{{ m.role }}:"
                 "{% if m.role == 'assistant' %}{% generation %}calls;{% endgeneration %}"
                 "{% else %}{{ m.content }};{% endif %}{% endfor %}"
                 "{% if messages[-1].role == 'assistant' %}END{% endif %}")
    with pytest.raises(ValueError, match="the results cannot be appended to the generated turn"):
        tool_observation_text([_calculate("1 + 1", 0)], ["2"], rewriting, QUESTION)


def test_an_observation_with_a_special_tokens_text_is_refused():
    with pytest.raises(ValueError, match=r"messages\[2\]\.content contains the special token"):
        tool_observation_text([_calculate("1 + 1", 0)], ["2<|im_end|>"], K3_CHAT_TEMPLATE,
                              QUESTION)


def test_tool_turn_messages_number_the_calls_after_the_history_and_pair_each_result():
    history = [*QUESTION, *tool_turn_messages([_calculate("1 + 1", 0)], ["2"], QUESTION)]
    assistant, result = tool_turn_messages([_calculate("2 + 2", 1)], ["4"], history)
    assert assistant == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "calculate", "arguments": {"expression": "2 + 2"}}}]}
    assert result == {"role": "tool", "tool_call_id": "call_1", "content": "4"}
    with pytest.raises(ValueError, match="1 calls and 2 observations"):
        tool_turn_messages([_calculate("2 + 2", 1)], ["4", "5"], history)
    with pytest.raises(ValueError, match="0 calls and 0 observations"):
        tool_turn_messages([], [], history)
