"""issue 30 item 2: the edge's per-token path renders SSE chunks without a dict or an encoder per chunk, and
the wire carries a plain delta as its few set fields. Both must say exactly what the general path says:
the same bytes on the SSE stream, the same TokenDelta out of the decoder, the same rejections."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import cast

import pytest

from cluster.frames import REASON_BAD_FIELD, FrameSigner
from cluster.http.connections import BodyWriter
from cluster.http.fanout import EventBuffer, Fanout
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
from cluster.http.responses import ChoiceBuilder, SseChunks, choice_builders, envelope, sse_event
from cluster.http.server_state import RouterLike
from cluster.protocol import (
    FinishReason,
    GenerateRequest,
    RequestTimings,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
)
from cluster.router.router import Router
from cluster.wire import EVENTS, ROUTER_ID, Deltas, Generate, WireDecoder, WireEncoder
from tests.support.fake_workers import TIMEOUT_S, FakeWorkers, assert_idle, run, until

SECRET = b"k" * 32
TEXTS = ["", " hello", 'say "hi"\n', "tab\tback\\slash", "naïve — 日本 🙂", "\x00\x1f\x7f", "</script>"]


def _plan(kind: str, include_usage: bool, num_choices: int = 2, logprobs: bool = False) -> Plan:
    jobs = [
        (i, GenerateRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8))) for i in range(num_choices)
    ]
    return Plan(
        kind,  # type: ignore[arg-type]
        'cmpl-\u00e9x"1',
        "pdserve-tiny",
        True,
        include_usage,
        logprobs,
        [[1, 2, 3]],
        jobs,
        created=1_700_000_000,
        num_logprobs=2 if logprobs else None,
    )


def _general(plan: Plan, builders: dict[int, ChoiceBuilder], index: int, delta: TokenDelta) -> bytes:
    usage = {"usage": None} if plan.include_usage else {}
    choice = builders[index].stream_choice(index, delta)
    return sse_event({**envelope(plan, chunk=True), "choices": [choice], **usage})


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_plain_chunk_is_byte_for_byte_the_general_one(kind: str, include_usage: bool) -> None:
    plan = _plan(kind, include_usage)
    fast, general = SseChunks(plan, choice_builders(plan, None)), choice_builders(plan, None)
    deltas = [TokenDelta(f"r{k % 2}", [100 + k] * (1 + k % 3), text) for k, text in enumerate(TEXTS)]
    deltas.append(TokenDelta("r0", [7], " end", finish_reason=FinishReason.LENGTH, timings=RequestTimings()))
    deltas.append(TokenDelta("r1", [], "", finish_reason=FinishReason.STOP))
    for delta in deltas:
        index = int(delta.request_id[1])
        assert fast.chunk(index, delta) == _general(plan, general, index, delta)
    for index in (0, 1):
        mine, theirs = fast.choices[index], general[index]
        assert (mine.text, mine.token_ids, mine.finish_reason) == (
            theirs.text,
            theirs.token_ids,
            theirs.finish_reason,
        )
    # and the bytes are the JSON the client parses
    text = fast.chunk(0, TokenDelta("r0", [5, 6], "naïve"))
    assert text.startswith(b"data: {") and text.endswith(b"}\n\n")
    assert json.loads(text[6:])["choices"][0]["token_ids"] == [5, 6]


def test_a_choice_with_logprobs_takes_the_general_path() -> None:
    plan = _plan("completion", False, logprobs=True)
    fast, general = SseChunks(plan, choice_builders(plan, None)), choice_builders(plan, None)
    assert not fast.choices[0].is_plain
    delta = TokenDelta("r0", [11], " x", logprobs=[TokenLogprobs(11, -0.25, [11, 12], [-0.25, -2.0])])
    assert fast.chunk(0, delta) == _general(plan, general, 0, delta)


def _frame_body(frame: bytes) -> object:
    """What a Deltas frame carries for its first delta (the envelope unpacked, not checked)."""
    import msgpack

    from cluster.frames import MAC_BYTES, MAGIC

    envelope_ = msgpack.unpackb(frame[len(MAGIC) + MAC_BYTES :], raw=False)
    return envelope_[5]["deltas"][0]


def test_a_plain_delta_travels_as_its_set_fields_and_decodes_to_the_same_delta() -> None:
    encoder, decoder = WireEncoder(SECRET), WireDecoder(SECRET, ROUTER_ID, EVENTS)
    plain = TokenDelta("a", [5], " hi")
    assert _frame_body(encoder.encode(ROUTER_ID, Deltas("w", [plain]))) == {
        "request_id": "a",
        "token_ids": [5],
        "text": " hi",
    }
    deltas = [
        plain,
        TokenDelta("b", [], ""),
        TokenDelta("c", [1, 2], "x", num_cached_tokens=16),
        TokenDelta("d", [3], "", scheduled_time=0.0),
        TokenDelta(
            "e", [4], "y", [TokenLogprobs(4, -0.5, [4], [-0.5])], FinishReason.STOP, 3, None, None, 1.5
        ),
        TokenDelta("f", [], "", error="boom", finish_reason=FinishReason.ERROR),
    ]
    event = decoder.decode(encoder.encode(ROUTER_ID, Deltas("w", deltas)))
    assert isinstance(event, Deltas) and event.deltas == deltas


@pytest.mark.parametrize(
    "bad",
    [
        {"request_id": "a", "token_ids": [True]},
        {"request_id": "a", "token_ids": ["5"]},
        {"request_id": 1, "token_ids": [5]},
        {"token_ids": [5]},
        {"request_id": "a", "token_ids": [5], "text": b"x"},
        {"request_id": "a", "token_ids": [5], "num_cached_tokens": 1.0},
        {"request_id": "a", "token_ids": [5], "surprise": 1},
    ],
)
def test_a_bad_plain_delta_is_still_rejected(bad: dict[str, object]) -> None:
    decoder = WireDecoder(SECRET, ROUTER_ID, EVENTS)
    frame = FrameSigner(SECRET).sign(ROUTER_ID, Deltas.TAG, {"worker_id": "w", "deltas": [bad]})
    assert decoder.decode(frame) is None
    assert decoder.rejected() == {REASON_BAD_FIELD: 1}


def test_the_event_buffer_hands_events_in_order_and_wakes_its_reader() -> None:
    async def main() -> None:
        buffer = EventBuffer(max_bytes=1 << 20)
        reader = asyncio.ensure_future(buffer.get())
        await asyncio.sleep(0)  # NOTE: one loop iteration: the reader is now waiting
        assert not reader.done()
        first, second = TokenDelta("a", [1], "x"), TokenDelta("a", [2], "y")
        buffer.put((0, first))
        buffer.put((0, second))
        assert await reader == (0, first)
        assert buffer.qsize() == 1 and buffer.get_nowait() == (0, second)
        assert buffer.empty() and buffer.num_bytes == 0
        with pytest.raises(asyncio.QueueEmpty):
            buffer.get_nowait()

    asyncio.run(main())


class _SilentRouter:
    """A router whose streams never yield (until the fanout closes them)."""

    mode = "colocated"

    def __init__(self) -> None:
        self.aborts: list[str] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        await asyncio.Event().wait()
        yield TokenDelta(req.request_id, [])  # NOTE: never reached

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)


def test_the_keep_alive_comes_after_the_idle_timeout_and_an_event_ends_the_wait() -> None:
    async def main() -> None:
        router = _SilentRouter()
        plan = _plan("completion", False, num_choices=1)
        fanout = Fanout(cast(RouterLike, router), Metrics(model_name="m"), plan, 0.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await fanout.next(0.05) is None
        assert loop.time() - t0 >= 0.05
        waiting = asyncio.ensure_future(fanout.next(60.0))
        await asyncio.sleep(0)  # NOTE: one loop iteration: the wait has started
        delta = TokenDelta("r0", [1], "x")
        fanout.queue.put((0, delta))
        assert await asyncio.wait_for(waiting, 10) == (0, delta)
        await fanout.close()
        assert router.aborts == ["r0"] and fanout._idle_timer is None

    asyncio.run(main())


class _Writer:
    """A ``BodyWriter`` stand-in: the bytes written, and a switch for a connection whose buffer is full."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.is_paused = False

    def write(self, data: bytes) -> None:
        self.data += data


