"""tool_choice "auto" (vLLM's ``--enable-auto-tool-choice --tool-call-parser``): the parsers of
``cluster/http/tool_parsers.py`` on their own, and the edge over a scripted router (the model's text is
a fixture) answering with ``tool_calls``, streamed and not, for every parser; the ``openai`` client's
tools example with tool_choice left out; the flags' checks; and the 400 of a server without the flag."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.config import TOOL_CALL_PARSERS, ServerConfig
from cluster.http.app import create_app
from cluster.http.tool_parsers import PARSERS, IdFactory, create_tool_parser
from cluster.protocol import FinishReason, GenerateRequest, TokenDelta
from deploy.cli import build_parser, main
from deploy.cli_args import build_config
from tests.support.stub_router import NUM_SPECIAL, ServerThread, StubRouter, make_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
MESSAGES = [{"role": "user", "content": "w20 w21"}]
WEATHER = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
NOOP = {"name": "noop", "arguments": "{}"}
ID_PATTERNS = {
    "hermes": r"chatcmpl-tool-[0-9a-f]{32}",
    "qwen": r"chatcmpl-tool-[0-9a-f]{32}",
    "llama3_json": r"chatcmpl-tool-[0-9a-f]{32}",
    "mistral": r"[A-Za-z0-9]{9}",
}


@dataclass(frozen=True)
class Case:
    """A model output (its text deltas), what the answer holds, and the stream's chunk deltas after the
    role chunk (call ids as "ID")."""

    parser: str
    pieces: list[str]
    content: str | None
    calls: list[dict[str, str]]
    deltas: list[dict[str, Any]]


def _entry(index: int, function: dict[str, str]) -> dict[str, Any]:
    return {"index": index, "id": "ID", "type": "function", "function": function}


HERMES_ONE = [
    "Let me check.",
    "\n<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Oslo"}}\n</tool_call>',
]
HERMES_TWO = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
    '<tool_call>\n{"name": "noop", "arguments": {}}\n',
    "</tool_call>",
]
HERMES_DELTAS_ONE: list[dict[str, Any]] = [
    {"content": "Let me check."},
    {"content": "\n"},
    {},
    {"tool_calls": [_entry(0, WEATHER)]},
]
HERMES_DELTAS_TWO: list[dict[str, Any]] = [
    {"tool_calls": [_entry(0, WEATHER)]},
    {},
    {"tool_calls": [_entry(1, NOOP)]},
]
CASES = [
    Case("hermes", HERMES_ONE, "Let me check.\n", [WEATHER], HERMES_DELTAS_ONE),
    Case("hermes", HERMES_TWO, None, [WEATHER, NOOP], HERMES_DELTAS_TWO),
    Case("qwen", HERMES_ONE, "Let me check.\n", [WEATHER], HERMES_DELTAS_ONE),
    Case("qwen", HERMES_TWO, None, [WEATHER, NOOP], HERMES_DELTAS_TWO),
    Case(
        "llama3_json",
        ["<|python_tag|>", '{"name": "get_weather", "parameters": ', '{"city": "Oslo"}}'],
        None,
        [WEATHER],
        [{}, {}, {"tool_calls": [_entry(0, WEATHER)]}],
    ),
    Case(
        "llama3_json",
        [
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            "; ",
            '{"name": "noop", "parameters": {}}',
        ],
        None,
        [WEATHER, NOOP],
        [{"tool_calls": [_entry(0, WEATHER)]}, {}, {"tool_calls": [_entry(1, NOOP)]}],
    ),
    Case(
        "mistral",
        ["Checking. ", "[TOOL_", 'CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'],
        "Checking. ",
        [WEATHER],
        [{"content": "Checking. "}, {}, {"tool_calls": [_entry(0, WEATHER)]}],
    ),
    Case(
        "mistral",
        ["[TOOL_CALLS]get_weather", '[ARGS]{"city": "Oslo"}', "[TOOL_CALLS]noop[ARGS]{}"],
        None,
        [WEATHER, NOOP],
        [{}, {"tool_calls": [_entry(0, WEATHER)]}, {"tool_calls": [_entry(1, NOOP)]}],
    ),
]
# text that is no call: it all stays content, streamed or not
MALFORMED = [
    ("hermes", ['Sure: <tool_call>{"name": "get_weather", "arguments": {"city": }}', "</tool_call>"]),
    ("qwen", ['<tool_call>{"name": "get_weather"}</tool_call>', " done"]),  # no arguments
    ("llama3_json", ["I will call ", '{"name": "get_weather", "parameters": {"city": "Oslo"}}']),
    ("llama3_json", ['{"name": "get_weather", "parameters": {"city": "Oslo"}']),  # never closed
    ("mistral", ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}']),  # never closed
    ("mistral", ["[TOOL_CALLS]get_weather", " is what I would call"]),
]


class ScriptedRouter(StubRouter):
    """The stub router answering every request with ``script`` (the model's text): one delta per piece,
    the last one finishing with ``finish``."""

    def __init__(self) -> None:
        super().__init__()
        self.paced = True  # NOTE: a chunk per piece, as the cases spell them
        self.script: list[str] = []
        self.finish = FinishReason.STOP

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.calls.append(req)
        for k, text in enumerate(self.script):
            await asyncio.sleep(0)
            finish = self.finish if k == len(self.script) - 1 else None
            yield TokenDelta(req.request_id, [NUM_SPECIAL + k], text, finish_reason=finish)


@pytest.fixture(scope="module")
def router() -> ScriptedRouter:
    return ScriptedRouter()


@pytest.fixture(scope="module")
def servers(router: ScriptedRouter) -> Iterator[dict[str | None, ServerThread]]:
    """A server per parser, and one (None) started without --enable-auto-tool-choice."""
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(
                ServerThread(
                    create_app(
                        router,
                        make_tokenizer(),
                        ServerConfig(enable_auto_tool_choice=name is not None, tool_call_parser=name),
                        structured_outputs=True,
                    )
                )
            )
            for name in (*TOOL_CALL_PARSERS, None)
        }


@pytest.fixture
def scripted(router: ScriptedRouter) -> Iterator[ScriptedRouter]:
    router.calls.clear()
    router.script, router.finish = [], FinishReason.STOP
    yield router


def _chat(server: ServerThread, **fields: Any) -> httpx.Response:
    body = {"model": "stub-model", "messages": MESSAGES, "tools": TOOLS, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)


def _full(server: ServerThread, parser: str) -> ChatCompletion:
    r = _chat(server)
    assert r.status_code == 200, r.text
    out = ChatCompletion.model_validate(r.json())
    for call in out.choices[0].message.tool_calls or []:
        assert re.fullmatch(ID_PATTERNS[parser], call.id), call.id
    return out


def _streamed(server: ServerThread, parser: str) -> tuple[list[dict[str, Any]], list[str | None]]:
    """The chunk deltas after the role chunk (call ids checked, then replaced by "ID") and the finish
    reasons of every chunk."""
    r = _chat(server, stream=True)
    assert r.status_code == 200, r.text
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas: list[dict[str, Any]] = []
    finishes: list[str | None] = []
    ids: list[str] = []
    for chunk in chunks:
        (choice,) = chunk.choices
        finishes.append(choice.finish_reason)
        delta = json.loads(chunk.choices[0].delta.model_dump_json(exclude_unset=True))
        for call in delta.get("tool_calls", []):
            assert re.fullmatch(ID_PATTERNS[parser], call["id"]), call
            ids.append(call["id"])
            call["id"] = "ID"
        deltas.append(delta)
    assert len(set(ids)) == len(ids)
    return deltas[1:], finishes


def _calls(tool_calls: Any) -> list[dict[str, str]]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in tool_calls or []]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}-{len(c.calls)}" for c in CASES])
def test_auto_tool_calls_full_and_streamed(
    scripted: ScriptedRouter, servers: dict[str | None, ServerThread], case: Case
) -> None:
    scripted.script = case.pieces
    out = _full(servers[case.parser], case.parser)
    (choice,) = out.choices
    assert (choice.message.content, _calls(choice.message.tool_calls)) == (case.content, case.calls)
    assert choice.finish_reason == "tool_calls"
    # the request ran unconstrained; the parser's markers are kept in the text where they are special
    params = scripted.calls[-1].params
    assert params.structured is None
    assert params.skip_special_tokens == (case.parser == "llama3_json")

    deltas, finishes = _streamed(servers[case.parser], case.parser)
    assert deltas == case.deltas
    assert finishes == [None] * len(case.pieces) + ["tool_calls"]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c["function"] for d in deltas for c in d.get("tool_calls", [])]
    assert (content, calls) == (case.content or "", case.calls)


@pytest.mark.parametrize(
    ("parser", "pieces"), MALFORMED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(MALFORMED)]
)
def test_text_that_is_no_call_stays_content(
    scripted: ScriptedRouter, servers: dict[str | None, ServerThread], parser: str, pieces: list[str]
) -> None:
    scripted.script = pieces
    (choice,) = _full(servers[parser], parser).choices
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        "".join(pieces),
        None,
        "stop",
    )
    deltas, finishes = _streamed(servers[parser], parser)
    assert all("tool_calls" not in d for d in deltas) and finishes[-1] == "stop"
    assert "".join(d.get("content", "") for d in deltas) == "".join(pieces)


def test_a_call_before_max_tokens_cut_the_text_finishes_as_tool_calls(
    scripted: ScriptedRouter, servers: dict[str | None, ServerThread]
) -> None:
    """vLLM's: calls found make the finish "tool_calls" even when max_tokens cut the rest short."""
    scripted.script = [HERMES_TWO[0], '<tool_call>\n{"name": "noop", "argu']
    scripted.finish = FinishReason.LENGTH
    (choice,) = _full(servers["hermes"], "hermes").choices
    assert (choice.message.content, _calls(choice.message.tool_calls), choice.finish_reason) == (
        '\n<tool_call>\n{"name": "noop", "argu',  # NOTE: text after a call: kept whole
        [WEATHER],
        "tool_calls",
    )


def test_none_required_and_named_are_unchanged_with_the_flag(
    scripted: ScriptedRouter, servers: dict[str | None, ServerThread]
) -> None:
    scripted.script = HERMES_TWO
    r = _chat(servers["hermes"], tool_choice="none")
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "".join(HERMES_TWO)}
    assert scripted.calls[-1].params.skip_special_tokens is True
    scripted.script = ['{"city": "Oslo"}']
    named = _chat(servers["hermes"], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    scripted.script = ['[{"name": "noop", "parameters": {}}]']
    required = _chat(servers["hermes"], tool_choice="required")
    for r, call in ((named, WEATHER), (required, NOOP)):
        (choice,) = ChatCompletion.model_validate(r.json()).choices
        assert (choice.message.content, _calls(choice.message.tool_calls)) == (None, [call])
        assert choice.message.tool_calls is not None and choice.message.tool_calls[0].id.startswith("call_")


TOOLS_EXAMPLE = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "City and state, e.g., 'San Francisco, CA'",
                    },
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location", "unit"],
            },
        },
    }
]
EXAMPLE_ARGUMENTS = {"location": "San Francisco, CA", "unit": "fahrenheit"}


