"""issue 31 row 6 (one bound since issue 41): bounded streams. A caller that stops reading cannot make the
router or the HTTP edge hold its request's output without bound: the router aborts a request whose
untaken output passes its consumer's bound (the edge's ``stream_buffer_bytes``, counted once: what its
router stream holds plus the connection's write buffer; on its workers: its KV is freed), and the edge
ends a stream whose client read nothing for ``stream_stall_timeout_s``."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from typing import cast

import pytest

from cluster.config import ServerConfig
from cluster.http.answer import Answer
from cluster.http.app import create_app
from cluster.http.metrics import Metrics
from cluster.http.planning import Edge, plan_completion
from cluster.http.server_state import DueAnswers, StreamLimits
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
    assert_idle,
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
    """The caller takes the first token, then nothing: the request's stream holds the deltas up to the
    caller's bound (merged: one delta, not one per token), then the router aborts the request on its
    decode worker (its KV freed) and drops what the worker still sends; the caller, once it reads again,
    gets the held output, then the abort, and the router holds nothing (its leak check)."""
    per_delta = delta_nbytes(_delta("a", 1000))
    fits = BUFFER_BYTES // per_delta  # deltas that fit under the bound; the next one passes it

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        params = SamplingParams(max_tokens=1000, temperature=0.0, logprobs=TOP)
        stream = router.open(GenerateRequest("a", PROMPT, params), max_unread_bytes=BUFFER_BYTES)
        first = asyncio.ensure_future(anext(stream))
        op = await fakes.op("prefill-0")
        assert isinstance(op, Generate) and op.request_id == "a"
        await fakes.send(Prefilled("prefill-0", _delta("a", 7), b"kv-a"))
        assert (await asyncio.wait_for(first, TIMEOUT_S)).token_ids == [7]
        assert isinstance(await fakes.op("decode-0"), DecodeHandoff)
        # the caller stops reading here; the decode worker goes on producing
        for k in range(fits + 50):
            await fakes.send(Deltas("decode-0", [_delta("a", 2000 + k)]))
        await fakes.send(Deltas("decode-0", [_delta("a", 9999, FinishReason.LENGTH)]))
        await until(lambda: stream.error is not None, "the stream overflowed")
        # both sides: the prefill worker still holds the KV it offered (no Transferred yet)
        assert (await fakes.op("decode-0"), await fakes.op("prefill-0")) == (Abort("a"), Abort("a"))
        # NOTE: the router handles events in the order sent: once the final delta's turn has passed
        # (a heartbeat after it is admitted), every late delta was dropped
        await fakes.beat("decode-0", num_free_blocks=77)
        await until(lambda: _free_blocks(router, "decode-0") == 77, "the later heartbeat")
        # the bound held: the deltas under it and the one that passed it, then the abort
        assert stream.num_unread_bytes == (fits + 1) * per_delta
        assert {w.worker_id: w.num_assigned for w in router.workers} == {"prefill-0": 0, "decode-0": 0}
        tokens: list[int] = []
        with pytest.raises(RequestAbortedError, match="stream_buffer_bytes 16384"):
            async for d in stream:
                tokens += d.token_ids
                assert d.logprobs is not None and [lp.token_id for lp in d.logprobs] == d.token_ids
        assert tokens == [2000 + k for k in range(fits + 1)]
        stream.close()
        assert_idle(router)
        # aborted once on each, not again when the caller closed its stream
        assert await fakes.pending_ops("decode-0") == []
        assert await fakes.pending_ops("prefill-0") == []

    run(scenario)


def _free_blocks(router: Router, worker_id: str) -> int | None:
    w = next(w for w in router.workers if w.worker_id == worker_id)
    return w.stats.engine.num_free_blocks if w.stats is not None else None


def test_issue31_row6_a_caller_that_keeps_up_is_never_cut() -> None:
    """Far more output than the bound, taken as it comes: it all arrives and nothing is aborted."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        params = SamplingParams(max_tokens=1000, temperature=0.0, logprobs=TOP)
        stream = router.open(GenerateRequest("c", PROMPT, params), max_unread_bytes=BUFFER_BYTES)
        await fakes.op("prefill-0")
        await fakes.send(Prefilled("prefill-0", _delta("c", 7), b"kv-c"))
        assert (await asyncio.wait_for(anext(stream), TIMEOUT_S)).token_ids == [7]
        assert isinstance(await fakes.op("decode-0"), DecodeHandoff)
        n = 3 * BUFFER_BYTES // delta_nbytes(_delta("c", 1000))
        for k in range(n):
            finish = FinishReason.LENGTH if k == n - 1 else None
            await fakes.send(Deltas("decode-0", [_delta("c", 2000 + k, finish)]))
            got = await asyncio.wait_for(anext(stream), TIMEOUT_S)
            assert got.token_ids == [2000 + k] and got.finish_reason == finish
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert stream.error is None
        assert_idle(router)
        assert await fakes.pending_ops("decode-0") == []

    run(scenario)


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


