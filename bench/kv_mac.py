"""What `transfer.integrity` costs: each chunk scheme's throughput on one core (seal = verify = one pass
over the chunk), the device schemes on a GPU when there is one, and a KV handoff's wall time with `mac`
vs `digest` vs `off` over a real gloo pair (both ends in this process, on loopback).

    python -m bench.kv_mac [--chunk-mib 4] [--handoff-mib 64] [--repeats 5]

Prints figures; asserts nothing (issue 31 row 3).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from cluster.frames import new_secret
from transfer.protocol import (
    CHECKSUM_SCHEME,
    DEVICE_CHECKSUM_SCHEME,
    DEVICE_MAC_SCHEME,
    HOST_MAC_SCHEME,
)
from transfer.staging import TRAILER_BYTES, chunk_digester, kv_mac_key, seal_chunk


def scheme_throughput(scheme: str, chunk_bytes: int, device: torch.device, repeats: int) -> float:
    """GB/s of sealing one `chunk_bytes` chunk with `scheme` on `device` (one thread)."""
    torch.set_num_threads(1)
    wire = torch.randint(0, 256, (chunk_bytes + TRAILER_BYTES,), dtype=torch.uint8, device=device)
    sealer = chunk_digester(scheme, 12345, kv_mac_key(new_secret()))
    if hasattr(sealer, "prepare"):
        sealer.prepare(chunk_bytes, device)  # type: ignore[union-attr]
    seal_chunk(wire, 12345, 0, sealer)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for chunk in range(repeats):
        seal_chunk(wire, 12345, chunk, sealer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return chunk_bytes * repeats / (time.perf_counter() - t0) / 1e9


def handoff_seconds(integrity: str, nbytes: int, chunk_bytes: int, repeats: int) -> float:
    """Median wall seconds of one handoff of `nbytes` KV between two sides over a gloo pair."""
    import threading

    from transfer.pairs import PairChannel
    from transfer.peers import PeerId
    from transfer.receiver import KVReceiver
    from transfer.sender import KVSender

    row_blocks = 64
    num_layers, block_size, heads, dim = 4, 16, 8, 64
    bytes_per_block = num_layers * 2 * block_size * heads * dim * 2
    num_blocks = max(1, nbytes // bytes_per_block)
    shape = (num_layers, num_blocks + row_blocks, 2, block_size, heads, dim)
    secret = new_secret()
    src, dst = torch.randn(shape).to(torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    pre, dec = PairChannel("127.0.0.1"), PairChannel("127.0.0.1")
    sent = threading.Semaphore(0)
    options: dict[str, Any] = {"secret": secret, "integrity": integrity, "timeout_s": 120.0}
    sender = KVSender(src, me=PeerId("p", "0"), channel=pre, on_sent=lambda r, ok: sent.release(),
                      chunk_bytes=chunk_bytes, **options)  # fmt: skip
    receiver = KVReceiver(dst, me=PeerId("d", "0"), channel=dec, **options)
    sender.start()
    receiver.start()
    seconds = []
    try:
        for i in range(repeats + 1):
            ids = list(range(1, num_blocks + 1))
            handoff = sender.offer(f"r{i}", ids, num_tokens=num_blocks * block_size)
            t0 = time.perf_counter()
            receiver.receive(handoff, ids)
            seconds.append(time.perf_counter() - t0)
            sent.acquire(timeout=60)
    finally:
        sender.close()
        receiver.close()
    return sorted(seconds[1:])[len(seconds[1:]) // 2]  # NOTE: the first builds the pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--handoff-mib", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    cpu = torch.device("cpu")
    print(f"chunk {args.chunk_mib} MiB, one thread:")
    for scheme in (CHECKSUM_SCHEME, HOST_MAC_SCHEME, DEVICE_CHECKSUM_SCHEME, DEVICE_MAC_SCHEME):
        gbps = scheme_throughput(scheme, chunk_bytes, cpu, 4 * args.repeats)
        print(f"  cpu   {scheme:20s} {gbps:7.2f} GB/s per core")
    if torch.cuda.is_available():
        gpu = torch.device("cuda", 0)
        for scheme in (DEVICE_CHECKSUM_SCHEME, DEVICE_MAC_SCHEME):
            for mib in (args.chunk_mib, 16.0):
                gbps = scheme_throughput(scheme, int(mib * (1 << 20)), gpu, 20 * args.repeats)
                print(
                    f"  {torch.cuda.get_device_name(0)[:12]:12s} {scheme:20s} {mib:5.1f} MiB {gbps:8.2f} GB/s"
                )
    nbytes = int(args.handoff_mib * (1 << 20))
    print(f"handoff of {args.handoff_mib} MiB over gloo on loopback (median of {args.repeats}):")
    base = None
    for integrity in ("off", "digest", "mac"):
        s = handoff_seconds(integrity, nbytes, chunk_bytes, args.repeats)
        base = base or s
        print(f"  {integrity:7s} {s * 1e3:8.1f} ms  {nbytes / s / 1e9:6.2f} GB/s  ({s / base:4.2f}x off)")


if __name__ == "__main__":
    main()