def test_openai_client_tools_example_with_tool_choice_left_out(
    scripted: ScriptedRouter, servers: dict[str | None, ServerThread]
) -> None:
    scripted.script = [
        "<tool_call>\n",
        json.dumps({"name": "get_weather", "arguments": EXAMPLE_ARGUMENTS}),
        "\n</tool_call>",
    ]
    client = openai.OpenAI(base_url=f"{servers['hermes'].url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "What's the weather like in San Francisco?"}]
    tools: Any = TOOLS_EXAMPLE
    response = client.chat.completions.create(model="stub-model", messages=messages, tools=tools)
    (call,) = response.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == EXAMPLE_ARGUMENTS  # type: ignore[union-attr]
    assert response.choices[0].finish_reason == "tool_calls"

    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState(input_tools=tools)
    for chunk in client.chat.completions.create(
        model="stub-model", messages=messages, tools=tools, stream=True
    ):
        state.handle_chunk(chunk)
    (choice,) = state.get_final_completion().choices
    (streamed,) = choice.message.tool_calls or []
    assert streamed.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(streamed.function.arguments) == EXAMPLE_ARGUMENTS  # type: ignore[union-attr]
    # NOTE: "" from the role chunk's content, as vLLM streams it
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""

    plain = openai.OpenAI(base_url=f"{servers[None].url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        plain.chat.completions.create(model="stub-model", messages=messages, tools=tools)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in error["message"]


def _counter() -> IdFactory:
    count = itertools.count()
    return lambda: f"call-{next(count)}"


def test_parsers_stream_exactly_what_they_extract_however_the_text_is_cut() -> None:
    """Each parser's deltas, cut at 200 seeded random places per text, add up to ``extract``'s answer."""
    texts = {name: [c.pieces for c in CASES if c.parser == name] for name in TOOL_CALL_PARSERS}
    for name, pieces in MALFORMED:
        texts[name].append(pieces)
    texts["mistral"].append(
        ['[TOOL_CALLS][{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]']
    )
    texts["mistral"].append(['[TOOL_CALLS]a{"x": 1}\n[TOOL_CALLS]b{}'])
    rng = random.Random(0)
    for name, outputs in texts.items():
        for text in ("".join(pieces) for pieces in outputs):
            content, calls = create_tool_parser(name, _counter()).extract(text)
            expected = (content or "", [{"index": i, **c} for i, c in enumerate(calls)])
            for _ in range(200):
                cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 6)))
                parser = create_tool_parser(name, _counter())
                got_content, got_calls = "", []
                for a, b in itertools.pairwise([0, *cuts, len(text)]):
                    step = parser.feed(text[a:b], final=b == len(text))
                    got_content += step.content
                    got_calls += step.tool_calls
                assert (got_content, got_calls) == expected, (name, text, cuts)


