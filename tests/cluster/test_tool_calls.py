"""Rendering a constrained output as OpenAI tool calls (cluster/http/responses.py), checked against the
``openai`` package's own response types: full choices and stream chunks, named and "required"."""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.http.output_constraints import ToolCalls
from cluster.http.responses import ChoiceBuilder
from cluster.protocol import FinishReason, TokenDelta

ENVELOPE = {"id": "chatcmpl-1", "created": 0, "model": "m"}


def deltas(pieces: list[str], finish: FinishReason = FinishReason.STOP) -> list[TokenDelta]:
    return [
        TokenDelta("r", [i], text, finish_reason=finish if i == len(pieces) - 1 else None)
        for i, text in enumerate(pieces)
    ]


def full(
    builder: ChoiceBuilder, pieces: list[str], finish: FinishReason = FinishReason.STOP
) -> ChatCompletion:
    for d in deltas(pieces, finish):
        builder.add(d)
    body: dict[str, Any] = {**ENVELOPE, "object": "chat.completion", "choices": [builder.full_choice(0)]}
    return ChatCompletion.model_validate(body)


def stream(builder: ChoiceBuilder, pieces: list[str]) -> list[ChatCompletionChunk]:
    chunks = []
    for d in deltas(pieces):
        body = {**ENVELOPE, "object": "chat.completion.chunk", "choices": [builder.stream_choice(0, d)]}
        chunks.append(ChatCompletionChunk.model_validate(body))
    return chunks


def test_named_tool_call_full_and_streamed() -> None:
    pieces = ['{"city"', ': "Oslo', '"}']
    out = full(ChoiceBuilder("chat", None, False, ToolCalls("named", "get_weather")), pieces)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')

    builder = ChoiceBuilder("chat", None, False, ToolCalls("named", "get_weather"))
    chunks = stream(builder, pieces)
    calls = [c.choices[0].delta.tool_calls for c in chunks]
    assert all(c is not None and len(c) == 1 and c[0].index == 0 for c in calls)
    head = calls[0][0]  # type: ignore[index]
    assert (head.id, head.type, head.function.name) == (builder.call_id, "function", "get_weather")  # type: ignore[union-attr]
    assert [c[0].function.arguments for c in calls] == pieces  # type: ignore[index, union-attr]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, "tool_calls"]
    assert all(c.choices[0].delta.content is None for c in chunks)


def test_required_tool_calls_are_parsed_once_complete() -> None:
    text = json.dumps([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}])
    pieces = [text[:10], text[10:]]
    out = full(ChoiceBuilder("chat", None, False, ToolCalls("required")), pieces)
    calls = out.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert len({c.id for c in calls}) == 2 and out.choices[0].finish_reason == "tool_calls"

    chunks = stream(ChoiceBuilder("chat", None, False, ToolCalls("required")), pieces)
    assert chunks[0].choices[0].delta.tool_calls is None and chunks[0].choices[0].delta.content is None
    last = chunks[-1].choices[0]
    assert [(c.index, c.function.name) for c in last.delta.tool_calls or []] == [(0, "a"), (1, "b")]  # type: ignore[union-attr]
    assert last.finish_reason == "tool_calls"


def test_output_cut_short_falls_back_to_content() -> None:
    out = full(
        ChoiceBuilder("chat", None, False, ToolCalls("named", "f")), ['{"city": "Os'], FinishReason.LENGTH
    )
    assert out.choices[0].message.content == '{"city": "Os' and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "length"
    chunks = stream(ChoiceBuilder("chat", None, False, ToolCalls("required")), ['[{"name": "a"'])
    assert (
        chunks[-1].choices[0].delta.content == '[{"name": "a"'
        and chunks[-1].choices[0].finish_reason == "stop"
    )
