"""Issue 31 row 10 (auth and admin defaults): ``pdserve serve`` refuses a non-loopback host without an API
key unless ``--allow-unauthenticated`` (then it says so in the log); the admin routes (/v1/pdserve/*) take
a separate admin key, never the inference key, and are off (404) without one; keys come from the
environment or files and are never echoed (not in a repr, an error or /v1/models); /v1/models shows the
served name, not the checkpoint's filesystem path."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.config import ServerConfig
from cluster.http.app import create_app
from cluster.http.auth import admin_key, load_keys_file
from deploy.cli import build_parser
from deploy.cli import main as cli_main
from deploy.cli_args import build_config
from deploy.http_host import check_exposure
from tests.support.stub_router import FakeScaler, ServerThread, StubRouter, make_tokenizer

API_KEY, ADMIN_KEY = "sk-inference-123", "sk-admin-456"


@pytest.fixture
def scaler() -> FakeScaler:
    return FakeScaler()


@pytest.fixture
def server(scaler: FakeScaler) -> Iterator[ServerThread]:
    app = create_app(
        StubRouter(max_model_len=64),
        make_tokenizer(),
        ServerConfig(api_key=API_KEY, admin_key=ADMIN_KEY),
        scaler=scaler,
    )
    with ServerThread(app) as s:
        yield s


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def scale(server: ServerThread, key: str | None) -> httpx.Response:
    body = {"pool": "decode", "num_workers": 2}
    return httpx.post(f"{server.url}/v1/pdserve/scale", json=body, headers=bearer(key), timeout=30)


def test_issue31_row10_admin_routes_take_the_admin_key_only(server: ServerThread, scaler: FakeScaler) -> None:
    inference = scale(server, API_KEY)
    assert inference.status_code == 403 and inference.json()["error"]["code"] == "admin_key_required"
    assert scale(server, None).status_code == 401
    wrong = scale(server, "sk-guess")
    assert wrong.status_code == 401 and "sk-guess" not in wrong.text
    assert scaler.calls == []
    ok = scale(server, ADMIN_KEY)
    assert ok.status_code == 200 and ok.json()["workers"] == ["decode-0", "decode-1"]
    assert scaler.calls == [("decode", 2)]
    # NOTE: the admin key is no inference key
    models = httpx.get(f"{server.url}/v1/models", headers=bearer(ADMIN_KEY), timeout=30)
    assert models.status_code == 401


@pytest.mark.parametrize("inference_key", [None, API_KEY])
def test_issue31_row10_admin_routes_are_off_without_an_admin_key(inference_key: str | None) -> None:
    scaler = FakeScaler()
    app = create_app(
        StubRouter(max_model_len=64), make_tokenizer(), ServerConfig(api_key=inference_key), scaler=scaler
    )
    with ServerThread(app) as s:
        replies = [
            scale(s, inference_key),
            httpx.get(f"{s.url}/v1/pdserve/advice", headers=bearer(inference_key), timeout=30),
        ]
    for reply in replies:
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "admin_disabled"
    assert scaler.calls == []


def test_issue31_row10_models_shows_the_served_name_not_a_path() -> None:
    router = StubRouter(max_model_len=64)  # its checkpoint directory: /models/stub
    app = create_app(router, make_tokenizer(), ServerConfig(served_model_name="tenant-facing"))
    with ServerThread(app) as s:
        listing = httpx.get(f"{s.url}/v1/models", timeout=30)
        card = httpx.get(f"{s.url}/v1/models/tenant-facing", timeout=30)
    assert listing.json()["data"][0]["root"] == "tenant-facing" and card.json()["root"] == "tenant-facing"
    assert "/models/stub" not in listing.text and "/models/stub" not in card.text


def test_issue31_row10_keys_are_never_echoed(tmp_path: Path) -> None:
    cfg = ServerConfig(api_key=API_KEY, admin_key=ADMIN_KEY)
    assert API_KEY not in repr(cfg) and ADMIN_KEY not in repr(cfg)
    bad = tmp_path / "keys"
    bad.write_text("alpha:sk-secret-1\nbeta:sk-secret-1\n")
    with pytest.raises(ValueError) as duplicate:
        load_keys_file(str(bad))
    assert "sk-secret-1" not in str(duplicate.value) and ":2:" in str(duplicate.value)
    with pytest.raises(ValueError, match="the admin key must differ from every API key") as same:
        create_app(StubRouter(), None, ServerConfig(api_key=API_KEY, admin_key=API_KEY))
    assert API_KEY not in str(same.value)


def test_issue31_row10_keys_from_the_environment_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    keys, admin = tmp_path / "keys", tmp_path / "admin"
    keys.write_text("alpha:sk-a\n")
    admin.write_text(f"{ADMIN_KEY}-from-file\n")
    args = ["serve", "--api-keys-file", str(keys), "--admin-key-file", str(admin)]
    cfg = build_config(build_parser().parse_args(args)).server
    assert (cfg.admin_key, cfg.api_keys_file, cfg.admin_key_file) == (ADMIN_KEY, str(keys), str(admin))
    assert admin_key(cfg) == ADMIN_KEY  # the environment's key wins over the file
    assert admin_key(ServerConfig(admin_key_file=str(admin))) == f"{ADMIN_KEY}-from-file"


def test_issue31_row10_a_public_bind_needs_a_key_or_allow_unauthenticated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        check_exposure(ServerConfig(), host)
    check_exposure(ServerConfig(api_key=API_KEY), "0.0.0.0")
    check_exposure(ServerConfig(api_keys_file="/etc/pdserve/keys"), "10.1.2.3")
    for host in ("0.0.0.0", "::", "10.1.2.3", "my-host.example"):
        with pytest.raises(ValueError, match="--allow-unauthenticated"):
            check_exposure(ServerConfig(), host)
    with caplog.at_level(logging.WARNING):
        check_exposure(ServerConfig(allow_unauthenticated=True), "0.0.0.0")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "serving 0.0.0.0 WITHOUT an API key (--allow-unauthenticated): anyone who can reach it can "
            "generate",
        )
    ]


def test_issue31_row10_serve_refuses_before_starting_the_cluster(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import deploy.launch

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    started: list[Any] = []

    def fake_build_cluster(cfg: Any) -> Any:
        started.append(cfg)
        raise ValueError("the test stops here")

    monkeypatch.setattr(deploy.launch, "build_cluster", fake_build_cluster)
    assert cli_main(["serve", "--host", "0.0.0.0"]) == 2
    assert started == []
    assert any("--allow-unauthenticated" in r.getMessage() for r in caplog.records)
    assert cli_main(["serve", "--host", "0.0.0.0", "--allow-unauthenticated"]) == 2
    assert len(started) == 1 and started[0].server.allow_unauthenticated
