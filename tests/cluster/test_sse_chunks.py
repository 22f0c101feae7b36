"""issue 30 item 2 and issue 41 item 1: the edge's per-token path renders SSE chunks without a dict or an
encoder per chunk, byte for byte what the general path renders, and writes a turn's output from the
receive loop, one write a turn. (The wire's plain deltas, once here: tests/cluster/test_wire.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import cast

import pytest

from cluster.http import answer as answer_module
from cluster.http.answer import Answer
from cluster.http.connections import Writer
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
from cluster.http.responses import ChoiceBuilder, SseChunks, choice_builders, envelope, sse_event
from cluster.http.server_state import DueAnswers
from cluster.protocol import (
    FinishReason,
    GenerateRequest,
    RequestTimings,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    delta_nbytes,
)
from cluster.router.router import Router
from cluster.wire import Deltas, Generate
from tests.support.fake_workers import TIMEOUT_S, FakeWorkers, assert_idle, run, until
from tests.support.stub_router import StubRouter

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


class _SilentRouter(StubRouter):
    """A router whose streams never yield (until the answer closes them)."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.calls.append(req)
        await asyncio.Event().wait()
        yield TokenDelta(req.request_id, [])  # NOTE: never reached


class _Writer:
    """A ``connections.Writer`` stand-in: the bytes written, and a switch for a connection whose buffer
    is full (``drain`` then waits until the test opens it)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.num_writes = 0
        self.is_paused = False
        self.num_buffered_bytes = 0
        self.room = asyncio.Event()

    def write(self, data: bytes) -> None:
        self.data += data
        self.num_writes += 1

    async def drain(self) -> None:
        await self.room.wait()
        self.is_paused = False

    async def run(self, work: Awaitable[None]) -> None:
        await work

    def abandon(self) -> None:
        raise AssertionError("not a stalled answer")


def test_the_keep_alive_comes_after_the_idle_timeout_and_output_puts_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(answer_module, "KEEPALIVE_S", 0.05)

    async def main() -> None:
        router = _SilentRouter()
        plan = _plan("completion", False, num_choices=1)
        answer = Answer(router, Metrics(model_name="m"), plan, 0.0, due=DueAnswers())
        writer = _Writer()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        answer.attach(cast(Writer, writer))
        assert writer.data == b""
        await until(lambda: writer.data == b": keep-alive\n\n", "the first keep-alive")
        assert loop.time() - t0 >= 0.05
        (choice,) = answer.choices
        assert choice.stream is not None
        delta = TokenDelta("r0", [1], "x")
        choice.stream.put(delta)
        await until(lambda: writer.num_writes == 2, "the output written")
        assert bytes(writer.data) == b": keep-alive\n\n" + _general(
            plan, choice_builders(plan, None), 0, delta
        )
        answer.close()
        assert router.aborts == ["r0"] and answer._keepalive is None

    asyncio.run(main())


def test_a_streams_deltas_go_from_the_receive_loop_to_the_connection_one_write_a_turn() -> None:
    """The real router and a fake worker: each plain delta is written from the turn of the loop that
    received it, in one write per turn, the same bytes as the general path's (and counted by the flight
    for a migration); while the connection's buffer is full the output waits in the stream, merged, and
    goes out as one chunk once it drains; the final delta ends the answer with [DONE]."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        plan = _plan("completion", False, num_choices=1)
        answer = Answer(router, Metrics(model_name="m"), plan, 0.0, due=DueAnswers())
        writer, reference = _Writer(), choice_builders(plan, None)
        assert isinstance(await fakes.op("colocated-0"), Generate)
        first = TokenDelta("r0", [5], " a")
        await fakes.send(Deltas("colocated-0", [first]))
        await asyncio.wait_for(answer.first_output(), TIMEOUT_S)
        answer.attach(cast(Writer, writer))
        expected = _general(plan, reference, 0, first)
        assert bytes(writer.data) == expected and writer.num_writes == 1
        plain = [TokenDelta("r0", [6], ' "b"'), TokenDelta("r0", [7, 8], "c\n")]
        for k, d in enumerate(plain):
            await fakes.send(Deltas("colocated-0", [d]))
            expected += _general(plan, reference, 0, d)
            await until(lambda k=k: writer.num_writes == 2 + k, "the write of the turn")  # type: ignore[misc]
        assert bytes(writer.data) == expected
        flight = router._flights.get("r0")
        assert flight is not None and flight.token_ids == [5, 6, 7, 8]
        writer.is_paused = True  # the client stopped reading: the output waits in the stream
        written = asyncio.ensure_future(answer.written())
        held = [TokenDelta("r0", [9], "d"), TokenDelta("r0", [10], "e")]
        await fakes.send(*(Deltas("colocated-0", [d]) for d in held))
        stream = answer.choices[0].stream
        assert stream is not None
        await until(lambda: stream.num_unread_bytes == sum(map(delta_nbytes, held)), "both held")
        assert writer.num_writes == 3
        writer.room.set()  # the client reads again: the held output goes out as one chunk
        expected += _general(plan, reference, 0, TokenDelta("r0", [9, 10], "de"))
        await until(lambda: writer.num_writes == 4, "the held output written")
        assert bytes(writer.data) == expected and not written.done()
        last = TokenDelta("r0", [11], "f", finish_reason=FinishReason.LENGTH)
        await fakes.send(Deltas("colocated-0", [last]))
        await asyncio.wait_for(written, TIMEOUT_S)
        tail = bytes(writer.data)[len(expected) :]
        assert tail.endswith(b"data: [DONE]\n\n") and b'"token_ids":[11],"finish_reason":"length"' in tail
        answer.close()
        assert_idle(router)

    run(scenario, mode="colocated")
