"""`pdserve` command line: generate, bench. Heavy imports happen inside the subcommand that needs them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _generate(args: argparse.Namespace) -> int:
    from cluster.protocol import SamplingParams
    from workers.llm import LLM

    llm = LLM(args.model, block_size=args.block_size, attention_backend=args.attention_backend)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    for prompt, out in zip(args.prompts, llm.generate(args.prompts, params), strict=True):
        ttft = (out.first_token_time or out.arrival_time) - out.arrival_time
        total = (out.finish_time or out.arrival_time) - out.arrival_time
        print(f"--- {prompt!r}")
        print(f"{out.text}")
        print(
            f"[{len(out.token_ids)} tokens, finish={out.finish_reason.value if out.finish_reason else None}, "
            f"ttft={ttft * 1000:.1f} ms, total={total * 1000:.1f} ms]"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "offline":
        from bench.offline import main as offline_main

        return offline_main(args.rest)
    raise SystemExit(f"unknown benchmark {args.bench!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation with one engine (bundled model by default)")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default="", help="HF checkpoint directory (default: the bundled tiny model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks that print figures (see bench/)")
    bench.add_argument("bench", choices=["offline"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
