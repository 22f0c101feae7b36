"""What a step costs at each tensor-parallel size, offline (`LLM`), on this machine.

    python bench/tp_step.py --tp 1 2 [--running 16] [--tokens 64] [--repeats 3]

Greedy, EOS ignored, ``--running`` prompts of 32 tokens decoded ``--tokens`` each after a short warm-up run;
prints the median wall time per step (prefill steps included) of ``--repeats`` runs per size, and how many
greedy outputs differ from the first size's (0 expected; a near-tie may differ). On a CPU the
ranks share the cores (an engine splits its threads over its ranks) and every collective is gloo over
loopback: this measures the control path's cost, not a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cluster.protocol import SamplingParams
from workers.llm import LLM


def step_ms(tp: int, running: int, tokens: int, repeats: int) -> tuple[list[float], list[list[int]]]:
    """(ms a step of each run, the last run's greedy outputs)."""
    options = {"num_kv_blocks": 512, "max_num_batched_tokens": 512, "max_num_seqs": running}
    with LLM("", tensor_parallel_size=tp, detokenize_thread=False, **options) as llm:
        prompts = [[5 + i] * 32 for i in range(running)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        runs, outputs = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            # NOTE: tokens - 1 decode steps after the prefill (one step at this budget)
            runs.append((time.perf_counter() - t0) / tokens * 1e3)
            outputs = [o.token_ids for o in done]
        return runs, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    first: list[list[int]] | None = None
    for tp in args.tp:
        runs, outputs = step_ms(tp, args.running, args.tokens, args.repeats)
        first = outputs if first is None else first
        differ = sum(a != b for a, b in zip(first, outputs, strict=True))
        print(
            f"TP={tp}: {statistics.median(runs):.2f} ms a step, median of {[round(r, 2) for r in runs]}; "
            f"greedy outputs differ from TP={args.tp[0]}'s in {differ} of {len(outputs)} requests"
        )


if __name__ == "__main__":
    main()
