"""A handoff's failed KV transfer racing the news of its source's death (cluster/router/handoff.py
``FailedTransfers``): it migrates when the source is or turns out dead (or silent) within the bound, and
fails when the source is alive (it beat twice since, or the bound passed with it healthy), never touching
a flight that ended or moved on."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from cluster.protocol import KVTransferFailedError, RouterError
from cluster.router.handoff import FailedTransfers
from cluster.router.membership import WorkerState


@dataclass
class _Worker:
    worker_id: str
    state: WorkerState = WorkerState.HEALTHY


@dataclass(eq=False)
class _Flight:
    wire_id: str
    is_ended: bool = False


def _watch(bound_s: float) -> tuple[FailedTransfers, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []

    def migrate(flight: Any, why: str) -> None:
        seen.append(("migrate", f"{flight.wire_id}: {why}"))

    def fail(flight: Any, error: RouterError) -> None:
        seen.append(("fail", f"{flight.wire_id}: {error}"))

    return FailedTransfers(bound_s, migrate, fail), seen


ERROR = KVTransferFailedError("KV transfer failed: connection closed by peer")


def test_each_outcome_of_a_failed_transfer() -> None:
    async def main() -> list[tuple[str, str]]:
        failures, seen = _watch(0.05)
        dead, dying, silent, alive = (_Worker(n) for n in ("p-dead", "p-dying", "p-silent", "p-alive"))
        dead.state = WorkerState.DEAD
        flights = {n: _Flight(f"{n}~0") for n in ("a", "b", "c", "d", "e", "f", "g")}
        failures.on_failed(flights["a"], dead, ERROR)  # known dead: at once  # type: ignore[arg-type]
        failures.on_failed(flights["b"], dying, ERROR)  # type: ignore[arg-type]
        failures.on_failed(flights["c"], silent, ERROR)  # type: ignore[arg-type]
        failures.on_failed(flights["d"], alive, ERROR)  # type: ignore[arg-type]
        failures.on_failed(flights["e"], alive, ERROR)  # type: ignore[arg-type]
        failures.on_failed(flights["f"], alive, ERROR)  # type: ignore[arg-type]
        beating = _Worker("p-beating")
        failures.on_failed(flights["g"], beating, ERROR)  # type: ignore[arg-type]
        assert len(failures) == 6
        failures.on_heartbeat(beating)  # type: ignore[arg-type]
        assert len(failures) == 6  # NOTE: one beat may have left before a death
        failures.on_heartbeat(beating)  # type: ignore[arg-type]
        assert seen == [("migrate", "a~0: KV source p-dead died mid-transfer"), ("fail", f"g~0: {ERROR}")]
        dying.state = WorkerState.DEAD
        failures.on_dead(dying)  # type: ignore[arg-type]
        silent.state = WorkerState.UNHEALTHY
        flights["e"].is_ended = True  # aborted meanwhile
        flights["f"].wire_id = "f~1"  # migrated meanwhile (a new attempt)
        await asyncio.sleep(0.2)
        assert len(failures) == 0
        return seen

    assert asyncio.run(main()) == [
        ("migrate", "a~0: KV source p-dead died mid-transfer"),
        ("fail", f"g~0: {ERROR}"),
        ("migrate", "b~0: KV source p-dying died mid-transfer"),
        ("migrate", "c~0: KV source p-silent died mid-transfer"),
        ("fail", f"d~0: {ERROR}"),
    ]
