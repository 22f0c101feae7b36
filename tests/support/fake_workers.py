"""Test utilities (not a test module): workers as the Router sees them, without engines or Ray.

``FakeWorkers`` speaks the router's real wire protocol (signed frames, cluster/wire.py): each fake worker
binds its own PULL socket for ops and registers with a Heartbeat; every event of every fake worker goes
through ONE PUSH socket, so the router handles events in exactly the order a test sends them.
``Stream`` holds one ``Router.open`` stream in a task and hands its deltas (or its error) to the test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from cluster.config import RouterConfig
from cluster.frames import new_secret
from cluster.protocol import (
    EngineStats,
    FinishReason,
    GenerateRequest,
    RouterError,
    SamplingParams,
    TokenDelta,
    WorkerStats,
    peer_name,
)
from cluster.router.router import Router
from cluster.router.stream import RequestStream
from cluster.wire import (
    OPS,
    ROUTER_ID,
    DecodeHandoff,
    Generate,
    Heartbeat,
    Prefilled,
    PrepareDecode,
    RouterLease,
    WireDecoder,
    WireEncoder,
    WorkerInfo,
)

TIMEOUT_S = 5.0  # NOTE: every wait is bounded; a loopback frame takes milliseconds
BLOCK_SIZE = 4
_END = object()
STREAM_TASK = "stream-"


class FakeWorkers:
    """The fake workers of one router (see the module docstring)."""

    def __init__(self, router: Router, secret: bytes) -> None:
        self.router = router
        self.secret = secret
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(router.endpoint)
        self.encoder = WireEncoder(secret)
        self.pulls: dict[str, zmq.asyncio.Socket] = {}
        self.decoders: dict[str, WireDecoder] = {}
        self.infos: dict[str, WorkerInfo] = {}
        self.leases: dict[str, int] = {}  # RouterLease ops each worker got

    async def add(
        self,
        worker_id: str,
        pool: str,
        *,
        num_free_blocks: int = 100,
        incarnation: str = "i0",
        pid: int = 1,
        max_model_len: int = 1024,
        model_dir: str = "/m",
        wait: bool = True,
        kv_events: bool = False,
    ) -> WorkerInfo:
        """Register a worker (its first heartbeat) and (``wait``) wait until the router admitted it.
        ``kv_events``: it says it publishes KvEvents (the router then asks it for snapshots)."""
        if worker_id not in self.pulls:
            pull = self.ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind("tcp://127.0.0.1:*")
            self.pulls[worker_id] = pull
        # NOTE: like a worker, each incarnation takes only the ops addressed to it
        self.decoders[worker_id] = WireDecoder(self.secret, peer_name(worker_id, incarnation), OPS)
        endpoint = self.pulls[worker_id].getsockopt_string(zmq.LAST_ENDPOINT)
        info = WorkerInfo(
            worker_id,
            pool,
            incarnation,
            endpoint,
            "127.0.0.1",
            BLOCK_SIZE,
            128,
            max_model_len,
            512,
            model_dir,
            "cpu",
            pid,
            kv_events=kv_events,
        )
        self.infos[worker_id] = info
        await self.beat(worker_id, num_free_blocks=num_free_blocks)
        if not wait:
            return info
        await until(
            lambda: any(w.info == info and w.healthy for w in self.router.workers), f"{worker_id} admitted"
        )
        return info

    async def beat(
        self,
        worker_id: str,
        *,
        num_free_blocks: int = 100,
        healthy: bool = True,
        broken_peers: Sequence[str] = (),
    ) -> None:
        info = self.infos[worker_id]
        engine = EngineStats(num_free_blocks=num_free_blocks)
        stats = WorkerStats(worker_id, info.pool, healthy, engine=engine, broken_peers=list(broken_peers))
        await self.send(Heartbeat(info, stats))

    async def send(self, *events: Any) -> None:
        for event in events:
            await self.push.send(self.encoder.encode(ROUTER_ID, event))

    async def op(self, worker_id: str) -> Any:
        """The next op the router sent to ``worker_id`` (bounded), leases aside (kept in ``leases``): an op
        that brings a request must name the router as its owner, and comes back with ``owner`` "" (so
        tests compare ops without it)."""
        while True:
            frame = await asyncio.wait_for(self.pulls[worker_id].recv(), TIMEOUT_S)
            decoder = self.decoders[worker_id]
            misaddressed = decoder.rejected().get("misaddressed", 0)
            op = decoder.decode(frame)
            if op is None and decoder.rejected().get("misaddressed", 0) > misaddressed:
                continue  # NOTE: an op for the worker's previous incarnation (a lease): dropped, as a worker does
            assert op is not None, f"router sent {worker_id} a frame it rejects: {decoder.rejected()}"
            if isinstance(op, RouterLease):
                assert op.incarnation == self.router.members.owner and op.replica == self.router.replica
                self.leases[worker_id] = self.leases.get(worker_id, 0) + 1
                continue
            if isinstance(op, (Generate, PrepareDecode, DecodeHandoff)):
                assert op.owner == self.router.members.owner, (op.owner, self.router.members.owner)
                return msgspec.structs.replace(op, owner="")
            return op

    async def ops(self, worker_id: str, n: int) -> list[Any]:
        return [await self.op(worker_id) for _ in range(n)]

    async def pending_ops(self, worker_id: str) -> list[Any]:
        """Ops already delivered to ``worker_id`` (none waited for)."""
        out = []
        while await self.pulls[worker_id].poll(0):
            frame = await self.pulls[worker_id].recv()
            op = self.decoders[worker_id].decode(frame)
            if isinstance(op, RouterLease):
                continue
            if isinstance(op, (Generate, PrepareDecode, DecodeHandoff)):
                op = msgspec.structs.replace(op, owner="")
            out.append(op)
        return out

    def close(self) -> None:
        for sock in [self.push, *self.pulls.values()]:
            sock.close(linger=0)
        self.ctx.term()


class Stream:
    """One request through ``router.open``, held by a task (its consumer: cancelling the task closes the
    stream, as a client that leaves); ``next()`` is its next delta as the router delivered it (the
    stream's listener sees each one before the stream merges it), or the RouterError it ended with, or
    None once it ended."""

    def __init__(self, router: Router, request_id: str, prompt: Sequence[int], **request: Any) -> None:
        params = request.pop("params", SamplingParams(max_tokens=16, temperature=0.0))
        self.req = GenerateRequest(request_id, list(prompt), params, **request)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._run(router), name=f"{STREAM_TASK}{request_id}")

    async def _run(self, router: Router) -> None:
        try:
            stream = router.open(self.req, self)
        except RouterError as e:
            self._queue.put_nowait(e)
            return
        try:
            await self._ended
        finally:
            stream.close()

    def on_output(self, stream: RequestStream, delta: TokenDelta | None) -> None:
        stream.take()  # NOTE: the deltas are kept as they came; the stream holds nothing
        if delta is None:
            self._queue.put_nowait(stream.error)
        else:
            self._queue.put_nowait(delta)
            if delta.finish_reason is None:
                return
            self._queue.put_nowait(_END)
        if not self._ended.done():
            self._ended.set_result(None)

    async def next(self) -> TokenDelta | RouterError | None:
        item = await asyncio.wait_for(self._queue.get(), TIMEOUT_S)
        return None if item is _END else item

    async def rest(self) -> list[TokenDelta | RouterError]:
        """Every remaining delta (and the error, if it ended with one)."""
        out: list[TokenDelta | RouterError] = []
        while (item := await self.next()) is not None:
            out.append(item)
            if isinstance(item, RouterError):
                break
        return out


async def cancel_streams() -> None:
    """Cancel every Stream still running (their requests settle while the router is still open)."""
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith(STREAM_TASK) and not t.done()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until(condition: Any, what: str, timeout_s: float = TIMEOUT_S) -> None:
    """Poll a condition on the event loop with a bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.005)


