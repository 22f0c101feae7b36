"""cluster.client.sdk against the stub-backed server: results, stream timing, retries, and the serve bench."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.serve import main as bench_main
from cluster.client.sdk import APIConnectionError, APIError, AsyncClient, Client, ServerTimings
from cluster.config import ServerConfig
from cluster.http.app import create_app
from cluster.protocol import ClusterUnavailableError, QueueFullError, SamplingParams
from tests.support.stub_router import ServerThread, StubRouter, expected_tokens, make_tokenizer, token_text

PROMPT_IDS = [10, 11, 12]
STUB_SPLIT = (0.001, 0.002, 0.003)  # the stub's queue / prefill / transfer seconds


def _expected(max_tokens: int, seed: int | None = None) -> list[int]:
    return expected_tokens(PROMPT_IDS, SamplingParams(max_tokens=max_tokens, seed=seed))


@pytest.fixture(scope="module")
def router() -> StubRouter:
    return StubRouter()


@pytest.fixture(scope="module")
def server(router: StubRouter) -> Iterator[ServerThread]:
    with ServerThread(create_app(router, make_tokenizer(), ServerConfig(api_key="k"))) as s:
        yield s


@pytest.fixture
def stub(router: StubRouter) -> Iterator[StubRouter]:
    router.calls.clear()
    router.behavior, router.fail_next = None, []
    yield router
    router.behavior, router.fail_next = None, []


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.url, api_key="k", timeout=10, retry_backoff_s=0.01) as c:
        yield c


def _split(t: ServerTimings | None) -> tuple[float, float, float]:
    assert t is not None
    return (t.queue_s, t.prefill_s, t.transfer_s)


def test_non_streaming_result(stub: StubRouter, client: Client) -> None:
    out = client.completions.create(prompt=PROMPT_IDS, max_tokens=4)
    ids = _expected(4)
    assert (out.text, out.token_ids, out.finish_reason) == ("".join(map(token_text, ids)), ids, "length")
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 4)
    assert _split(out.timings) == STUB_SPLIT and out.latency_s > 0
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "w9"}], max_tokens=2, n=2, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(
        len(c.token_ids or []) == 2 for c in chat.choices
    )


def test_stream_deltas_and_result(stub: StubRouter, client: Client) -> None:
    stream = client.completions.create(
        prompt=PROMPT_IDS, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    deltas = list(stream)
    ids = _expected(5)
    assert [d.token_ids for d in deltas] == [[t] for t in ids]
    assert [d.text for d in deltas] == [token_text(t) for t in ids]
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]
    times = [d.arrival_time for d in deltas]
    assert times == sorted(times)
    r = stream.result
    assert r.token_ids == ids and r.finish_reason == "length"
    assert r.ttft_s is not None and r.ttft_s == times[0] - r.start_time
    assert r.tbt_s == [b - a for a, b in itertools.pairwise(times)]
    assert r.e2e_s is not None and r.e2e_s >= r.ttft_s
    assert _split(r.timings) == STUB_SPLIT
    assert r.usage is not None and r.usage.completion_tokens == 5


def test_chat_stream(stub: StubRouter, client: Client) -> None:
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": "w9"}], max_tokens=3, stream=True
    )
    text = "".join(d.text for d in stream)
    assert text == stream.result.text and len(stream.result.token_ids) == 3 and len(stream.result.tbt_s) == 2


@pytest.mark.parametrize("error", [ClusterUnavailableError("restarting"), QueueFullError("full")])
def test_retries_before_the_first_byte(stub: StubRouter, client: Client, error: Exception) -> None:
    stub.fail_next = [error, error]  # type: ignore[list-item]
    out = client.completions.create(prompt=PROMPT_IDS, max_tokens=2)
    assert out.token_ids == _expected(2) and len(stub.calls) == 3
    stub.fail_next = [error] * 3  # type: ignore[list-item]
    with pytest.raises(APIError) as info:
        client.completions.create(prompt=PROMPT_IDS, max_tokens=2, stream=True)
    assert info.value.status in (429, 503) and len(stub.calls) == 6


def test_no_retry_on_bad_request_or_after_the_stream_began(stub: StubRouter, client: Client) -> None:
    with pytest.raises(APIError, match="max_tokens must be >= 1, got 0") as info:
        client.completions.create(prompt=PROMPT_IDS, max_tokens=0)
    assert info.value.status == 400 and stub.calls == []
    stub.behavior = "fail_mid"
    stream = client.completions.create(prompt=PROMPT_IDS, max_tokens=5, stream=True)
    got = []
    with pytest.raises(APIError, match="decode worker decode-0 died") as info:
        for d in stream:
            got.append(d.token_ids)
    assert info.value.code == "worker_failed" and info.value.status is None
    assert got == [[t] for t in _expected(2)] and len(stub.calls) == 1


def test_bad_key_and_connect_errors(server: ServerThread) -> None:
    with Client(server.url, api_key="wrong") as c, pytest.raises(APIError) as info:
        c.completions.create(prompt=PROMPT_IDS)
    assert info.value.status == 401
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        bad = Client(f"http://127.0.0.1:{port}", max_retries=1, retry_backoff_s=0.01)
        with bad, pytest.raises(APIConnectionError, match="cannot connect"):
            bad.completions.create(prompt=PROMPT_IDS)


def test_async_client(stub: StubRouter, server: ServerThread) -> None:
    async def go() -> None:
        async with AsyncClient(server.url + "/v1", api_key="k", timeout=10) as c:
            out = await c.completions.create(prompt=PROMPT_IDS, max_tokens=3, seed=2)
            assert out.token_ids == _expected(3, seed=2)
            streams = await asyncio.gather(
                *(c.completions.create(prompt=PROMPT_IDS, max_tokens=k, stream=True) for k in (2, 4))
            )
            for k, stream in zip((2, 4), streams, strict=True):
                assert [d.token_ids async for d in stream] == [[t] for t in _expected(k)]
                assert len(stream.result.tbt_s) == k - 1 and _split(stream.result.timings) == STUB_SPLIT

    asyncio.run(go())


def test_bench_smoke_writes_json_and_plot(stub: StubRouter, server: ServerThread, tmp_path: Path) -> None:
    argv = [
        "--url",
        server.url,
        "--api-key",
        "k",
        "--scenario",
        "smoke",
        "--num-requests",
        "6",
        "--prompt-len",
        "4",
        "8",
        "--output-len",
        "3",
        "5",
        "--out",
        str(tmp_path),
        "--quiet",
    ]
    assert bench_main(argv) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    summary, requests = result["summary"], result["requests"]
    assert (summary["num_requests"], summary["num_ok"], summary["num_errors"]) == (6, 6, 0)
    assert summary["output_tokens"] == sum(r["max_tokens"] for r in requests)
    assert all(4 <= r["prompt_len"] <= 8 and 3 <= r["max_tokens"] <= 5 for r in requests)
    assert sorted(len(c.prompt_token_ids) for c in stub.calls) == sorted(r["prompt_len"] for r in requests)
    assert all(c.params.ignore_eos and c.params.temperature == 0.0 for c in stub.calls)
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_edge_modules_import_no_torch_and_client_no_ray() -> None:
    code = (
        "import sys, cluster.client.sdk; assert 'torch' not in sys.modules and 'ray' not in sys.modules; "
        "import cluster.http.app, cluster.http.metrics; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_results_are_shaped_like_the_openai_package(stub: StubRouter, client: Client) -> None:
    out = client.chat.completions.create(messages=[{"role": "user", "content": "w20 w21"}], max_tokens=3)
    ids = expected_tokens(
        make_tokenizer().encode_chat([{"role": "user", "content": "w20 w21"}]), SamplingParams(max_tokens=3)
    )
    text = "".join(token_text(t) for t in ids)
    assert out.choices[0].message is not None
    assert (out.choices[0].message.role, out.choices[0].message.content) == ("assistant", text)
    assert out.choices[0].text == text and out.choices[0].message.tool_calls is None
    assert out.usage is not None and (out.usage.completion_tokens, out.usage.total_tokens) == (
        3,
        out.usage.prompt_tokens + 3,
    )
    done = client.completions.create(prompt=PROMPT_IDS, max_tokens=2)
    assert (
        done.choices[0].text == "".join(token_text(t) for t in _expected(2))
        and done.choices[0].message is None
    )
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": "w20 w21"}], max_tokens=3, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [c.choices[0].token_ids for c in chunks] == [[t] for t in ids]
    assert chunks[-1].choices[0].finish_reason == "length" and stream.result.timings is not None


def test_typed_errors(stub: StubRouter, server: ServerThread) -> None:
    from cluster.client.sdk import (
        APITimeoutError,
        AuthenticationError,
        BadRequestError,
        InternalServerError,
        NotFoundError,
        RateLimitError,
    )

    with Client(server.url, api_key="k", max_retries=0) as c:
        with pytest.raises(BadRequestError) as bad:
            c.completions.create(prompt=PROMPT_IDS, max_tokens=0)
        assert (bad.value.status_code, bad.value.param, bad.value.code) == (
            400,
            "max_tokens",
            "invalid_request",
        )
        with pytest.raises(NotFoundError):
            c.completions.create(prompt=PROMPT_IDS, model="nope")
        stub.behavior = "queue_full"
        with pytest.raises(RateLimitError) as limited:
            c.completions.create(prompt=PROMPT_IDS)
        assert limited.value.status_code == 429 and isinstance(limited.value, APIError)
        stub.behavior = "unavailable"
        with pytest.raises(InternalServerError) as down:
            c.completions.create(prompt=PROMPT_IDS)
        assert down.value.status_code == 503
        stub.behavior = "hang"
    with Client(server.url, api_key="wrong") as c, pytest.raises(AuthenticationError):
        c.completions.create(prompt=PROMPT_IDS)
    with Client(server.url, api_key="k", timeout=0.5, max_retries=0) as c, pytest.raises(APITimeoutError):
        list(c.completions.create(prompt=PROMPT_IDS, max_tokens=4, stream=True))


def test_base_url_and_key_from_the_environment(
    stub: StubRouter, server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_BASE_URL", f"{server.url}/v1")
    monkeypatch.setenv("PDSERVE_API_KEY", "k")
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with Client() as c:
        assert c.completions.create(prompt=PROMPT_IDS, max_tokens=2).token_ids == _expected(2)
    monkeypatch.delenv("PDSERVE_API_KEY")
    with Client() as c, pytest.raises(APIError) as info:
        c.completions.create(prompt=PROMPT_IDS, max_tokens=2)
    assert info.value.status == 401