def test_issue31_row6_an_answer_nobody_takes_is_aborted_at_its_bound_exactly() -> None:
    """Nobody takes an answer's output (no writer yet, no collector): its router stream holds the deltas
    until they pass ``buffer_bytes``, then the request is aborted (once) with a stream_stalled error
    after exactly the deltas held, merged into one; closing the answer aborts nothing more."""
    router = _CountingRouter(chunk_bytes=1000, num_chunks=200)
    limits = StreamLimits(buffer_bytes=16 << 10, stall_timeout_s=0.2)
    per_delta = delta_nbytes(TokenDelta("s", [100], "x" * 1000))
    fits = limits.buffer_bytes // per_delta

    async def main() -> None:
        metrics = Metrics(router.worker_stats, model_name="stub-model", mode=router.mode)
        plan = plan_completion({"prompt": [10, 11, 12], "max_tokens": 50_000, "stream": True}, _edge(router))
        answer = Answer(router, metrics, plan, 0.0, due=DueAnswers(), limits=limits)
        (choice,) = answer.choices
        stream = choice.stream
        assert stream is not None
        await until(lambda: stream.error is not None, "the stream passed its bound")
        rid = plan.jobs[0][1].request_id
        assert router.num_yielded[rid] == fits + 1 and router.aborts == [rid]
        assert isinstance(stream.error, RequestAbortedError)
        assert "stream_stalled" in str(stream.error) and "stream_buffer_bytes 16384" in str(stream.error)
        held = stream.take()
        assert held is not None and held.token_ids == [100 + k for k in range(fits + 1)]
        assert held.text == "x" * 1000 * (fits + 1)
        answer.close()
        assert router.aborts == [rid]
        await until(lambda: router.closed == {rid}, "the stub's generator closed")

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
    output waits in the choices' router streams, and each choice is aborted on the router as the answer
    passes its buffer bound (the edge took no more from the router than that); the connection, full for
    stream_stall_timeout_s, is closed: what the client reads afterwards ends, within the bound."""
    chunk = 256 << 10
    router = _CountingRouter(chunk_bytes=chunk, num_chunks=200)  # 50 MiB per choice, far past any buffer
    limits = StreamLimits(buffer_bytes=1 << 20, stall_timeout_s=0.5)
    server_config = ServerConfig(stream_buffer_bytes=limits.buffer_bytes, stream_stall_timeout_s=0.5)
    app = create_app(router, make_tokenizer(), server_config)
    with ServerThread(app, send_buffer_bytes=4096) as server:
        body = {"prompt": [10, 11, 12], "max_tokens": 1000, "n": 2, "stream": True}
        sock = _stalled_request(server.port, body)
        try:
            assert router.wait_aborts(2, timeout=20)
            assert sorted(router.aborts) == sorted(c.request_id for c in router.calls)
            assert router.closed == {c.request_id for c in router.calls}
            # bounded: what sits in the connection's buffers (a few MiB at most) plus the edge's bound
            assert all(n < 100 for n in router.num_yielded.values()), router.num_yielded
            deadline = time.monotonic() + 20
            while not any("its client read nothing for 0.5 s" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the stall bound never ended the answer"
                time.sleep(0.05)  # NOTE: a bounded poll of the server thread's log
            # the connection is closed: what is left to read ends
            sock.settimeout(TIMEOUT_S)
            rest = b""
            while chunk_ := sock.recv(1 << 20):
                rest += chunk_
            # all the client can still read: at most the bound and a delta per choice (the bound held)
            assert len(rest) <= limits.buffer_bytes + 2 * (chunk + 1024)
        finally:
            sock.close()
    assert any("its client read nothing for 0.5 s" in r.getMessage() for r in caplog.records)


class _FinishedRouter(StubRouter):
    """Every request finishes at once with one token."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.calls.append(req)
        yield TokenDelta(req.request_id, [5], " w5", finish_reason=FinishReason.LENGTH)


