"""Grammar bombs against an offline engine (issue 31 row 1): does a request with a huge grammar stall
anyone else's batch?

Prints, for the bundled tiny model on this machine:
  - what one bomb's compile costs when run inline (what the step thread paid before grammars compiled
    on the pool);
  - a 4-token free-text request's latency alone (baseline, median of --repeats), then with N distinct
    bombs (~9,500-rule EBNF grammars, like the issue's) added at the same moment, for the default caps
    (the bombs are refused at admission by structured_max_grammar_rules) and with the caps lifted
    (the bombs reach the compile pool and meet structured_compile_timeout_s);
  - the longest gap between two step() returns while the bombs compile: a worker beats its heartbeat
    between steps, so this bounds how late a heartbeat can be.

    .venv/bin/python bench/grammar_bomb.py [--rules 9500] [--bombs 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from cluster.protocol import ErrorCode, SamplingParams, StructuredOutput
from workers.engine import Engine
from workers.llm import LLM
from workers.structured_compile import CompileFailed

PROMPT = "Hello there, how are you"
STEP_BOUND = 200_000


def bomb(num_rules: int, salt: int) -> str:
    """A chain of ``num_rules`` rules, each with a literal, a class and an exit (~30 characters a rule)."""
    lines = ["root ::= r0"]
    for i in range(num_rules - 1):
        lines.append(f'r{i} ::= "{salt}a{i % 89}" r{i + 1} | [a-z] r{i + 1} | "b"')
    lines.append(f'r{num_rules - 1} ::= "z"')
    return "\n".join(lines)


def free_params() -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def run_one(engine: Engine, request_id: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, free_params())
    for _ in range(STEP_BOUND):
        for delta in engine.step():
            if delta.request_id == request_id and delta.finish_reason is not None:
                return time.perf_counter() - t0
    raise RuntimeError("request did not finish")


def with_bombs(engine: Engine, prompt: list[int], grammars: list[str], tag: str) -> dict[str, Any]:
    """Add the bombs and a 4-token request together; step until everything ends."""
    outcome: dict[str, str] = {}
    t0 = time.perf_counter()
    for i, text in enumerate(grammars):
        params = SamplingParams(max_tokens=4, structured=StructuredOutput("grammar", text))
        try:
            engine.add_request(f"{tag}-bomb{i}", prompt, params)
        except CompileFailed as e:
            outcome[f"bomb{i}"] = f"refused at admission ({e.code.value}): {e}"
    admit_s = time.perf_counter() - t0
    engine.add_request(f"{tag}-free", prompt, free_params())
    free_s: float | None = None
    max_gap = 0.0
    last = time.perf_counter()
    for _ in range(STEP_BOUND):
        if not engine.has_unfinished():
            break
        deltas = engine.step()
        now = time.perf_counter()
        max_gap, last = max(max_gap, now - last), now
        for failure in engine.take_failed():
            outcome[failure.request_id.split("-")[-1]] = f"failed at {now - t0:.2f} s ({failure.code.value})"
        for delta in deltas:
            if delta.finish_reason is None:
                continue
            if delta.request_id.endswith("-free"):
                free_s = now - t0
            else:
                outcome[delta.request_id.split("-")[-1]] = (
                    f"finished at {now - t0:.2f} s ({delta.finish_reason})"
                )
    for failure in engine.take_failed():
        outcome[failure.request_id.split("-")[-1]] = f"failed ({failure.code.value})"
    return {"admit_s": admit_s, "free_s": free_s, "max_step_gap_s": max_gap, "bombs": outcome}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rules", type=int, default=9500)
    parser.add_argument("--bombs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1, help="as a worker (pools' torch_threads)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)

    grammars = [bomb(args.rules, salt) for salt in range(args.bombs + 1)]
    print(
        f"bombs: {args.bombs} distinct grammars of {args.rules} rules, {len(grammars[0]):,} characters each"
    )

    inline = LLM(detokenize_thread=False).engine
    prompt = inline.tokenizer.encode(PROMPT)
    t0 = time.perf_counter()
    inline.structured.cache.compile(StructuredOutput("grammar", grammars[-1]))
    print(
        f"one bomb compiled inline (the step thread's stall before this change): {time.perf_counter() - t0:.2f} s"
    )

    for label, options in (
        ("default caps", {}),
        (
            "caps lifted",
            {"structured_max_grammar_rules": 1_000_000, "structured_max_spec_chars": 4 << 20},
        ),
    ):
        engine = LLM(detokenize_thread=False, **options).engine
        _ = (
            engine.structured.cache
        )  # NOTE: built up front (seconds on a real vocabulary), as in a warm worker
        for i in range(2):
            run_one(engine, f"warm{i}", prompt)
        base = statistics.median(run_one(engine, f"base{i}", prompt) for i in range(args.repeats))
        # NOTE: fresh bombs every run: a spec that timed out once is refused at admission afterwards
        runs = [
            with_bombs(
                engine,
                prompt,
                [bomb(args.rules, 1000 * (r + 1) + b) for b in range(args.bombs)],
                f"{label[0]}{r}",
            )
            for r in range(args.repeats)
        ]
        free = [r["free_s"] for r in runs if r["free_s"] is not None]
        worst = max(free)
        bound = 2 * base + 0.100
        config = engine.config
        print(
            f"\n[{label}] timeout {config.structured_compile_timeout_s:g} s, "
            f"{config.structured_compile_threads} compile threads, max rules {config.structured_max_grammar_rules}"
        )
        print(f"  4-token request alone: median {base * 1000:.1f} ms")
        print(
            f"  with {args.bombs} bombs: median {statistics.median(free) * 1000:.1f} ms, worst {worst * 1000:.1f} ms "
            f"(bound 2x baseline + 100 ms = {bound * 1000:.1f} ms: {'PASS' if worst <= bound else 'FAIL'})"
        )
        print(
            f"  admitting the bombs took at most {max(r['admit_s'] for r in runs) * 1000:.1f} ms; "
            f"longest gap between steps {max(r['max_step_gap_s'] for r in runs) * 1000:.1f} ms"
        )
        for name, what in sorted(runs[-1]["bombs"].items()):
            print(f"  {name}: {what[:150]}")
        engine.check_no_leaks()
    assert ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX  # the code the failed bombs carry


if __name__ == "__main__":
    main()
