"""Issue 31 row 5 (fairness): one client must not take the whole queue. Each tenant (an API key from the
keys file, or a client address when the server has no keys) may hold at most ``max_requests_per_key``
router requests in flight and ``max_tokens_per_key`` queued tokens (prompt + max_tokens per sequence);
past a limit its requests are a 429 with Retry-After naming the limit, while every other tenant is served.
The router's global cap (``max_pending_requests``) stays. Timing is measured by bench/fairness.py."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.config import ServerConfig
from cluster.http.app import create_app
from cluster.http.auth import KeyRing, load_keys_file
from cluster.http.errors import ApiError
from cluster.http.quotas import TenantLimits, TenantQuotas
from cluster.protocol import GenerateRequest, SamplingParams, TokenDelta
from tests.support.stub_router import ServerThread, StubRouter, expected_tokens, make_tokenizer

HOLD = 500  # a prompt starting with this id is held by the router until its client goes away
KEYS = {"alpha": "sk-alpha", "beta": "sk-beta"}


class HoldingRouter(StubRouter):
    """StubRouter that holds (never finishes) every request whose prompt starts with HOLD."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if req.prompt_token_ids[:1] == [HOLD]:
            self.calls.append(req)
            await asyncio.Event().wait()  # until the server cancels this stream (client gone)
        async for delta in super().generate(req):
            yield delta


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def body(prompt: list[int], n: int = 1, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "stub-model", "prompt": prompt, "n": n, "max_tokens": max_tokens, **extra}


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``condition`` (bounded); the server runs on another thread."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def server_config(limits: TenantLimits, keys_dir: Path) -> ServerConfig:
    """A server of the tenants KEYS (their keys file in ``keys_dir``) with ``limits`` per tenant."""
    keys_file = keys_dir / "keys"
    keys_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    return ServerConfig(
        api_keys_file=str(keys_file),
        max_requests_per_key=limits.max_requests,
        max_tokens_per_key=limits.max_tokens,
    )


def run_with_server(limits: TenantLimits, scenario: Callable[[str, HoldingRouter], Any]) -> Any:
    router = HoldingRouter(max_model_len=128)
    with tempfile.TemporaryDirectory() as keys_dir:
        app = create_app(router, make_tokenizer(), server_config(limits, Path(keys_dir)))
    with ServerThread(app) as server:
        result = asyncio.run(scenario(server.url, router))
        quotas: TenantQuotas = app.state.pdserve.quotas
        # NOTE: every lease is given back once its answer ended (done, refused or client gone)
        asyncio.run(wait_until(lambda: not quotas.num_requests and not quotas.num_tokens, "leases released"))
    return result


def test_issue31_row5_a_key_at_its_request_cap_gets_429_while_another_key_is_served() -> None:
    async def scenario(url: str, router: HoldingRouter) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as alpha_held,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            held = asyncio.ensure_future(
                alpha_held.post("/v1/completions", json=body([HOLD, 7], n=4), headers=auth("alpha"))
            )
            await wait_until(lambda: len(router.calls) == 4, "alpha's 4 sequences in flight")
            out["alpha_over"] = await http.post("/v1/completions", json=body([9, 10]), headers=auth("alpha"))
            out["beta"] = await http.post("/v1/completions", json=body([9, 10]), headers=auth("beta"))
            out["beta_stream"] = await http.post(
                "/v1/completions", json=body([9, 10], stream=True), headers=auth("beta")
            )
            out["too_big"] = await http.post("/v1/completions", json=body([9, 10], n=5), headers=auth("beta"))
            held.cancel()  # alpha's client goes away: its sequences are aborted and its lease released
            await asyncio.gather(held, return_exceptions=True)
            await wait_until(lambda: len(router.aborts) == 4, "alpha's held sequences aborted")
            out["alpha_again"] = await http.post("/v1/completions", json=body([9, 10]), headers=auth("alpha"))
        return out

    out = run_with_server(TenantLimits(max_requests=4, max_tokens=0), scenario)
    over = out["alpha_over"]
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert over.json()["error"] == {
        "message": "this API key has 4 requests in flight; the limit is server.max_requests_per_key (4): "
        "retry when some finish",
        "type": "invalid_request_error",
        "param": None,
        "code": "key_requests_limit",
    }
    expected = expected_tokens([9, 10], SamplingParams(max_tokens=4))
    assert out["beta"].status_code == 200 and out["beta"].json()["choices"][0]["token_ids"] == expected
    assert out["beta_stream"].status_code == 200 and out["beta_stream"].text.endswith("data: [DONE]\n\n")
    too_big = out["too_big"]
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "n"
    assert "server.max_requests_per_key is 4" in too_big.json()["error"]["message"]
    assert out["alpha_again"].status_code == 200


