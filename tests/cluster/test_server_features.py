"""The HTTP edge's vLLM-style features against the stub router: /tokenize, /detokenize, /version,
Retry-After, OpenAI's context_length_exceeded, structured-output and tool fields parsed into the spec the
workers get, unsupported fields refused by name, and the chat template's tools / tool_calls / kwargs."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from cluster import __version__
from cluster.config import ServerConfig
from cluster.http.app import create_app
from cluster.http.output_constraints import UNSUPPORTED
from cluster.protocol import StructuredOutput
from cluster.tokenizer import Tokenizer
from tests.support.stub_router import ServerThread, StubRouter, make_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }};{% endif %}"
    "{% if enable_thinking is defined %}THINK={{ enable_thinking }};{% endif %}"
    "{% for m in messages %}{{ m.role }}:"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.id }} {{ c.function.name }}"
    "{{ c.function.arguments | tojson(separators=(',', ':'), sort_keys=True) }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ m.content or '' }}|{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "w20 w21"}]


class RecordingTokenizer(Tokenizer):
    """The stub's tokenizer with a tool-aware template; remembers every rendered prompt."""

    def __init__(self) -> None:
        base = make_tokenizer()
        super().__init__(base.backend, base.bos_token, base.eos_token, TOOL_TEMPLATE)
        self.rendered: list[str] = []

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        text = super().apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        self.rendered.append(text)
        return text


@pytest.fixture(scope="module")
def router() -> StubRouter:
    return StubRouter(max_model_len=128)


@pytest.fixture(scope="module")
def tok() -> RecordingTokenizer:
    return RecordingTokenizer()


@pytest.fixture(scope="module")
def server(router: StubRouter, tok: RecordingTokenizer) -> Iterator[ServerThread]:
    with ServerThread(create_app(router, tok, ServerConfig(api_key="k"), structured_outputs=True)) as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(router: StubRouter) -> Iterator[ServerThread]:
    with ServerThread(create_app(router, make_tokenizer())) as s:
        yield s


@pytest.fixture
def stub(router: StubRouter) -> Iterator[StubRouter]:
    router.calls.clear()
    router.behavior, router.healthy = None, True
    yield router
    router.behavior, router.healthy = None, True


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": "Bearer k"}, timeout=30)


def chat(server: ServerThread, **fields: Any) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, **fields})


def test_version(plain_server: ServerThread) -> None:
    assert httpx.get(f"{plain_server.url}/version").json() == {"version": __version__}


def test_tokenize_and_detokenize(stub: StubRouter, server: ServerThread, tok: RecordingTokenizer) -> None:
    r = post(server, "/tokenize", {"prompt": "w10 w11 w12", "return_token_strs": True})
    assert r.json() == {
        "count": 3,
        "max_model_len": 128,
        "tokens": [10, 11, 12],
        "token_strs": ["w10", "w11", "w12"],
    }
    r = post(server, "/tokenize", {"prompt": "w10 w11", "add_special_tokens": False})
    assert r.json()["tokens"] == [10, 11] and r.json()["token_strs"] is None
    r = post(server, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}})
    assert tok.rendered[-1] == "THINK=False;user:w20 w21|"
    assert r.json()["tokens"] == tok.encode(tok.rendered[-1], add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": [1, 10, 11]}).json() == {"prompt": "<s> w10 w11"}
    bad = post(server, "/tokenize", {"prompt": "w1", "messages": MESSAGES})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    bad = post(server, "/detokenize", {"tokens": [512]})
    assert bad.status_code == 400 and "outside the vocabulary [0, 512)" in bad.json()["error"]["message"]
    assert post(server, "/detokenize", {"tokens": [1], "model": "nope"}).status_code == 404
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "w1"}).status_code == 401
    assert stub.calls == []


