"""Test-session setup shared by every module."""

from __future__ import annotations

import os

import torch

# NOTE: without CUDA, Triton kernels run in the interpreter, and triton decides that for its own library
# functions when it is first imported (torch imports it lazily from many places), so set it up front.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
