"""EngineWorker driven directly (no Ray): bad frames are counted and dropped while it keeps serving, it
beats while idle, and a dead thread makes it say so (WorkerFailed + on_fatal) instead of hanging."""

from __future__ import annotations

import contextlib
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import pytest
import zmq

from cluster.config import EngineConfig, TransferConfig
from cluster.frames import FrameSigner, new_secret
from cluster.protocol import ErrorCode, SamplingParams, TokenDelta, WorkerStats, peer_name
from cluster.wire import (
    EVENTS,
    OPS,
    ROUTER_ID,
    Abort,
    DecodeHandoff,
    Deltas,
    Generate,
    Heartbeat,
    RequestFailed,
    WireDecoder,
    WireEncoder,
    WorkerControl,
    WorkerFailed,
    router_recipient,
)
from tests.support.cluster_utils import wait_for
from workers.llm import LLM
from workers.worker import EXIT_CODE_FATAL, EngineWorker
from workers.worker_threads import Guard

PROMPT = [3, 40, 99, 7, 250, 18]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = EngineConfig.from_options(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=8)


@dataclass(frozen=True)
class Delta:
    """One request's delta from ``worker_id``: a ``Deltas`` frame taken apart, as the router's receive
    loop takes it apart."""

    worker_id: str
    delta: TokenDelta


