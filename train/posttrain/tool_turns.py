"""Tool calls in a generated assistant turn, and the tokens of the tool results that follow it.

In the K3 chat format (data_pipeline.chat.K3_CHAT_TEMPLATE) an assistant turn that calls tools
ends with

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|>...<|tool_calls_section_end|>
    <|im_end|>

(one line, INDEX counting the conversation's calls from 0); `parse_tool_calls` reads the calls
from such a turn, decoded with its special tokens kept. The tool results and the next assistant
header are then appended to the episode's tokens: `tool_observation_text` takes that text from
the chat template itself (what the conversation renders with the results and the generation
prompt, past what it renders up to the calls), so that a user's template gets its own format.
"""

from __future__ import annotations

import json
import re

from data_pipeline.chat import render_chat, render_prompt
from data_pipeline.tokenizer import RESERVED_TOKENS

from .environments import ToolCall

_CALL_BEGIN = "<|tool_call_begin|>"
_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_CALL_END = "<|tool_call_end|>"
_CALL_ID = re.compile(r"functions\.([A-Za-z0-9_-]+):\d+")  # OpenAI's function-name characters
_UNNAMED = "unnamed"  # the name a call with an unreadable id is rendered with (templates need one)


def parse_tool_calls(turn_text: str) -> list[ToolCall]:
    """The tool calls of one generated assistant turn in the K3 format, in order ([] for a turn
    without calls). A call that cannot be read (an id that is not functions.NAME:INDEX, no
    argument marker, arguments that are not a JSON object or hold a special token's text, a turn
    that ended inside the call) comes back with its `error` set, to be answered with an error
    observation."""
    calls = []
    for chunk in turn_text.split(_CALL_BEGIN)[1:]:
        body, closed, _ = chunk.partition(_CALL_END)
        calls.append(_parsed(body, bool(closed)))
    return calls


def _parsed(body: str, closed: bool) -> ToolCall:
    # The error texts become observations in the chat: they quote no special token.
    call_id, marked, arguments = body.partition(_ARGUMENT_BEGIN)
    match = _CALL_ID.fullmatch(call_id.strip())
    if match is None:
        return ToolCall("", "", error="its id is not functions.NAME:INDEX")
    call_id, name = match.group(0), match.group(1)
    if not closed:
        return ToolCall(call_id, name, error="the turn ended inside the call")
    if not marked:
        return ToolCall(call_id, name, error="no argument marker follows its id")
    if any(token in arguments for token in RESERVED_TOKENS):
        return ToolCall(call_id, name, error="its arguments hold a special token")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as e:
        return ToolCall(call_id, name, error=f"its arguments are not JSON ({e})")
    if not isinstance(parsed, dict):
        return ToolCall(call_id, name, error=f"its arguments are a JSON "
                                             f"{type(parsed).__name__}, not an object")
    return ToolCall(call_id, name, parsed)


def tool_turn_messages(calls: list[ToolCall], observations: list[str],
                       history: list[dict]) -> list[dict]:
    """The messages of a tool-call turn after `history` (the conversation's messages before it):
    the assistant's message with `calls`, then one tool message per observation. Call ids are
    call_N, N counting the calls in `history`, so that ids stay unique in the conversation."""
    if not calls or len(calls) != len(observations):
        raise ValueError(f"{len(calls)} calls and {len(observations)} observations: each call "
                         "needs its observation, and a tool-call turn has at least one call")
    first = sum(len(m.get("tool_calls") or ()) for m in history)
    ids = [f"call_{first + k}" for k in range(len(calls))]
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function",
         "function": {"name": call.name or _UNNAMED, "arguments": call.arguments}}
        for i, call in zip(ids, calls)]}
    results = [{"role": "tool", "tool_call_id": i, "content": observation}
               for i, observation in zip(ids, observations)]
    return [assistant, *results]


def tool_observation_text(calls: list[ToolCall], observations: list[str], chat_template: str,
                          history: list[dict], tools: list[dict] | None = None) -> str:
    """The text `chat_template` renders after the assistant's turn making `calls`: the tool
    results `observations` and the generation prompt of the next assistant turn. `history`: the
    conversation's messages before that turn (its earlier tool turns as tool_turn_messages made
    them: the K3 format counts the conversation's calls); `tools`: the schemas shown.

    Raises ValueError when the template renders the conversation with the results as something
    other than an extension of it up to the calls (the results could not be appended), and as
    data_pipeline.chat.render_chat does (an observation holding a special token's text)."""
    turn = tool_turn_messages(calls, observations, history)
    before, _ = render_chat([*history, turn[0]], chat_template, tools)
    after = render_prompt([*history, *turn], chat_template, tools)
    if not after.startswith(before):
        raise ValueError("the chat template renders a conversation with tool results as other "
                         "than the conversation up to the tool calls followed by more text, so "
                         "the results cannot be appended to the generated turn")
    return after[len(before):]
