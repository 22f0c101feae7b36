"""Test utilities (not a test module): the handoff roles driven by hand, one step-loop turn at a time.

``DecodeSide`` / ``PrefillSide`` wrap a real Engine and the real ``DecodeRole`` / ``PrefillRole`` and do
what ``EngineWorker``'s step loop does with them (drain the commands the role posted, ``poll``, step the
engine, route an abort through ``on_abort`` first), with the KV mover replaced by a fake whose
transfers the test ends when it wants and with what it wants (the right KV, junk, an error). Events the
role sends to the router are kept in ``events``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from cluster.config import EngineConfig, TransferConfig
from cluster.frames import new_secret
from cluster.protocol import SamplingParams, TokenDelta, TransferStats
from cluster.wire import DecodeHandoff
from transfer.channel import layout_of
from transfer.protocol import KVHandoff, TransferError, TransferResult
from workers.decode_role import DecodeRole
from workers.engine import Engine
from workers.prefill_role import PrefillRole, _Sent
from workers.request import RequestStatus
from workers.role import WorkerContext


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_config(model_dir: str, **options: Any) -> EngineConfig:
    # NOTE: CPU even where CUDA exists: outputs are compared exactly with fp32 CPU transformers.
    return EngineConfig.from_options(model_dir, device="cpu", block_size=4, **options)


@dataclasses.dataclass
class Fetch:
    """One ``submit`` the decode role made: where the KV must land, and the future it waits on."""

    handoff: KVHandoff
    dst_block_ids: list[int]
    skip_first_n_blocks: int
    deadline: float | None
    wait_for_offer: bool
    future: Future[TransferResult]


class FakeMover:
    """What a KV sender and receiver both report (the values a test sets)."""

    def __init__(self) -> None:
        self.thread = threading.Thread(target=lambda: None, name="fake-mover")
        self.broken: list[str] = []
        self.rejected: dict[str, int] = {}

    def broken_peers(self) -> list[str]:
        return list(self.broken)

    def rejected_frames(self) -> dict[str, int]:
        return dict(self.rejected)


class FakeReceiver(FakeMover):
    """Stands in for KVReceiver: records each fetch; the test ends it (``land`` / ``fail``)."""

    def __init__(self, kv: torch.Tensor) -> None:
        super().__init__()
        self.kv = kv
        self.layout = layout_of(kv)
        self.fetches: dict[str, Fetch] = {}
        self.dropped: list[tuple[str, str | None]] = []

    def submit(
        self,
        handoff: KVHandoff,
        dst_block_ids: Sequence[int],
        skip_first_n_blocks: int = 0,
        deadline: float | None = None,
        wait_for_offer: bool = False,
    ) -> Future[TransferResult]:
        # NOTE: early fetches (posted before the offer) are tested with the real receiver
        # (tests/e2e/test_early_admission.py); here every fetch is one the test ends
        fetch = Fetch(handoff, list(dst_block_ids), skip_first_n_blocks, deadline, wait_for_offer, Future())
        self.fetches[handoff.request_id] = fetch  # NOTE: the latest fetch of a request id
        return fetch.future

    def land(self, request_id: str, rows: torch.Tensor) -> None:
        """The transfer writes ``rows`` ([L, n, ...] KV of its n blocks) and succeeds."""
        fetch = self.fetches[request_id]
        self.kv[:, fetch.dst_block_ids] = rows
        nbytes = rows.numel() * rows.element_size()
        fetch.future.set_result(TransferResult(request_id, True, len(fetch.dst_block_ids), nbytes, 0.25))

    def fail(self, request_id: str, junk: bool = False) -> None:
        """The transfer fails (after writing junk into the blocks, if ``junk``)."""
        fetch = self.fetches[request_id]
        if junk:
            self.kv[:, fetch.dst_block_ids] = 1e4
        fetch.future.set_exception(TransferError("injected: the sender went away"))

    def drop_peer(self, worker_id: str, incarnation: str | None = None) -> None:
        self.dropped.append((worker_id, incarnation))

    def cancel(self, request_id: str) -> None:
        """As KVReceiver.cancel: a fetch still waiting for its offer ends now (a failed transfer)."""
        fetch = self.fetches[request_id]
        if not fetch.future.done():
            fetch.future.set_exception(TransferError(f"fetch of {request_id!r} cancelled"))

    def stats(self) -> TransferStats:
        return TransferStats(num_ok=len(self.fetches), bytes_total=7)


def context(
    engine: Engine, transfer: TransferConfig, events: list[Any], commands: list[object]
) -> WorkerContext:
    return WorkerContext(
        "worker-0", "inc0", "127.0.0.1", engine, transfer, new_secret(), False, events.append, commands.append
    )


class DecodeSide:
    """A decode worker's engine + DecodeRole + FakeReceiver, stepped by ``turn()``."""

    def __init__(self, model_dir: str, transfer: TransferConfig | None = None, **engine_options: Any) -> None:
        self.engine = Engine(engine_config(model_dir, **engine_options))
        self.events: list[Any] = []
        self.commands: list[object] = []
        self.role = DecodeRole(context(self.engine, transfer or TransferConfig(), self.events, self.commands))
        self.receiver = FakeReceiver(self.engine.runner.kv_cache)
        self.role.receiver = self.receiver  # type: ignore[assignment]
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.layout = layout_of(self.engine.runner.kv_cache)

    def handoff(
        self, rid: str, prompt: list[int], first: int, params: SamplingParams, deadline_s: float = 60
    ) -> None:
        handoff = KVHandoff(rid, "prefill-0", "p0", "tcp://127.0.0.1:1", self.layout, len(prompt), 0, 0.0)
        op = DecodeHandoff(rid, prompt, first, params, handoff.to_bytes(), time.time() + deadline_s)
        self.role.on_decode(op)

    def abort(self, rid: str) -> None:
        """As EngineWorker does: the role may take the abort over, else the engine drops the request."""
        if not self.role.on_abort(rid):
            self.engine.abort(rid)

    def turn(self) -> list[TokenDelta]:
        """One step-loop turn: commands, poll, one engine step."""
        commands, self.commands[:] = list(self.commands), []
        for cmd in commands:
            self.role.handle(cmd)
        self.role.poll()
        deltas = self.engine.step() if self.engine.has_unfinished() else []
        for d in deltas:
            self.tokens[d.request_id] += d.token_ids
        return deltas

    def run_until_idle(self, max_turns: int = 500) -> None:
        for _ in range(max_turns):
            self.turn()
            if not (self.engine.has_unfinished() or self.commands or self.role.num_waiting_for_kv()):
                return
        raise AssertionError(f"not idle after {max_turns} turns")

    def events_for(self, rid: str) -> list[Any]:
        return [e for e in self.events if getattr(e, "request_id", None) == rid]

    def check_no_leaks(self) -> None:
        self.engine.check_no_leaks()
        self.role.check_leaks()


