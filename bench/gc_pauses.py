"""Garbage-collector pauses on a worker's step thread, with and without the start-up heap frozen.

    python -m bench.gc_pauses [--requests 1024] [--max-num-seqs 256] [--prompt-len 16 64]
                              [--output-len 64 256] [--seed 0]

Each mode runs in a fresh process (``gc.freeze`` is process-wide): the bundled model's ``Engine`` with a
``DetokenizerStage`` on its own thread, stepped as a worker's step thread steps it, over the same seeded
requests (all queued at once, EOS ignored). ``frozen`` calls ``cluster.heap.freeze_startup_heap`` after
the engine is built, as a launched worker does; ``plain`` does not. Printed per mode, all measured in
that process: the objects the collector tracks, one full collection's time (``gc.collect()``, median of
3, before the run), and over the run the collections of each generation (``gc.callbacks``: how many,
their total and their longest pause) and the step wall times (p50, p99, max).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from bench.offline import make_workload
from cluster.heap import freeze_startup_heap
from workers.detokenizer import DetokenizerStage
from workers.engine import Engine
from workers.llm import LLM

MODES = ("plain", "frozen")


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(2048, args.max_num_seqs * 8))
    engine: Engine = llm.engine
    stage = DetokenizerStage(engine.tokenizer, lambda deltas: None, name="bench-detokenizer")
    w = make_workload(args.requests, args.prompt_len, args.output_len, engine.vocab_size, args.seed)
    frozen = freeze_startup_heap() if mode == "frozen" else 0
    full: list[float] = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        full.append(time.perf_counter() - t0)
    tracked = len(gc.get_objects())
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[threading.get_ident()] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started.pop(threading.get_ident()))

    for i, (prompt, params) in enumerate(zip(w.prompts, w.params(), strict=True)):
        engine.add_request(f"r{i}", prompt, params)
        stage.add_request(f"r{i}", prompt, params)
    steps: list[float] = []
    gc.callbacks.append(on_gc)
    try:
        t_run = time.perf_counter()
        while engine.has_unfinished():
            t0 = time.perf_counter()
            stage.submit(engine.step())
            steps.append(time.perf_counter() - t0)
        run_s = time.perf_counter() - t_run
    finally:
        gc.callbacks.remove(on_gc)
    stage.flush(60.0)
    stage.close(60.0)
    engine.check_no_leaks()
    steps.sort()
    return {
        "mode": mode,
        "frozen": frozen,
        "tracked": tracked,
        "full_collect_ms": statistics.median(full) * 1e3,
        "run_s": run_s,
        "steps": len(steps),
        "step_ms": {
            "p50": steps[len(steps) // 2] * 1e3,
            "p99": steps[min(len(steps) - 1, int(len(steps) * 0.99))] * 1e3,
            "max": steps[-1] * 1e3,
        },
        "collections": {
            str(g): {"n": len(p), "total_ms": sum(p) * 1e3, "max_ms": max(p, default=0.0) * 1e3}
            for g, p in pauses.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gc_pauses", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--output-len", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    args = ap.parse_args(argv)
    if args.mode is not None:
        print(json.dumps(run_mode(args.mode, args)))
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])
    print(
        f"{args.requests} requests, max_num_seqs {args.max_num_seqs}, prompt {tuple(args.prompt_len)}, "
        f"output {tuple(args.output_len)}, seed {args.seed}; each mode in a fresh process"
    )
    for mode in MODES:
        child = subprocess.run(
            [sys.executable, "-m", "bench.gc_pauses", *passed, "--mode", mode],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
        r = json.loads(child.stdout.strip().splitlines()[-1])
        c, s = r["collections"], r["step_ms"]
        print(
            f"{mode:6s}: {r['tracked']:7d} objects tracked ({r['frozen']} frozen), full collection "
            f"{r['full_collect_ms']:6.1f} ms; run {r['run_s']:.1f} s, {r['steps']} steps, step p50 "
            f"{s['p50']:.1f} p99 {s['p99']:.1f} max {s['max']:.1f} ms; collections "
            + ", ".join(
                f"gen {g}: {c[g]['n']} ({c[g]['total_ms']:.1f} ms, longest {c[g]['max_ms']:.1f})" for g in c
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
