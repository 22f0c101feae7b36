"""Throughput of the KV transfer's device digest (transfer/digest.py) against the device's copy bandwidth.

    python bench/device_digest.py            # CUDA if present, else CPU (numbers then say nothing of a GPU)

A chunk is sealed on the sender's device and checked on the receiver's: the digest must run well above the
link it guards (NVLink: ~450 GB/s per direction on an H100 SXM) or it, not the link, caps a transfer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_throughput import seconds_per_call
from transfer.digest import DeviceDigest


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    iters = 50 if device.type == "cuda" else 3
    digest = DeviceDigest(nonce=12345)
    for mib in (4, 16):
        nbytes = mib << 20
        chunk = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        digest.prepare(nbytes, device)
        dst = torch.empty_like(chunk)
        t_digest = seconds_per_call(lambda c=chunk: digest(c, 0), device, iters)
        t_copy = seconds_per_call(lambda c=chunk, d=dst: d.copy_(c), device, iters)
        print(f"{device.type} chunk {mib:2d} MiB: digest {nbytes / t_digest / 1e9:8.1f} GB/s "
              f"({t_digest * 1e6:8.1f} us), copy {2 * nbytes / t_copy / 1e9:8.1f} GB/s read+write")  # fmt: skip


if __name__ == "__main__":
    main()