class PrefillEngine:
    """The KV a prefill worker would send: runs prompts held after their first token."""

    def __init__(self, model_dir: str, **engine_options: Any) -> None:
        self.engine = Engine(engine_config(model_dir, **engine_options))

    def prefill(self, rid: str, prompt: list[int], params: SamplingParams) -> tuple[int, torch.Tensor]:
        """(first token, KV rows [L, num_blocks, ...] of the prompt's blocks); the request is released."""
        e = self.engine
        e.add_request(rid, prompt, params, hold_after_prefill=True)
        first: list[int] = []
        while e.request_status(rid) != RequestStatus.SENDING_KV:
            first += [t for d in e.step() for t in d.token_ids]
        block_ids = e.held_block_ids(rid)
        assert block_ids is not None and len(first) == 1
        rows = e.runner.kv_cache[:, block_ids].clone()
        e.release(rid)
        return first[0], rows


class FakeSender(FakeMover):
    """Stands in for KVSender: records offers; ``abort`` answers what the test set in ``in_flight``."""

    def __init__(self, kv: torch.Tensor) -> None:
        super().__init__()
        self.layout = layout_of(kv)
        self.offers: dict[str, tuple[list[int], int]] = {}
        self.in_flight: set[str] = set()
        self.leases: list[tuple[str, float]] = []
        self.dropped: list[tuple[str, str | None]] = []

    def offer(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> KVHandoff:
        self.offers[request_id] = (list(block_ids), num_tokens)
        return KVHandoff(
            request_id, "worker-0", "inc0", "tcp://127.0.0.1:1", self.layout, num_tokens, len(block_ids), 1.0
        )

    def abort(self, request_id: str) -> bool:
        if request_id in self.in_flight or request_id not in self.offers:
            return False
        del self.offers[request_id]
        return True

    def extend_lease(self, request_id: str, lease_s: float) -> bool:
        self.leases.append((request_id, lease_s))
        return True

    def num_parked(self) -> int:
        return 0  # NOTE: no fetch reaches a fake sender before its offer

    def drop_peer(self, worker_id: str, incarnation: str | None = None) -> None:
        self.dropped.append((worker_id, incarnation))

    def num_held(self) -> int:
        return len(self.offers)

    def stats(self) -> TransferStats:
        return TransferStats(num_ok=len(self.offers), bytes_total=9)

    @property
    def endpoint(self) -> str:
        return "tcp://127.0.0.1:9"


class PrefillSide:
    """A prefill worker's engine + PrefillRole + FakeSender, stepped by ``turn()``."""

    def __init__(self, model_dir: str, transfer: TransferConfig | None = None, **engine_options: Any) -> None:
        self.engine = Engine(engine_config(model_dir, **engine_options))
        self.events: list[Any] = []
        self.commands: list[object] = []
        self.role = PrefillRole(
            context(self.engine, transfer or TransferConfig(), self.events, self.commands)
        )
        self.sender = FakeSender(self.engine.runner.kv_cache)
        self.role.sender = self.sender  # type: ignore[assignment]

    def abort(self, rid: str) -> None:
        if not self.role.on_abort(rid):
            self.engine.abort(rid)

    def sent(self, rid: str, ok: bool) -> None:
        """The sender is done with ``rid`` (its ``on_sent``, posted to the step thread)."""
        self.sender.offers.pop(rid, None)
        self.commands.append(_Sent(rid, ok))

    def turn(self) -> list[TokenDelta]:
        """One step-loop turn; a held request's first token goes to the role, as EngineWorker routes it."""
        commands, self.commands[:] = list(self.commands), []
        for cmd in commands:
            self.role.handle(cmd)
        deltas = self.engine.step() if self.engine.has_unfinished() else []
        for d in deltas:
            if self.engine.request_status(d.request_id) == RequestStatus.SENDING_KV:
                self.role.on_first_token(d)
            else:
                self.events.append(d)
        return deltas
