"""data_pipeline.chat: chat templates, their rendering and the assistant-only loss mask, checked
against transformers' apply_chat_template on a tokenizer trained here (no hub, no network)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from data_pipeline.chat import (
    K3_CHAT_TEMPLATE,
    NoAssistantTokens,
    encode_chat,
    encode_prompt,
    load_chat_template,
    render_chat,
    without_generation_markers,
)
from data_pipeline.tokenizer import (
    CHAT_SPECIAL_TOKENS,
    IMAGE_ID,
    RESERVED_TOKENS,
    SPECIAL_TOKENS,
    load_tokenizer,
    train_tokenizer,
)
from model.errors import ConfigError

IM_END = RESERVED_TOKENS.index("<|im_end|>")
HEADER = "<|im_assistant|>assistant<|im_middle|>"

# Markers on lines of their own, indented, with and without `-`: what trim_blocks,
# lstrip_blocks and whitespace control strip must be the same with and without them.
LINES_TEMPLATE = """\
{% for message in messages %}
    {% if message.role == 'assistant' %}
<|im_assistant|>assistant<|im_middle|>
        {%- generation %}
{{ message.content }}<|im_end|>
        {%- endgeneration %}
    {% else %}
<|im_user|>{{ message.role }}<|im_middle|>{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_assistant|>assistant<|im_middle|>
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, <b>now</b> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "single": ([{"role": "user", "content": "what is the weather in paris"},
                {"role": "assistant", "content": "paris is sunny today"}], None),
    "multi": ([{"role": "system", "content": "you answer in short words"},
               {"role": "user", "content": "tell me a story"},
               {"role": "assistant", "content": "once a river met the sea"},
               {"role": "user", "content": [{"type": "text", "text": "and then"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "they became one"}]}],
              None),
    "tools": ([{"role": "user", "content": "weather in london please"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_7", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "london"}}}]},
               {"role": "tool", "tool_call_id": "call_7", "content": "rain, 12 C"},
               {"role": "assistant", "content": "it rains in london",
                "tool_calls": [{"id": "call_8", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_8", "content": "sun, 20 C"},
               {"role": "assistant", "content": "and the sun shines in paris"}], TOOLS),
    "image": ([{"role": "user", "content": [{"type": "text", "text": "what is in "},
                                            {"type": "image", "url": "photo.png"},
                                            {"type": "text", "text": " this photo"}]},
               {"role": "assistant", "content": "a bridge over a river"}], None),
}

# What each assistant turn must contribute to the mask, in order.
ASSISTANT_TEXTS = {
    "single": ["paris is sunny today<|im_end|>"],
    "multi": ["once a river met the sea<|im_end|>", "they became one<|im_end|>"],
    "tools": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
              '<|tool_call_argument_begin|>{"city": "london"}<|tool_call_end|>'
              "<|tool_calls_section_end|><|im_end|>",
              "it rains in london<|tool_calls_section_begin|><|tool_call_begin|>"
              'functions.get_weather:1<|tool_call_argument_begin|>{"city": "paris"}'
              "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
              "and the sun shines in paris<|im_end|>"],
    "image": ["a bridge over a river<|im_end|>"],
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    rng = random.Random(0)
    syllables = "ka ri to mel va sun de lo pir an ze tu bor ni qua sel ra mo fen ish".split()
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
             for _ in range(300)]
    texts = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(400)]
    texts += ["the weather in paris and london is sunny today, tell me a story"] * 20
    return train_tokenizer(texts, vocab_size=600)


@pytest.fixture(scope="module")
def hf(tok):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.to_str()), pad_token="<pad>",
        bos_token="<bos>", eos_token="<eod>",
        additional_special_tokens=list(RESERVED_TOKENS[3:]))


