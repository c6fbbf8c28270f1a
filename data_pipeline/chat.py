"""Chat templates and assistant-only loss masks, for supervised fine-tuning.

encode_chat renders a conversation (OpenAI / Hugging Face messages) with a Hugging Face chat
template as transformers' apply_chat_template does, tokenizes it, and returns the ids with a mask
that is True exactly on the assistant's tokens: its content, tool calls and end-of-turn token.
The mask comes from the template's {% generation %} ... {% endgeneration %} markers where it has
them (the same mask as transformers' return_assistant_tokens_mask=True); a template without them
is rendered prefix by prefix, and each assistant turn is the text its message adds after the
generation prompt. Either way a mask with no assistant token is an error, never a silent zero.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from model.errors import ConfigError

from .tokenizer import (
    BOS_ID,
    EOD_ID,
    PAD_ID,
    RESERVED_TOKENS,
    SPECIAL_TOKENS,
    check_chat_special_tokens,
)

ROLES = ("system", "user", "assistant", "tool")

# Kimi K2's format with the tokenizer's fixed chat tokens. An image part renders as one <image>
# where it stands in the user's content; the packing step expands each into the image's real
# number of placeholder tokens. A tool call is rendered as functions.NAME:INDEX (INDEX counts the
# conversation's calls) and a tool result names the call it answers by that same id.
K3_CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}
{{ content }}
{%- else -%}
{%- for part in content -%}
{%- if part.type == 'image' -%}
<image>
{%- else -%}
{{ part.text }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(call_ids=[], rendered_ids=[]) -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
<|im_system|>system<|im_middle|>{{ render_content(message.content) }}<|im_end|>
{%- elif message.role == 'user' -%}
<|im_user|>user<|im_middle|>{{ render_content(message.content) }}<|im_end|>
{%- elif message.role == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>
{%- generation -%}
{%- if message.content -%}
{{ render_content(message.content) }}
{%- endif -%}
{%- if message.tool_calls -%}
<|tool_calls_section_begin|>
{%- for call in message.tool_calls -%}
{%- set call_id = 'functions.' ~ call.function.name ~ ':' ~ ns.call_ids | length -%}
<|tool_call_begin|>{{ call_id }}<|tool_call_argument_begin|>
{%- if call.function.arguments is string -%}
{{ call.function.arguments }}
{%- else -%}
{{ call.function.arguments | tojson }}
{%- endif -%}
<|tool_call_end|>
{%- set ns.call_ids = ns.call_ids + [call.id] -%}
{%- set ns.rendered_ids = ns.rendered_ids + [call_id] -%}
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- endgeneration -%}
{%- else -%}
{%- if message.tool_call_id is not string -%}
{{ raise_exception('messages[' ~ loop.index0 ~ '].tool_call_id is missing: a tool result names '
                   'the id of the tool call it answers') }}
{%- elif message.tool_call_id not in ns.call_ids -%}
{{ raise_exception('messages[' ~ loop.index0 ~ '].tool_call_id=' ~ message.tool_call_id | tojson
                   ~ ' answers no tool call made before it') }}
{%- endif -%}
{%- set call_id = ns.rendered_ids[ns.call_ids.index(message.tool_call_id)] -%}
<|im_system|>tool<|im_middle|>## Return of {{ call_id }}{{ '\n' }}
{{- render_content(message.content) }}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

# Where templates commonly read the special tokens' strings (transformers passes them too).
_SPECIAL_TOKEN_VARIABLES = {"pad_token": SPECIAL_TOKENS[PAD_ID],
                            "bos_token": SPECIAL_TOKENS[BOS_ID],
                            "eos_token": SPECIAL_TOKENS[EOD_ID]}


class NoAssistantTokens(ValueError):
    """A conversation with nothing to learn from: no assistant message, or a template that renders
    none of the assistant's text."""


def render_chat(messages: list[dict], chat_template: str, tools: list[dict] | None = None,
                specials=RESERVED_TOKENS) -> tuple[str, list[tuple[int, int]]]:
    """(text, character spans of the assistant's part) of the conversation rendered with
    `chat_template`: every check of encode_chat that needs no tokenizer, so that a reader can
    refuse a conversation before any tokenizer exists. `specials`: the strings a tokenizer
    would encode as control tokens (a message holding one is refused).

    Raises ValueError naming the field for a malformed conversation, for text in it that holds a
    special token's string, and for a template that fails to render; NoAssistantTokens (a
    ValueError) for a conversation whose rendering has no assistant text.
    """
    messages = _checked_messages(messages)
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools={tools!r} is invalid: a list of tool JSON schemas (dicts)")
    _check_no_special_text(specials, messages, tools)
    template = _compile(chat_template)
    if _marker_tags(chat_template):
        text, spans = _render(template, messages, tools, add_generation_prompt=False)
    else:
        text, spans = _spans_from_prefixes(template, messages, tools)
    if not any(end > start for start, end in spans):
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        raise NoAssistantTokens(
            f"messages[{first}] is an assistant message, yet no rendered token is the "
            "assistant's: the chat template renders nothing for its assistant turns, or its "
            "{% generation %} markers enclose nothing it rendered")
    return text, spans