def test_retry_after_on_429_and_503(stub: StubRouter, plain_server: ServerThread) -> None:
    for behavior, status in (("queue_full", 429), ("unavailable", 503)):
        stub.behavior = behavior
        r = httpx.post(f"{plain_server.url}/v1/completions", json={"prompt": [6, 7]})
        assert (r.status_code, r.headers.get("retry-after")) == (status, "1")
    stub.behavior, stub.healthy = None, False
    r = httpx.get(f"{plain_server.url}/health")
    assert (r.status_code, r.headers.get("retry-after")) == (503, "1")
    stub.healthy = True
    bad = httpx.post(f"{plain_server.url}/v1/completions", json={"prompt": [6], "max_tokens": 0})
    assert bad.status_code == 400 and "retry-after" not in bad.headers


def test_chat_context_overflow_uses_openai_wording(stub: StubRouter, plain_server: ServerThread) -> None:
    prompt_len = len(make_tokenizer().encode_chat(MESSAGES))
    r = httpx.post(f"{plain_server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 125})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": f"This model's maximum context length is 128 tokens. However, you requested "
        f"{prompt_len + 125} tokens ({prompt_len} in the messages, 125 in the completion). Please reduce the "
        "length of the messages or completion.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert stub.calls == []


NOT_NEUTRAL: dict[str, Any] = {
    "guided_whitespace_pattern": " ",
    "spaces_between_special_tokens": False,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "truncate_prompt_tokens": 4,
    "lora_request": {"name": "x"},
    "logits_processors": ["x"],
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "x"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "chat_template": "{{ messages }}",
    "documents": [{"text": "x"}],
    "continue_final_message": True,
    "mm_processor_kwargs": {"x": 1},
}


def test_every_unsupported_field_is_a_400_naming_it(stub: StubRouter, server: ServerThread) -> None:
    assert set(NOT_NEUTRAL) == set(UNSUPPORTED)
    for name, value in NOT_NEUTRAL.items():
        r = chat(server, **{name: value})
        assert r.status_code == 400, name
        assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
    for name, neutral in UNSUPPORTED.items():
        assert chat(server, **{name: neutral[-1]}).status_code == 200, name
    assert stub.calls and len(stub.calls) == len(UNSUPPORTED)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA, sort_keys=True)
