"""Issue 31 row 8: a prompt too long to fit the context is refused on its characters before anything
tokenizes it, and big bodies are tokenized on their own lane, so small requests never wait behind them.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.http.app import create_app
from cluster.protocol import ModelInfo
from cluster.tokenizer import Tokenizer
from tests.support.stub_router import ServerThread, StubRouter, make_tokenizer

TINY = Path(__file__).resolve().parents[2] / "workers" / "assets" / "pdserve-tiny"
MAX_MODEL_LEN = 2048


class CountingTokenizer(Tokenizer):
    """The bundled tokenizer, counting the characters it was asked to tokenize."""

    def __init__(self) -> None:
        base = Tokenizer.from_pretrained(TINY)
        assert base is not None
        super().__init__(base.backend, base.bos_token, base.eos_token, base.chat_template)
        self.num_chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_chars += len(text)
        return super().encode(text, add_special_tokens)

    def encode_chat(self, messages: Sequence[dict[str, Any]], *args: Any, **kwargs: Any) -> list[int]:
        self.num_chars += sum(len(m["content"] or "") for m in messages)
        return super().encode_chat(messages, *args, **kwargs)


def test_max_chars_per_token_bounds_every_token() -> None:
    """The bound is the longest token: no token of the vocabulary decodes to more characters."""
    tok = Tokenizer.from_pretrained(TINY)
    assert tok is not None
    assert tok.max_chars_per_token == 12  # <|im_start|>
    longest = max(len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size))
    assert longest <= tok.max_chars_per_token
    assert make_tokenizer().max_chars_per_token == len("assistant")


@pytest.fixture(scope="module")
def tok() -> CountingTokenizer:
    return CountingTokenizer()


@pytest.fixture(scope="module")
def server(tok: CountingTokenizer) -> Iterator[ServerThread]:
    router = StubRouter(max_model_len=MAX_MODEL_LEN)
    router.model_info = ModelInfo("stub-model", "/models/stub", MAX_MODEL_LEN, tok.vocab_size)
    with ServerThread(create_app(router, tok)) as s:
        yield s


LIMIT = MAX_MODEL_LEN * 12
REASON = (
    f"max_model_len {MAX_MODEL_LEN} x 12 characters per token, the longest token of the model's tokenizer"
)
HUGE = "ab " * ((1 << 20) // 3 - 100)  # ~1 MiB: 349,425 tokens on the bundled tokenizer


def _post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


CASES = [
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}, "prompt", f"prompt: the prompt is {len(HUGE):,}"),
    (
        "/v1/completions",
        {"prompt": ["ab", HUGE], "max_tokens": 1},
        "prompt",
        f"prompt: prompt[1] is {len(HUGE):,}",
    ),
    ("/tokenize", {"prompt": HUGE}, "prompt", f"prompt: the prompt is {len(HUGE):,}"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1},
        "messages[0].content",
        f"messages[0].content: its content is {len(HUGE):,}",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "x" * (LIMIT - 10)},
                {"role": "user", "content": [{"type": "text", "text": "y" * 11}]},
            ]
        },
        "messages[1].content",
        f"messages[1].content: the content of messages[0..1] is {LIMIT + 1:,}",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": HUGE}]},
        "messages[0].content",
        f"messages[0].content: its content is {len(HUGE):,}",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "start"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_issue31_row8_huge_prompt_is_refused_before_tokenizing(
    server: ServerThread, tok: CountingTokenizer, path: str, body: dict[str, Any], param: str, start: str
) -> None:
    """issue 31 row 8: a prompt past max_model_len x the longest token is a 400 naming the field and the
    limit, and the tokenizer never sees it (today: the whole ~1 MiB is tokenized, then refused)."""
    tok.num_chars = 0
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert error["message"].startswith(start)
    assert error["message"].endswith(
        f" characters, over the limit of {LIMIT:,} ({REASON}): it cannot fit the context"
    )
    assert tok.num_chars <= 2  # NOTE: "ab", the first prompt of the list case, is tokenized first


def test_prompt_at_the_limit_is_tokenized(server: ServerThread, tok: CountingTokenizer) -> None:
    """The character bound never refuses a prompt that could fit: one at the limit reaches the tokenizer
    (and is then refused on its token count)."""
    tok.num_chars = 0
    r = _post(server, "/v1/completions", {"prompt": "a" * LIMIT, "max_tokens": 1})
    assert tok.num_chars == LIMIT
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "This model's maximum context length is 2048 tokens"
    )


class GatedTokenizer(Tokenizer):
    """The stub's tokenizer; encoding a text longer than 1,000 characters waits for ``gate``."""

    def __init__(self) -> None:
        base = make_tokenizer()
        super().__init__(base.backend, base.bos_token, base.eos_token, base.chat_template)
        self.gate = threading.Event()
        self.num_waiting = 0
        self.lock = threading.Condition()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 1000:
            with self.lock:
                self.num_waiting += 1
                self.lock.notify_all()
            if not self.gate.wait(60):
                raise TimeoutError("gate never opened")
        return super().encode(text, add_special_tokens)


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that counts the work handed to it (``counter.value``, notified on each)."""

    def __init__(self, counter: Counter, num_threads: int, name: str) -> None:
        super().__init__(num_threads, thread_name_prefix=name)
        self.counter = counter

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        with self.counter.cond:
            self.counter.value += 1
            self.counter.cond.notify_all()
        return super().submit(fn, *args, **kwargs)


class Counter:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.value = 0


def test_issue31_row8_small_requests_never_wait_behind_big_ones() -> None:
    """issue 31 row 8: while 8 big prompts hold the tokenizer, a small request is still answered (today
    the two edge threads are both taken by big prompts, and the small one queues behind all 8)."""
    tok = GatedTokenizer()
    router = StubRouter(max_model_len=1 << 16)
    app = create_app(router, tok, num_tokenizer_threads=2)
    state = app.state.pdserve
    handed = Counter()
    # NOTE: every pool the edge runs bodies on counts its work, so the small request is sent only once all
    # 8 big bodies are queued or running
    state.pool = CountingPool(handed, 2, "pdserve-edge")
    if hasattr(state, "large_pool"):
        state.large_pool = CountingPool(handed, 1, "pdserve-edge-large")
    big = {"prompt": " ".join(["w7"] * 10_000), "max_tokens": 1}  # 30 KB: past the large-body bound
    with ServerThread(app) as s, concurrent.futures.ThreadPoolExecutor(8) as clients:
        try:
            bigs = [
                clients.submit(httpx.post, f"{s.url}/v1/completions", json=big, timeout=90) for _ in range(8)
            ]
            with handed.cond:
                assert handed.cond.wait_for(lambda: handed.value >= 8, timeout=30)
            with tok.lock:
                assert tok.lock.wait_for(lambda: tok.num_waiting >= 1, timeout=30)
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "w8 w9", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2
            assert not any(f.done() for f in bigs)  # the big ones are all still waiting
        finally:
            tok.gate.set()
        assert [f.result().status_code for f in bigs] == [200] * 8


def test_token_id_bodies_are_planned_on_the_loop_and_the_rest_on_the_pool() -> None:
    """A small /v1/completions body that can need no tokenizer (a token-id prompt, plain sampling fields)
    is planned on the event loop; text, chat, a field that may tokenize (bad_words) or a large body go
    to the edge's pools."""
    router = StubRouter(max_model_len=1 << 16)
    app = create_app(router, make_tokenizer())
    state = app.state.pdserve
    handed = Counter()
    state.pool = CountingPool(handed, 2, "pdserve-edge")
    state.large_pool = CountingPool(handed, 1, "pdserve-edge-large")
    on_pool: list[int] = []
    with ServerThread(app) as s:
        for path, body in [
            ("completions", {"prompt": [6, 7], "max_tokens": 2, "temperature": 0.0, "stream": True}),
            ("completions", {"prompt": [6, 7], "max_tokens": 2, "stop": ["w3"], "seed": 1, "n": 2}),
            ("completions", {"prompt": "w6 w7", "max_tokens": 2}),
            ("completions", {"prompt": [6, 7], "max_tokens": 2, "bad_words": ["w3"]}),
            ("completions", {"prompt": [[6, 7], [8]], "max_tokens": 2}),
            ("completions", {"prompt": [6] * 12000, "max_tokens": 2}),  # > 16 KiB: large_body_bytes
            ("chat/completions", {"messages": [{"role": "user", "content": "w6"}], "max_tokens": 2}),
        ]:
            before = handed.value
            r = httpx.post(f"{s.url}/v1/{path}", json=body, timeout=30)
            assert r.status_code == 200, r.text
            on_pool.append(handed.value - before)
    assert on_pool == [0, 0, 1, 1, 1, 1, 1]