class _Writer:
    """A ``connections.Writer`` of the pdserve server (the BODY_WRITER extension), recording into ``sent``."""

    def __init__(self, sent: list[dict[str, object]]) -> None:
        self.sent = sent
        self.is_paused = False
        self.num_buffered_bytes = 0

    def write(self, data: bytes) -> None:
        self.sent.append({"type": "direct", "body": data})

    async def drain(self) -> None:
        pass

    async def run(self, work: Awaitable[None]) -> None:
        await work

    def abandon(self) -> None:
        raise AssertionError("not a stalled answer")


@pytest.mark.parametrize("direct", [False, True])
def test_a_stream_written_whole_gives_its_lease_back_before_its_end_is_sent(direct: bool) -> None:
    """A client that reads a stream's end and sends its next request at once must find its tenant's
    lease given back (else a tenant at its request limit gets a 429 for a request that is over): the
    lease goes back just before the message that ends the answer, with pdserve's writer and over plain
    ASGI sends."""
    from cluster.http.connections import BODY_WRITER
    from cluster.http.streaming import SseResponse

    sent: list[dict[str, object]] = []
    at_release: list[int] = []

    async def main() -> None:
        router = _FinishedRouter()
        plan = plan_completion({"prompt": [10, 11], "max_tokens": 1, "stream": True}, _edge(router))
        answer = Answer(router, Metrics(model_name="m"), plan, 0.0, due=DueAnswers())
        await asyncio.wait_for(answer.first_output(), TIMEOUT_S)
        response = SseResponse(answer, on_complete=lambda: at_release.append(len(sent)))
        never = asyncio.Event()

        async def receive() -> dict[str, object]:
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope: dict[str, object] = {"type": "http", "asgi": {"spec_version": "2.3"}, "extensions": {}}
        if direct:
            scope["extensions"] = {BODY_WRITER: _Writer(sent)}
        await response(scope, receive, send)
        assert answer.closed and router.aborts == []

    asyncio.run(main())
    body_type = "direct" if direct else "http.response.body"
    assert sent[0]["type"] == "http.response.start" and sent[-1]["type"] == "http.response.body"
    assert [m["type"] for m in sent[1:-1]] == [body_type] * (len(sent) - 2) and len(sent) > 2
    body = b"".join(cast(bytes, m["body"]) for m in sent[1:-1])
    assert body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in body
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert at_release == [len(sent) - 1]


def test_the_stall_bound_holds_over_plain_asgi_sends_too(caplog: pytest.LogCaptureFixture) -> None:
    """Under a server that is not pdserve's (plain ASGI ``send``): a send that never returns (a client
    that reads nothing) ends the answer after stream_stall_timeout_s, its request aborted, the lease
    never given back as complete."""
    from cluster.http.streaming import SseResponse

    router = _CountingRouter(chunk_bytes=64, num_chunks=3)
    limits = StreamLimits(buffer_bytes=1 << 20, stall_timeout_s=0.2)
    completed: list[bool] = []

    async def main() -> None:
        plan = plan_completion({"prompt": [10, 11], "max_tokens": 100, "stream": True}, _edge(router))
        answer = Answer(router, Metrics(model_name="m"), plan, 0.0, due=DueAnswers(), limits=limits)
        await asyncio.wait_for(answer.first_output(), TIMEOUT_S)
        response = SseResponse(answer, on_complete=lambda: completed.append(True))
        never = asyncio.Event()
        started: list[str] = []

        async def receive() -> dict[str, object]:
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            started.append(str(message["type"]))
            if message["type"] == "http.response.body":
                await never.wait()  # the client reads nothing

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(response({"type": "http", "extensions": {}}, receive, send), TIMEOUT_S)
        assert loop.time() - t0 >= limits.stall_timeout_s
        assert started == ["http.response.start", "http.response.body"]
        assert answer.closed and router.aborts == [plan.jobs[0][1].request_id]

    with caplog.at_level("WARNING", logger="cluster.http.streaming"):
        asyncio.run(main())
    assert completed == []
    assert any("its client read nothing for 0.2 s" in r.getMessage() for r in caplog.records)


def _edge(router: StubRouter) -> Edge:
    return Edge(router.model_info, make_tokenizer(), [router.model_info.name])