STRUCTURED: list[tuple[dict[str, Any], StructuredOutput | None]] = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
        StructuredOutput("json", SCHEMA_TEXT),
    ),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutput("json", SCHEMA_TEXT)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json", SCHEMA_TEXT)),
    ({"guided_regex": "[ab]+"}, StructuredOutput("regex", "[ab]+")),
    ({"guided_choice": ["yes", "no", "yes"]}, StructuredOutput("choice", choices=["yes", "no"])),
    (
        {"guided_grammar": 'root ::= "x"', "guided_decoding_backend": "xgrammar"},
        StructuredOutput("grammar", 'root ::= "x"'),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", SCHEMA_TEXT)),
    ({"structured_outputs": {"choice": ["a"]}}, StructuredOutput("choice", choices=["a"])),
    (
        {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
        StructuredOutput("regex", "a+"),
    ),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
]


@pytest.mark.parametrize(("fields", "expected"), STRUCTURED, ids=[json.dumps(f)[:50] for f, _ in STRUCTURED])
def test_structured_fields_reach_the_router_as_one_spec(
    stub: StubRouter, server: ServerThread, fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    assert chat(server, **fields).status_code == 200
    completion = post(server, "/v1/completions", {"prompt": "w10", "max_tokens": 2, **fields})
    assert completion.status_code == 200
    assert [c.params.structured for c in stub.calls] == [expected, expected]


BAD_STRUCTURED: list[tuple[dict[str, Any], str, str]] = [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "give at most one of"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be text, json_object or json_schema"),
    (
        {"response_format": {"type": "json_schema"}},
        "response_format",
        "json_schema must be an object with a schema",
    ),
    ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
    ({"guided_json": [1]}, "guided_json", "must be a JSON schema object"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    (
        {"structured_outputs": {"structural_tag": {"x": 1}}},
        "structured_outputs",
        "structural_tag is not supported",
    ),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs", "unknown key(s) ['yaml']"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_STRUCTURED, ids=[b[2] for b in BAD_STRUCTURED])
def test_bad_structured_fields_are_400s(
    stub: StubRouter, server: ServerThread, fields: dict[str, Any], param: str, words: str
) -> None:
    r = chat(server, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert words in r.json()["error"]["message"]
    assert stub.calls == []


def test_structured_outputs_are_refused_while_the_workers_cannot_mask(
    stub: StubRouter, plain_server: ServerThread
) -> None:
    r = httpx.post(
        f"{plain_server.url}/v1/chat/completions",
        json={"messages": MESSAGES, "response_format": {"type": "json_object"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "not enabled on this server" in r.json()["error"]["message"] and stub.calls == []


def test_tool_choice_named_and_required_constrain_the_output(
    stub: StubRouter, server: ServerThread, tok: RecordingTokenizer
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(server, tools=TOOLS, tool_choice=named).status_code == 200
    assert tok.rendered[-1] == "TOOLS=get_weather,noop;user:w20 w21|"
    spec = stub.calls[-1].params.structured
    assert spec == StructuredOutput("json", json.dumps(TOOLS[0]["function"]["parameters"], sort_keys=True))
    assert chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).status_code == 200
    spec = stub.calls[-1].params.structured
    assert spec is not None and spec.kind == "json"
    schema = json.loads(spec.spec)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    names = [branch["properties"]["name"]["enum"] for branch in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["noop"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert chat(server, tools=TOOLS, tool_choice="none").status_code == 200
    assert stub.calls[-1].params.structured is None and tok.rendered[-1].startswith("TOOLS=get_weather,noop;")


BAD_TOOLS: list[tuple[dict[str, Any], str, str]] = [
    (
        {"tools": TOOLS},
        "tool_choice",
        'tool_choice "auto" (the default when tools are given) is not supported',
    ),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "no parser for free-text tool calls"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
        "not in tools",
    ),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", 'must be "function"'),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "duplicate function names"),
    (
        {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
        "tool_choice",
        "both constrain the output",
    ),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set ['messages']"),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_TOOLS, ids=[b[2][:30] for b in BAD_TOOLS])
def test_bad_tool_fields_are_400s(
    stub: StubRouter, server: ServerThread, fields: dict[str, Any], param: str, words: str
) -> None:
    r = chat(server, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert words in r.json()["error"]["message"]
    assert stub.calls == []


def test_tool_messages_and_template_kwargs_reach_the_template(
    stub: StubRouter, server: ServerThread, tok: RecordingTokenizer
) -> None:
    messages = [
        {"role": "user", "content": "w1"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "w2"},
    ]
    r = post(
        server,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 2,
            "tools": TOOLS,
            "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    assert r.status_code == 200
    assert (
        tok.rendered[-1]
        == 'TOOLS=get_weather,noop;THINK=True;user:w1|assistant:CALL c1 get_weather{"a":1,"city":"Oslo"}|tool:[c1]w2|'
    )
    bad = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "tool_calls": messages[1]["tool_calls"]}]},
    )
    assert bad.status_code == 400 and "only assistant messages carry them" in bad.json()["error"]["message"]


def test_tojson_takes_transformers_arguments() -> None:
    base = make_tokenizer()
    template = (
        "{{ messages[0] | tojson(indent=2, sort_keys=True) }}|{{ messages[0] | tojson(ensure_ascii=True) }}"
    )
    t = Tokenizer(base.backend, chat_template=template)
    text = t.apply_chat_template([{"role": "user", "content": "é<&>"}], add_generation_prompt=False)
    assert text == '{\n  "content": "é<&>",\n  "role": "user"\n}|{"role": "user", "content": "\\u00e9<&>"}'