def test_parser_answers_with_injected_ids() -> None:
    content, calls = create_tool_parser("mistral", _counter()).extract(
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": "ü"}}, {"name": "b", "arguments": {}}]'
    )
    assert (content, calls) == (
        None,
        [
            {"id": "call-0", "type": "function", "function": {"name": "a", "arguments": '{"x": "ü"}'}},
            {"id": "call-1", "type": "function", "function": {"name": "b", "arguments": "{}"}},
        ],
    )
    text = '{"name": "say", "parameters": {"text": "a \\"}\\" b"}}'  # an escaped quote before a brace
    assert create_tool_parser("llama3_json", _counter()).extract(text) == (
        None,
        [
            {
                "id": "call-0",
                "type": "function",
                "function": {"name": "say", "arguments": '{"text": "a \\"}\\" b"}'},
            }
        ],
    )
    assert create_tool_parser("hermes").extract("no calls here") == ("no calls here", [])
    assert create_tool_parser("llama3_json").extract(" \n") == (" \n", [])
    assert sorted(PARSERS) == sorted(TOOL_CALL_PARSERS)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        create_tool_parser("pythonic")
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        create_app(
            StubRouter(),
            make_tokenizer(),
            ServerConfig(enable_auto_tool_choice=True, tool_call_parser="pythonic"),
        )


def test_flags_and_their_checks(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "qwen"])
    server = build_config(args).server
    assert (server.enable_auto_tool_choice, server.tool_call_parser) == (True, "qwen")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        assert main(["serve", "--tool-call-parser", "pythonic"]) == 2
        assert main(["serve", "--enable-auto-tool-choice"]) == 2
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err.strip().splitlines()
    parsers = "('hermes', 'llama3_json', 'mistral', 'qwen')"
    assert len(err) == 2
    assert err[0].endswith(
        f" ERROR pdserve: server.tool_call_parser must be one of {parsers}, got 'pythonic'"
    )
    assert err[1].endswith(
        " ERROR pdserve: server.enable_auto_tool_choice needs tool_call_parser: --enable-auto-tool-choice "
        f"needs --tool-call-parser (one of {parsers})"
    )
