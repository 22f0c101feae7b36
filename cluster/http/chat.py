"""Chat messages as chat templates expect them (transformers' shape), checked on the way (no FastAPI here,
no torch). Rendering the template is the tokenizer's (``cluster/tokenizer.py``)."""

from __future__ import annotations

import json
from typing import Any

from cluster.http.schema import ChatMessage, check

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