Scenario = Callable[[Router, FakeWorkers], Awaitable[None]]


def run(
    scenario: Scenario,
    served_model_name: str | None = None,
    rejected: dict[str, int] | None = None,
    **config: Any,
) -> None:
    """Run ``scenario`` against a fresh router (RouterConfig overrides in ``config``) and its fake
    workers on a new event loop; then the router's own loops must all be running and the frames it
    rejected, by reason, must be ``rejected`` (none by default). Streams still running are cancelled before the router closes."""

    async def main() -> None:
        secret = new_secret()
        options: dict[str, Any] = {"health_interval_s": 0.02, "health_timeout_s": 60.0, **config}
        router = Router(RouterConfig(**options), secret, served_model_name=served_model_name)
        await router.start()
        fakes = FakeWorkers(router, secret)
        try:
            await scenario(router, fakes)
            assert router.dead_tasks() == [] and router.rejected_frames() == (rejected or {})
        finally:
            await cancel_streams()
            fakes.close()
            await router.close()

    asyncio.run(main())


def delta(rid: str, *tokens: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(rid, list(tokens), finish_reason=finish)


def assert_idle(router: Router) -> None:
    """The router's per-worker bookkeeping is back to zero and it holds no request (its leak check)."""
    assert {w.worker_id: (w.num_assigned, w.num_prompt_tokens) for w in router.workers} == {
        w.worker_id: (0, 0) for w in router.workers
    }
    # NOTE: no public view of these maps; a request left in them is a leak
    assert (router._flights.by_request, router._flights.by_wire) == ({}, {})


async def prefilled(fakes: FakeWorkers, s: Stream, prefill: str, token: int) -> DecodeHandoff:
    """``s`` is on ``prefill``: it sends the first token; returns the handoff the router sends on."""
    gen = await fakes.op(prefill)
    assert gen == Generate(s.req.request_id, s.req.prompt_token_ids, s.req.params, gen.deadline, True, [])
    handoff = f"kv-{s.req.request_id}".encode()
    await fakes.send(Prefilled(prefill, delta(s.req.request_id, token), handoff))
    first = await s.next()
    assert isinstance(first, TokenDelta) and first.token_ids == [token]
    rid = s.req.request_id
    await until(lambda: fakes.router.placement(rid)[1] is not None, f"{rid} handed off")
    op = await fakes.op(decode_of(fakes.router, rid))
    assert op == DecodeHandoff(
        s.req.request_id, s.req.prompt_token_ids, token, s.req.params, handoff, gen.deadline
    )
    return op


def decode_of(router: Router, rid: str) -> str:
    decode = router.placement(rid)[1]
    assert decode is not None, f"{rid} has no decode worker"
    return decode