def encode_chat(messages: list[dict], tokenizer: Tokenizer, chat_template: str,
                tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of the conversation rendered with `chat_template`.

    The mask is True exactly on the assistant's tokens (content, tool calls, end of turn), False
    on system, user and tool-result tokens and on each assistant turn's header. `tools` (OpenAI
    function schemas) reaches the template as `tools`. Without {% generation %} markers a turn
    is all its message adds to the rendering, so a separator the template writes after the
    end-of-turn token (ChatML's newline) is learned too; markers leave it out.

    Raises what render_chat raises (ValueError naming the field, NoAssistantTokens), and
    ConfigError for a tokenizer without the chat tokens the template uses.
    """
    text, spans = render_chat(messages, chat_template, tools,
                              _chat_specials(tokenizer, chat_template))
    encoding = _encoded(tokenizer, text)
    # A token is the assistant's if its characters overlap a span; spans come in text order.
    # Every character is some token's, so a non-empty span (render_chat) masks a token.
    mask, k = [], 0
    for start, end in encoding.offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and end > spans[k][0])
    return encoding.ids, mask


def encode_prompt(messages: list[dict], tokenizer: Tokenizer, chat_template: str,
                  tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation to continue (its last turn the user's or a tool's) rendered
    with the template's generation prompt: what the model was fine-tuned to answer. Raises as
    encode_chat does (no assistant turn is needed)."""
    specials = _chat_specials(tokenizer, chat_template)
    return _encoded(tokenizer, render_prompt(messages, chat_template, tools, specials)).ids


def render_prompt(messages: list[dict], chat_template: str, tools: list[dict] | None = None,
                  specials=RESERVED_TOKENS) -> str:
    """The text encode_prompt tokenizes: the conversation rendered with the template's generation
    prompt, after the checks of render_chat (no assistant turn is needed)."""
    messages = _checked_messages(messages, to_learn=False)
    _check_no_special_text(specials, messages, tools)
    text, _ = _render(_compile(chat_template), messages, tools, add_generation_prompt=True)
    return text


def _chat_specials(tokenizer: Tokenizer, chat_template: str) -> list[str]:
    """The tokenizer's special tokens' strings, after checking it has the chat tokens the
    template uses at their fixed ids."""
    check_chat_special_tokens(tokenizer, "the tokenizer",
                              [t for t in RESERVED_TOKENS if t in chat_template])
    return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]


def encode_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of text a chat template rendered (its control tokens as such): a rollout's
    tool observations and generation prompts."""
    return _encoded(tokenizer, text).ids


def _encoded(tokenizer: Tokenizer, text: str):
    saved = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = False  # the template's <|im_end|> etc. are control tokens
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = saved


def without_generation_markers(template: str) -> str:
    """`template` without its {% generation %} and {% endgeneration %} tags: the unmarked twin
    that renders the same text (whitespace the tags stripped, through `-` or trim_blocks, is
    left out with them)."""
    tokens = list(_environment().lex(template))
    dropped = {i for first, last in _marker_tags(template) for i in range(first, last + 1)}
    return "".join(value for i, (_, _, value) in enumerate(tokens) if i not in dropped)


def load_chat_template(path: str | None) -> str:
    """The chat template at `path`: None is K3_CHAT_TEMPLATE; a .json file is a Hugging Face
    tokenizer_config.json whose "chat_template" is a string or a list of {"name", "template"}
    (the one named "default" is used); any other file is the template's text."""
    if path is None:
        return K3_CHAT_TEMPLATE
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"chat template {path}: no such file")
    if file.suffix != ".json":
        return file.read_text()
    try:
        template = json.loads(file.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"chat template {path}: not a tokenizer_config.json object ({e})") from e
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise ConfigError(f"chat template {path}: chat_template lists templates "
                              f"{sorted(map(str, named))} but none named 'default'")
        template = named["default"]
    if not isinstance(template, str):
        raise ConfigError(f"chat template {path}: no \"chat_template\" string in this "
                          "tokenizer_config.json (give the template's file instead)")
    return template


# ------------------------------------------------------------------ validation

