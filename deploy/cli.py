"""`pdserve` command line: generate, serve, demo, bench. Heavy imports happen inside the subcommand that
needs them (this module imports neither torch nor ray at load time)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.client import StreamResult
    from cluster.config import ClusterConfig

DEFAULT_CONFIG = "deploy/cpu-disagg.yaml"
# (endpoint, prompt): the demo's requests; the first streams alone, the rest concurrently.
DEMO_REQUESTS = [
    ("completion", "Once upon a time"),
    ("chat", "Tell me a story about a brave little robot."),
    ("completion", "The little dog ran to the park"),
    ("completion", "One day, a girl named Lily found a box"),
]


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


def _load_config(path: str, model: str | None) -> ClusterConfig:
    from cluster.config import ClusterConfig

    # NOTE: the default is relative to the repository, so `pdserve demo` works from any directory.
    repo_relative = Path(__file__).resolve().parents[1] / path
    cfg = ClusterConfig.from_yaml(
        path if Path(path).exists() or not repo_relative.exists() else str(repo_relative)
    )
    return cfg if not model else dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model))


def _serve(args: argparse.Namespace) -> int:
    from deploy.http_host import serve_on_loop
    from deploy.launch import start_cluster

    handle = start_cluster(_load_config(args.config, args.model))
    try:
        serve_on_loop(handle, args.host, args.port)
    finally:
        handle.shutdown()
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Local cluster -> HTTP server on a free loopback port -> streaming SDK requests -> latency table."""
    from deploy.http_host import start_http
    from deploy.launch import start_cluster

    cfg = _load_config(args.config, args.model)
    print(f"starting the {cfg.router.mode} cluster from {args.config} (Ray, CPU workers) ...", flush=True)
    handle = start_cluster(cfg)
    try:
        with start_http(handle) as http:
            print(f"serving {handle.model_info.name} on {http.url}\n", flush=True)
            results = asyncio.run(_demo_requests(http.url, args.max_tokens))
        _print_table(results)
    finally:
        handle.shutdown()
    print("\ncluster shut down", flush=True)
    return 0


def _demo_body(kind: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    key: dict[str, Any] = (
        {"messages": [{"role": "user", "content": prompt}]} if kind == "chat" else {"prompt": prompt}
    )
    return {**key, "max_tokens": max_tokens, "temperature": 0.0}


async def _demo_requests(url: str, max_tokens: int) -> list[tuple[str, StreamResult]]:
    """The first request streams alone, token by token; the others stream at the same time and print a
    tagged line per finished sentence, so their interleaving shows."""
    from cluster.client import AsyncClient

    async with AsyncClient(url, max_retries=0, timeout=120) as client:

        async def one(tag: int, kind: str, prompt: str, live: bool) -> tuple[str, StreamResult]:
            create = client.chat.completions.create if kind == "chat" else client.completions.create
            stream = await create(stream=True, **_demo_body(kind, prompt, max_tokens))
            pending = ""
            async for delta in stream:
                if live:
                    print(delta.text, end="", flush=True)
                    continue
                pending += delta.text
                while (end := _sentence_end(pending)) > 0:
                    print(f"  [{tag}] {pending[:end].strip()}", flush=True)
                    pending = pending[end:]
            if pending.strip() and not live:
                print(f"  [{tag}] {pending.strip()}", flush=True)
            return prompt, stream.result

        kind, prompt = DEMO_REQUESTS[0]
        print(f"[1] {kind} {prompt!r}, streaming alone:\n  ", end="", flush=True)
        first = await one(1, kind, prompt, live=True)
        print(f"\n\n{len(DEMO_REQUESTS) - 1} requests streaming concurrently:", flush=True)
        for tag, (kind, prompt) in enumerate(DEMO_REQUESTS[1:], start=2):
            print(f"[{tag}] {kind} {prompt!r}", flush=True)
        rest = await asyncio.gather(
            *(one(tag, k, p, live=False) for tag, (k, p) in enumerate(DEMO_REQUESTS[1:], start=2))
        )
    print()
    return [first, *rest]


def _sentence_end(text: str) -> int:
    """Index just past the first sentence end ('.', '!' or '?' then a space, after a word), or 0."""
    ends = [
        i + 1
        for i, c in enumerate(text[:-1])
        if c in ".!?" and text[i + 1] == " " and any(ch.isalnum() for ch in text[:i])
    ]
    return ends[0] if ends else 0


def _print_table(results: list[tuple[str, StreamResult]]) -> None:
    import numpy as np

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    head = ("prompt", "tokens", "TTFT", "TBT p50", "TBT p90", "E2E", "queue", "prefill", "transfer", "decode")
    rows = []
    for tag, (prompt, r) in enumerate(results, start=1):
        tbt = np.percentile(r.tbt_s, [50, 90]).tolist() if r.tbt_s else [None, None]
        t = r.timings
        split = [t.queue_s, t.prefill_s, t.transfer_s, t.decode_s] if t else [None] * 4
        label = f"[{tag}] " + (prompt if len(prompt) <= 28 else prompt[:25] + "...")
        rows.append((label, str(len(r.token_ids)), *(ms(v) for v in [r.ttft_s, *tbt, r.e2e_s, *split])))
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    print("latency in ms; TTFT/TBT/E2E measured at the client, queue/prefill/transfer/decode by the router")
    for row in [head, *rows]:
        print(
            "  ".join(
                str(c).ljust(w) if i == 0 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "offline":
        from bench.offline import main as offline_main

        return offline_main(args.rest)
    if args.bench == "serve":
        from bench.serve import main as serve_main

        return serve_main(args.rest)
    raise SystemExit(f"unknown benchmark {args.bench!r}")


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["plan"]:
        # NOTE: bench/plan.py's own parser owns every option after the word (argparse's REMAINDER
        # would not take leading options such as `pdserve plan --workers 4`).
        from bench.plan import main as plan_main

        return plan_main(words[1:])
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

    srv = sub.add_parser("serve", help="start the cluster and serve the OpenAI API until interrupted")
    srv.add_argument("--config", default=DEFAULT_CONFIG, help="ClusterConfig YAML (deploy/*.yaml)")
    srv.add_argument("--host", default=None, help="default: the config's server.host")
    srv.add_argument("--port", type=int, default=None, help="default: the config's server.port")
    srv.add_argument("--model", default=None, help="override the config's model.path")
    srv.set_defaults(func=_serve)

    demo = sub.add_parser("demo", help="local cluster + HTTP server, a few streaming requests, latency table")
    demo.add_argument("--config", default=DEFAULT_CONFIG, help="ClusterConfig YAML (deploy/*.yaml)")
    demo.add_argument("--model", default=None, help="override the config's model.path")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks that print figures (see bench/)")
    bench.add_argument("bench", choices=["offline", "serve"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)

    sub.add_parser(
        "plan", help="simulate prefill:decode splits for a workload and SLO; plan calibrate / validate"
    )

    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
