"""Prefill and decode EngineWorkers driven directly (no Ray, moving no KV): each refuses the ops its role
cannot serve (failing the request, not the worker) and still runs whole requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cluster.config import EngineConfig, TransferConfig
from cluster.frames import new_secret
from cluster.protocol import ErrorCode, SamplingParams
from cluster.wire import DecodeHandoff, Generate, RequestFailed, WorkerControl
from tests.workers.test_worker import Delta, FakeRouter
from workers.llm import LLM
from workers.worker import EngineWorker

PROMPT = [3, 40, 99, 7, 250, 18]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
ENGINE = EngineConfig.from_options(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return LLM(device="cpu", block_size=4).generate([PROMPT], PARAMS)[0].token_ids


@pytest.fixture(params=["prefill", "decode"])
def started(request: pytest.FixtureRequest) -> Iterator[tuple[EngineWorker, FakeRouter]]:
    secret = new_secret()
    router = FakeRouter(secret)
    control = WorkerControl((router.endpoint,), heartbeat_interval_s=0.05)  # moves_kv False: no KV mover
    fatal: list[str] = []  # NOTE: a dead thread must fail the test, not end the test process
    try:
        worker = EngineWorker(
            f"{request.param}-0",
            request.param,
            ENGINE,
            TransferConfig(),
            secret,
            control,
            on_fatal=fatal.append,
        )
    except BaseException:
        router.close()  # NOTE: an open ZMQ context would hold the process at exit
        raise
    router.connect(worker)
    yield worker, router
    worker.shutdown()
    router.close()
    assert fatal == []


def test_ops_the_role_cannot_serve_fail_the_request_and_whole_requests_still_run(
    started: tuple[EngineWorker, FakeRouter], reference: list[int]
) -> None:
    worker, router = started
    router.send(Generate("held", PROMPT, PARAMS, deadline=1e12, hold=True))
    router.send(DecodeHandoff("handoff", PROMPT, 5, PARAMS, b"", deadline=1e12))
    failed = {e.request_id: e for e in (router.next((RequestFailed,)), router.next((RequestFailed,)))}
    if worker.pool == "prefill":
        # it holds prefills, but has no sender to offer them with; it never receives KV
        assert (failed["held"].code, failed["held"].message) == (
            ErrorCode.INTERNAL,
            "prefill worker has no KV sender (it moves no KV)",
        )
        assert (failed["handoff"].code, failed["handoff"].message) == (
            ErrorCode.INVALID_REQUEST,
            "prefill worker cannot receive KV",
        )
    else:
        assert (failed["held"].code, failed["held"].message) == (
            ErrorCode.INVALID_REQUEST,
            "decode worker cannot hold KV",
        )
        assert (failed["handoff"].code, failed["handoff"].message) == (
            ErrorCode.INTERNAL,
            "decode worker has no KV receiver (it moves no KV)",
        )
    router.send(Generate("whole", PROMPT, PARAMS, deadline=1e12))
    tokens: list[int] = []
    while len(tokens) < PARAMS.max_tokens:
        event = router.next((Delta, RequestFailed))
        assert isinstance(event, Delta) and event.delta.request_id == "whole", event
        tokens += event.delta.token_ids
    assert tokens == reference
    assert worker.health() and worker.check_leaks() is None