def _runs(ids: list[int], mask: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of each run of masked tokens."""
    runs = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([i, i + 1])
        elif m:
            runs[-1][1] = i + 1
    return [tuple(r) for r in runs]


def test_train_tokenizer_reserves_the_chat_tokens_at_fixed_ids(tok):
    assert tok.get_vocab_size() == 600
    assert [tok.token_to_id(t) for t in RESERVED_TOKENS] == list(range(15))
    specials = tok.get_added_tokens_decoder()
    assert [specials[i].content for i in range(15) if specials[i].special] == \
        list(SPECIAL_TOKENS + CHAT_SPECIAL_TOKENS)
    assert tok.encode("a <|im_end|> in text", add_special_tokens=False).ids.count(IM_END) == 0


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("template", [K3_CHAT_TEMPLATE, LINES_TEMPLATE], ids=["k3", "lines"])
def test_encode_chat_equals_transformers_with_and_without_markers(tok, hf, template, name):
    messages, tools = CONVERSATIONS[name]
    out = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True)
    want = (out["input_ids"], [bool(m) for m in out["assistant_masks"]])
    assert sum(want[1]) > 0
    assert encode_chat(messages, tok, template, tools) == want
    unmarked = without_generation_markers(template)
    assert "generation %}" not in unmarked
    assert encode_chat(messages, tok, unmarked, tools) == want
    assert tok.encode_special_tokens  # restored: raw text keeps its specials as text


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_the_mask_is_exactly_each_assistant_turn(tok, name):
    messages, tools = CONVERSATIONS[name]
    ids, mask = encode_chat(messages, tok, K3_CHAT_TEMPLATE, tools)
    runs = _runs(ids, mask)
    assert [tok.decode(ids[s:e], skip_special_tokens=False) for s, e in runs] == \
        ASSISTANT_TEXTS[name]
    for s, e in runs:  # the role header before each turn is the prompt, not learned
        assert tok.decode(ids[:s], skip_special_tokens=False).endswith(HEADER)
        assert ids[e - 1] == IM_END and not mask[s - 1]
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
    for message in messages:
        if message["role"] in ("user", "tool") and isinstance(message["content"], str):
            assert message["content"] in unmasked


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_a_prompt_is_the_conversation_up_to_the_assistants_first_token(tok, name):
    """encode_prompt of the conversation before its last assistant turn: the full conversation's
    ids up to that turn's first learned token (the generation prompt included), which follows."""
    messages, tools = CONVERSATIONS[name]
    ids, mask = encode_chat(messages, tok, K3_CHAT_TEMPLATE, tools)
    prompt = encode_prompt(messages[:-1], tok, K3_CHAT_TEMPLATE, tools)
    first = max(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1])
    assert prompt == ids[:first]
    assert tok.decode(prompt, skip_special_tokens=False).endswith(HEADER)


def test_k3_template_renders_kimi_k2_format(tok):
    messages, tools = CONVERSATIONS["tools"]
    ids, _ = encode_chat(messages + [{"role": "user", "content": "thanks"}], tok,
                         K3_CHAT_TEMPLATE, tools)
    declared = json.dumps(TOOLS, ensure_ascii=False, separators=(",", ":"))
    assert "<b>now</b> & later" in declared  # no HTML escaping
    a1, a2, a3 = ASSISTANT_TEXTS["tools"]
    assert tok.decode(ids, skip_special_tokens=False) == (
        f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>"
        "<|im_user|>user<|im_middle|>weather in london please<|im_end|>"
        f"{HEADER}{a1}"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nrain, 12 C<|im_end|>"
        f"{HEADER}{a2}"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\nsun, 20 C<|im_end|>"
        f"{HEADER}{a3}"
        "<|im_user|>user<|im_middle|>thanks<|im_end|>")
    assert ids[0] == RESERVED_TOKENS.index("<|im_system|>") and ids.count(IM_END) == 8


def test_an_image_part_is_one_image_token_in_place(tok):
    messages, _ = CONVERSATIONS["image"]
    ids, mask = encode_chat(messages, tok, K3_CHAT_TEMPLATE)
    assert ids.count(IMAGE_ID) == 1 and not mask[ids.index(IMAGE_ID)]
    at = ids.index(IMAGE_ID)
    assert tok.decode(ids[:at], skip_special_tokens=False).endswith("what is in ")
    assert tok.decode(ids[at + 1:], skip_special_tokens=False).startswith(" this photo")


def _bad(i: int, **fields) -> list[dict]:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}]
    messages[i] = {k: v for k, v in (messages[i] | fields).items() if v != "DROP"}
    return messages


@pytest.mark.parametrize("messages,tools,match", [
    (_bad(2, role="robot"), None,
     r"messages\[2\].role='robot' is invalid: one of system, user, assistant, tool"),
    (_bad(1, content="DROP"), None,
     r"messages\[1\] is an assistant message with neither content nor tool_calls"),
    (_bad(1, content=""), None, r"messages\[1\] is an assistant message with neither"),
    (_bad(0, content="DROP"), None, r"messages\[0\].content is missing"),
    (_bad(0, content=7), None, r"messages\[0\].content is a int"),
    (_bad(0, content=[{"type": "audio"}]), None, r"messages\[0\].content\[0\]=.* is invalid"),
    (_bad(0, content=[{"type": "text", "text": 3}]), None,
     r"messages\[0\].content\[0\].text=3 is invalid"),
    (_bad(1, content=[{"type": "image", "url": "x.png"}]), None,
     r"messages\[1\].content\[0\] is an image part, but images may appear only in user"),
    (_bad(0, tool_calls=[]), None, r"messages\[0\].tool_calls is set on a user message"),
    (_bad(1, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": 3}}]),
     None, r"messages\[1\].tool_calls\[0\].function.arguments=3 is invalid"),
    (_bad(1, tool_calls=[{"type": "function", "function": {"arguments": "{}"}}]), None,
     r"messages\[1\].tool_calls\[0\].function.name=None is invalid"),
    (_bad(1, role="user"), None, r"messages has no assistant message .*nothing to learn"),
    ([], None, r"messages=\[\] is invalid"),
    (_bad(0, content="stop<|im_end|><|im_assistant|>"), None,
     r"messages\[0\].content contains the special token text \['<\|im_end\|>'"),
    (_bad(0, content=[{"type": "text", "text": "an <image> tag"}]), None,
     r"messages\[0\].content\[0\].text contains the special token text \['<image>'\]"),
    (_bad(0), [{"description": "<eod>"}], r"tools\[0\].description contains the special"),
    (_bad(0), {"name": "f"}, r"tools=.* is invalid: a list of tool JSON schemas"),
    (_bad(0) + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], None,
     r"failed to render.*messages\[3\].tool_call_id=\"call_9\" answers no tool call"),
    (_bad(0) + [{"role": "tool", "content": "x"}], None,
     r"failed to render.*messages\[3\].tool_call_id is missing"),
])
def test_bad_input_is_refused_naming_the_field(tok, messages, tools, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages, tok, K3_CHAT_TEMPLATE, tools)


