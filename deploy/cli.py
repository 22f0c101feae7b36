"""`pdserve` command line: generate, serve, demo, bench. Heavy imports happen inside the subcommand that
needs them (this module imports neither torch nor ray at load time)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from cluster.client.sdk import StreamResult
# (endpoint, prompt): the demo's requests; the first streams alone, the rest concurrently.
DEMO_REQUESTS = [
    ("completion", "Once upon a time"),
    ("chat", "Tell me a story about a brave little robot."),
    ("completion", "The little dog ran to the park"),
    ("completion", "One day, a girl named Lily found a box"),
]


def _generate(args: argparse.Namespace) -> int:
    from cluster.hub import resolve_model
    from cluster.protocol import SamplingParams
    from workers.llm import LLM

    model = resolve_model(args.model, args.revision).path
    llm = LLM(model, block_size=args.block_size, attention_backend=args.attention_backend)
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


def _serve(args: argparse.Namespace) -> int:
    from deploy.cli_args import build_config
    from deploy.front_end import check_exposure
    from deploy.http_host import serve
    from deploy.launch import build_cluster
    from deploy.logs import configure_logging

    cfg = build_config(args)
    configure_logging(cfg.log)
    # NOTE: before the cluster starts: refusing an unauthenticated public bind must cost nothing
    check_exposure(cfg.server, cfg.server.host)
    with build_cluster(cfg) as cluster:
        serve(cluster)
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Local cluster -> HTTP server on a free loopback port -> streaming SDK requests -> latency table."""
    from deploy.cli_args import build_config
    from deploy.http_host import start_http
    from deploy.launch import build_cluster

    cfg = build_config(args)
    where = args.config or "the packaged cpu-disagg.yaml"
    print(f"starting the {cfg.router.mode} cluster from {where} (Ray) ...", flush=True)
    with build_cluster(cfg) as cluster:
        with start_http(cluster) as http:
            print(f"serving {cluster.model_info.name} on {http.url}\n", flush=True)
            results = asyncio.run(_demo_requests(http.url, args.max_tokens))
        _print_table(results)
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
    from cluster.client.sdk import AsyncClient

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


BENCHMARKS_GROUP = "pdserve.benchmarks"


def _benchmarks() -> dict[str, EntryPoint]:
    """The benchmarks `pdserve bench NAME` runs, as bench/ registers them (setup.cfg's ``pdserve.benchmarks``
    entry points). NOTE: a registry, not imports: bench/ builds on deploy/, so the CLI names no bench module
    and the layers keep one direction."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=BENCHMARKS_GROUP)}


def _bench(args: argparse.Namespace) -> int:
    found = _benchmarks()
    if args.bench not in found:
        known = ", ".join(sorted(found)) or "none (is pdserve installed? `make setup`)"
        raise SystemExit(f"unknown benchmark {args.bench!r}; registered: {known}")
    main_of_bench: Callable[[list[str]], int] = found[args.bench].load()
    return main_of_bench(args.rest)


def _scale(args: argparse.Namespace) -> int:
    """POST /v1/pdserve/scale on a running server; prints the pool's workers, or the server's error."""
    import httpx

    admin_key = args.admin_key or os.environ.get("PDSERVE_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    body = {"pool": args.pool, "num_workers": args.workers}
    # NOTE: a scale-down waits for the drain (router.drain_timeout_s) before it answers.
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    base = args.url.rstrip("/").removesuffix("/v1")
    try:
        reply = httpx.post(f"{base}/v1/pdserve/scale", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        print(f"pdserve scale: {args.url} did not answer: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if reply.status_code != 200:
        print(f"pdserve scale: HTTP {reply.status_code}: {reply.text[:500]}", file=sys.stderr)
        return 1
    result = reply.json()
    print(f"{result['pool']}: {result['num_workers']} workers: {' '.join(result['workers'])}")
    return 0


def _add_scale(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    scale = sub.add_parser("scale", help="grow or shrink a pool of a running server (admin route)")
    scale.add_argument("--pool", required=True, help="prefill, decode, or colocated")
    scale.add_argument("--workers", type=int, required=True, help="the pool's new number of workers")
    scale.add_argument("--url", default=os.environ.get("PDSERVE_BASE_URL", "http://127.0.0.1:8000"))
    scale.add_argument(
        "--admin-key", default=None, help="the server's admin key (default: $PDSERVE_ADMIN_KEY)"
    )
    scale.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    scale.set_defaults(func=_scale)


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser("generate", help="offline generation with one engine (bundled model by default)")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default="", help="checkpoint directory or Hugging Face repo id")
    gen.add_argument("--revision", default=None, help="hub repo branch, tag or commit")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    gen.set_defaults(func=_generate)


def _configure_logging(args: argparse.Namespace) -> None:
    from cluster.config import LogConfig
    from deploy.logs import configure_logging

    configure_logging(
        LogConfig(
            level=getattr(args, "log_level", None) or "INFO",
            format=getattr(args, "log_format", None) or "text",
        )
    )


def build_parser() -> argparse.ArgumentParser:
    from deploy.cli_args import add_cluster_arguments

    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_scale(sub)

    srv = sub.add_parser(
        "serve",
        help="start the cluster and serve the OpenAI API until interrupted",
        description="pdserve serve [MODEL] [--config YAML] [flags]: flags override the YAML",
    )
    add_cluster_arguments(srv)
    srv.set_defaults(func=_serve)

    demo = sub.add_parser("demo", help="local cluster + HTTP server, a few streaming requests, latency table")
    add_cluster_arguments(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks that print figures (see bench/)")
    bench.add_argument(
        "bench",
        help="offline, serve, soak, admission, frontend, multiturn (the pdserve.benchmarks entry points)",
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    sub.add_parser(
        "plan", help="simulate prefill:decode splits for a workload and SLO; plan calibrate / validate"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["plan"]:
        # NOTE: deploy/plan/cli.py's own parser owns every option after the word (argparse's REMAINDER
        # would not take leading options such as `pdserve plan --workers 4`).
        from deploy.plan.cli import main as plan_main

        return plan_main(words[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("serve", "demo"):
            _configure_logging(args)
        result: int = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        from cluster.hub import ModelNotFoundError
        from deploy.device_check import CudaUnavailableError

        # NOTE: configuration problems (bad YAML value, unknown model, no CUDA) end in one logged line,
        # not a traceback; anything else keeps its traceback.
        if not isinstance(e, (ValueError, FileNotFoundError, ModelNotFoundError, CudaUnavailableError)):
            raise
        logging.getLogger("pdserve").error("%s", e)
        return 2
    return result


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
