"""KV handoff over a rate-limited link between two hosts vs a raw torch.distributed send over that link.

Runs on the two-host lab (bench/netns_lab.py, as root, no Ray): host A is the root network namespace,
host B a namespace joined to it by a veth pair, limited with ``tc ... tbf rate RATE`` in both directions.
This process hosts a store on host A (bench/raw_store.py: for the raw group and to pass the handoffs; the
pair's own group rendezvous over its handshake link) and starts two worker processes: the prefill
side on host A (KVSender) and the decode side inside host B's namespace (KVReceiver). Each repetition
moves the same bytes twice, in the same run and over the same link: first one ``send``/``recv`` of a
contiguous buffer over a plain two-rank gloo group (the link alone), then a full handoff of that many
tokens' KV (signed ZMQ handshake, the pair's own group built on first use, gather of non-contiguous
blocks, digests, scatter into other block ids) timed on the decode side from submit to result. Layout:
Llama-3-8B (32 layers, 8 KV heads, head_dim 128, block 16, bf16: 128 KiB per token). Repetition 0 warms
up (it builds the pair) and is not counted; figures are medians.

    sudo python -m bench.bench_link                          # 4096 tokens, 1gbit, 3 repetitions
    sudo python -m bench.bench_link --tokens 8192 --rate 2gbit --reps 5

Prints the payload rates (GB/s and Gbit/s), each as a share of the nominal link rate, the handoff's
share of the raw send's rate, and the bytes host A's end of the veth sent in all (payload + headers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_TIMEOUT_S = 600.0


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate must end in one of {list(units)}, got {rate!r}")


def worker(args: argparse.Namespace) -> None:
    """One side of the benchmark (``--side prefill|decode``): prints one ``RESULT {...}`` line."""
    import datetime

    import torch
    import torch.distributed as dist

    from transfer.connector import KVReceiver, KVSender
    from transfer.pairs import PairChannel, build_group
    from transfer.peers import PeerId
    from transfer.protocol import KVHandoff, KVLayout

    torch.set_num_threads(1)
    host, port = args.store.split(":")
    store = (host, int(port))
    is_prefill = args.side == "prefill"
    rank = 0 if is_prefill else 1
    secret = bytes.fromhex(args.secret)
    layout = KVLayout(num_layers=args.layers, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    n = args.tokens // layout.block_size
    num_blocks = n + n // 4 + 1
    kv = torch.empty(layout.staging_shape(num_blocks), dtype=torch.bfloat16)
    kv.view(torch.uint8).random_()
    nbytes = n * layout.bytes_per_block
    raw_buf = torch.empty(nbytes, dtype=torch.uint8).random_()
    shared = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=_TIMEOUT_S))
    raw = build_group(store, "bench-link/raw/", rank, "gloo", args.bind, _TIMEOUT_S)
    channel = PairChannel(args.bind, "gloo", group_timeout_s=_TIMEOUT_S)
    me = PeerId(f"link-{args.side}", "0")
    side: Any
    if is_prefill:
        side = KVSender(kv, me=me, channel=channel, secret=secret, on_sent=lambda r, ok: None,
                        endpoint=f"tcp://{args.bind}:*", timeout_s=_TIMEOUT_S, lease_s=_TIMEOUT_S)  # fmt: skip
    else:
        side = KVReceiver(kv, me=me, channel=channel, secret=secret, timeout_s=_TIMEOUT_S)
    side.start()
    rng = random.Random(rank)
    raw_s: list[float] = []
    handoff_s: list[float] = []
    results: list[dict[str, float]] = []
    for rep in range(args.reps + 1):
        raw.barrier().wait()
        t0 = time.perf_counter()
        (raw.send([raw_buf], 1, rep) if is_prefill else raw.recv([raw_buf], 0, rep)).wait()
        raw.barrier().wait()
        if rep:
            raw_s.append(time.perf_counter() - t0)
        request_id = f"r{rep}"
        if is_prefill:
            handoff = side.offer(request_id, rng.sample(range(1, num_blocks), n), args.tokens)
            shared.set(f"bench-link/handoff/{rep}", handoff.to_bytes())
        else:
            handoff = KVHandoff.from_bytes(shared.get(f"bench-link/handoff/{rep}"))
            t0 = time.perf_counter()
            result = side.receive(handoff, rng.sample(range(1, num_blocks), n))
            if rep:
                handoff_s.append(time.perf_counter() - t0)
                results.append({"wire_s": result.wire_seconds, "blocked_s": result.blocked_seconds,
                                "scatter_s": result.scatter_seconds, "hash_s": result.hash_seconds})  # fmt: skip
        raw.barrier().wait()
    if not is_prefill:
        print(
            "RESULT "
            + json.dumps({"nbytes": nbytes, "raw_s": raw_s, "handoff_s": handoff_s, "phases": results})
        )
    sys.stdout.flush()
    side.close()
    os._exit(0)  # NOTE: skip gloo's teardown, which would wait for the peer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate on the veth, both directions")
    ap.add_argument("--side", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--bind", help=argparse.SUPPRESS)
    ap.add_argument("--secret", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        worker(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.netns_lab import netns_refusal, two_host_lab
    from bench.raw_store import RawStore
    from cluster.frames import new_secret

    refusal = netns_refusal()
    if refusal is not None:
        print(f"SKIP: the two-host lab is unavailable here: {refusal}")
        return 0
    link_bits = _rate_bits(args.rate)
    with two_host_lab(start_ray=False) as lab:
        lab.rate_limit(args.rate)
        store = RawStore(lab.ip_a)
        common = ["--tokens", str(args.tokens), "--layers", str(args.layers), "--reps", str(args.reps),
                  "--store", f"{store.address[0]}:{store.address[1]}", "--secret", new_secret().hex()]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        me = [sys.executable, "-m", "bench.bench_link"]
        sent_before = lab.link_bytes()[1]
        load = os.getloadavg()[0]
        procs = [
            subprocess.Popen([*me, "--side", "prefill", "--bind", lab.ip_a, *common], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, text=True),
            subprocess.Popen(["ip", "netns", "exec", lab.ns, *me, "--side", "decode", "--bind", lab.ip_b, *common],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True),
        ]  # fmt: skip
        try:
            outputs = [p.communicate(timeout=_TIMEOUT_S)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        sent = lab.link_bytes()[1] - sent_before
        store.close()
    lines = [ln for ln in outputs[1].splitlines() if ln.startswith("RESULT ")]
    if not lines or any(p.returncode for p in procs):
        print(f"FAILED: return codes {[p.returncode for p in procs]}\n{outputs}")
        return 1
    res = json.loads(lines[-1][len("RESULT ") :])
    nbytes = res["nbytes"]
    raw_s, kv_s = statistics.median(res["raw_s"]), statistics.median(res["handoff_s"])
    raw_rate, kv_rate = nbytes / raw_s, nbytes / kv_s
    print(f"link: veth {lab.veth_a} <-> {lab.veth_b} (netns {lab.ns}), tc tbf rate {args.rate} both ways; "
          f"{args.tokens} tokens x {args.layers} layers of Llama-3-8B KV = {nbytes / 2**20:.0f} MiB; median of "
          f"{args.reps} after 1 warm-up; load average {load:.1f} (shared 2-core box)")  # fmt: skip
    print("| what | ms | GB/s | Gbit/s | of link rate |")
    print("|---|---:|---:|---:|---:|")
    for name, secs, rate in (("raw gloo send", raw_s, raw_rate), ("KV handoff", kv_s, kv_rate)):
        print(
            f"| {name} | {secs * 1e3:.0f} | {rate / 1e9:.3f} | {rate * 8 / 1e9:.3f} | {rate * 8 / link_bits:.1%} |"
        )
    ratios = [r / k for r, k in zip(res["raw_s"], res["handoff_s"], strict=True)]
    print(
        f"handoff / raw: {kv_rate / raw_rate:.1%} (per repetition: {', '.join(f'{r:.1%}' for r in ratios)})"
    )
    expected = (args.reps + 1) * 2 * nbytes
    print(f"host A sent {sent / 2**20:.0f} MiB on the veth for {expected / 2**20:.0f} MiB of payload "
          f"({sent / expected:.3f}x: headers, handshakes)")  # fmt: skip
    phases = res["phases"]
    print("decode side, median ms: " + ", ".join(
        f"{k} {statistics.median(p[k] for p in phases) * 1e3:.0f}" for k in phases[0]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
