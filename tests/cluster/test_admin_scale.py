"""The admin scale route (``POST /v1/pdserve/scale``) and ``pdserve scale``, over a fake scaler: the API
key is required when set, bad bodies are a 400 naming the field before the scaler is called, a second
scale while one runs is a 409, and the CLI prints the pool or the server's error. The real
``Cluster.scale`` under traffic is tested in tests/e2e/test_elastic.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.config import ServerConfig
from cluster.http.admin_routes import MAX_POOL_WORKERS
from cluster.http.app import create_app
from deploy.cli import main as cli_main
from tests.support.stub_router import FakeScaler, ServerThread, StubRouter, make_tokenizer

KEY = "adm1n"  # the admin key (issue 31 row 10: the admin routes take it, never the inference key)


@pytest.fixture
def scaler() -> FakeScaler:
    return FakeScaler()


@pytest.fixture
def server(scaler: FakeScaler) -> Iterator[ServerThread]:
    with ServerThread(
        create_app(
            StubRouter(max_model_len=64),
            make_tokenizer(),
            ServerConfig(api_key="inference", admin_key=KEY),
            scaler=scaler,
        )
    ) as s:
        yield s


def post(server: ServerThread, body: Any, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/pdserve/scale", json=body, headers=headers, timeout=30)


def test_scale_calls_the_scaler_and_answers_the_pool(server: ServerThread, scaler: FakeScaler) -> None:
    reply = post(server, {"pool": "decode", "num_workers": 2})
    assert reply.status_code == 200
    assert reply.json() == {"pool": "decode", "num_workers": 2, "workers": ["decode-0", "decode-1"]}
    assert scaler.calls == [("decode", 2)]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"pool": "nope", "num_workers": 1}, "pool", "pool must be one of ['prefill', 'decode'], got 'nope'"),
        ({"num_workers": 1}, "pool", "got None"),
        ({"pool": "decode", "num_workers": -1}, "num_workers", f"integer in [0, {MAX_POOL_WORKERS}], got -1"),
        (
            {"pool": "decode", "num_workers": MAX_POOL_WORKERS + 1},
            "num_workers",
            f"got {MAX_POOL_WORKERS + 1}",
        ),
        ({"pool": "decode", "num_workers": 1.5}, "num_workers", "got 1.5"),
        ({"pool": "decode", "num_workers": True}, "num_workers", "got True"),
        ({"pool": "decode", "num_workers": 1, "force": 1}, "force", "unknown field 'force'"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(
    server: ServerThread, scaler: FakeScaler, body: dict[str, Any], param: str, message: str
) -> None:
    reply = post(server, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert scaler.calls == []


def test_the_api_key_is_required(server: ServerThread, scaler: FakeScaler) -> None:
    assert post(server, {"pool": "decode", "num_workers": 1}, key=None).status_code == 401
    assert post(server, {"pool": "decode", "num_workers": 1}, key="wrong").status_code == 401
    assert scaler.calls == []


def test_a_second_scale_while_one_runs_is_a_409(server: ServerThread, scaler: FakeScaler) -> None:
    scaler.gate = threading.Event()
    first: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: first.append(post(server, {"pool": "prefill", "num_workers": 3}))
    )
    thread.start()
    try:
        assert scaler.entered.wait(30)
        second = post(server, {"pool": "decode", "num_workers": 1})
        assert second.status_code == 409 and "another scale operation" in second.json()["error"]["message"]
        # NOTE: the server keeps serving everything else while a scale runs
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    finally:
        scaler.gate.set()
        thread.join(30)
    assert first[0].status_code == 200 and first[0].json()["num_workers"] == 3
    assert scaler.calls == [("prefill", 3)]


def test_a_server_without_a_cluster_cannot_scale() -> None:
    with ServerThread(
        create_app(StubRouter(max_model_len=64), make_tokenizer(), ServerConfig(admin_key=KEY))
    ) as s:
        reply = post(s, {"pool": "decode", "num_workers": 1})
    assert reply.status_code == 404 and "cannot scale" in reply.json()["error"]["message"]


def test_cli_prints_the_pool_or_the_error(
    server: ServerThread, scaler: FakeScaler, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["scale", "--url", f"{server.url}/v1", "--admin-key", KEY]
    assert cli_main([*base, "--pool", "decode", "--workers", "2"]) == 0
    assert capsys.readouterr().out == "decode: 2 workers: decode-0 decode-1\n"
    assert cli_main([*base, "--pool", "other", "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdserve scale: HTTP 400: ") and "pool must be one of" in err
    assert scaler.calls == [("decode", 2)]
