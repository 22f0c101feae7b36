"""One client request's answer: :class:`Answer` opens a router stream per choice (n x prompts), observes the
latency metrics as each delta arrives, and renders what its streams hold into the answer: SSE chunks
written to the connection, or the choices of one JSON body.

The token path, one road: the router puts a delta into its request's stream (cluster/router/stream.py)
while it handles the worker's frame; the stream tells the choice (``_Choice.on_output``: TTFT, TBT, TPOT
and ITL observed here and nowhere else); the answer is noted due once per turn of the loop
(``DueAnswers``), and once the turn's frames are handled one callback flushes every due answer: each
takes its streams' output (merged when the producer ran ahead), renders it (``responses.SseChunks``) and
writes it to the connection in one write (``connections.BodyWriter``). No task wakes per token.

The one byte bound: an answer's client may leave ``stream_buffer_bytes`` unread, counted once: the output
its choices' router streams hold (left there while the connection's buffer is full) plus the bytes in the
connection's write buffer. A choice whose output takes it past the bound is aborted by the router (its KV
freed) and its stream ends with ``stream_stalled``. The one time bound: a connection whose buffer stays full for
``stream_stall_timeout_s`` ends the answer (``ClientStalled``).

Lifecycle: ``close()`` must run once the answer is done or abandoned (idempotent): it closes every router
stream, which aborts the requests that did not end, so a disconnect, an error or a sibling choice's failure
frees KV blocks everywhere.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import replace

from cluster.http.connections import Writer
from cluster.http.errors import ApiError, as_api_error, error_body
from cluster.http.metrics import Metrics
from cluster.http.planning import Plan
from cluster.http.responses import ChoiceBuilder, SseChunks, choice_builders, sse_event, usage
from cluster.http.server_state import DueAnswers, RouterLike, StreamLimits
from cluster.protocol import FinishReason, TokenDelta
from cluster.router.stream import RequestStream
from cluster.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

KEEPALIVE_S = 15.0  # an SSE comment while idle, so a vanished client is noticed on the next send
STALLED_CODE = "stream_stalled"
DONE_EVENT = b"data: [DONE]\n\n"


def _role_choice(index: int) -> dict[str, object]:
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


class ClientStalled(Exception):
    """The connection's write buffer stayed full for the stall timeout: its client reads nothing."""


def stalled_error(limits: StreamLimits, what: str) -> ApiError:
    return ApiError(
        499,
        f"stream aborted: {what} for {limits.stall_timeout_s:g} s (stream_stall_timeout_s)",
        code=STALLED_CODE,
    )


class _Choice:
    """One choice's router stream as its answer sees it: the stream's listener."""

    __slots__ = ("answer", "error", "index", "is_due", "last", "num_prompt_tokens", "num_tokens", "stream")

    def __init__(self, answer: Answer, index: int, num_prompt_tokens: int) -> None:
        self.answer, self.index, self.num_prompt_tokens = answer, index, num_prompt_tokens
        self.stream: RequestStream | None = None
        self.last: float | None = None  # when its last token arrived (perf_counter)
        self.num_tokens = 0
        self.is_due = False  # it has output or an end the answer has not handled yet
        self.error: ApiError | None = None  # how it failed

    def on_output(self, stream: RequestStream, delta: TokenDelta | None) -> None:
        """The router's stream got ``delta`` (None: it failed): the request's metrics, then the answer is
        due. NOTE: the only place the per-token latencies are observed."""
        answer = self.answer
        if delta is None:
            self.error = as_api_error(stream.error) if stream.error is not None else None
        else:
            now = time.perf_counter()
            if delta.token_ids:
                if self.last is None:
                    answer.metrics.observe_first_token(now - answer.arrival, answer.mode)
                else:
                    answer.observe_gap(now - self.last)
                self.last, self.num_tokens = now, self.num_tokens + len(delta.token_ids)
            if delta.finish_reason == FinishReason.ERROR:
                self.error = ApiError(
                    500, f"worker failed: {delta.error or 'unknown error'}", code="worker_failed"
                )
            elif delta.finish_reason is not None:
                answer.observe_finished(self, delta, now)
        if not self.is_due:
            self.is_due = True
            answer.due(self)

    @property
    def is_ended(self) -> bool:
        return self.error is not None or (self.stream is not None and self.stream.is_finished)


