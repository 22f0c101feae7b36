"""Count the kernels one call launches, with the torch profiler (used by layer_ops.py and gpu_throughput.py).

On CUDA the profiler's device events are the kernels themselves (Triton, cuBLAS, torch's own, and the
kernels a CUDA-graph replay runs). On CPU there are no kernels, so a CPU count is a proxy: every leaf
operator of the trace that would launch a kernel on a GPU (view-like and allocation-only operators are
left out; an operator counts once unless its children already launch kernels) plus one per Triton launch (each labelled ``triton::<name>`` by ``kernel_probe``; the work the
interpreter does under that label is not counted).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

from workers.attention.kernel_probe import probe_launches

T = TypeVar("T")

# Leaf operators that only make views, allocate or read metadata: no kernel on a GPU.
NO_KERNEL_OPS = frozenset(
    "aten::" + name
    for name in (
        "view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "split", "split_with_sizes",
        "narrow", "unsqueeze", "squeeze", "transpose", "t", "permute", "expand", "detach", "alias", "empty",
        "empty_strided", "empty_like", "resize_", "unbind", "lift_fresh", "result_type", "to", "contiguous",
        "chunk", "flatten", "unflatten", "view_as", "numpy_T", "_unsafe_view", "set_", "is_nonzero",
        "as_strided_", "resolve_conj", "resolve_neg", "conj", "_neg_view", "_conj",
        # NOTE: on this CPU run every tensor is a host tensor; the backends call .item()/.tolist() only
        # on the host copies (``*_cpu``) of the metadata, which on a GPU launch nothing either.
        "_local_scalar_dense", "item",
    )
)  # fmt: skip


# Host-side launch calls (CUDA runtime / driver API events of the trace; Triton launches via the driver).
_LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchKernelExC")


@dataclass
class KernelCount:
    """``total``: kernels (device events on CUDA; the CPU proxy otherwise). ``launch_calls``: host launch
    API calls on CUDA (one per eager kernel, one per graph replay); equal to ``total`` on CPU."""

    total: int = 0
    by_name: collections.Counter[str] = field(default_factory=collections.Counter)
    launch_calls: int = 0

    def __sub__(self, other: KernelCount) -> KernelCount:
        by_name = collections.Counter(self.by_name)
        by_name.subtract(other.by_name)
        kept = collections.Counter({k: v for k, v in by_name.items() if v})
        return KernelCount(self.total - other.total, kept, self.launch_calls - other.launch_calls)


def _cpu_kernels(event: Any, out: KernelCount) -> int:
    """Kernels under ``event``: its children's, or 1 for an operator whose children launch none."""
    if event.name.startswith("triton::"):
        out.total += 1
        out.by_name[event.name] += 1
        return 1
    num = sum(_cpu_kernels(child, out) for child in event.cpu_children)
    if num == 0 and event.name.startswith("aten::") and event.name not in NO_KERNEL_OPS:
        out.total += 1
        out.by_name[event.name] += 1
        num = 1
    return num


def count_kernels(fn: Callable[[], T], device: torch.device) -> tuple[T, KernelCount]:
    """Runs ``fn()`` once under the profiler; returns its result and the kernels it launched."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with probe_launches(lambda *_: None, label=device.type != "cuda"), profile(activities=activities) as prof:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    count = KernelCount()
    if device.type == "cuda":
        count.launch_calls = sum(1 for e in prof.events() if e.name.startswith(_LAUNCH_CALLS))
        for event in prof.events():
            if (
                event.device_type == torch.autograd.DeviceType.CUDA
                and event.name
                and "Memcpy" not in event.name
            ):
                count.total += 1
                count.by_name[event.name] += 1
    else:
        for event in prof.events():
            if event.cpu_parent is None:
                _cpu_kernels(event, count)
        count.launch_calls = count.total
    return result, count
