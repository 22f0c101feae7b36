"""issue 31 row 6: bounded streams. A caller that stops reading cannot make the router or the HTTP edge
buffer its request's output without bound: the router aborts a request whose untaken events pass
``router.request_buffer_bytes`` (on its workers: its KV is freed), and the edge stops taking a stream's
tokens at ``stream_buffer_bytes`` and aborts a stream whose client read nothing for
``stream_stall_timeout_s``."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable
from types import SimpleNamespace
from typing import cast

import pytest

from cluster.http.app import create_app
from cluster.http.errors import ApiError
from cluster.http.fanout import Fanout, StreamLimits
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
from cluster.protocol import (
    FinishReason,
    GenerateRequest,
    RequestAbortedError,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    delta_nbytes,
)
from cluster.router.router import Router
from cluster.wire import Abort, DecodeHandoff, Deltas, Generate, Prefilled
from tests.support.fake_workers import (
    TIMEOUT_S,
    FakeWorkers,
    Stream,
    assert_idle,
    prefilled,
    run,
    until,
)
from tests.support.stub_router import ServerThread, StubRouter, make_tokenizer

PROMPT = [11, 12, 13, 14, 15, 16]
TOP = 20
BUFFER_BYTES = 16 << 10


def _delta(rid: str, token: int, finish: FinishReason | None = None) -> TokenDelta:
    lp = TokenLogprobs(token, -0.5, list(range(1000, 1000 + TOP)), [-0.5] * TOP)
    return TokenDelta(rid, [token], text=f" t{token}", logprobs=[lp], finish_reason=finish)


def test_issue31_row6_router_aborts_a_request_whose_caller_stopped_taking_its_events() -> None:
    """The caller takes the first token, then nothing: the router queues deltas up to
    request_buffer_bytes, then aborts the request on its decode worker (its KV freed) and drops what the
    worker still sends; the caller, once it reads again, gets the queued deltas, then the abort, and
    the router holds nothing (its leak check)."""
    per_delta = delta_nbytes(_delta("a", 1000))
    fits = BUFFER_BYTES // per_delta  # deltas that fit under the bound; the next one passes it

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        params = SamplingParams(max_tokens=1000, temperature=0.0, logprobs=TOP)
        gen = router.generate(GenerateRequest("a", PROMPT, params))
        first = asyncio.ensure_future(anext(gen))
        op = await fakes.op("prefill-0")
        assert isinstance(op, Generate) and op.request_id == "a"
        await fakes.send(Prefilled("prefill-0", _delta("a", 7), b"kv-a"))
        assert (await asyncio.wait_for(first, TIMEOUT_S)).token_ids == [7]
        assert isinstance(await fakes.op("decode-0"), DecodeHandoff)
        flight = router._flights.get("a")
        assert flight is not None
        # the caller stops reading here; the decode worker goes on producing
        for k in range(fits + 50):
            await fakes.send(Deltas("decode-0", [_delta("a", 2000 + k)]))
        await fakes.send(Deltas("decode-0", [_delta("a", 9999, FinishReason.LENGTH)]))
        await until(lambda: flight.is_overflowed, "the flight overflowed")
        # both sides: the prefill worker still holds the KV it offered (no Transferred yet)
        assert (await fakes.op("decode-0"), await fakes.op("prefill-0")) == (Abort("a"), Abort("a"))
        # NOTE: the router handles events in the order sent: once the final delta's turn has passed
        # (a heartbeat after it is admitted), every late delta was dropped
        await fakes.beat("decode-0", num_free_blocks=77)
        await until(lambda: _free_blocks(router, "decode-0") == 77, "the later heartbeat")
        # the bound held: the deltas under it, the one that passed it, and the abort
        assert flight.events.qsize() == fits + 2
        assert flight.num_queued_bytes == (fits + 1) * per_delta
        assert {w.worker_id: w.num_assigned for w in router.workers} == {"prefill-0": 0, "decode-0": 0}
        tokens: list[int] = []
        with pytest.raises(RequestAbortedError, match="request_buffer_bytes 16384"):
            async for d in gen:
                tokens += d.token_ids
        assert tokens == [2000 + k for k in range(fits + 1)]
        assert_idle(router)
        # aborted once on each, not again when the request settled
        assert await fakes.pending_ops("decode-0") == []
        assert await fakes.pending_ops("prefill-0") == []

    run(scenario, request_buffer_bytes=BUFFER_BYTES)


def _free_blocks(router: Router, worker_id: str) -> int | None:
    w = next(w for w in router.workers if w.worker_id == worker_id)
    return w.stats.engine.num_free_blocks if w.stats is not None else None


def test_issue31_row6_a_caller_that_keeps_up_is_never_cut() -> None:
    """Far more output than the bound, taken as it comes: it all arrives and nothing is aborted."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        params = SamplingParams(max_tokens=1000, temperature=0.0, logprobs=TOP)
        s = Stream(router, "c", PROMPT, params=params)
        await prefilled(fakes, s, "prefill-0", 7)
        n = 3 * BUFFER_BYTES // delta_nbytes(_delta("c", 1000))
        for k in range(n):
            finish = FinishReason.LENGTH if k == n - 1 else None
            await fakes.send(Deltas("decode-0", [_delta("c", 2000 + k, finish)]))
            got = await s.next()
            assert isinstance(got, TokenDelta) and got.token_ids == [2000 + k]
        assert await s.next() is None
        assert_idle(router)
        assert await fakes.pending_ops("decode-0") == []

    run(scenario, request_buffer_bytes=BUFFER_BYTES)


