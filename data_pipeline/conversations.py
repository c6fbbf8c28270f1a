"""Conversation records of chat sources: where their pictures are, and the canonical text that
dedup, the held-out split and tokenizer training see in place of the rendered chat.

A record is {"messages": [...], "tools": [...] (optional), "id": ...} in the OpenAI / Hugging
Face convention; an image part of a user turn is {"type": "image", "image": "<path>"}.
"""

from __future__ import annotations

import hashlib
import json

from .chat import NoAssistantTokens


def refusal_reason(error: ValueError) -> str:
    """The quarantine reason of a conversation chat.render_chat or encode_chat refused."""
    return "no_assistant_tokens" if isinstance(error, NoAssistantTokens) else \
        "invalid_conversation"


def image_parts(messages: list[dict]) -> list[tuple[str, object]]:
    """(field path, the part's "image" value) of every image part, in the order the template
    renders them (message by message, part by part): the order of the placeholders."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            out += [(f"messages[{i}].content[{j}]", part.get("image"))
                    for j, part in enumerate(content)
                    if isinstance(part, dict) and part.get("type") == "image"]
    return out


def picture_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _arguments(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, sort_keys=True)


def chat_text(messages: list[dict], digests: list[str]) -> str:
    """One line per message, `role: content`, with a picture as [image <digest of its file>]
    (conversations that differ only in their pictures are no duplicates) and each tool call as
    `role calls name(arguments)`, for a conversation that chat.render_chat accepted. Left out:
    call ids (arbitrary, so conversations that differ only in them are duplicates) and the
    tools' schemas (boilerplate shared by many conversations, which would make them near
    duplicates of each other)."""
    pictures = iter(digests)
    lines = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(f"[image {next(pictures)}]" if part["type"] == "image"
                              else part["text"] for part in content)
        lines.append(f"{message['role']}: {content or ''}")
        lines += [f"{message['role']} calls {call['function']['name']}"
                  f"({_arguments(call['function']['arguments'])})"
                  for call in message.get("tool_calls") or ()]
    return "\n".join(lines)
