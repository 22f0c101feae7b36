"""Which Triton a test session runs: the interpreter (CPU tensors) or compiled kernels (CUDA tensors).

One process cannot hold both: triton decides for its own library functions when it is first imported.
Without CUDA every session interprets. With CUDA, a session that selects only the ``gpu`` tests
(``pytest -m gpu``) runs compiled; any other session interprets, so the CPU tests that hand CPU tensors
to Triton kernels keep working on a GPU machine, and its ``gpu`` tests are skipped with a reason saying
how to run them.
"""

from __future__ import annotations

import re

GPU_ONLY = re.compile(r"\s*gpu(\s+and\s+.+)?\s*")
SKIP_REASON = (
    "this session runs Triton in its interpreter (CPU tests selected); run the gpu tests alone: pytest -m gpu"
)


def selects_only_gpu_tests(markexpr: str) -> bool:
    """``-m gpu`` or ``-m "gpu and ..."``: every selected test is a ``gpu`` test."""
    return GPU_ONLY.fullmatch(markexpr) is not None


def interprets(has_cuda: bool, markexpr: str, env_value: str | None) -> bool:
    """Whether the session runs Triton in its interpreter. An explicit ``TRITON_INTERPRET`` wins."""
    if env_value is not None:
        return env_value == "1"
    return not has_cuda or not selects_only_gpu_tests(markexpr)