def test_a_streams_plain_deltas_go_from_the_receive_loop_to_the_connection() -> None:
    """The real router and a fake worker: once the stream's writer waits, each plain mid-stream delta is
    handed from the router's receive loop to the fanout and written at once (nothing in the fanout's
    buffer, the same bytes as the general path's, in order, and counted by the flight for a migration);
    while the connection's buffer is full, or for the delta that finishes, the buffer takes them."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        plan = _plan("completion", False, num_choices=1)
        fanout = Fanout(cast(RouterLike, router), Metrics(model_name="m"), plan, 0.0)
        writer, reference = _Writer(), choice_builders(plan, None)
        fanout.body_writer = cast(BodyWriter, writer)
        fanout.chunks = SseChunks(plan, choice_builders(plan, None))
        assert isinstance(await fakes.op("colocated-0"), Generate)
        first = TokenDelta("r0", [5], " a")
        await fakes.send(Deltas("colocated-0", [first]))
        assert await asyncio.wait_for(fanout.next(60.0), TIMEOUT_S) == (0, first)  # the first: queued
        # NOTE: the writer renders the first itself (both renderers see it; it is not written here)
        assert fanout.chunks.chunk(0, first) == _general(plan, reference, 0, first)
        expected = b""
        waiting = asyncio.ensure_future(fanout.next(60.0))
        flight = router._flights.get("r0")
        assert flight is not None
        await until(lambda: flight.is_waiting and fanout._is_waiting, "the stream and its writer wait")
        plain = [TokenDelta("r0", [6], ' "b"'), TokenDelta("r0", [7, 8], "c\n")]
        await fakes.send(Deltas("colocated-0", plain[:1]))
        await fakes.send(Deltas("colocated-0", plain[1:]))
        for d in plain:
            expected += _general(plan, reference, 0, d)
        await until(lambda: len(writer.data) == len(expected), "the direct writes")
        assert bytes(writer.data) == expected and fanout.queue.empty() and not waiting.done()
        assert flight.token_ids == [5, 6, 7, 8]
        writer.is_paused = True  # the client stopped reading: the writer's own path, within its bounds
        held = TokenDelta("r0", [9], "d")
        await fakes.send(Deltas("colocated-0", [held]))
        assert await asyncio.wait_for(waiting, TIMEOUT_S) == (0, held)
        last = TokenDelta("r0", [10], "e", finish_reason=FinishReason.LENGTH)
        await fakes.send(Deltas("colocated-0", [last]))
        got = await asyncio.wait_for(fanout.next(60.0), TIMEOUT_S)
        assert got is not None and got[0] == 0 and isinstance(got[1], TokenDelta) and got[1].token_ids == [10]
        assert bytes(writer.data) == expected
        await fanout.close()
        assert_idle(router)

    run(scenario, mode="colocated")
