"""What the front-end replica tests share (not a test module): a mock engine slow enough that a kill
lands mid-stream, the mock's rule, and 32 streams through a replicated front end, one replica killed
(kill -9) once every stream has its first token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from cluster.cost_model import CostProfile, LinearStepCost, TransferCost
from cluster.http.server_state import REPLICA_HEADER
from cluster.tokenizer import Tokenizer
from workers.engine import BUNDLED_MODEL
from workers.mock_runner import MockTokens
from workers.models.arch import ArchConfig

NUM_STREAMS = 32
MAX_TOKENS = 64
# NOTE: a killed replica's requests must outlive its lease (2 s in the tests) on the workers: 400 mock steps
# of 12 ms are ~5 s, so each is freed by the lease, never by finishing
KILL_TOKENS = 400
PROMPTS = [[300 + 11 * i + j for j in range(6 + i % 5)] for i in range(NUM_STREAMS)]


def slow_profile(path: Path) -> str:
    """A cost profile whose every mock step waits ~12 ms (KILL_TOKENS take ~5 s), saved at ``path``."""
    step = LinearStepCost(0.012, 0.0, 0.0, 0.0, 0.0, 0.0)
    path.write_text(json.dumps(CostProfile("test", "test", step, TransferCost(1e-3, 1e9), 1024).to_dict()))
    return str(path)


def rule_outputs(max_tokens: int = KILL_TOKENS) -> list[list[int]]:
    """What the bundled model's mock generates after each of PROMPTS (greedy)."""
    rule = MockTokens.for_model(
        ArchConfig.from_pretrained(BUNDLED_MODEL), Tokenizer.from_pretrained(BUNDLED_MODEL)
    )
    return [rule.continuation(prompt, max_tokens) for prompt in PROMPTS]


class Stream:
    """One streamed completion on a connection of its own: the replica that served it, its tokens,
    whether it ended with [DONE] or an error."""

    def __init__(self, prompt: list[int], max_tokens: int) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.replica: int | None = None
        self.tokens: list[int] = []
        self.finished = False
        self.error: str | None = None
        self.first = asyncio.Event()

    async def run(self, url: str) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True}
        try:
            # NOTE: a client (a connection) each: the kernel spreads new connections over the replicas
            async with (
                httpx.AsyncClient(timeout=60) as http,
                http.stream("POST", f"{url}/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                self.replica = int(response.headers[REPLICA_HEADER])
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        self.finished = True
                        break
                    if line.startswith("data: "):
                        self.tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                        self.first.set()
        except (httpx.TransportError, httpx.StreamError) as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.first.set()

    def as_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "tokens": self.tokens,
            "finished": self.finished,
            "error": self.error,
        }


async def _run_with_a_fault(url: str, fault: Callable[[], None], streams: list[Stream]) -> None:
    tasks = [asyncio.create_task(s.run(url)) for s in streams]
    async with asyncio.timeout(60):
        for s in streams:
            await s.first.wait()
    fault()
    async with asyncio.timeout(120):
        await asyncio.gather(*tasks)


def streams_with_a_fault(
    url: str, fault: Callable[[], None], num: int = NUM_STREAMS, max_tokens: int = MAX_TOKENS
) -> list[Stream]:
    """The first ``num`` PROMPTS streamed at once through ``url``; ``fault()`` once each has its first
    token."""
    streams = [Stream(p, max_tokens) for p in PROMPTS[:num]]
    asyncio.run(_run_with_a_fault(url, fault, streams))
    return streams


def streams_with_a_kill(url: str, victim_pid: int) -> list[Stream]:
    """PROMPTS streamed at once through ``url`` (KILL_TOKENS each); process ``victim_pid`` killed (-9) once
    each has its first token."""
    return streams_with_a_fault(url, lambda: os.kill(victim_pid, signal.SIGKILL), max_tokens=KILL_TOKENS)


def check_streams(streams: list[dict[str, Any]], expected: list[list[int]], killed: int) -> None:
    """Every stream on a surviving replica finished with the rule's output; every one on ``killed`` was
    cut mid-stream (a prefix of the rule, then a connection error); both replicas served some."""
    replicas = [s["replica"] for s in streams]
    assert killed in replicas and any(r != killed for r in replicas), replicas
    for s, want in zip(streams, expected, strict=True):
        if s["replica"] != killed:
            assert (s["finished"], s["error"], s["tokens"]) == (True, None, want)
        else:
            assert not s["finished"] and s["error"] is not None, s
            assert s["tokens"] == want[: len(s["tokens"])]


def serve_on_every_replica(url: str, expected: list[list[int]], replicas: set[int]) -> set[int]:
    """Short requests on new connections until each of ``replicas`` answered one (bounded: 60 tries),
    each with the rule's output; returns the replicas that answered."""
    served: set[int] = set()
    with httpx.Client(timeout=60) as http:
        for i in range(60):
            if served >= replicas:
                break
            body = {"prompt": PROMPTS[i % NUM_STREAMS], "max_tokens": 4, "temperature": 0.0}
            answer = http.post(f"{url}/v1/completions", json=body, headers={"Connection": "close"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == expected[i % NUM_STREAMS][:4]  # NOTE: a prefix
            served.add(int(answer.headers[REPLICA_HEADER]))
    return served
