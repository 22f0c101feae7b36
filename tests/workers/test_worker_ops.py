"""The step thread's command dispatch (workers/worker_ops.py) on a colocated worker (no role), with the
engine, the outbox and the vitals faked: each op does exactly its one thing, and a command nobody
knows is an error, not a silent drop."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, cast

import pytest

from cluster.protocol import ErrorCode, SamplingParams
from cluster.wire import (
    Abort,
    DecodeHandoff,
    ExtendLease,
    Generate,
    KvResync,
    PeerDead,
    PrepareDecode,
    RouterLease,
)
from workers.worker_ops import InjectedFault, LeakCheck, OpHandler

PARAMS = SamplingParams(max_tokens=4)


class FakeLinks:
    def __init__(self) -> None:
        self.owners = {"leased"}
        self.admitted: list[tuple[str, str]] = []

    def admit(self, request_id: str, owner: str) -> bool:
        if owner and owner not in self.owners:
            return False
        self.admitted.append((request_id, owner))
        return True

    def on_lease(self, op: RouterLease) -> list[str] | None:
        return None if op.replica else ["freed-1"]


class FakeOutbox:
    worker_id = "colocated-0"

    def __init__(self) -> None:
        self.links = FakeLinks()
        self.failed: list[tuple[str, ErrorCode, str]] = []

    def fail_request(self, request_id: str, code: ErrorCode, message: str) -> None:
        self.failed.append((request_id, code, message))


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, **kw: Any) -> None:
        self.calls.append(("add", request_id, prompt, kw))

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    def request_status(self, request_id: str) -> object:
        return object() if request_id == "freed-1" else None


class FakeVitals:
    num_freed_for_router = 0
    num_snapshots_asked = 0

    def request_kv_snapshot(self) -> None:
        self.num_snapshots_asked += 1

    def leak_report(self) -> str | None:
        return "1 block leaked"


def handler() -> tuple[OpHandler, FakeEngine, FakeOutbox, list[str]]:
    engine, outbox, rejected = FakeEngine(), FakeOutbox(), []
    ops = OpHandler(
        "colocated", cast(Any, engine), None, cast(Any, outbox), cast(Any, FakeVitals()), rejected.append
    )
    return ops, engine, outbox, rejected


def test_each_op_does_its_one_thing_on_a_worker_without_a_role() -> None:
    ops, engine, outbox, rejected = handler()
    ops.handle(Generate("a", [1, 2], PARAMS, 1e12, output_token_ids=[7], owner="leased"))
    ops.handle(Generate("b", [1], PARAMS, 1e12, hold=True))
    ops.handle(DecodeHandoff("c", [1], 5, PARAMS, b"", 1e12))
    ops.handle(PrepareDecode("d", [1], PARAMS, 1e12, "prefill-0", "i", "tcp://x:1"))  # a hint: ignored
    ops.handle(PeerDead("prefill-0"))
    ops.handle(ExtendLease("a"))
    ops.handle(Abort("a"))
    ops.handle(KvResync())
    assert cast(Any, ops)._vitals.num_snapshots_asked == 1
    assert engine.calls == [
        ("add", "a", [1, 2], {"hold_after_prefill": False, "output_token_ids": [7]}),
        ("abort", "a"),
    ]
    assert outbox.failed == [
        ("b", ErrorCode.INVALID_REQUEST, "colocated worker cannot hold KV"),
        ("c", ErrorCode.INVALID_REQUEST, "colocated worker cannot receive KV"),
    ]
    assert outbox.links.admitted == [("a", "leased"), ("b", ""), ("c", ""), ("d", "")]
    assert rejected == []


def test_an_op_of_an_unleased_router_is_refused_and_a_lease_frees_what_it_replaces() -> None:
    ops, engine, outbox, rejected = handler()
    ops.handle(Generate("late", [1], PARAMS, 1e12, owner="gone"))
    ops.handle(RouterLease("new", 0, 5.0))  # replaces an incarnation that held "freed-1"
    ops.handle(RouterLease("odd", 1, 5.0))  # a lease this worker cannot take
    assert rejected == ["stale_owner", "bad_field"]
    assert engine.calls == [("abort", "freed-1")] and outbox.failed == []
    assert cast(Any, ops)._vitals.num_freed_for_router == 1


def test_internal_commands_and_an_unknown_one() -> None:
    ops, _, _, _ = handler()
    check = LeakCheck(Future())
    ops.handle(check)
    assert check.result.result(timeout=0) == "1 block leaked"
    with pytest.raises(RuntimeError, match="injected fault in the step thread"):
        ops.handle(InjectedFault("step"))
    with pytest.raises(RuntimeError, match="colocated-0: unexpected command object"):
        ops.handle(object())