# ---- the HTTP edge ---------------------------------------------------------------------------------


class _CountingRouter(StubRouter):
    """The stub router, counting the deltas each request's stream handed out and whether it was closed;
    ``chunk_bytes`` > 0: each delta carries that much text and, after ``num_chunks``, the stream waits
    (until cancelled) instead of finishing."""

    def __init__(self, chunk_bytes: int = 0, num_chunks: int = 0) -> None:
        super().__init__(max_model_len=100_000)
        self.chunk_bytes, self.num_chunks = chunk_bytes, num_chunks
        self.num_yielded: dict[str, int] = {}
        self.closed: set[str] = set()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        rid = req.request_id
        self.num_yielded[rid] = 0
        try:
            if self.chunk_bytes:
                self.calls.append(req)
                for k in range(self.num_chunks):
                    await asyncio.sleep(0)
                    self.num_yielded[rid] += 1
                    yield TokenDelta(rid, [100 + k], "x" * self.chunk_bytes)
                await asyncio.Event().wait()  # until the edge closes this stream
            async for d in super().generate(req):
                self.num_yielded[rid] += 1
                yield d
        finally:
            self.closed.add(rid)


def test_issue31_row6_the_edge_buffers_a_stream_up_to_its_bound_then_aborts_it_after_the_stall() -> None:
    """Nobody takes a fanout's events: its task takes deltas from the router until the buffer reaches
    its bound, then none (exactly), and after stall_timeout_s it ends its router stream with a
    stream_stalled error; close() aborts the request."""
    router = _CountingRouter()
    params = SamplingParams(max_tokens=50_000, temperature=0.0, logprobs=TOP)
    req = GenerateRequest("s", [10, 11, 12], params)
    limits = StreamLimits(buffer_bytes=16 << 10, stall_timeout_s=0.2)

    async def main() -> None:
        metrics = Metrics(router.worker_stats, model_name="stub-model", mode=router.mode)
        fanout = Fanout(router, metrics, cast(Plan, SimpleNamespace(jobs=[(0, req)])), 0.0, limits)
        await asyncio.wait_for(asyncio.gather(*fanout.tasks), TIMEOUT_S)
        # what the buffer holds: every delta the router handed out, then the stall error
        events = [fanout.queue.get_nowait() for _ in range(fanout.queue.qsize())]
        deltas = [e for _, e in events[:-1]]
        assert all(isinstance(d, TokenDelta) for d in deltas) and len(deltas) == router.num_yielded["s"]
        sizes = [delta_nbytes(d) for d in deltas if isinstance(d, TokenDelta)]
        assert sum(sizes[:-1]) < limits.buffer_bytes <= sum(sizes)  # it stopped at the first past the bound
        error = events[-1][1]
        assert isinstance(error, ApiError) and (error.status, error.code) == (499, "stream_stalled")
        assert "stream_stall_timeout_s" in error.message and router.closed == {"s"}
        await fanout.close()
        assert router.aborts == ["s"]

    asyncio.run(main())