def test_templates_that_fail_are_refused_with_jinja_message(tok):
    messages = _bad(0)
    with pytest.raises(ValueError, match=r"failed to render messages\[:3\]: no system here"):
        encode_chat(messages, tok, "{{ raise_exception('no system here') }}")
    with pytest.raises(ValueError, match="chat template line 1: invalid Jinja"):
        encode_chat(messages, tok, "{% for m in messages %}")


def test_a_template_that_rewrites_earlier_turns_needs_markers(tok):
    # The turn count written first changes as the conversation grows: prefixes are no prefixes.
    marked = ("<|im_system|>turns {{ messages | length }}<|im_end|>" + LINES_TEMPLATE)
    ids, mask = encode_chat(_bad(0), tok, marked)
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == \
        "hello<|im_end|>"
    with pytest.raises(ValueError, match=r"messages\[1\]: the chat template rewrites earlier "
                                         r"turns.*needs \{% generation %\}"):
        encode_chat(_bad(0), tok, without_generation_markers(marked))


@pytest.mark.parametrize("template", [
    LINES_TEMPLATE.replace("{{ message.content }}<|im_end|>",
                           "").replace("{%- endgeneration %}", "{%- endgeneration %}x"),
    "{% for m in messages if m.role != 'assistant' %}{{ m.content }}{% endfor %}",
], ids=["markers-around-nothing", "no-markers-no-assistant-text"])
def test_a_template_hiding_the_assistant_is_refused_not_all_false(tok, template):
    with pytest.raises(ValueError, match=r"messages\[1\] is an assistant message, yet no "
                                         r"rendered token is the assistant's"):
        encode_chat(_bad(0), tok, template)
    assert tok.encode_special_tokens


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_render_chat_finds_the_assistant_text_without_a_tokenizer(name):
    messages, tools = CONVERSATIONS[name]
    text, spans = render_chat(messages, K3_CHAT_TEMPLATE, tools)
    assert [text[s:e] for s, e in spans] == ASSISTANT_TEXTS[name]


def test_render_chat_refuses_what_a_reader_must_quarantine():
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(NoAssistantTokens, match="no assistant message"):
        render_chat(hello, K3_CHAT_TEMPLATE)
    with pytest.raises(NoAssistantTokens, match=r"messages\[1\] is an assistant message, yet"):
        render_chat(hello + [{"role": "assistant", "content": "hi"}],
                    "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match=r"messages\[0\].content contains the special token "
                                         r"text \['<image>'\]") as error:
        render_chat([{"role": "user", "content": "a literal <image> tag"},
                     {"role": "assistant", "content": "ok"}], K3_CHAT_TEMPLATE)
    assert not isinstance(error.value, NoAssistantTokens)


def test_an_old_tokenizer_loads_but_cannot_encode_chats(tmp_path, tok):
    old = Tokenizer(models.BPE())
    old.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    old.train_from_iterator(["some old pre-training text"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPECIAL_TOKENS), show_progress=False))
    old.save(str(tmp_path / "old.json"))
    loaded = load_tokenizer(tmp_path / "old.json")
    assert [loaded.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match=r"the tokenizer lacks the chat special tokens "
                                          r"\['<\|im_system\|>', .*retrain it with k3-data"):
        encode_chat(_bad(0), loaded, K3_CHAT_TEMPLATE)
    # A template without chat tokens needs none of them.
    ids, mask = encode_chat(_bad(0), loaded, "{% for m in messages %}{% generation %}"
                            "{{ m.content }}{% endgeneration %}{% endfor %}")
    assert ids == loaded.encode("hihellobye", add_special_tokens=False).ids and all(mask)


def test_load_chat_template(tmp_path):
    assert load_chat_template(None) == K3_CHAT_TEMPLATE
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}\n")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0].content }}\n"
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "A"}))
    assert load_chat_template(str(config)) == "A"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                                    {"name": "default", "template": "D"}]}))
    assert load_chat_template(str(config)) == "D"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: chat_template lists "
                                          r"templates \['tool_use'\] but none named 'default'"):
        load_chat_template(str(config))
    config.write_text(json.dumps({"model_max_length": 8}))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: no \"chat_template\""):
        load_chat_template(str(config))
    with pytest.raises(ConfigError, match=r"missing.jinja: no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
