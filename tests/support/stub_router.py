"""Test utilities for the HTTP front: a deterministic in-memory Router, a word-level tokenizer with a chat
template, and a uvicorn server in a background thread.

``StubRouter`` emits, for a prompt P and seed s, token k = (sum(P) + 31 * (s or 0) + 7 * k + 3) mod vocab
(skipping the 3 special ids), text " w<id>" per token, one token per delta with a tiny await between
deltas. It applies stop strings, stop_token_ids and max_tokens like the engine, records every request
and abort, and can be told to fail (see ``behavior``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import httpx
import tokenizers
from fastapi import FastAPI

from cluster.http.app import create_server
from cluster.protocol import (
    ClusterUnavailableError,
    DeadlineExceededError,
    EngineStats,
    FinishReason,
    GenerateRequest,
    ModelInfo,
    QueueFullError,
    RequestAbortedError,
    RequestTimings,
    RouterError,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    TransferStats,
    WorkerFailedError,
    WorkerStats,
)
from cluster.router.stream import OutputListener, RequestStream
from cluster.tokenizer import Tokenizer

VOCAB_SIZE = 512
NUM_SPECIAL = 3  # <unk> <s> </s>
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }} {{ m['role'] }} {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def make_tokenizer() -> Tokenizer:
    """Word-level tokenizer: <unk>=0 <s>=1 </s>=2, roles 3-5, then "w<id>" for every other id."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "system": 3, "user": 4, "assistant": 5}
    vocab.update({f"w{i}": i for i in range(6, VOCAB_SIZE)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)


def token_text(token_id: int) -> str:
    return f" w{token_id}"


def expected_tokens(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """The ids the stub generates before stop handling (max_tokens of them)."""
    base = sum(prompt_ids) + 31 * (params.seed or 0)
    span = VOCAB_SIZE - NUM_SPECIAL
    return [NUM_SPECIAL + (base + 7 * k + 3) % span for k in range(params.max_tokens)]


def fake_logprobs(token_id: int, k: int) -> TokenLogprobs:
    top = [NUM_SPECIAL + (token_id - NUM_SPECIAL + i) % (VOCAB_SIZE - NUM_SPECIAL) for i in range(k)]
    return TokenLogprobs(token_id, -0.25, top, [-0.25 - 0.5 * i for i in range(k)])


class StubRouter:
    """A deterministic Router for server/client tests; thread-safe enough for one test at a time.

    behavior: None (normal), "queue_full", "unavailable" (503), "deadline" (waits until req.deadline,
    then 504), "fail_mid" (2 deltas then WorkerFailedError), "hang" (1 delta then waits until aborted
    or cancelled), "hang_first" (waits so before its first delta). ``fail_next`` errors are raised (and popped) first, one per call.
    """

    def __init__(self, mode: str = "disaggregated", max_model_len: int = 128) -> None:
        self.model_info = ModelInfo("stub-model", "/models/stub", max_model_len, VOCAB_SIZE)
        self.mode = mode
        self.behavior: str | None = None
        # each delta waits until the consumer took the one before (a consumer that keeps up: a chunk per
        # delta; else the stream merges what the consumer has not taken)
        self.paced = False
        self.fail_next: list[RouterError] = []
        self.healthy = True
        self.num_cached_tokens = 0
        self.calls: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.abort_event = threading.Event()
        self._abort_cond = threading.Condition()
        self.stats = [
            WorkerStats(
                "prefill-0",
                "prefill",
                engine=EngineStats(
                    num_running=1,
                    num_waiting=2,
                    num_free_blocks=30,
                    num_total_blocks=40,
                    prefix_cache_queries=100,
                    prefix_cache_hits=40,
                ),
                transfer=TransferStats(num_ok=2, bytes_total=4096, seconds_total=0.01),
                rejected_frames={"bad_mac": 3},
            ),
            WorkerStats(
                "decode-0",
                "decode",
                num_waiting_for_kv=1,
                engine=EngineStats(num_running=3, num_free_blocks=20, num_total_blocks=40, num_preemptions=1),
                transfer=TransferStats(num_ok=2, bytes_total=4096),
            ),
        ]

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.calls.append(req)
        start = time.perf_counter()
        if self.fail_next:
            raise self.fail_next.pop(0)
        if self.behavior == "queue_full":
            raise QueueFullError("router queue is full (4 waiting, max_waiting 4)")
        if self.behavior == "unavailable":
            raise ClusterUnavailableError("no healthy decode worker")
        if self.behavior == "deadline":
            assert req.deadline is not None, "deadline behavior needs a request deadline"
            await asyncio.sleep(max(0.0, req.deadline - time.time()))
            raise DeadlineExceededError(f"request {req.request_id} passed its deadline")
        p = req.params
        text = ""
        ids = expected_tokens(req.prompt_token_ids, p)
        for k, token in enumerate(ids):
            await asyncio.sleep(0.001)
            if self.behavior == "fail_mid" and k == 2:
                raise WorkerFailedError("decode worker decode-0 died")
            if (self.behavior == "hang" and k == 1) or (self.behavior == "hang_first" and k == 0):
                await asyncio.Event().wait()  # until the server cancels this stream
            finish: FinishReason | None = None
            new_text = token_text(token)
            cut = [i for s in p.stop if (i := (text + new_text).find(s)) >= 0]
            if token in p.stop_token_ids or cut:
                finish = FinishReason.STOP
                new_text = (text + new_text)[: min(cut)][len(text) :] if cut else ""
            elif k == len(ids) - 1:
                finish = FinishReason.LENGTH
            text += new_text
            emitted = [] if token in p.stop_token_ids else [token]
            logprobs = [fake_logprobs(t, p.logprobs) for t in emitted] if p.logprobs is not None else None
            timings = None
            if finish is not None:
                e2e = time.perf_counter() - start
                transfer = 0.003 if self.mode == "disaggregated" else 0.0
                timings = RequestTimings(0.001, 0.002, transfer, max(0.0, e2e - 0.006), 0.003, e2e)
            yield TokenDelta(
                req.request_id, emitted, new_text, logprobs, finish, self.num_cached_tokens, timings=timings
            )
            if finish is not None:
                return

    def open(
        self,
        req: GenerateRequest,
        listener: OutputListener | None = None,
        *,
        max_unread_bytes: int | None = None,
        unread_elsewhere: Callable[[], int] | None = None,
    ) -> RequestStream:
        """``Router.open`` over ``generate``: a task puts its deltas into the stream. An abort is recorded
        as the router sends one: for a stream past its bound, one that failed, one closed unfinished."""
        stream = RequestStream(
            req.request_id, listener, max_unread_bytes=max_unread_bytes, unread_elsewhere=unread_elsewhere
        )
        task = asyncio.get_running_loop().create_task(self._feed(req, stream))

        def on_close() -> None:
            if not task.done():
                task.cancel()
            if not stream.is_ended:
                self._record_abort(req.request_id)

        stream.on_close(on_close)
        return stream

    async def _feed(self, req: GenerateRequest, stream: RequestStream) -> None:
        gen = self.generate(req)
        try:
            async for delta in gen:
                if self.paced:
                    await _taken(stream)
                if stream.put(delta):
                    stream.fail(
                        RequestAbortedError(
                            f"stream_stalled: the caller left {stream.num_unread_bytes} bytes of this request's "
                            f"output untaken (stream_buffer_bytes {stream.max_unread_bytes}); generation aborted"
                        )
                    )
                    self._record_abort(req.request_id)
                    return
        except RouterError as e:
            # NOTE: as the router settles a failed request: aborted on whatever holds it
            stream.fail(e)
            self._record_abort(req.request_id)
        finally:
            await gen.aclose()

    def rejected_frames(self) -> dict[str, int]:
        return {}

    def route_decisions(self) -> dict[tuple[str, str], int]:
        return {}

    async def abort(self, request_id: str) -> None:
        self._record_abort(request_id)

    def _record_abort(self, request_id: str) -> None:
        with self._abort_cond:
            # NOTE: the server awaits aborts after a client has gone, so one from an earlier test's
            # request can land after the fixture reset; only this test's requests count.
            if request_id not in {c.request_id for c in self.calls}:
                return
            self.aborts.append(request_id)
            self.abort_event.set()
            self._abort_cond.notify_all()

    def wait_aborts(self, count: int, timeout: float = 10.0) -> bool:
        """Block (another thread than the server's) until ``count`` aborts were recorded, bounded."""
        with self._abort_cond:
            return self._abort_cond.wait_for(lambda: len(self.aborts) >= count, timeout)

    def is_healthy(self) -> bool:
        return self.healthy

    def worker_stats(self) -> list[WorkerStats]:
        return list(self.stats)


async def _taken(stream: RequestStream, timeout_s: float = 10.0) -> None:
    """Until the stream's consumer took its output (bounded: TimeoutError)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while stream.has_output and not stream.is_closed:
        if loop.time() > deadline:
            raise TimeoutError(f"the consumer of {stream.request_id} took nothing for {timeout_s} s")
        await asyncio.sleep(0.001)


class FakeScaler:
    """A scaler for the admin route (``Cluster.scale``'s shape): records calls; ``gate`` (when set)
    holds a call until the test releases it."""

    def __init__(self) -> None:
        self.pools = ["prefill", "decode"]
        self.calls: list[tuple[str, int]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def scale(self, pool: str, num_workers: int) -> list[str]:
        self.calls.append((pool, num_workers))
        self.entered.set()
        if self.gate is not None and not self.gate.wait(30):
            raise TimeoutError("the test never released the gate")
        return [f"{pool}-{i}" for i in range(num_workers)]


class ServerThread:
    """Runs ``app`` with uvicorn on a free 127.0.0.1 port in a daemon thread (context manager).

    The socket is bound and listening before the thread starts, so the readiness probe (GET /health,
    bounded by ``ready_timeout_s``) connects at once and simply waits for the server to accept.
    """

    def __init__(
        self, app: FastAPI, ready_timeout_s: float = 20.0, send_buffer_bytes: int | None = None
    ) -> None:
        """``send_buffer_bytes``: the accepted connections' kernel send buffer (Linux: inherited from the
        listening socket), so a client that reads nothing fills a connection soon."""
        self.sock = socket.socket(
            socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
        )  # NOTE: TCP_NODELAY on accepts
        if send_buffer_bytes is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = create_server(app, "127.0.0.1", self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.ready_timeout_s = ready_timeout_s

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=self.ready_timeout_s).status_code in (200, 503):
                    return self
            except httpx.TransportError:
                if time.monotonic() > deadline or not self.thread.is_alive():
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on {self.url} not ready within {self.ready_timeout_s} s")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
