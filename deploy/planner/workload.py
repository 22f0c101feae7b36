"""Workloads the planner simulates: who sends what, when.

A :class:`Workload` is a list of :class:`SimRequest` (send time, prompt and output length, optional
prefix group) plus an optional client concurrency limit (closed loop: a request is sent when a slot
frees, as ``pdserve bench serve --max-concurrency`` does). Sources: a Poisson (gamma) arrival process
with uniform length ranges, a trace file (JSON lines or CSV), or exact token-id prompts (the benchmark's
seeded scenarios, so a simulation sees the very prompts a real run sends).

Prompt tokens are made on demand from the seed (a 10,000-request workload never holds every prompt):
requests of one prefix group share their first ``prefix_len`` tokens, so the real prefix cache and the
router's prefix affinity see the sharing.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE_FIELDS = ("arrival_s", "prompt_len", "output_len", "prefix_group", "prefix_len")


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float  # seconds after the start (open loop); ignored under a concurrency limit
    prompt_len: int
    output_len: int  # tokens generated (EOS ignored, as the benchmark does)
    prefix_group: int | None = None  # requests of one group share their first prefix_len tokens
    prefix_len: int = 0


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    vocab_size: int = 1000
    seed: int = 0
    max_concurrency: int | None = None
    # exact prompts (index -> token ids); requests without one get seeded random tokens
    prompts: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.requests)

    def prompt_tokens(self, index: int) -> list[int]:
        """The token ids of request ``index`` (deterministic in the seed)."""
        exact = self.prompts.get(index)
        if exact is not None:
            return exact
        r = self.requests[index]
        hi = max(11, self.vocab_size // 4)
        shared = min(r.prefix_len, r.prompt_len) if r.prefix_group is not None else 0
        head: list[int] = []
        if shared:
            group_rng = np.random.default_rng([self.seed, 1, r.prefix_group or 0])
            head = group_rng.integers(10, hi, size=shared).tolist()
        tail = np.random.default_rng([self.seed, 2, index]).integers(10, hi, size=r.prompt_len - shared)
        return head + tail.tolist()

    @property
    def duration_hint_s(self) -> float:
        return max((r.arrival_s for r in self.requests), default=0.0)


def arrivals(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets: all at 0 for an infinite rate, else gamma gaps (shape ``burstiness``; 1 is Poisson)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = np.random.default_rng([seed, 3])
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num_requests)
    return np.cumsum(gaps).tolist()


def poisson(
    rate: float,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    vocab_size: int = 1000,
    max_model_len: int | None = None,
    num_prefix_groups: int = 0,
    prefix_len: int = 0,
    max_concurrency: int | None = None,
) -> Workload:
    """Requests arriving at ``rate``/s with lengths uniform in the (inclusive) ranges; with prefix groups,
    each request joins one of ``num_prefix_groups`` at random and shares its first ``prefix_len`` tokens."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"rate must be > 0 and num_requests >= 1, got {rate} and {num_requests}")
    rng = np.random.default_rng([seed, 4])
    offsets = arrivals(num_requests, rate, burstiness, seed)
    requests = []
    for t in offsets:
        out = int(rng.integers(output_len[0], output_len[1] + 1))
        n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        if max_model_len is not None:
            out = min(out, max_model_len // 2)
            n = max(1, min(n, max_model_len - out))
        group = int(rng.integers(num_prefix_groups)) if num_prefix_groups else None
        requests.append(SimRequest(t, n, out, group, prefix_len if group is not None else 0))
    name = f"poisson {rate:g} req/s"
    return Workload(name, requests, vocab_size, seed, max_concurrency)


def from_prompts(
    name: str,
    prompts: Sequence[tuple[list[int], int]],
    offsets: Sequence[float],
    *,
    vocab_size: int,
    max_concurrency: int | None = None,
) -> Workload:
    """Exact (prompt token ids, output length) pairs sent at ``offsets``."""
    requests = [SimRequest(t, len(p), out) for (p, out), t in zip(prompts, offsets, strict=True)]
    exact = {i: list(p) for i, (p, _) in enumerate(prompts)}
    return Workload(name, requests, vocab_size, 0, max_concurrency, exact)


def load_trace(path: str | Path, *, vocab_size: int = 1000, seed: int = 0) -> Workload:
    """A trace file: JSON lines (one object per request) or CSV with a header, fields ``arrival_s``,
    ``prompt_len``, ``output_len`` and optionally ``prefix_group``, ``prefix_len``. Sorted by arrival."""
    p = Path(path)
    rows: list[dict[str, str | float | int | None]]
    if p.suffix == ".csv":
        with p.open(newline="") as f:
            rows = [dict(row) for row in csv.DictReader(f)]
    else:
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    requests = []
    for i, row in enumerate(rows):
        unknown = sorted(set(row) - set(TRACE_FIELDS))
        if unknown:
            raise ValueError(f"{p}: request {i}: unknown field(s) {unknown}; known: {list(TRACE_FIELDS)}")
        try:
            group = row.get("prefix_group")
            req = SimRequest(
                float(row["arrival_s"]),  # type: ignore[arg-type]
                int(row["prompt_len"]),  # type: ignore[arg-type]
                int(row["output_len"]),  # type: ignore[arg-type]
                None if group in (None, "") else int(group),  # type: ignore[arg-type]
                int(row.get("prefix_len") or 0),  # type: ignore[arg-type]
            )
        except (KeyError, ValueError) as e:
            raise ValueError(f"{p}: request {i}: {type(e).__name__}: {e}") from None
        if req.prompt_len < 1 or req.output_len < 1 or req.arrival_s < 0:
            raise ValueError(f"{p}: request {i}: needs prompt_len >= 1, output_len >= 1, arrival_s >= 0")
        requests.append(req)
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(f"trace {p.name}", requests, vocab_size, seed)
