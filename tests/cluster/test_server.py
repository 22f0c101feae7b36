"""HTTP front against a stub router: the official openai client for the happy paths, httpx for errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from cluster.config import ServerConfig
from cluster.http.app import create_app
from cluster.protocol import QueueFullError, SamplingParams
from tests.support.stub_router import ServerThread, StubRouter, expected_tokens, make_tokenizer, token_text

TOK = make_tokenizer()
PROMPT = "w10 w11 w12"
PROMPT_IDS = [10, 11, 12]
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "w20 w21"}]
CHAT_IDS = TOK.encode_chat([{"role": "user", "content": "w20 w21"}])


def _expected(prompt_ids: list[int], max_tokens: int, seed: int | None = None) -> list[int]:
    return expected_tokens(prompt_ids, SamplingParams(max_tokens=max_tokens, seed=seed))


def _text(ids: list[int]) -> str:
    return "".join(token_text(t) for t in ids)


@pytest.fixture(scope="module")
def router() -> StubRouter:
    return StubRouter(max_model_len=128)


@pytest.fixture(scope="module")
def server(router: StubRouter) -> Iterator[ServerThread]:
    with ServerThread(create_app(router, TOK)) as s:
        yield s


@pytest.fixture
def stub(router: StubRouter) -> Iterator[StubRouter]:
    router.calls.clear()
    router.aborts.clear()
    router.abort_event.clear()
    router.behavior, router.fail_next = None, []
    yield router
    router.behavior, router.fail_next = None, []


@pytest.fixture
def oai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion_non_streaming(stub: StubRouter, oai: openai.OpenAI) -> None:
    out = oai.completions.create(model="stub-model", prompt=PROMPT, max_tokens=5)
    ids = _expected(PROMPT_IDS, 5)
    assert out.object == "text_completion" and out.model == "stub-model"
    assert [c.text for c in out.choices] == [_text(ids)]
    assert out.choices[0].finish_reason == "length"
    extra = out.choices[0].model_extra or {}
    assert extra["token_ids"] == ids
    assert set(extra["pdserve_timings"]) == {
        "queue_s",
        "prefill_s",
        "transfer_s",
        "decode_s",
        "ttft_s",
        "e2e_s",
        "num_migrations",
        "route",
    }
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)
    assert out.usage.total_tokens == 8
    assert out.usage.prompt_tokens_details is not None and out.usage.prompt_tokens_details.cached_tokens == 0
    assert [c.prompt_token_ids for c in stub.calls] == [PROMPT_IDS]


def test_completion_streaming_token_id_prompt(stub: StubRouter, oai: openai.OpenAI) -> None:
    chunks = list(oai.completions.create(model="stub-model", prompt=[7, 8, 9], max_tokens=4, stream=True))
    ids = _expected([7, 8, 9], 4)
    assert [c.choices[0].text for c in chunks] == [token_text(t) for t in ids]
    assert [(c.choices[0].model_extra or {})["token_ids"] for c in chunks] == [[t] for t in ids]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]
    assert "pdserve_timings" in (chunks[-1].choices[0].model_extra or {})
    assert all(c.usage is None for c in chunks)


def test_chat_non_streaming_and_streaming_with_usage(stub: StubRouter, oai: openai.OpenAI) -> None:
    ids = _expected(CHAT_IDS, 3)
    out = oai.chat.completions.create(model="stub-model", messages=CHAT, max_completion_tokens=3)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == _text(ids)
    assert stub.calls[0].prompt_token_ids == CHAT_IDS and stub.calls[0].params.max_tokens == 3

    stream = oai.chat.completions.create(
        model="stub-model",
        messages=CHAT,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks[1:-1]) == _text(ids)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(CHAT_IDS), 3)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_default_max_tokens_fills_the_context(stub: StubRouter, oai: openai.OpenAI) -> None:
    oai.chat.completions.create(model="stub-model", messages=CHAT)
    assert stub.calls[0].params.max_tokens == 128 - len(CHAT_IDS)


def test_stop_string_and_sampling_passthrough(stub: StubRouter, oai: openai.OpenAI) -> None:
    oai.completions.create(
        model="stub-model",
        prompt=PROMPT,
        max_tokens=8,
        stop="w5",
        temperature=0.5,
        top_p=0.9,
        seed=3,
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [4]},
    )
    ids = _expected(PROMPT_IDS, 8, seed=3)
    stop = f"w{ids[2]}"
    out = oai.completions.create(model="stub-model", prompt=PROMPT, max_tokens=8, stop=[stop], seed=3)
    assert out.choices[0].text == _text(ids[:2]) + " " and out.choices[0].finish_reason == "stop"
    p = stub.calls[0].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.ignore_eos) == (0.5, 0.9, 5, 0.1, 3, True)
    assert (p.stop, p.stop_token_ids, stub.calls[1].params.stop) == (["w5"], [4], [stop])


def test_n_fans_out_with_derived_ids_and_seeds(stub: StubRouter, oai: openai.OpenAI) -> None:
    out = oai.completions.create(model="stub-model", prompt=PROMPT, max_tokens=3, n=2, seed=5)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [_text(_expected(PROMPT_IDS, 3, s)) for s in (5, 6)]
    assert [c.params.seed for c in sorted(stub.calls, key=lambda c: c.request_id)] == [5, 6]
    assert len({c.request_id for c in stub.calls}) == 2
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 6)
    chunks = list(
        oai.chat.completions.create(model="stub-model", messages=CHAT, max_tokens=2, n=2, stream=True)
    )
    assert sorted(c.choices[0].index for c in chunks) == [0, 0, 0, 1, 1, 1]  # role chunk + 2 tokens each


def test_logprobs_shapes(stub: StubRouter, oai: openai.OpenAI) -> None:
    ids = _expected(PROMPT_IDS, 3)
    out = oai.completions.create(model="stub-model", prompt=PROMPT, max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens == [f"w{t}" for t in ids]
    assert lp.token_logprobs == [-0.25] * 3 and lp.text_offset == [0, 3, 6]
    assert lp.top_logprobs == [{f"w{t}": -0.25, f"w{t + 1}": -0.75} for t in ids]
    assert stub.calls[0].params.logprobs == 2

    chat = oai.chat.completions.create(
        model="stub-model", messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=1
    )
    assert chat.choices[0].logprobs is not None
    content = chat.choices[0].logprobs.content
    assert content is not None and [c.token for c in content] == [f"w{t}" for t in _expected(CHAT_IDS, 2)]
    assert [len(c.top_logprobs) for c in content] == [1, 1] and content[0].bytes == list(
        content[0].token.encode()
    )
    no_lp = oai.chat.completions.create(model="stub-model", messages=CHAT, max_tokens=2)
    assert no_lp.choices[0].logprobs is None and stub.calls[-1].params.logprobs is None


def test_models_health_and_unknown_route(stub: StubRouter, server: ServerThread, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == ["stub-model"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    stub.healthy = False
    try:
        assert httpx.get(f"{server.url}/health").status_code == 503
    finally:
        stub.healthy = True
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


BAD: list[tuple[str, dict[str, Any], int, str, str]] = [
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1, got 0"),
    (
        "completions",
        {"prompt": PROMPT, "max_tokens": 126},
        400,
        "prompt",
        "This model's maximum context length is 128 tokens, however you requested 129 tokens (3 in your "
        "prompt; 126 for the completion). Please reduce your prompt; or completion length.",
    ),
    (
        "completions",
        {"prompt": list(range(6, 140)), "max_tokens": 1},
        400,
        "prompt",
        "This model's maximum context length is 128 tokens. However, your prompt resulted in 134 tokens.",
    ),
    ("completions", {"prompt": [5, 512]}, 400, "prompt", "token id 512 is outside the vocabulary [0, 512)"),
    ("completions", {"prompt": [5, -1]}, 400, "prompt", "token id -1 is outside the vocabulary"),
    ("completions", {"prompt": ""}, 400, "prompt", "prompt must not be empty"),
    ("completions", {"prompt": []}, 400, "prompt", "prompt must not be empty"),
    ("completions", {"prompt": [1.5]}, 400, "prompt", "prompt must be a string, a list of token ids"),
    (
        "completions",
        {"prompt": PROMPT, "temperature": -0.1},
        400,
        "temperature",
        "temperature must be >= 0, got -0.1",
    ),
    ("completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1], got 0"),
    ("completions", {"prompt": PROMPT, "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1], got 1.5"),
    ("completions", {"prompt": PROMPT, "top_k": -2}, 400, "top_k", "top_k must be -1, 0 (disabled) or >= 1"),
    ("completions", {"prompt": PROMPT, "min_p": 2}, 400, "min_p", "min_p must be in [0, 1], got 2"),
    ("completions", {"prompt": PROMPT, "n": 0}, 400, "n", "n must be in [1, 16], got 0"),
    ("completions", {"prompt": PROMPT, "n": 17}, 400, "n", "n must be in [1, 16], got 17"),
    (
        "completions",
        {"prompt": PROMPT, "logprobs": 21},
        400,
        "logprobs",
        "logprobs must be in [0, 20], got 21",
    ),
    (
        "completions",
        {"prompt": PROMPT, "stop_token_ids": [600]},
        400,
        "stop_token_ids",
        "outside the vocabulary",
    ),
    (
        "completions",
        {"prompt": PROMPT, "max_tokens": "ten"},
        400,
        "max_tokens",
        "max_tokens: Input should be a valid integer",
    ),
    ("completions", {"prompt": PROMPT, "timeout": 0}, 400, "timeout", "timeout must be > 0 seconds, got 0"),
    (
        "completions",
        {"prompt": PROMPT, "presence_penalty": 3},
        400,
        "presence_penalty",
        "presence_penalty must be in [-2.0, 2.0], got 3.0",
    ),
    (
        "completions",
        {"prompt": PROMPT, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed when stream is true",
    ),
    ("completions", {}, 400, "prompt", "prompt: Field required"),
    ("completions", {"prompt": PROMPT, "model": "gpt-9"}, 404, "model", "model 'gpt-9' does not exist"),
    ("chat/completions", {"messages": []}, 400, "messages", "messages must not be empty"),
    (
        "chat/completions",
        {"messages": CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "max_completion_tokens must be >= 1, got 0",
    ),
    (
        "chat/completions",
        {"messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
        "requires logprobs to be true",
    ),
    (
        "chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
        "top_logprobs must be in [0, 20], got 30",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
        "only text parts are supported",
    ),
    (
        "completions",
        {"prompt": PROMPT, "stop": [f"w{i}" for i in range(17)]},
        400,
        "stop",
        "stop may hold at most 16 strings, got 17",
    ),
    (
        "completions",
        {"prompt": PROMPT, "stop": "x" * 300},
        400,
        "stop",
        "stop strings may be at most 256 characters, got 300",
    ),
    (
        "completions",
        {"prompt": PROMPT, "stop_token_ids": [7] * 257},
        400,
        "stop_token_ids",
        "stop_token_ids may hold at most 256 ids, got 257",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "wizard", "content": "w20"}]},
        400,
        "messages",
        "messages[0].role must be one of ['system', 'user', 'assistant', 'tool', 'developer'], got 'wizard'",
    ),
]

RAW_BAD: list[tuple[bytes, str | None, str]] = [
    (b'{"prompt": "\\ud800"}', "prompt", "prompt contains a lone surrogate"),
    (b'{"prompt": "w1", "stop": ["w2", "\\udfff"]}', "stop", "stop contains a lone surrogate"),
    (b'{"\\ud800": 1, "prompt": "w1"}', "\\ud800", "contains a lone surrogate"),
    (b'{"prompt": "w1 \xed\xa0\x80"}', "prompt", "prompt contains a lone surrogate"),  # its UTF-8 bytes
    (b'{"prompt": "w1", "temperature": NaN}', None, "request body contains NaN, which is not a JSON number"),
    (b'{"prompt": "w1", "timeout": Infinity}', None, "request body contains Infinity"),
    (b'{"prompt": "w1", "top_p": -Infinity}', None, "request body contains -Infinity"),
    (b'{"prompt": "w1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nests deeper than 32 levels"),
    (b'{"prompt": "w1", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "x", "nests deeper than 32 levels"),
    (
        b'{"prompt": "w1", "x": ' + b"[" * 32 + b"]" * 32 + b"}",
        "x",
        "nests deeper than 32 levels",
    ),  # 33 levels
]


@pytest.mark.parametrize(("body", "param", "message"), RAW_BAD, ids=[b[2][:30] for b in RAW_BAD])
def test_bodies_that_are_not_strict_json_are_a_400(
    stub: StubRouter, server: ServerThread, body: bytes, param: str | None, message: str
) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert stub.calls == []
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert ok.status_code == 200 and len(stub.calls) == 1


class _ExplodingTokenizer:
    """A tokenizer with a bug: any text prompt raises something nobody handles."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        raise RuntimeError("tokenizer bug")


