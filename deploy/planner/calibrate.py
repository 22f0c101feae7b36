"""Fit a step-cost model to this machine's engine: a short sweep of step shapes, then least squares.

The sweep drives a real :class:`~workers.engine.Engine` (the model, KV cache and backend the cluster
config names) through prefill-only steps, chunked prefills, decode-only batches at several context
lengths and mixed steps. Each timed step is what a worker's step thread does per turn: ``engine.step()``,
handing the deltas to the detokenizer thread (which, as a worker's does, adds their text and encodes the
control frame, on its own thread), and the stats snapshot. A shape's time is the
median of its repetitions; the fit is non-negative least squares on relative error, so 3 ms decode steps
count as much as 300 ms prefills.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cluster.config import EngineConfig
from cluster.cost_model import CostProfile, LinearStepCost, StepShape, TransferCost, shape_of
from cluster.protocol import SamplingParams, TokenDelta
from cluster.wire import ROUTER_ID, Deltas, WireEncoder

# NOTE: gloo between two local processes moved 0.8-2.5 GB/s on these machines (see DESIGN.md); the
# cluster probe (deploy/planner/probe.py) replaces these with what the handoffs actually took.
DEFAULT_TRANSFER = TransferCost(latency_s=3e-3, bytes_per_s=1e9)
_STAGE_WAIT_S = 60.0  # bound on the detokenizer thread's catching up at the end of the sweep


@dataclass(frozen=True)
class Sample:
    label: str
    shape: StepShape
    seconds: float  # median over repetitions


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares (active set: drop the most negative coefficient, refit)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_linear(samples: Sequence[Sample]) -> LinearStepCost:
    """Non-negative least squares of the step time on the shape's features, on relative error; the
    hinge of the padded decode context is searched over the sampled padded sizes (0: no hinge)."""
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-6)
    knees = [0.0, *sorted({float(s.shape.num_padded_context_tokens) for s in samples} - {0.0})[:-1]]
    best: tuple[float, float, np.ndarray] | None = None
    for knee in knees:
        x = np.array([LinearStepCost.features(s.shape, knee) for s in samples], dtype=np.float64)
        coef = _nnls(x * w[:, None], y * w)
        error = float(np.sum(((x @ coef - y) * w) ** 2))
        # NOTE: a hinge has to earn its extra parameter: 5% less squared error than no hinge
        if best is None or error < best[0] * (0.95 if best[1] == 0.0 else 1.0):
            best = (error, knee, coef)
    assert best is not None
    _, knee, coef = best
    values: dict[str, Any] = {name: float(c) for name, c in zip(LinearStepCost.FEATURES, coef, strict=True)}
    return LinearStepCost(**values, padded_knee_tokens=knee)


class _ShapeRecorder:
    """Wraps ``scheduler.schedule`` to see the shape of the step the engine is about to run."""

    def __init__(self, scheduler: object) -> None:
        self.last: StepShape = StepShape()
        inner: Callable[[], object] = scheduler.schedule  # type: ignore[attr-defined]

        def schedule() -> object:
            out = inner()
            self.last = shape_of(
                (s.start_position, len(s.token_ids), s.is_decode)
                for s in out.scheduled  # type: ignore[attr-defined]
            )
            return out

        scheduler.schedule = schedule  # type: ignore[attr-defined]


class Sweep:
    """Drives one engine through chosen step shapes and times each turn as a worker runs it."""

    def __init__(self, engine_config: EngineConfig, *, reps: int = 5, seed: int = 0) -> None:
        from workers.detokenizer import DetokenizerStage
        from workers.engine import Engine

        self.engine = Engine(engine_config)
        self.encoder = WireEncoder(b"calibration-secret-0123456789abc")
        self.stage: DetokenizerStage | None = None
        if self.engine.tokenizer is not None:
            self.stage = DetokenizerStage(self.engine.tokenizer, self._encode, "calibration-detokenizer")
            self.engine.use_stage(self.stage)
        self.reps = reps
        self.rng = np.random.default_rng(seed)
        self.recorder = _ShapeRecorder(self.engine.scheduler)
        self.samples: list[Sample] = []
        self._ids = 0

    @property
    def budget(self) -> int:
        return self.engine.config.max_num_batched_tokens

    def _tokens(self, n: int) -> list[int]:
        hi = max(11, self.engine.vocab_size // 4)
        return [int(t) for t in self.rng.integers(10, hi, size=n)]

    def _add(self, n: int, max_tokens: int, prefix: list[int] | None = None) -> str:
        self._ids += 1
        rid = f"cal-{self._ids}"
        head = prefix or []
        prompt = head + self._tokens(n - len(head))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def _settle_prefills(self) -> None:
        s = self.engine.scheduler
        while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
            self._turn()

    def _encode(self, deltas: list[TokenDelta]) -> None:
        self.encoder.encode(ROUTER_ID, Deltas("worker", deltas))  # as a worker sends them

    def _turn(self) -> tuple[StepShape, float]:
        t0 = time.perf_counter()
        deltas = self.engine.step()
        if self.stage is not None:
            self.stage.submit(deltas)
        self.engine.stats()
        return self.recorder.last, time.perf_counter() - t0

    def close(self) -> None:
        """Stop the detokenizer thread (bounded); its state must be empty (every request ended)."""
        if self.stage is not None:
            self.stage.flush(_STAGE_WAIT_S)
            left = self.stage.num_requests
            self.stage.close(_STAGE_WAIT_S)
            if left:
                raise AssertionError(f"the sweep's detokenizer thread still holds {left} request(s)")

    def _record(self, label: str, runs: list[tuple[StepShape, float]]) -> None:
        shape = runs[len(runs) // 2][0]
        self.samples.append(Sample(label, shape, statistics.median(t for _, t in runs)))

    def _drain(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    def prefill(self, n: int) -> None:
        """A prompt of n tokens alone (chunked under the token budget): one sample per chunk."""
        num_chunks = -(-n // self.budget)
        runs: list[list[tuple[StepShape, float]]] = [[] for _ in range(num_chunks)]
        for _ in range(self.reps):
            self._add(n, 1)
            for chunk in runs:
                chunk.append(self._turn())
        for i, chunk in enumerate(runs):
            self._record(f"prefill {n}" + (f" chunk {i + 1}" if num_chunks > 1 else ""), chunk)

    def decode(self, batch: int, context: int, extra_prompt: int = 0, short: int = 0) -> None:
        """``batch`` sequences decoding at about ``context`` tokens (with ``short``, every other one at
        ``short`` tokens: a batch padded to its longest); with ``extra_prompt``, each timed step also
        carries a new prompt of that many tokens (a mixed step)."""
        # NOTE: the sequences share all but their last block, so building the batch's context costs one
        # prompt (the rest are prefix-cache hits) while every decode still reads its whole context.
        bs = self.engine.config.block_size
        max_tokens = 4 * self.reps + 8
        lengths = [short if short and i % 2 else context for i in range(batch)]
        shared = self._tokens(max(0, context - bs))
        rids = [self._add(context, max_tokens, shared)]
        self._settle_prefills()
        rids += [self._add(n, max_tokens, shared[: max(0, n - bs)]) for n in lengths[1:]]
        self._settle_prefills()
        self._turn()  # the first step where every sequence decodes
        runs = []
        for _ in range(self.reps):
            if extra_prompt:
                rids.append(self._add(extra_prompt, 1))
            runs.append(self._turn())
        label = f"decode {batch} x {context}" + (f"/{short}" if short else "")
        self._record(label + (f" + prefill {extra_prompt}" if extra_prompt else ""), runs)
        self._drain(rids)


def default_plan(engine_config: EngineConfig, max_model_len: int) -> list[tuple[str, tuple[int, ...]]]:
    """The sweep: (kind, arguments) pairs sized to the engine's token budget and seat count."""
    budget, seats = engine_config.max_num_batched_tokens, engine_config.max_num_seqs
    prompts = sorted({n for n in (16, 64, 256, budget // 2, budget, 2 * budget) if 0 < n < max_model_len})
    batches = sorted({b for b in (1, 4, 16, seats // 2, seats) if 0 < b <= seats})
    contexts = [c for c in (32, 256, 1024) if c <= max_model_len // 2]
    plan: list[tuple[str, tuple[int, ...]]] = [("prefill", (n,)) for n in prompts]
    plan += [("decode", (b, c)) for b in batches for c in contexts]
    mixed_prompt = min(budget // 2, 256)
    plan += [
        ("decode", (b, 128, mixed_prompt)) for b in batches if 4 <= b < seats and b + mixed_prompt <= budget
    ]
    # half long, half short: what padding the batch to its longest sequence costs
    plan += [("decode", (b, contexts[-1], 0, contexts[0])) for b in batches if b >= 4 and len(contexts) > 1]
    return plan


def calibrate(
    engine_config: EngineConfig,
    *,
    reps: int = 5,
    seed: int = 0,
    name: str = "",
    progress: Callable[[str], None] | None = None,
) -> tuple[CostProfile, list[Sample]]:
    """Run the sweep on this machine, fit the step model; the transfer and hop terms are defaults until
    the cluster probe measures them. Returns the profile and the measured samples."""
    cfg = replace(engine_config, device="cpu" if engine_config.device == "auto" else engine_config.device)
    # NOTE: the largest decode batch at the longest context must fit in the KV pool
    need = cfg.max_num_seqs * (1024 + 4 * reps + 16) // cfg.block_size + 64
    cfg = replace(cfg, num_kv_blocks=max(cfg.num_kv_blocks or 0, need))
    sweep = Sweep(cfg, reps=reps, seed=seed)
    plan = default_plan(cfg, sweep.engine.max_model_len)
    for kind, args in plan:
        if progress is not None:
            progress(f"{kind} {args}")
        if kind == "prefill":
            sweep.prefill(*args)
        else:
            sweep.decode(*args)
    sweep.engine.check_no_leaks()
    sweep.close()
    step = fit_linear(sweep.samples)
    runner = sweep.engine.runner
    kv_bytes_per_token = int(runner.bytes_per_block // cfg.block_size)
    host = platform.node() or "this machine"
    source = (
        f"calibrated on {host} ({os.cpu_count()} CPUs) {time.strftime('%Y-%m-%d %H:%M')}: "
        f"{len(sweep.samples)} step shapes x {reps}, device {runner.device}"
    )
    profile = CostProfile(
        name=name or f"{host}-{runner.device}",
        source=source,
        step=step,
        transfer=DEFAULT_TRANSFER,
        kv_bytes_per_token=kv_bytes_per_token,
        hop_s=5e-4,
        http_s=2e-3,
        host_cpus=float(os.cpu_count() or 1) if str(runner.device) == "cpu" else None,
    )
    return profile, sweep.samples


def fit_table(profile: CostProfile, samples: Sequence[Sample]) -> str:
    """Measured vs fitted step time per swept shape."""
    lines = [f"{'shape':<34} {'measured ms':>12} {'model ms':>10} {'error':>7}"]
    for s in samples:
        model = profile.step_s(s.shape)
        lines.append(
            f"{s.label:<34} {s.seconds * 1e3:12.2f} {model * 1e3:10.2f} {(model / s.seconds - 1) * 100:6.1f}%"
        )
    return "\n".join(lines)
