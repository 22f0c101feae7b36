"""KV-transfer benchmark: handoff latency and throughput vs a raw torch.distributed send/recv.

Two processes (rank 0 = prefill with KVSenders, rank 1 = decode with KVReceivers) on one machine; this
process hosts the store their raw group rendezvous on (bench/raw_store.py; a pair's own group rendezvous
over its handshake link, as in a cluster, which hosts no store). For each prompt length and each
repetition, the same number of bytes is first moved with a plain `send`/`recv` of one contiguous buffer
over a two-rank group of their own (the wire alone), then as a full handoff by each
configuration in turn: signed ZMQ handshake, the pair's own group (built in the warm-up), gather of
non-contiguous blocks into the staging ring, digest,
channel send, digest check, scatter into other block ids, final ack, pipelined in chunks of `--chunk-mib`
through `--slots` slots per side (lists sweep every combination, interleaved within each repetition so a
load that drifts hits them alike). Layout: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, block_size
16, bf16 -> 128 KiB per token), random data. Figures are medians over `--reps` repetitions (after one
warm-up).

Columns: `raw ms` / `handoff ms` (receiver's submit -> result), `handoff/raw` = raw ms / handoff ms (the
efficiency; issue 11's target is >= 85% at >= 1k tokens; also as the median of each repetition's ratio),
GB/s of each. A second table says where the transfer threads spent the handoff: the sender's gather,
digest, and time blocked (a free slot of its own or a credit for the receiver's), the receiver's digest,
scatter, and time blocked on the channel (the next chunk), `wire` (receiver: ack -> last chunk scattered),
and the CPU milliseconds each process (every thread) used for the raw send/recv and for the handoff. On a
shared box run it several times and compare medians; the header prints the load average.

    python bench/bench_transfer.py                                  # gloo on CPU, the library's defaults
    python bench/bench_transfer.py --tokens 1024 --chunk-mib 2,4,8 --slots 3,4    # sweep
    python bench/bench_transfer.py --backend nccl                   # two GPUs (rank r on cuda:r)
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from transfer.protocol import KVLayout

_SENDER_PHASES = ("gather_seconds", "hash_seconds", "blocked_seconds")
_RECEIVER_PHASES = ("hash_seconds", "scatter_seconds", "blocked_seconds", "wire_seconds")


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _worker(rank: int, store: tuple[str, int], secret: bytes, backend: str, cases: list[tuple[int, KVLayout]],
            reps: int, configs: list[tuple[int, int]], handoffs: Any, out: Any) -> None:  # fmt: skip
    from transfer.channel import TORCH_DTYPES
    from transfer.connector import KVReceiver, KVSender
    from transfer.pairs import PairChannel, build_group
    from transfer.peers import PeerId
    from transfer.protocol import KVHandoff

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = build_group(store, "bench-transfer/raw/", rank, backend, "127.0.0.1", 600.0, device)
    channel = PairChannel("127.0.0.1", backend, group_timeout_s=600.0, device=device)

    def barrier() -> None:
        group.barrier().wait()
        _sync(device)

    rng = random.Random(rank)
    rows: list[dict[str, Any]] = []
    for num_tokens, layout in cases:
        n = num_tokens // layout.block_size
        num_blocks = n + n // 4 + 1  # room for a shuffled, non-contiguous set of block ids
        kv = torch.empty(layout.staging_shape(num_blocks), dtype=TORCH_DTYPES[layout.dtype], device=device)
        kv.view(torch.uint8).random_()
        sides: list[Any] = []
        for i, (chunk_bytes, num_slots) in enumerate(configs):
            # NOTE: each configuration is its own couple of peers, so its own pair (built in the warm-up)
            me = PeerId(f"{'prefill' if rank == 0 else 'decode'}-{num_tokens}-{i}", str(rank))
            if rank == 0:
                sides.append(KVSender(kv, me=me, channel=channel, secret=secret, on_sent=lambda r, ok: None,
                                      timeout_s=120.0, chunk_bytes=chunk_bytes, num_slots=num_slots))  # fmt: skip
            else:
                sides.append(KVReceiver(kv, me=me, channel=channel, secret=secret, timeout_s=120.0,
                                        num_slots=num_slots))  # fmt: skip
            sides[-1].start()
        nbytes = n * layout.bytes_per_block
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        raw.random_()
        raw_times: list[float] = []
        raw_cpu: list[float] = []
        kv_times: list[list[float]] = [[] for _ in configs]
        kv_cpu: list[list[float]] = [[] for _ in configs]
        phases: list[list[list[float]]] = [[] for _ in configs]
        for rep in range(reps + 1):  # rep 0 warms up (first touch of staging pages, the pairs' groups)
            barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            if rank == 0:
                group.send([raw], 1, 0).wait()
            else:
                group.recv([raw], 0, 0).wait()
            _sync(device)
            if rep:  # NOTE: process CPU (every thread) from barrier to barrier
                raw_times.append(time.perf_counter() - t0)
                raw_cpu.append(time.process_time() - c0)
            for i, side in enumerate(sides):
                barrier()
                c0 = time.process_time()
                request_id = f"r{num_tokens}-{i}-{rep}"
                if rank == 0:
                    src_ids = rng.sample(range(1, num_blocks), n)
                    handoffs.put(side.offer(request_id, src_ids, num_tokens).to_bytes())
                else:
                    handoff = KVHandoff.from_bytes(handoffs.get(timeout=300))
                    t0 = time.perf_counter()
                    result = side.receive(handoff, rng.sample(range(1, num_blocks), n))
                    if rep:
                        kv_times[i].append(time.perf_counter() - t0)
                        phases[i].append([getattr(result, p) for p in _RECEIVER_PHASES])
                barrier()
                if rep:
                    kv_cpu[i].append(time.process_time() - c0)
        for i, side in enumerate(sides):
            if rank == 0:  # NOTE: the sender records a result after the receiver's DONE: wait for the last
                deadline = time.monotonic() + 60
                while len(side.results()) < reps + 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                sent = [r for r in side.results() if r.ok][1:]
                sender_phases = [_median([getattr(r, p) for r in sent]) for p in _SENDER_PHASES]
                out.put((sender_phases, [_median(raw_cpu), _median(kv_cpu[i])]))
            else:
                rows.append({
                    "config": configs[i], "tokens": num_tokens, "layers": layout.num_layers, "nbytes": nbytes,
                    "raw": _median(raw_times), "handoff": _median(kv_times[i]),
                    "ratio": _median([r / k for r, k in zip(raw_times, kv_times[i], strict=True)]),
                    "receiver": [_median([p[j] for p in phases[i]]) for j in range(len(_RECEIVER_PHASES))],
                    "receiver_cpu": [_median(raw_cpu), _median(kv_cpu[i])],
                })  # fmt: skip
            side.close()
        del kv, raw, sides
    if rank == 1:
        out.put(rows)
    out.close()
    out.join_thread()  # NOTE: os._exit skips the queue's flush; without this a loaded box lost the results
    barrier()
    os._exit(0)


def _print_tables(rows: list[dict[str, Any]]) -> None:
    header = ("tokens", "layers", "MiB", "raw ms", "raw GB/s", "handoff ms", "handoff GB/s", "handoff/raw",
              "median per-rep raw/handoff")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for row in rows:
        nbytes, raw_t, kv_t = row["nbytes"], row["raw"], row["handoff"]
        cells = (row["tokens"], row["layers"], f"{nbytes / 2**20:.0f}", f"{raw_t * 1e3:.1f}",
                 f"{nbytes / raw_t / 1e9:.2f}", f"{kv_t * 1e3:.1f}", f"{nbytes / kv_t / 1e9:.2f}",
                 f"{raw_t / kv_t:.0%}", f"{row['ratio']:.0%}")  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print("\nwhere the time went (ms; S = sender, R = receiver; CPU = the process, every thread)")
    header = ("tokens", "S gather", "S hash", "S blocked", "R hash", "R scatter", "R blocked", "wire",
              "S CPU raw", "R CPU raw", "S CPU handoff", "R CPU handoff")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for row in rows:
        times = (*row["sender"], *row["receiver"])
        cpu = (row["sender_cpu"][0], row["receiver_cpu"][0], row["sender_cpu"][1], row["receiver_cpu"][1])
        cells = (row["tokens"], *(f"{t * 1e3:.1f}" for t in (*times, *cpu)))
        print("| " + " | ".join(str(c) for c in cells) + " |")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument(
        "--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024, 4096, 16384]
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunk-mib", type=_floats, default=None, help="KVSender chunk_bytes in MiB (list)")
    parser.add_argument("--slots", type=_floats, default=None, help="staging ring slots per side (list)")
    parser.add_argument(
        "--mem-fraction", type=float, default=0.5, help="of MemAvailable the run may use (gloo)"
    )
    args = parser.parse_args()
    from transfer.side import DEFAULT_CHUNK_BYTES, NUM_SLOTS

    chunk_sizes = [int(c * 2**20) for c in args.chunk_mib] if args.chunk_mib else [DEFAULT_CHUNK_BYTES]
    slot_counts = [int(s) for s in args.slots] if args.slots else [NUM_SLOTS]
    configs = list(itertools.product(chunk_sizes, slot_counts))

    cases, notes = [], []
    per_token_layer = 2 * 8 * 128 * 2  # K and V bytes of one token in one layer (bf16)
    budget = args.mem_fraction * _mem_available_bytes()
    for num_tokens in args.tokens:
        layers = args.layers
        # both processes: KV (1.25x the prompt's blocks) + the raw buffer ~ 2.3x the bytes each
        while (
            args.backend == "gloo" and layers > 1 and 2 * 2.3 * num_tokens * per_token_layer * layers > budget
        ):
            layers //= 2
        if layers != args.layers:
            notes.append(f"NOTE: {num_tokens} tokens: num_layers scaled {args.layers} -> {layers} to fit "
                         f"{budget / 2**30:.1f} GiB (x{args.layers // layers} bytes and ~time for the full model)")  # fmt: skip
        layout = KVLayout(num_layers=layers, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
        cases.append((num_tokens, layout))
    from bench.raw_store import RawStore
    from cluster.frames import new_secret

    raw_store = RawStore("127.0.0.1")
    ctx = mp.get_context("spawn")
    handoffs, sender_out, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    common = (raw_store.address, new_secret(), args.backend, cases, args.reps, configs, handoffs)
    procs = [
        ctx.Process(target=_worker, args=(0, *common, sender_out)),
        ctx.Process(target=_worker, args=(1, *common, out)),
    ]
    load_before = os.getloadavg()[0]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=3600)
        for row in rows:
            row["sender"], row["sender_cpu"] = sender_out.get(timeout=60)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
        raw_store.close()
    print(f"backend={args.backend} torch={torch.__version__} cpus={os.cpu_count()} Llama-3-8B KV layout "
          f"(8 KV heads, head_dim 128, block 16, bf16; 4 KiB/token/layer), median of {args.reps} after 1 "
          f"warm-up; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
    for note in notes:
        print(note)
    for chunk_bytes, num_slots in configs:
        print(f"\nchunks of {chunk_bytes / 2**20:g} MiB, {num_slots} staging slots per side")
        _print_tables([r for r in rows if r["config"] == (chunk_bytes, num_slots)])


if __name__ == "__main__":
    main()
