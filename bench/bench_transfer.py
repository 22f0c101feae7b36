"""KV-transfer benchmark: handoff latency and throughput vs a raw torch.distributed send/recv.

Two processes (rank 0 = prefill with a KVSender, rank 1 = decode with a KVReceiver) on one machine.
For each prompt length, the same number of bytes is first moved with a plain `dist.send`/`dist.recv`
(the wire alone), then as a full handoff: ZMQ handshake, gather of non-contiguous blocks into staging,
checksum, channel send, checksum, scatter into other block ids, final ack, pipelined in chunks of
`--chunk-mib` ("wire ms" is the receiver's ACK -> last chunk in, which overlaps gather and scatter). Layout: Llama-3-8B
(32 layers, 8 KV heads, head_dim 128, block_size 16, bf16 -> 128 KiB per token), random data.

    python bench/bench_transfer.py                       # gloo on CPU
    python bench/bench_transfer.py --backend nccl        # two GPUs (rank r on cuda:r)
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from transfer.protocol import KVLayout


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, port: int, backend: str, cases: list[tuple[int, KVLayout]], reps: int, chunk_bytes: int,
            handoffs: Any, out: Any) -> None:  # fmt: skip
    import torch.distributed as dist

    from transfer.channel import TORCH_DTYPES, TorchDistChannel
    from transfer.connector import KVReceiver, KVSender
    from transfer.protocol import KVHandoff

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = TorchDistChannel()
    rng = random.Random(rank)
    tables: dict[str, list[int]] = {}
    rows = []
    for num_tokens, layout in cases:
        n = num_tokens // layout.block_size
        num_blocks = n + n // 4 + 1  # room for a shuffled, non-contiguous set of block ids
        shape = [layout.num_layers, num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim]
        kv = torch.empty(shape, dtype=TORCH_DTYPES[layout.dtype], device=device)
        kv.view(torch.uint8).random_()
        if rank == 0:
            side: Any = KVSender(kv, rank=0, channel=channel, get_block_ids=tables.get,
                                 on_sent=lambda r, ok: None, timeout_s=120.0, chunk_bytes=chunk_bytes)  # fmt: skip
        else:
            side = KVReceiver(kv, rank=1, channel=channel, timeout_s=120.0)
        side.start()
        nbytes = n * layout.bytes_per_block
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        raw.random_()
        raw_times, kv_times, wire_times = [], [], []
        for rep in range(reps + 1):  # rep 0 warms up (first touch of staging pages, nccl setup)
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(raw, dst=1)
            else:
                dist.recv(raw, src=0)
            _sync(device)
            raw_t = time.perf_counter() - t0
            dist.barrier()
            request_id = f"r{num_tokens}-{rep}"
            if rank == 0:
                tables[request_id] = rng.sample(range(1, num_blocks), n)
                handoffs.put(side.offer(request_id, num_tokens).to_bytes())
            else:
                handoff = KVHandoff.from_bytes(handoffs.get(timeout=300))
                t0 = time.perf_counter()
                result = side.receive(handoff, rng.sample(range(1, num_blocks), n))
                kv_t = time.perf_counter() - t0
                if rep:
                    raw_times.append(raw_t)
                    kv_times.append(kv_t)
                    wire_times.append(result.wire_seconds)
            dist.barrier()
        side.close()
        del kv, raw, side
        if rank == 1:
            rows.append((num_tokens, layout.num_layers, nbytes, statistics.median(raw_times),
                         statistics.median(kv_times), statistics.median(wire_times)))  # fmt: skip
    if rank == 1:
        out.put(rows)
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument(
        "--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024, 4096, 16384]
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--chunk-mib", type=float, default=16.0, help="KVSender chunk_bytes (pipelining unit)"
    )
    parser.add_argument(
        "--mem-fraction", type=float, default=0.5, help="of MemAvailable the run may use (gloo)"
    )
    args = parser.parse_args()

    cases, notes = [], []
    per_token_layer = 2 * 8 * 128 * 2  # K and V bytes of one token in one layer (bf16)
    budget = args.mem_fraction * _mem_available_bytes()
    for num_tokens in args.tokens:
        layers = args.layers
        # both processes: KV (1.25x the prompt's blocks) + staging + raw buffer ~ 3.3x the bytes each
        while (
            args.backend == "gloo" and layers > 1 and 2 * 3.3 * num_tokens * per_token_layer * layers > budget
        ):
            layers //= 2
        if layers != args.layers:
            notes.append(f"NOTE: {num_tokens} tokens: num_layers scaled {args.layers} -> {layers} to fit "
                         f"{budget / 2**30:.1f} GiB (x{args.layers // layers} bytes and ~time for the full model)")  # fmt: skip
        layout = KVLayout(num_layers=layers, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
        cases.append((num_tokens, layout))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    handoffs, out = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, port, args.backend, cases, args.reps, int(args.chunk_mib * 2**20), handoffs, out),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=1800)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    print(f"backend={args.backend} torch={torch.__version__} cpus={os.cpu_count()} Llama-3-8B KV layout "
          f"(8 KV heads, head_dim 128, block 16, bf16; 4 KiB/token/layer), chunks of {args.chunk_mib:g} MiB, "
          f"median of {args.reps} after 1 warm-up")  # fmt: skip
    for note in notes:
        print(note)
    header = (
        "tokens",
        "layers",
        "MiB",
        "raw ms",
        "raw GB/s",
        "handoff ms",
        "wire ms",
        "handoff GB/s",
        "handoff/raw",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for num_tokens, layers, nbytes, raw_t, kv_t, wire_t in rows:
        cells = (num_tokens, layers, f"{nbytes / 2**20:.0f}", f"{raw_t * 1e3:.1f}", f"{nbytes / raw_t / 1e9:.2f}",
                 f"{kv_t * 1e3:.1f}", f"{wire_t * 1e3:.1f}", f"{nbytes / kv_t / 1e9:.2f}", f"{kv_t / raw_t:.2f}x")  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
