"""The seeded load generator: scenarios of random token-id prompts sent as streaming completions to a
running server, each request's client-side timings recorded. ``pdserve bench serve`` prints figures over
it; ``pdserve plan calibrate --probe`` and ``plan validate`` run it against the cluster they measure, and
the planner's twin replays the very same prompts and send times (``build_dataset``, ``arrival_offsets``).

Prompt and output lengths are drawn from ranges with a fixed seed; requests arrive by a Poisson / gamma
process (``request_rate``, ``burstiness``: 1 is Poisson, < 1 burstier) or all at once, bounded by a
fixed concurrency.

Scenarios (``SCENARIOS``; ``bench serve``'s flags override their fields):

* smoke: 8 short requests, 4 at a time; a liveness check.
* staggered: 48 mixed requests, Poisson arrivals at 4 req/s.
* long_prompts: long prompts, short outputs at 1 req/s; prefill-bound, where disaggregation keeps
  decoders' TBT flat.
* long_decode: short prompts, long outputs, 8 at a time; decode-bound.
* stress: 256 requests at once: more than the decode pool's slots, so requests queue.
* batch_pressure: 64 concurrent requests against a server whose decode engines run tiny batches
  (expects e.g. ``max_num_seqs: 4`` and a small ``num_kv_blocks`` in the decode pool's engine config),
  so requests wait for decode slots and KV blocks (``waiting_for_kv`` grows, preemptions appear).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from cluster.client.sdk import APIError, AsyncClient


@dataclass(frozen=True)
class Scenario:
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    request_rate: float = math.inf  # requests/s; inf sends all at once (bounded by max_concurrency)
    burstiness: float = 1.0
    max_concurrency: int | None = None


SCENARIOS = {
    "smoke": Scenario(8, (16, 64), (8, 32), max_concurrency=4),
    "staggered": Scenario(48, (32, 256), (32, 128), request_rate=4.0),
    "long_prompts": Scenario(16, (1024, 3072), (8, 32), request_rate=1.0),
    "long_decode": Scenario(16, (16, 64), (512, 1024), max_concurrency=8),
    "stress": Scenario(256, (64, 512), (64, 256)),
    "batch_pressure": Scenario(64, (64, 256), (128, 256), max_concurrency=64),
}


@dataclass(frozen=True)
class ClientSettings:
    """How the client sends a scenario's requests: ``seed`` draws the prompts and send times; no request
    is retried (a refusal is an error in its record). The defaults are a measuring run's: greedy, every
    output to its length, no progress bar."""

    seed: int
    api_key: str | None = None
    timeout: float = 600.0  # read timeout, seconds
    model: str | None = None  # None: the server's
    temperature: float = 0.0
    ignore_eos: bool = True
    quiet: bool = True


@dataclass
class Record:
    prompt_len: int
    max_tokens: int
    send_time: float = 0.0
    output_tokens: int = 0
    ttft_s: float | None = None
    tbt_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    server: dict[str, Any] | None = None
    cached_tokens: int | None = None  # the server's usage, when asked for (``stream_completion``)
    error: str | None = None


def build_dataset(s: Scenario, vocab_size: int, max_model_len: int, seed: int) -> list[tuple[list[int], int]]:
    """Random token-id prompts and output lengths, clamped so every request fits max_model_len."""
    rng = np.random.default_rng(seed)
    out_hi = min(s.output_len[1], max_model_len // 2)
    out_lo = min(s.output_len[0], out_hi)
    dataset = []
    for _ in range(s.num_requests):
        out = int(rng.integers(out_lo, out_hi + 1))
        p_hi = max(1, min(s.prompt_len[1], max_model_len - out))
        p_lo = max(1, min(s.prompt_len[0], p_hi))
        n = int(rng.integers(p_lo, p_hi + 1))
        # NOTE: ids from the low end of the vocabulary up to 1/4 of it skip most special tokens.
        dataset.append((rng.integers(10, max(11, vocab_size // 4), size=n).tolist(), out))
    return dataset


def arrival_offsets(s: Scenario, seed: int) -> list[float]:
    if math.isinf(s.request_rate):
        return [0.0] * s.num_requests
    rng = np.random.default_rng(seed + 1)
    gaps = rng.gamma(s.burstiness, 1.0 / (s.request_rate * s.burstiness), size=s.num_requests)
    return np.cumsum(gaps).tolist()


async def run_scenario(
    url: str, name: str, settings: ClientSettings, s: Scenario
) -> tuple[list[Record], float]:
    """Send ``s``'s requests to the server at ``url`` (its first model card gives the vocabulary and the
    context the prompts are drawn for); returns every request's record, in send order, and the run's
    wall seconds. ``name`` labels the progress bar."""
    async with AsyncClient(url, settings.api_key, timeout=settings.timeout, max_retries=0) as client:
        card = (await client.models())[0]
        dataset = build_dataset(
            s, int(card.get("vocab_size", 1000)), int(card.get("max_model_len", 2048)), settings.seed
        )
        offsets = arrival_offsets(s, settings.seed)
        sem = asyncio.Semaphore(s.max_concurrency or s.num_requests)
        bar = tqdm(total=s.num_requests, desc=name, disable=settings.quiet)
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, offset: float) -> Record:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with sem:
                rec, _ = await stream_completion(client, settings, prompt, max_tokens, start)
            bar.update(1)
            return rec

        records = await asyncio.gather(*(one(p, m, o) for (p, m), o in zip(dataset, offsets, strict=True)))
        bar.close()
        return list(records), time.perf_counter() - start


async def stream_completion(
    client: AsyncClient,
    settings: ClientSettings,
    prompt: list[int],
    max_tokens: int,
    start: float,
    *,
    include_usage: bool = False,
) -> tuple[Record, list[int]]:
    """Send one streaming completion of ``prompt`` now and time it at the client (``send_time`` and the
    token times are seconds since ``start``, a ``time.perf_counter()``). Returns its record and the
    output's token ids (those that came before an error, if one ended it). ``include_usage`` asks the
    server for its usage chunk, whose cached prompt tokens go into ``Record.cached_tokens``."""
    rec = Record(len(prompt), max_tokens, send_time=time.perf_counter() - start)
    token_ids: list[int] = []
    try:
        stream = await client.completions.create(
            model=settings.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=settings.temperature,
            ignore_eos=settings.ignore_eos,
            stream=True,
            **({"stream_options": {"include_usage": True}} if include_usage else {}),
        )
        async for delta in stream:
            rec.token_times.append(delta.arrival_time - start)
            token_ids += delta.token_ids
        r = stream.result
        token_ids = r.token_ids
        rec.output_tokens, rec.ttft_s, rec.tbt_s, rec.e2e_s = len(r.token_ids), r.ttft_s, r.tbt_s, r.e2e_s
        rec.server = asdict(r.timings) if r.timings else None
        rec.cached_tokens = r.usage.cached_tokens if r.usage is not None else None
    except APIError as e:
        rec.error = str(e)
    return rec, token_ids
