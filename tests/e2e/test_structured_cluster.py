"""Structured outputs and tool calls end to end, through the official ``openai`` client, on a live local
cluster in each mode (colocated: one worker masks every token; disaggregated, with asynchronous
scheduling: the prefill worker masks the first token and the decode worker advances its matcher over it,
then masks the rest). Seeded, temperature 1.0, the bundled model; every test ends with the leak check
(matchers included).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from deploy.http_host import HttpServerHandle, start_http
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import cluster_config
from tests.support.schema_gen import random_schema
from workers.engine import BUNDLED_MODEL

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
MAX_TOKENS = 256  # the longest of the 20 seeded outputs is about half of it
SCHEMAS = [random_schema(seed) for seed in range(20)]
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
PARAMETERS = {"get_weather": WEATHER, "set_alarm": ALARM}
# NOTE: the disaggregated workers also schedule asynchronously (a constrained step samples after the
# previous step's tokens are back); tests/workers/test_structured_engine.py compares that with synchronous.
MODES = {
    "colocated": {"router": {"mode": "colocated"}, "colocated": {"num_workers": 1}},
    "disaggregated": {"engine": {"async_scheduling": True}},
}


@pytest.fixture(scope="module", params=sorted(MODES))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    handle = build_cluster(cluster_config(BUNDLED_MODEL, **MODES[request.param]))
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Iterator[HttpServerHandle]:
    with start_http(cluster) as server:
        yield server


def client(http: HttpServerHandle) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=300)


def assert_quiet(cluster: Cluster) -> None:
    cluster.wait_until_quiet(timeout_s=60)
    assert set(cluster.check_leaks().values()) == {None}


async def _schema_chat(oai: openai.AsyncOpenAI, index: int, stream: bool) -> tuple[str, str | None]:
    """(text, finish_reason) of schema ``index`` asked as a chat with ``response_format``."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": 100 + index,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"s{index}", "schema": SCHEMAS[index]},
        },
    }
    if not stream:
        out = await oai.chat.completions.create(**kwargs)
        return out.choices[0].message.content or "", out.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await oai.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_random_schemas_validate_streamed_and_not(cluster: Cluster, http: HttpServerHandle) -> None:
    async def main() -> list[tuple[str, str | None]]:
        async with client(http) as oai:
            jobs = [_schema_chat(oai, i, stream) for stream in (False, True) for i in range(len(SCHEMAS))]
            return list(await asyncio.gather(*jobs))

    results = asyncio.run(main())
    whole, streamed = results[: len(SCHEMAS)], results[len(SCHEMAS) :]
    for i, schema in enumerate(SCHEMAS):
        text, finish = whole[i]
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
        assert streamed[i] == whole[i], i  # the same seed: the same tokens, streamed or not
    assert_quiet(cluster)


def test_choice_regex_and_json_on_completions(cluster: Cluster, http: HttpServerHandle) -> None:
    choices = ["positive", "negative", "neutral"]
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"

    async def main() -> list[Any]:
        async with client(http) as oai:
            common: dict[str, Any] = {
                "model": MODEL,
                "prompt": "The answer is",
                "max_tokens": 32,
                "temperature": 1.0,
            }
            jobs = [
                *(
                    oai.completions.create(**common, seed=s, extra_body={"guided_choice": choices})
                    for s in range(6)
                ),
                oai.completions.create(**common, seed=1, extra_body={"guided_regex": regex}),
                oai.completions.create(
                    **{**common, "max_tokens": MAX_TOKENS},
                    seed=2,
                    extra_body={"structured_outputs": {"json": SCHEMAS[5]}},
                ),
            ]
            return list(await asyncio.gather(*jobs))

    *picked, matched, as_json = asyncio.run(main())
    assert all(p.choices[0].finish_reason == "stop" for p in [*picked, matched, as_json])
    assert {p.choices[0].text for p in picked} <= set(choices)
    assert re.fullmatch(regex, matched.choices[0].text)
    jsonschema.validate(json.loads(as_json.choices[0].text), SCHEMAS[5])
    assert_quiet(cluster)


def test_tool_choice_named_and_required(cluster: Cluster, http: HttpServerHandle) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask: list[Any] = [{"role": "user", "content": "Weather in Oslo, and wake me at 7."}]

    async def main() -> tuple[list[Any], list[Any], str]:
        async with client(http) as oai:
            common: dict[str, Any] = {
                "model": MODEL,
                "messages": ask,
                "tools": TOOLS,
                "max_tokens": MAX_TOKENS,
            }
            forced = [oai.chat.completions.create(**common, tool_choice=named, seed=s) for s in range(4)]
            required = [
                oai.chat.completions.create(
                    **common, tool_choice="required", parallel_tool_calls=False, seed=s
                )
                for s in range(4)
            ]
            outs = await asyncio.gather(*forced, *required)
            arguments = ""
            async for chunk in await oai.chat.completions.create(
                **common, tool_choice=named, seed=9, stream=True
            ):
                for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    arguments += call.function.arguments if call.function and call.function.arguments else ""
            return list(outs[:4]), list(outs[4:]), arguments

    forced, required, streamed_arguments = asyncio.run(main())
    for out in forced:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    jsonschema.validate(json.loads(streamed_arguments), WEATHER)
    for out in required:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        # NOTE: one call (parallel_tool_calls false): an unbounded list at temperature 1.0 may not end.
        assert isinstance(calls, list) and len(calls) == 1
        jsonschema.validate(json.loads(calls[0].function.arguments), PARAMETERS[calls[0].function.name])
    assert_quiet(cluster)


def test_a_spec_the_worker_cannot_compile_is_a_400(cluster: Cluster, http: HttpServerHandle) -> None:
    async def main() -> None:
        async with client(http) as oai:
            with pytest.raises(openai.BadRequestError, match="invalid regex for structured output"):
                await oai.completions.create(
                    model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(unclosed"}
                )
            out = await oai.completions.create(
                model=MODEL, prompt="x", max_tokens=8, seed=0, extra_body={"guided_choice": ["a", "b"]}
            )
            assert out.choices[0].text in ("a", "b")

    asyncio.run(main())
    assert_quiet(cluster)
