"""Chunk-digest candidates on this machine: GB/s of one thread hashing a KV chunk, cache-resident and not.

Measures what transfer/staging.py could seal a chunk with: XXH3-64 / XXH3-128 seeded with a nonce
(`xxhash`, the one in use), keyed BLAKE3 (`blake3`), CRC32C (`crc32c`; `google-crc32c`, whose API takes
only read-only bytes, so a torch buffer is copied first), and the old int32 row-sum checksum (torch) for
reference; candidates whose package is not installed are skipped.
"cached" hashes one `--chunk-mib` buffer over and over; "DRAM" walks a buffer of `--dram-mib`.

    python bench/bench_chunk_hash.py
    pip install blake3 crc32c google-crc32c   # to compare the others too
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

NONCE = 0x1234_5678_9ABC_DEF0


def _candidates(chunk: torch.Tensor) -> dict[str, Callable[[memoryview], object]]:
    out: dict[str, Callable[[memoryview], object]] = {}

    import xxhash  # NOTE: the one in use (a runtime dependency); the others are measured when present

    out["xxh3_64 seeded (in use)"] = lambda b: xxhash.xxh3_64_intdigest(b, seed=NONCE)
    out["xxh3_128 seeded"] = lambda b: xxhash.xxh3_128_intdigest(b, seed=NONCE)
    try:
        import blake3

        key = NONCE.to_bytes(8, "little") * 4
        out["blake3 keyed"] = lambda b: blake3.blake3(b, key=key).digest()
    except ImportError:
        pass
    try:
        import crc32c

        out["crc32c (crc32c)"] = lambda b: crc32c.crc32c(b)
    except ImportError:
        pass
    try:  # NOTE: takes read-only bytes only: a torch buffer must be copied first
        import google_crc32c

        out["crc32c (google-crc32c, incl. the copy)"] = lambda b: google_crc32c.value(bytes(b))
    except ImportError:
        pass

    def rowsum(b: memoryview) -> object:  # the checksum this replaced: int32 word sums per 64 KiB row
        words = torch.frombuffer(b, dtype=torch.int32)
        return words.view(-1, 16384).sum(dim=1, dtype=torch.int32)

    out["old int32 row-sum (torch)"] = rowsum
    return out


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--dram-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chunk_bytes = args.chunk_mib << 20
    big = torch.empty(args.dram_mib << 20, dtype=torch.uint8)
    big.random_()
    chunk = big[:chunk_bytes].clone()
    cached = memoryview(chunk.numpy())
    views = [memoryview(big[i : i + chunk_bytes].numpy()) for i in range(0, big.numel(), chunk_bytes)]
    print(
        f"torch={torch.__version__} cpus={os.cpu_count()} one thread; chunk {args.chunk_mib} MiB; "
        f"median of {args.reps}; load average {os.getloadavg()[0]:.1f}"
    )
    print("| digest | cached GB/s | DRAM GB/s |")
    print("|---|---:|---:|")
    for name, fn in _candidates(chunk).items():
        hot = _median_seconds(lambda fn=fn: fn(cached), args.reps)

        def walk(fn: Callable[[memoryview], object] = fn) -> None:
            for v in views:
                fn(v)

        cold = _median_seconds(walk, max(3, args.reps // 3))
        print(f"| {name} | {chunk_bytes / hot / 1e9:.1f} | {big.numel() / cold / 1e9:.1f} |")


if __name__ == "__main__":
    main()
