"""Chat messages as chat templates expect them (transformers' shape), checked on the way (no FastAPI here,
no torch), and :func:`encode_messages`, the one path from a request's messages to prompt ids (the chat
route and /tokenize). Rendering the template is the tokenizer's (``cluster/tokenizer.py``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cluster.http.errors import ApiError
from cluster.http.schema import ChatMessage, check, check_prompt_chars
from cluster.tokenizer import RESERVED_TEMPLATE_NAMES, Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """One message as chat templates expect it (transformers' shape: tool call arguments as objects)."""
    check(
        m.role in CHAT_ROLES,
        f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role!r}"[:300],
        "messages",
    )
    if isinstance(m.content, list):
        check(
            all(p.type == "text" and p.text is not None for p in m.content),
            f"messages[{i}].content: only text parts are supported",
            "messages",
        )
        text: str | None = "".join(p.text or "" for p in m.content)
    else:
        text = m.content
    message: dict[str, Any] = {"role": m.role, "content": text if text is not None or m.tool_calls else ""}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        check(
            m.role == "assistant", f"messages[{i}].tool_calls: only assistant messages carry them", "messages"
        )
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in m.tool_calls
        ]
    return message


def _arguments(text: str) -> Any:
    # NOTE: OpenAI sends arguments as JSON text; Hugging Face chat templates (Qwen, Llama 3.1, Mistral)
    # iterate or tojson them as an object, so a JSON object is passed on decoded (as vLLM does).
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def encode_messages(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool,
    tools: Sequence[dict[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
    max_chars: int,
    max_chars_reason: str,
    add_special_tokens: bool = False,
) -> list[int]:
    """A request's messages -> prompt ids, or ApiError 400 naming the field, checked in this order: no
    messages, each message's shape, the content's characters against ``max_chars`` (before any
    tokenizing), reserved ``template_kwargs`` names, then the template itself.

    Special-token strings in what the client sent are encoded as plain text (``Tokenizer.encode_chat``).
    """
    check(len(messages) > 0, "messages must not be empty", "messages")
    rendered = [template_message(i, m) for i, m in enumerate(messages)]
    num_chars = 0
    for i, message in enumerate(rendered):
        content = message["content"]
        num_chars += len(content) if isinstance(content, str) else 0
        what = "its content" if i == 0 else f"the content of messages[0..{i}]"
        check_prompt_chars(num_chars, max_chars, max_chars_reason, f"messages[{i}].content", what)
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs))
    check(
        not reserved,
        f"chat_template_kwargs may not set {reserved}: the server gives the template those",
        "chat_template_kwargs",
    )
    try:
        return tokenizer.encode_chat(
            rendered,
            add_generation_prompt,
            tools,
            template_kwargs=kwargs,
            add_special_tokens=add_special_tokens,
        )
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