def _stalled_request(port: int, body: dict[str, object]) -> socket.socket:
    """POST a streaming request and read only its response head; the caller then reads nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # NOTE: before connect: a small window
    sock.settimeout(TIMEOUT_S)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    assert sock.recv(12) == b"HTTP/1.1 200"
    return sock


def test_issue31_row6_a_stream_whose_client_reads_nothing_is_aborted_after_the_stall_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client reads the response head, then nothing: once the connection's buffers are full the
    edge's write does not return; after stream_stall_timeout_s the stream is aborted (both choices,
    on the router) and its connection closed, while the edge took no more from the router than its
    buffer bound allowed."""
    chunk = 256 << 10
    router = _CountingRouter(chunk_bytes=chunk, num_chunks=200)  # 50 MiB per choice, far past any buffer
    limits = StreamLimits(buffer_bytes=1 << 20, stall_timeout_s=0.5)
    app = create_app(router, make_tokenizer(), stream_limits=limits)
    with ServerThread(app) as server:
        body = {"prompt": [10, 11, 12], "max_tokens": 1000, "n": 2, "stream": True}
        sock = _stalled_request(server.port, body)
        try:
            assert router.wait_aborts(2, timeout=20)
            assert sorted(router.aborts) == sorted(c.request_id for c in router.calls)
            assert router.closed == {c.request_id for c in router.calls}
            # bounded: what sits in the connection's buffers (a few MiB at most) plus the edge's bound
            assert all(n < 100 for n in router.num_yielded.values()), router.num_yielded
            # the connection is closed: what is left to read ends (no [DONE])
            sock.settimeout(TIMEOUT_S)
            rest = b""
            while chunk_ := sock.recv(1 << 20):
                rest += chunk_
            assert b"data: [DONE]" not in rest
        finally:
            sock.close()
    assert any("its client read nothing for 0.5 s" in r.getMessage() for r in caplog.records)


class _ClosedFanout:
    """What ClosingStreamingResponse needs of a fanout whose choices all finished."""

    def __init__(self) -> None:
        self.limits = StreamLimits()
        self.closed = False

    def flush_direct(self) -> None:
        pass

    async def close(self) -> None:
        await asyncio.sleep(0)
        self.closed = True


@pytest.mark.parametrize("direct", [False, True])
def test_a_stream_written_whole_gives_its_lease_back_before_its_end_is_sent(direct: bool) -> None:
    """A client that reads a stream's end and sends its next request at once must find its tenant's
    lease given back (else a tenant at its request limit gets a 429 for a request that is over): the
    lease goes back just before the message that ends the answer, on both write paths."""
    from cluster.http.connections import BODY_WRITER
    from cluster.http.streaming import ClosingStreamingResponse

    sent: list[dict[str, object]] = []
    at_release: list[int] = []

    class Writer:
        is_paused = False

        def write(self, data: bytes) -> None:
            sent.append({"type": "direct", "body": data})

        async def run(self, work: Awaitable[None]) -> None:
            await work

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    async def main() -> None:
        fanout = _ClosedFanout()
        response = ClosingStreamingResponse(
            body(), cast(Fanout, fanout), on_complete=lambda: at_release.append(len(sent))
        )
        never = asyncio.Event()

        async def receive() -> dict[str, object]:
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "extensions": {}}
        if direct:
            scope["extensions"] = {BODY_WRITER: Writer()}
        await response(scope, receive, send)
        assert fanout.closed

    asyncio.run(main())
    assert [m["type"] for m in sent] == [
        "http.response.start",
        *(["direct"] * 2 if direct else ["http.response.body"] * 2),
        "http.response.body",
    ]
    assert sent[-1].get("more_body", False) is False and at_release == [len(sent) - 1]