class FakeRouter:
    """The router's end of one worker: a PULL for events, a PUSH for ops, signed with the secret."""

    def __init__(self, secret: bytes, replica: int = 0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.push = self.ctx.socket(zmq.PUSH)
        self.encoder = WireEncoder(secret)
        self.decoder = WireDecoder(secret, router_recipient(replica), EVENTS)
        self.recipient = ""  # the worker's process: its id and incarnation, as the router addresses ops
        self._split: list[Delta] = []  # the rest of the last Deltas frame

    def connect(self, worker: EngineWorker) -> None:
        self.push.connect(worker.request_endpoint)
        self.recipient = peer_name(worker.worker_id, worker.info.incarnation)

    def send(self, op: Any) -> None:
        self.push.send(self.encoder.encode(self.recipient, op))

    def next(self, kinds: tuple[type, ...], timeout_s: float = 30.0) -> Any:
        """The next event of one of ``kinds`` (others, e.g. heartbeats, are skipped), within a bound.
        A ``Deltas`` frame is taken apart as the router does: one ``Delta`` per request, in order."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._split:
                event = self._split.pop(0)
            else:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not self.pull.poll(left_ms):
                    raise TimeoutError(f"no {[k.__name__ for k in kinds]} within {timeout_s} s")
                event = self.decoder.decode(self.pull.recv())
                assert event is not None, f"worker sent a frame the router rejects: {self.decoder.rejected()}"
                if isinstance(event, Deltas) and Deltas not in kinds:
                    assert event.deltas, "an empty Deltas frame"
                    self._split = [Delta(event.worker_id, d) for d in event.deltas]
                    continue
            if isinstance(event, kinds):
                return event

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return LLM(device="cpu", block_size=4).generate([PROMPT], PARAMS)[0].token_ids


@pytest.fixture
def started() -> Iterator[tuple[EngineWorker, FakeRouter, list[str]]]:
    with running_worker() as parts:
        yield parts


@contextlib.contextmanager
def running_worker(**options: Any) -> Iterator[tuple[EngineWorker, FakeRouter, list[str]]]:
    """A colocated worker (fault injection on, ``options`` for EngineWorker) wired to a FakeRouter, and
    the reasons its ``on_fatal`` got."""
    secret = new_secret()
    fatal: list[str] = []
    router = FakeRouter(secret)
    control = WorkerControl((router.endpoint,), heartbeat_interval_s=0.05)
    worker = EngineWorker(
        "colocated-0",
        "colocated",
        ENGINE,
        TransferConfig(),
        secret,
        control,
        allow_fault_injection=True,
        on_fatal=fatal.append,
        **options,
    )
    try:
        router.connect(worker)
        yield worker, router, fatal
    finally:
        worker.shutdown()
        router.close()


def generate(router: FakeRouter, request_id: str, params: SamplingParams = PARAMS) -> list[int]:
    router.send(Generate(request_id, PROMPT, params, deadline=1e12))
    tokens: list[int] = []
    while True:
        event = router.next((Delta, RequestFailed))
        assert isinstance(event, Delta), event
        tokens += event.delta.token_ids
        if event.delta.finish_reason is not None:
            return tokens


def test_bad_frames_are_counted_and_dropped_while_the_worker_keeps_serving(
    started: tuple[EngineWorker, FakeRouter, list[str]], reference: list[int]
) -> None:
    worker, router, fatal = started
    signer = FrameSigner(new_secret())  # not the cluster's
    replay = router.encoder.encode(router.recipient, Abort("nobody"))
    predecessor = peer_name(worker.worker_id, "its-predecessor")
    frames = [
        bytes.fromhex("81910102"),
        b"\x00" * 100,
        signer.sign(router.recipient, "abort", {"request_id": "x"}),
        replay,  # accepted (an abort of nothing)
        replay,  # rejected: seen
        router.encoder.encode(router.recipient, Deltas("w", [TokenDelta("r", [1])])),  # an event: no op
        # an op meant for another process of this worker (a restart): never acted on here
        router.encoder.encode(predecessor, Generate("for-the-predecessor", PROMPT, PARAMS, deadline=1e12)),
        router.encoder.encode(worker.worker_id, Generate("for-no-process", PROMPT, PARAMS, deadline=1e12)),
    ]
    for frame in frames:
        router.push.send(frame)
    assert generate(router, "after-bad-frames") == reference  # NOTE: no other request's delta came
    assert worker.stats().rejected_frames == {
        "malformed": 2,
        "bad_mac": 1,
        "unknown_tag": 1,
        "replayed": 1,
        "misaddressed": 2,
    }

    # its split of the steps: every step the engine ran, its prompt and its 8 tokens; no transfer beside
    # (published with the stats after the step that streamed the last token: waited for, bounded)
    def last_step_stats() -> WorkerStats | None:
        st = worker.stats()
        return st if st.steps.num_tokens == 8 else None

    stats = wait_for(last_step_stats, 10.0, "the last step's stats")
    assert (stats.steps.num_steps, stats.steps.prompt_tokens) == (stats.engine.num_steps, len(PROMPT))
    assert stats.steps.seconds > 0.0 and (stats.steps.beside_steps, stats.steps.beside_transfers) == (0, 0)
    assert worker.health() and fatal == []
    assert worker.check_leaks() is None


def test_it_beats_while_idle_with_fresh_stats(started: tuple[EngineWorker, FakeRouter, list[str]]) -> None:
    worker, router, _ = started
    beats = [router.next((Heartbeat,), timeout_s=5) for _ in range(3)]
    assert all(b.stats.worker_id == "colocated-0" and b.stats.healthy for b in beats)
    assert all(b.info == worker.info for b in beats)
    assert worker.info.request_endpoint == worker.request_endpoint and worker.info.pool == "colocated"
    assert beats[-1].stats.engine.num_total_blocks == worker.engine.stats().num_total_blocks


def test_ops_a_colocated_worker_cannot_serve_fail_the_request_not_the_worker(
    started: tuple[EngineWorker, FakeRouter, list[str]], reference: list[int]
) -> None:
    worker, router, _ = started
    router.send(Generate("held", PROMPT, PARAMS, deadline=1e12, hold=True))
    failed = router.next((RequestFailed,))
    assert (failed.request_id, failed.code) == ("held", ErrorCode.INVALID_REQUEST)
    router.send(DecodeHandoff("handoff", PROMPT, 5, PARAMS, b"", deadline=1e12))
    failed = router.next((RequestFailed,))
    assert (failed.request_id, failed.code) == ("handoff", ErrorCode.INVALID_REQUEST)
    router.send(Generate("too-long", PROMPT, SamplingParams(max_tokens=10**6), deadline=1e12))
    failed = router.next((RequestFailed,))
    assert failed.code == ErrorCode.INVALID_REQUEST and "max_model_len" in failed.message
    assert generate(router, "still-serving") == reference and worker.health()


@pytest.mark.parametrize("kind", ["step", "inbound", "detokenizer"])
def test_a_dead_thread_makes_the_worker_say_so(
    started: tuple[EngineWorker, FakeRouter, list[str]], kind: str
) -> None:
    worker, router, fatal = started
    worker.inject_fault(kind)
    failed = router.next((WorkerFailed,), timeout_s=10)
    assert failed.worker_id == "colocated-0"
    assert failed.reason.startswith(f"{kind} thread died: RuntimeError: injected fault")
    assert wait_for(lambda: fatal, 5, "on_fatal") == [failed.reason]
    assert not worker.health() and not worker.stats().healthy


def test_a_stuck_detokenizer_thread_makes_the_worker_say_so() -> None:
    """The step thread would go on beating while every stream hangs: past ``stage_stuck_s`` on one item,
    the worker fails loudly instead."""
    with running_worker(stage_stuck_s=0.5) as (worker, router, fatal):
        worker.inject_fault("detokenizer_stuck")
        failed = router.next((WorkerFailed,), timeout_s=10)
        assert failed.reason == "detokenizer thread stuck: one step's deltas for over 0.5 s"
        assert wait_for(lambda: fatal, 5, "on_fatal") == [failed.reason]
        assert not worker.health()


_DYING_WORKER = """
import sys
import threading
from cluster.config import EngineConfig, TransferConfig
from cluster.wire import WorkerControl
from workers.worker import EXIT_CODE_FATAL, EngineWorker

engine = EngineConfig.from_options(device="cpu", block_size=4, num_kv_blocks=16, max_num_seqs=2)
control = WorkerControl((sys.argv[1],), heartbeat_interval_s=60.0)
worker = EngineWorker(
    "colocated-9", "colocated", engine, TransferConfig(), bytes.fromhex(sys.argv[2]), control,
    allow_fault_injection=True,
)
worker.inject_fault("step")
threading.Event().wait(60)  # the step thread ends the process long before
sys.exit(3)
"""


def test_a_worker_whose_thread_died_exits_only_after_its_last_words_left() -> None:
    """The default ``on_fatal`` ends the process; the WorkerFailed said just before must still reach
    the router, even one that only comes back (binds its socket) after the worker said it: a frame
    left queued in ZMQ would die with the process."""
    with socket.socket() as probe:  # a free port, nobody listening on it yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    secret = new_secret()
    child = subprocess.Popen(
        [sys.executable, "-c", _DYING_WORKER, endpoint, secret.hex()],
        cwd=Path(__file__).resolve().parents[2],
        stderr=subprocess.PIPE,
        text=True,
    )
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        assert child.stderr is not None
        said = [line for line in _lines_until(child.stderr, "worker failed", 60.0)]
        assert "worker failed: step thread died" in said[-1], said
        pull.bind(endpoint)
        decoder = WireDecoder(secret, ROUTER_ID, EVENTS)
        events = []
        while pull.poll(10_000):
            events.append(decoder.decode(pull.recv()))
            if isinstance(events[-1], WorkerFailed):
                break
        assert isinstance(events[-1], WorkerFailed), events
        assert events[-1].reason.startswith("step thread died: RuntimeError: injected fault")
        assert child.wait(timeout=30) == EXIT_CODE_FATAL
    finally:
        child.kill()
        child.wait(timeout=30)
        pull.close(linger=0)
        ctx.term()


def _lines_until(stream: IO[str], marker: str, timeout_s: float) -> Iterator[str]:
    """Lines of ``stream`` up to the first holding ``marker`` (a reader thread bounds the wait)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        yield line
        if marker in line:
            return


def test_fault_injection_is_off_unless_asked() -> None:
    router = FakeRouter(new_secret())
    control = WorkerControl((router.endpoint,), heartbeat_interval_s=0.05)
    fatal: list[str] = []  # NOTE: a dead thread must fail the test, not end the test process
    worker = EngineWorker(
        "colocated-1", "colocated", ENGINE, TransferConfig(), new_secret(), control, on_fatal=fatal.append
    )
    try:
        with pytest.raises(PermissionError):
            worker.inject_fault("step")
    finally:
        worker.shutdown()
        router.close()
    assert fatal == []


def test_ops_and_events_are_disjoint() -> None:
    assert not {cls.TAG for cls in OPS} & {cls.TAG for cls in EVENTS}


def test_text_is_made_on_the_detokenizer_thread_and_equals_the_offline_text(
    started: tuple[EngineWorker, FakeRouter, list[str]],
) -> None:
    worker, router, fatal = started
    assert worker.engine.stage is not None and not worker.engine.detokenize
    llm = LLM(device="cpu", block_size=4)
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    offline_plain, offline_long = llm.generate([PROMPT, PROMPT], [plain, long])
    stop = offline_plain.text[len(offline_plain.text) // 2 :][:3]  # NOTE: ends the request mid-way
    stopping = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    (offline_stop,) = llm.generate([PROMPT], stopping)
    assert offline_stop.finish_reason == "stop" and len(offline_stop.token_ids) < 16
    for rid, params in (("plain", plain), ("stopping", stopping), ("gone", long)):
        router.send(Generate(rid, PROMPT, params, deadline=1e12))
    texts = dict.fromkeys(("plain", "stopping", "gone"), "")
    ends: dict[str, str] = {}
    while not {"plain", "stopping"} <= ends.keys():
        event = router.next((Delta, RequestFailed))
        assert isinstance(event, Delta), event
        d = event.delta
        texts[d.request_id] += d.text
        if d.finish_reason is not None:
            ends[d.request_id] = d.finish_reason.value
        elif d.request_id == "gone" and "gone" not in ends:
            router.send(Abort("gone"))  # NOTE: it ends with no final delta: the stage must drop it
            ends["gone"] = "aborted"
    assert (texts["plain"], ends["plain"]) == (offline_plain.text, "length")
    assert (texts["stopping"], ends["stopping"]) == (offline_stop.text, "stop")
    assert ends["gone"] == "aborted" and offline_long.text.startswith(texts["gone"])
    # NOTE: the Abort frame may still be on its way in: poll the leak check (engine, then stage) with a bound
    wait_for(lambda: worker.check_leaks() is None, 10, "no request left in the engine or the stage")
    assert worker.engine.stage.num_requests == 0
    assert worker.health() and fatal == []


class _NoOutbox:
    """An outbox a Guard may say its last words to (kept, not sent)."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object, last_words_s: float | None = None) -> None:
        self.sent.append(message)


def test_a_thread_that_raises_once_shutdown_began_is_no_failure_of_the_worker() -> None:
    """Shutdown's join is bounded: a thread still running when its sockets close raises for that. The
    process is ending, not failing: no WorkerFailed and no on_fatal (whose default ends the process).
    Before the stop, the same exception is the worker's failure."""
    for stop_first in (True, False):
        stop, release, fatal, outbox = threading.Event(), threading.Event(), [], _NoOutbox()
        guard = Guard("colocated-0", stop, cast(Any, outbox), fatal.append, lambda: None, list)

        def closed_under_it(release: threading.Event = release) -> None:
            release.wait(10)
            raise zmq.ZMQError(zmq.ENOTSOCK)

        guard.start("step", closed_under_it)
        if stop_first:
            stop.set()
        release.set()
        guard.join(timeout_s=10)
        if stop_first:
            assert (fatal, outbox.sent, guard.failed) == ([], [], None)
        else:
            assert fatal == [guard.failed] and [type(m).__name__ for m in outbox.sent] == ["WorkerFailed"]