def test_an_unexpected_exception_is_a_json_500_and_the_server_keeps_serving(
    stub: StubRouter, router: StubRouter
) -> None:
    tokenizer = _ExplodingTokenizer()
    with ServerThread(create_app(router, tokenizer)) as s:  # type: ignore[arg-type]
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "w1 w2", "max_tokens": 2})
        assert r.status_code == 500
        assert r.json() == {
            "error": {
                "message": "internal error: RuntimeError",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        }
        # NOTE: tokenization ran on the edge's thread pool, never on the event loop
        assert [name.startswith("pdserve-edge") for name in tokenizer.threads] == [True]
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": [6, 7], "max_tokens": 1})
        assert ok.status_code == 200 and stub.calls[-1].prompt_token_ids == [6, 7]


def test_client_deadline_is_capped(stub: StubRouter, router: StubRouter) -> None:
    with ServerThread(create_app(router, TOK, max_timeout_s=5.0)) as s:
        for timeout in (1e9, 2.0):
            sent = time.time()
            body = {"prompt": [6], "max_tokens": 1, "timeout": timeout}
            assert httpx.post(f"{s.url}/v1/completions", json=body).status_code == 200
            deadline = stub.calls[-1].deadline
            assert deadline is not None and sent < deadline <= time.time() + min(timeout, 5.0)
        # no timeout given: the router's own request_timeout_s (the same cap) applies
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": [6], "max_tokens": 1}).status_code == 200
        assert stub.calls[-1].deadline is None


@pytest.mark.parametrize(("route", "body", "status", "param", "message"), BAD, ids=[b[4][:40] for b in BAD])
def test_invalid_input_is_rejected_before_the_router(
    stub: StubRouter,
    server: ServerThread,
    route: str,
    body: dict[str, Any],
    status: int,
    param: str,
    message: str,
) -> None:
    r = httpx.post(f"{server.url}/v1/{route}", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert len(r.content) < 400 and stub.calls == []
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert ok.status_code == 200 and len(stub.calls) == 1


def test_bad_json_and_oversized_body(stub: StubRouter, router: StubRouter) -> None:
    with ServerThread(create_app(router, TOK, ServerConfig(max_body_bytes=256))) as s:
        r = httpx.post(
            f"{s.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        big = json.dumps({"prompt": "w7 " * 200}).encode()
        r = httpx.post(f"{s.url}/v1/completions", content=big)
        assert r.status_code == 413
        assert r.json()["error"]["message"] == f"request body ({len(big)} bytes) exceeds max_body_bytes (256)"

        def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
            yield big[:200]
            yield big[200:]

        r = httpx.post(f"{s.url}/v1/completions", content=chunked())
        assert r.status_code == 413 and "exceeds max_body_bytes (256)" in r.json()["error"]["message"]
        assert stub.calls == []
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": [6], "max_tokens": 1}).status_code == 200


def test_api_key(stub: StubRouter, router: StubRouter) -> None:
    with ServerThread(create_app(router, TOK, ServerConfig(api_key="s3cret"))) as s:
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(s.url + path).status_code == 401
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = httpx.post(
            f"{s.url}/v1/completions", json={"prompt": PROMPT}, headers={"Authorization": "Bearer nope"}
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{s.url}/health").status_code == 200 and stub.calls == []
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="stub-model", prompt=PROMPT, max_tokens=1).choices[0].text


@pytest.mark.parametrize(
    ("behavior", "status", "code"),
    [
        ("queue_full", 429, "queue_full"),
        ("unavailable", 503, "unavailable"),
        ("deadline", 504, "deadline_exceeded"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_router_errors_map_to_status(
    stub: StubRouter, server: ServerThread, behavior: str, status: int, code: str, stream: bool
) -> None:
    stub.behavior = behavior
    before = time.time()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "stream": stream, "timeout": 0.05})
    assert r.status_code == status and r.json()["error"]["code"] == code
    deadline = stub.calls[0].deadline
    assert deadline is not None and before + 0.05 <= deadline <= time.time() + 0.05
    stub.behavior = None
    assert (
        httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code
        == 200
    )


def test_failure_mid_stream_sends_an_error_event(
    stub: StubRouter, server: ServerThread, oai: openai.OpenAI
) -> None:
    stub.behavior = "fail_mid"
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": PROMPT, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and len(events) == 4 and events[-1] == "data: [DONE]"
    assert json.loads(events[2].removeprefix("data: "))["error"]["code"] == "worker_failed"
    with pytest.raises(openai.APIError, match="decode worker decode-0 died"):
        list(oai.completions.create(model="stub-model", prompt=PROMPT, stream=True))


@pytest.mark.parametrize("n", [1, 2])
def test_client_disconnect_mid_stream_aborts(
    stub: StubRouter, server: ServerThread, oai: openai.OpenAI, n: int
) -> None:
    stub.behavior = "hang"
    body = {"prompt": PROMPT, "stream": True, "n": n}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()  # NOTE: keep the iterator: dropping it closes the connection
        first = next(lines)
        assert first.startswith("data: ") and stub.aborts == []
    assert stub.wait_aborts(n, timeout=10)
    assert sorted(stub.aborts) == sorted(c.request_id for c in stub.calls) and len(stub.calls) == n
    stub.behavior = None
    assert (
        oai.completions.create(model="stub-model", prompt=PROMPT, max_tokens=2).choices[0].finish_reason
        == "length"
    )


def test_client_disconnect_before_the_first_token_of_a_stream_aborts(
    stub: StubRouter, server: ServerThread
) -> None:
    """The answer's head waits for the first event (so errors before it keep their status): a client gone
    before it is a 499 and its request is aborted."""

    def num_499() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        (line,) = [x for x in text.splitlines() if 'code="client_disconnected"' in x and "_total{" in x]
        return float(line.rsplit(" ", 1)[1])

    before = num_499()
    stub.behavior = "hang_first"
    body = {"prompt": PROMPT, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    assert stub.abort_event.wait(timeout=10)
    assert stub.aborts == [stub.calls[0].request_id]
    deadline = time.monotonic() + 10
    while num_499() != before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # NOTE: the 499 is counted as the route unwinds, just after the abort
    assert num_499() == before + 1


def test_client_disconnect_while_not_streaming_aborts(stub: StubRouter, server: ServerThread) -> None:
    stub.behavior = "hang"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT}, timeout=0.3)
    assert stub.abort_event.wait(timeout=10)
    assert stub.aborts == [stub.calls[0].request_id]


def test_defaults_and_no_abort_after_normal_finish(stub: StubRouter, oai: openai.OpenAI) -> None:
    out = oai.completions.create(model="stub-model", prompt=list(range(6, 126)))
    assert stub.calls[0].params.max_tokens == 8  # min(16, max_model_len 128 - 120 prompt tokens)
    assert out.choices[0].finish_reason == "length" and stub.aborts == []
    assert stub.calls[0].deadline is None  # no timeout field and no server default


def test_a_failing_choice_aborts_its_siblings(stub: StubRouter, server: ServerThread) -> None:
    stub.fail_next = [QueueFullError("full")]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "n": 2, "max_tokens": 50})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert len(stub.calls) == 2 and sorted(stub.aborts) == sorted(c.request_id for c in stub.calls)


def test_without_tokenizer_only_token_ids_are_served(stub: StubRouter, router: StubRouter) -> None:
    with ServerThread(
        create_app(router, None, ServerConfig(served_model_name="alias"), default_timeout_s=30)
    ) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "w5"})
        assert r.status_code == 400 and "text prompts need a tokenizer" in r.json()["error"]["message"]
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert stub.calls == []
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "alias", "prompt": [6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "alias"
        assert r.json()["choices"][0]["token_ids"] == _expected([6, 7], 2)
        assert stub.calls[0].deadline is not None and stub.calls[0].deadline > time.time() + 25
        assert httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"] == "alias"