def test_issue31_row5_queued_tokens_are_limited_per_key() -> None:
    async def scenario(url: str, router: HoldingRouter) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as held_client,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            # 10 prompt tokens + 50 max_tokens = 60 of alpha's 100
            held = asyncio.ensure_future(
                held_client.post(
                    "/v1/completions", json=body([HOLD, *range(6, 15)], max_tokens=50), headers=auth("alpha")
                )
            )
            await wait_until(lambda: len(router.calls) == 1, "alpha's request in flight")
            out["alpha_over"] = await http.post(
                "/v1/completions", json=body(list(range(6, 16)), max_tokens=50), headers=auth("alpha")
            )
            out["alpha_fits"] = await http.post(
                "/v1/completions", json=body(list(range(6, 16)), max_tokens=30), headers=auth("alpha")
            )
            out["beta"] = await http.post(
                "/v1/completions", json=body(list(range(6, 16)), max_tokens=50), headers=auth("beta")
            )
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
        return out

    out = run_with_server(TenantLimits(max_requests=0, max_tokens=100), scenario)
    over = out["alpha_over"]
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "key_tokens_limit"
    assert over.json()["error"]["message"] == (
        "this API key has 60 tokens queued; the limit is server.max_tokens_per_key (100): retry when some finish"
    )
    assert out["alpha_fits"].status_code == 200
    assert out["beta"].status_code == 200


def test_issue31_row5_without_keys_each_client_address_is_its_own_tenant() -> None:
    keys = KeyRing.create(None, None)
    quotas = TenantQuotas(TenantLimits(max_requests=2, max_tokens=0))
    first, second = keys.tenant("", "10.0.0.1"), keys.tenant("Bearer anything", "10.0.0.2")
    assert (first, second) == ("address:10.0.0.1", "address:10.0.0.2")
    lease = quotas.acquire(first, 2, 10)
    with pytest.raises(ApiError) as refused:
        quotas.acquire(first, 1, 1)
    assert (refused.value.status, refused.value.code) == (429, "key_requests_limit")
    quotas.acquire(second, 2, 10).release()
    lease.release()
    lease.release()  # idempotent
    assert quotas.num_requests == {} and quotas.num_tokens == {}
    quotas.acquire(first, 2, 10)
    assert quotas.num_requests == {first: 2} and quotas.num_tokens == {first: 10}


def test_issue31_row5_keys_file_names_tenants_and_each_key_is_its_own_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# tenants\nalpha:sk-alpha\n\nsk-bare\n  beta : sk-beta  \n")
    assert load_keys_file(str(path)) == {"alpha": "sk-alpha", "key-4": "sk-bare", "beta": "sk-beta"}
    keys = KeyRing.create(load_keys_file(str(path)), None)
    assert [keys.tenant(f"Bearer {k}", "10.0.0.1") for k in ("sk-alpha", "sk-bare", "sk-beta")] == [
        "alpha",
        "key-4",
        "beta",
    ]
    with pytest.raises(ApiError) as unknown:
        keys.tenant("Bearer sk-other", "10.0.0.1")
    assert unknown.value.status == 401 and "sk-other" not in unknown.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_issue41_a_request_that_ends_in_an_error_gives_its_lease_back(stream: bool, tmp_path: Path) -> None:
    """A tenant at its limit of one request: after a request of its ends in an error that is not a
    disconnect (the router's 503, its full queue's 429, a deadline's 504, a worker failing mid-stream),
    its next request is served, never a 429 for the one that is over."""
    router = HoldingRouter(max_model_len=128)
    app = create_app(router, make_tokenizer(), server_config(TenantLimits(1, 0), tmp_path))
    quotas: TenantQuotas = app.state.pdserve.quotas
    expected = expected_tokens([9, 10], SamplingParams(max_tokens=4))
    with (
        ServerThread(app) as server,
        httpx.Client(base_url=server.url, timeout=30, headers=auth("alpha")) as http,
    ):
        for behavior, status in [
            ("unavailable", 503),
            ("queue_full", 429),
            ("deadline", 504),
            ("fail_mid", 200 if stream else 500),
        ]:
            router.behavior = behavior
            extra = {"timeout": 0.2} if behavior == "deadline" else {}
            r = http.post("/v1/completions", json=body([9, 10], stream=stream, **extra))
            assert r.status_code == status, (behavior, r.text)
            code = "queue_full" if behavior == "queue_full" else None
            if status != 200:
                assert r.json()["error"]["code"] != "key_requests_limit"
                assert code is None or r.json()["error"]["code"] == code
            else:  # the stream had begun: the error is its last event
                assert '"code":"worker_failed"' in r.text and r.text.endswith("data: [DONE]\n\n")
            router.behavior = None
            # NOTE: at once, as a client does that retries on seeing the error
            ok = http.post("/v1/completions", json=body([9, 10], stream=stream))
            assert ok.status_code == 200, (behavior, ok.text)
            if not stream:
                assert ok.json()["choices"][0]["token_ids"] == expected

    assert not quotas.num_requests and not quotas.num_tokens