class Answer:
    """The choices of one plan, their router streams and their rendering (see the module docstring).

    Phases: opened (``__init__``; a RouterError there means nothing was left queued), then ``first_output``
    (until some choice has output or failed: an error first is the request's HTTP error), then one of
    ``collect`` (a JSON body) or ``attach`` + ``written`` (an SSE stream)."""

    def __init__(
        self,
        router: RouterLike,
        metrics: Metrics,
        plan: Plan,
        arrival: float,
        *,
        due: DueAnswers,
        limits: StreamLimits | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.plan, self.metrics, self.arrival, self.mode = plan, metrics, arrival, router.mode
        self.limits = limits or StreamLimits()
        self.observe_gap = metrics.token_gap_observer(self.mode)
        self.builders: dict[int, ChoiceBuilder] = choice_builders(plan, tokenizer)
        self.remaining = len(plan.jobs)  # choices not finished yet
        self.generated: list[int] = []  # tokens of each finished choice (vllm:request_max_num_...)
        self.error: ApiError | None = None  # the first choice's error: the answer ends with it
        self.closed = False
        self.is_written = False  # SSE: the whole answer, [DONE] included, is written
        self.writer: Writer | None = None
        self.chunks: SseChunks | None = None
        self._due_answers = due
        self._due: list[_Choice] = []
        self._is_collecting = False
        self._wakeup: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._last_write = 0.0
        self._keepalive: asyncio.TimerHandle | None = None
        self.choices: list[_Choice] = []
        try:
            for index, req in plan.jobs:
                choice = _Choice(self, index, len(req.prompt_token_ids))
                self.choices.append(choice)
                choice.stream = router.open(
                    req,
                    choice,
                    max_unread_bytes=self.limits.buffer_bytes,
                    unread_elsewhere=functools.partial(self._unread_besides, choice),
                )
        except BaseException:
            self.close()
            raise

    # ---- what the choices tell it ---------------------------------------------------------------------
    def due(self, choice: _Choice) -> None:
        if not self._due:
            self._due_answers.add(self)
        self._due.append(choice)

    def observe_finished(self, choice: _Choice, delta: TokenDelta, now: float) -> None:
        self.generated.append(choice.num_tokens)
        if len(self.generated) == len(self.choices):
            self.metrics.observe_group(self.generated)
        reason = delta.finish_reason
        self.metrics.observe_finished(
            delta.timings,
            reason.value if reason is not None else "",
            self.mode,
            e2e_s=now - self.arrival,
            num_prompt_tokens=choice.num_prompt_tokens,
            num_generation_tokens=choice.num_tokens,
            num_cached_tokens=delta.num_cached_tokens,
        )

    def _unread_besides(self, choice: _Choice) -> int:
        """What the client has not read of this answer but ``choice``'s stream's output: the other choices'
        untaken output and the connection's write buffer (the bound is the answer's, counted once)."""
        writer = self.writer
        unread = writer.num_buffered_bytes if writer is not None else 0
        for other in self.choices:
            if other is not choice and other.stream is not None:
                unread += other.stream.num_unread_bytes
        return unread

    # ---- handing the output on --------------------------------------------------------------------------
    def flush(self) -> None:
        """The due choices' output goes where the answer is in its phases (``DueAnswers`` calls it once a
        turn): written as SSE, added to the JSON body's choices, or left in the streams until the head is
        sent (the waiting task is woken)."""
        if self.closed:
            return
        if self.chunks is not None:
            self._write_due()
        elif self._is_collecting:
            self._collect_due()
        self._wake()

    def _take(self) -> list[tuple[_Choice, TokenDelta | None]]:
        """The due choices' output, in the order it came (their errors after it); clears ``_due``."""
        due, self._due = self._due, []
        taken = []
        for choice in due:
            choice.is_due = False
            assert choice.stream is not None
            taken.append((choice, choice.stream.take()))
        return taken

    def _collect_due(self) -> None:
        for choice, delta in self._take():
            if delta is not None and delta.finish_reason != FinishReason.ERROR:
                self.builders[choice.index].add(delta)
                self.remaining -= delta.finish_reason is not None
            if choice.error is not None and self.error is None:
                self.error = choice.error

    def _write_due(self) -> None:
        writer, chunks = self.writer, self.chunks
        assert writer is not None and chunks is not None
        if writer.is_paused or self.is_written:
            return  # NOTE: the output waits in the streams; the waiting task drains the connection
        parts: list[bytes] = []
        for choice, delta in self._take():
            if self.error is not None:
                break
            if delta is not None:
                if delta.finish_reason == FinishReason.ERROR:  # NOTE: the tokens before it still go out
                    delta = replace(delta, finish_reason=None, error=None) if delta.token_ids else None
                if delta is not None:
                    parts.append(chunks.chunk(choice.index, delta))
                    self.remaining -= delta.finish_reason is not None
            if choice.error is not None:
                self.error = choice.error
                self.metrics.observe_error(choice.error.status, choice.error.code)
                parts.append(sse_event(error_body(choice.error)))
        if self.remaining == 0 or self.error is not None:
            if self.remaining == 0 and self.plan.include_usage:
                parts.append(
                    sse_event({**chunks.envelope, "choices": [], "usage": usage(self.plan, self.builders)})
                )
            parts.append(DONE_EVENT)
            self.is_written = True
        if parts:
            writer.write(parts[0] if len(parts) == 1 else b"".join(parts))
            self._last_write = self._loop.time()

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        waiter = self._wakeup
        if waiter is None or waiter.done():
            waiter = self._wakeup = self._loop.create_future()
        await waiter

    # ---- the phases -----------------------------------------------------------------------------------
    async def first_output(self) -> None:
        """Until some choice has output or has failed; raises the ApiError of a choice that failed before
        any output (the request's HTTP status: 429, 503, 504 ...)."""
        while not self._due:
            await self._wait()
        first = self._due[0]
        assert first.stream is not None
        if first.error is not None and not first.stream.has_output:
            raise first.error

    async def collect(self) -> dict[int, ChoiceBuilder]:
        """Every choice's whole output (a JSON answer); raises the first choice's error."""
        self._is_collecting = True
        self._collect_due()
        while self.remaining and self.error is None:
            await self._wait()
        if self.error is not None:
            raise self.error
        return self.builders

    def attach(self, writer: Writer) -> None:
        """Stream from here on to ``writer`` (the response head is sent): the chat role chunks, then what
        the streams hold, then each turn's output as it comes."""
        chunks = self.chunks = SseChunks(self.plan, self.builders)
        self.writer = writer
        if self.plan.kind == "chat":
            head = {**chunks.envelope}
            writer.write(
                b"".join(
                    sse_event({**head, "choices": [_role_choice(i)], **chunks.usage}) for i in self.builders
                )
            )
        self._last_write = self._loop.time()
        self._write_due()
        self._keepalive = self._loop.call_at(self._last_write + KEEPALIVE_S, self._keep_alive)

    def _keep_alive(self) -> None:
        """A comment once the answer wrote nothing for KEEPALIVE_S (one timer, re-armed when it fires)."""
        self._keepalive = None
        writer = self.writer
        if self.closed or self.is_written or writer is None:
            return
        due = self._last_write + KEEPALIVE_S
        if self._loop.time() >= due:
            if not writer.is_paused:
                writer.write(b": keep-alive\n\n")
            self._last_write = self._loop.time()
            due = self._last_write + KEEPALIVE_S
        self._keepalive = self._loop.call_at(due, self._keep_alive)

    async def written(self) -> None:
        """Until the whole answer is written and the connection took it; ClientStalled once the
        connection's buffer stayed full for ``stream_stall_timeout_s`` (a bound armed only while it is
        full: no timer per write)."""
        writer = self.writer
        assert writer is not None
        while not self.is_written or writer.is_paused:
            if writer.is_paused:
                try:
                    async with asyncio.timeout(self.limits.stall_timeout_s):
                        await writer.drain()
                except TimeoutError:
                    raise ClientStalled from None
                self._write_due()
                continue
            await self._wait()

    def close(self) -> None:
        """Close every choice's router stream (idempotent): a request that did not end is aborted."""
        if self.closed:
            return
        self.closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        for choice in self.choices:
            stream = choice.stream
            if stream is None:
                continue
            if not choice.is_ended:
                self.metrics.observe_abort(self.mode)
            stream.close()