def _checked_messages(messages, to_learn: bool = True) -> list[dict]:
    """The messages, checked; `to_learn`: a conversation trained on, which needs an assistant
    message (a prompt does not)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages={messages!r} is invalid: a non-empty list of message dicts")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}={message!r} is invalid: a dict with role and content")
        # As transformers does: an absent value (content=None beside tool_calls) is no key.
        message = {key: value for key, value in message.items() if value is not None}
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role={role!r} is invalid: one of {', '.join(ROLES)}")
        if "content" in message:
            _check_content(message["content"], role, f"{where}.content")
        elif role != "assistant":
            raise ValueError(f"{where}.content is missing: a {role} message needs content")
        if "tool_calls" in message:
            if role != "assistant":
                raise ValueError(f"{where}.tool_calls is set on a {role} message: only "
                                 "assistant messages call tools")
            _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "assistant" and not message.get("content") and not message.get("tool_calls"):
            raise ValueError(f"{where} is an assistant message with neither content nor "
                             "tool_calls: nothing to learn from")
        checked.append(message)
    if to_learn and not any(m["role"] == "assistant" for m in checked):
        raise NoAssistantTokens(f"messages has no assistant message (roles: "
                         f"{[m['role'] for m in checked]}): nothing to learn from")
    return checked


def _check_content(content, role: str, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where} is a {type(content).__name__}: must be a string or a list of "
                         "parts ({'type': 'text', 'text': ...} or {'type': 'image', ...})")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image" and role != "user":
            raise ValueError(f"{where}[{j}] is an image part, but images may appear only in "
                             f"user messages (role={role!r})")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text={part.get('text')!r} is invalid: a string")
        if kind not in ("text", "image"):
            raise ValueError(f"{where}[{j}]={part!r} is invalid: a dict with type 'text' or "
                             "'image'")


def _check_tool_calls(calls, where: str) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where} is a {type(calls).__name__}: must be a list of tool calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{where}[{j}]={call!r} is invalid: {{'id': ..., 'type': "
                             "'function', 'function': {'name': ..., 'arguments': ...}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}[{j}].function.name={function.get('name')!r} is invalid: "
                             "the tool's name")
        if not isinstance(function.get("arguments"), (str, dict)):
            raise ValueError(f"{where}[{j}].function.arguments={function.get('arguments')!r} "
                             "is invalid: a JSON string or a dict")


def _check_no_special_text(specials, messages: list[dict], tools: list[dict] | None) -> None:
    """Special-token strings are encoded as control tokens in the rendered chat, so a "<|im_end|>"
    or "<image>" typed in a message would end its turn or stand for an image."""
    for where, text in [*_strings(messages, "messages"), *_strings(tools, "tools")]:
        found = sorted((s for s in specials if s in text), key=text.index)
        if found:
            raise ValueError(f"{where} contains the special token text {found}: it would be "
                             "encoded as a control token; remove or escape it")


def _strings(value, where: str):
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")


# ------------------------------------------------------------------ rendering

class _Tracker:
    """The render in progress: characters yielded so far and the generation spans in them."""

    def __init__(self):
        self.rendered = 0
        self.spans: list[tuple[int, int]] = []


_TRACKER: ContextVar[_Tracker | None] = ContextVar("k3_chat_tracker", default=None)


class _GenerationExtension(Extension):
    """{% generation %} ... {% endgeneration %}: records the span of the text rendered inside."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

    def _record(self, caller) -> str:
        text = caller()
        tracker = _TRACKER.get()
        if tracker is not None:
            # Top-level output is yielded block by block, so what came before is all counted.
            tracker.spans.append((tracker.rendered, tracker.rendered + len(text)))
        return text


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # transformers' settings: templates from the Hub are untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationExtension, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compile(chat_template: str) -> jinja2.Template:
    try:
        return _environment().from_string(chat_template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template line {e.lineno}: invalid Jinja: {e.message}") from e


@lru_cache(maxsize=8)
def _marker_tags(template: str) -> tuple[tuple[int, int], ...]:
    """(first, last) lexer-token indices of each {% generation %} and {% endgeneration %} tag."""
    tokens = list(_environment().lex(template))
    tags = []
    for i, (_, kind, _) in enumerate(tokens):
        if kind != "block_begin":
            continue
        name = tokens[i + 1 + (tokens[i + 1][1] == "whitespace")][2]
        if name in ("generation", "endgeneration"):
            last = next(j for j in range(i, len(tokens)) if tokens[j][1] == "block_end")
            tags.append((i, last))
    return tuple(tags)


def _render(template: jinja2.Template, messages: list[dict], tools: list[dict] | None,
            add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
    """(text, generation spans) of `messages`."""
    tracker = _Tracker()
    token = _TRACKER.set(tracker)
    blocks = []
    try:
        # documents=None as transformers passes it (templates test it against none)
        for block in template.generate(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt,
                                       **_SPECIAL_TOKEN_VARIABLES):
            blocks.append(block)
            tracker.rendered += len(block)
    except (jinja2.TemplateError, TypeError) as e:  # TypeError: tojson of a non-JSON value
        raise ValueError(f"the chat template failed to render messages[:{len(messages)}]: "
                         f"{e}") from e
    finally:
        _TRACKER.reset(token)
    return "".join(blocks), tracker.spans


def _spans_from_prefixes(template: jinja2.Template, messages: list[dict],
                         tools: list[dict] | None) -> tuple[str, list[tuple[int, int]]]:
    """Without markers: assistant message i is what rendering messages[:i + 1] adds to
    messages[:i] rendered with the generation prompt."""
    text, _ = _render(template, messages, tools, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, _ = _render(template, messages[:i], tools, add_generation_prompt=True)
        turn, _ = _render(template, messages[:i + 1], tools, add_generation_prompt=False)
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise ValueError(
                f"messages[{i}]: the chat template rewrites earlier turns (the conversation "
                "rendered up to this assistant message does not extend the one before it), so "
                "its assistant tokens cannot be found; the template needs {% generation %} ... "
                "{% endgeneration %} markers around the assistant's part")
        spans.append((len(prompt), len(turn)))
    return text, spans
