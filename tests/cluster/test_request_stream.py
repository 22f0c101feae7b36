"""issue 41 item 1: one request's output in one slot (cluster/router/stream.py). What its consumer has not
taken is merged, exactly: token ids and text appended in order, logprobs appended, the last delta's
finish, error, timings and cached count, the first delta's scheduled time and prompt logprobs; its bytes
counted once; its listener told of every delta as it came; its reader woken by one future."""

from __future__ import annotations

import asyncio
from array import array

import pytest

from cluster.protocol import (
    FinishReason,
    RequestAbortedError,
    RequestTimings,
    TokenDelta,
    TokenLogprobs,
    delta_nbytes,
)
from cluster.router.stream import RequestStream


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, [token, token + 1], [-0.5, -1.5])


def test_a_stream_taken_as_it_comes_hands_each_delta_as_it_came() -> None:
    stream = RequestStream("r")
    first = TokenDelta("r", [1], " a", scheduled_time=3.0)
    assert not stream.put(first) and stream.num_unread_bytes == delta_nbytes(first)
    assert stream.take() is first and stream.take() is None and stream.num_unread_bytes == 0


def test_untaken_deltas_merge_exactly() -> None:
    stream = RequestStream("r")
    timings = RequestTimings(ttft_s=0.5)
    prompt = [None, _lp(9)]
    deltas = [
        TokenDelta("r", [1], " a", [_lp(1)], scheduled_time=3.0, prompt_logprobs=prompt, num_cached_tokens=4),
        TokenDelta("r", [], ""),
        TokenDelta("r", [2, 3], " b", None, num_cached_tokens=4),
        TokenDelta("r", [4], "c", [_lp(4)], FinishReason.STOP, 4, None, timings, scheduled_time=9.0),
    ]
    for d in deltas:
        stream.put(d)
    assert stream.num_unread_bytes == sum(map(delta_nbytes, deltas))
    assert stream.take() == TokenDelta(
        "r", [1, 2, 3, 4], " a bc", [_lp(1), _lp(4)], FinishReason.STOP, 4, None, timings, 3.0, prompt
    )
    assert stream.is_finished and stream.take() is None and stream.num_unread_bytes == 0


def test_a_lagging_stream_holds_its_text_in_a_few_strings_and_its_ids_in_one_array() -> None:
    stream = RequestStream("r")
    for k in range(1000):
        stream.put(TokenDelta("r", [100_000 + k], f" t{k}"))
    merged = stream._merged
    assert merged is not None and isinstance(merged.token_ids, array) and len(merged.texts) < 64
    taken = stream.take()
    assert taken is not None and taken.token_ids == [100_000 + k for k in range(1000)]
    assert taken.text == "".join(f" t{k}" for k in range(1000))


def test_the_bound_counts_the_untaken_output_and_what_the_consumer_holds_itself() -> None:
    held = [0]
    one = TokenDelta("r", [1], "x" * 100)
    size = delta_nbytes(one)
    stream = RequestStream("r", max_unread_bytes=3 * size, unread_elsewhere=lambda: held[0])
    assert [stream.put(one) for _ in range(3)] == [False, False, False]
    assert stream.put(one)  # 4 deltas untaken: past the bound
    stream.take()
    held[0] = 2 * size  # NOTE: asked only while the consumer is behind (something was untaken)
    assert not stream.put(one)
    assert stream.put(one)  # 2 untaken + 2 held elsewhere
    final = TokenDelta("r", [2], "y" * 10_000, finish_reason=FinishReason.LENGTH)
    assert not stream.put(final)  # NOTE: the final delta always fits: nothing more will come


def test_an_error_comes_after_the_held_output_and_nothing_comes_after_the_end() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        stream.put(TokenDelta("r", [1], "a"))
        stream.fail(RequestAbortedError("aborted"))
        stream.put(TokenDelta("r", [2], "b"))  # late: ignored
        stream.fail(RequestAbortedError("twice"))
        assert (await anext(stream)).token_ids == [1]
        with pytest.raises(RequestAbortedError, match=r"^aborted$"):
            await anext(stream)

    asyncio.run(main())


def test_a_listener_sees_each_delta_before_the_merge_and_the_failure() -> None:
    seen: list[TokenDelta | None] = []

    class Listener:
        def on_output(self, stream: RequestStream, delta: TokenDelta | None) -> None:
            seen.append(delta)

    stream = RequestStream("r", Listener())
    a, b = TokenDelta("r", [1], "a"), TokenDelta("r", [2], "b")
    stream.put(a)
    stream.put(b)
    stream.fail(RequestAbortedError("x"))
    assert seen == [a, b, None]
    taken = stream.take()
    assert taken is not None and (taken.token_ids, taken.text) == ([1, 2], "ab")


def test_its_reader_waits_without_a_future_per_delta_and_close_runs_the_routers_action_once() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        closed: list[int] = []
        stream.on_close(lambda: closed.append(1))
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # NOTE: one loop iteration: the reader now waits
        waiter = stream._waiter
        assert waiter is not None and not reader.done()
        stream.put(TokenDelta("r", [1], "a"))
        stream.put(TokenDelta("r", [2], "b"))  # NOTE: before the reader ran: merged, the same future
        assert (await reader).token_ids == [1, 2] and stream._waiter is waiter
        stream.close()
        stream.close()
        assert closed == [1] and not stream.put(TokenDelta("r", [3], "c"))
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(main())
