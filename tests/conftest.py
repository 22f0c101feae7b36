"""Test-session setup shared by every module."""

from __future__ import annotations

import os
import pathlib


def _cuda_available() -> bool:
    # NOTE: no GPU device node means no CUDA; only then is torch's (seconds-long) import skipped, so the
    # torch-free unit tests (and the mutation runner's many runs of them) start in well under a second.
    if not any(pathlib.Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


# NOTE: without CUDA, Triton kernels run in the interpreter, and triton decides that for its own library
# functions when it is first imported (torch imports it lazily from many places), so set it up front.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
