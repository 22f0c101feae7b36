"""workers/host_memory.py: a CPU engine keeps freed memory for reuse (glibc's mallopt), and the option
that turns it off does. Each check runs in a fresh interpreter: the setting is process-wide and for good.

The probe: three 30 MiB blocks from ``malloc``, every byte written, then freed; four rounds. Under
glibc's defaults every round faults its 23,040 pages in again, whatever its dynamic thresholds have
grown to (they stop at a 32 MiB mmap threshold and a 64 MiB trim threshold, and the rounds free 90 MiB
at once); with freed memory retained, only the first round after the setting faults. The probe calls
the C library through ctypes: no Python object is allocated between the blocks, so the heap has no
small allocations in it that would move them."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)

_PROBE = """
import ctypes, json, resource

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
SIZE = 30 << 20

def rounds():
    out = []
    for _ in range(4):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(SIZE) for _ in range(3)]
        for block in blocks:
            libc.memset(block, 1, SIZE)
        for block in blocks:
            libc.free(block)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return out
"""

_PAGES = 3 * (30 << 20) // 4096  # a round's pages


def _run(body: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE + body],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _rounds(result: dict[str, object], key: str) -> list[int]:
    rounds = result[key]
    assert isinstance(rounds, list), result
    return rounds


def _assert_refaults(rounds: list[int]) -> None:
    """The rounds after the first fault (nearly) all of their pages again: glibc's defaults. NOTE: at
    least two of the three: in a process with an engine's threads, one round may keep part of the heap
    (seen once in a clean-clone CI run: [23043, 20510, 23008, 23008]); retained memory faults < 2%."""
    later = sorted(rounds[1:])
    assert later[1] >= _PAGES * 0.9 and later[0] >= _PAGES * 0.5, rounds


def _assert_retained(rounds: list[int]) -> None:
    """No round faults more than a few of its pages: freed memory is reused."""
    assert max(rounds) < _PAGES * 0.02, rounds


def test_retain_freed_memory_stops_the_refaults() -> None:
    result = _run(
        "from workers.host_memory import retain_freed_memory\n"
        "before = rounds()\n"
        "applied = retain_freed_memory()\n"
        "print(json.dumps({'before': before, 'applied': applied, 'after': rounds()}))\n"
    )
    after = _rounds(result, "after")
    # NOTE: the control: without the setting every round faults (nearly) all of its pages again.
    _assert_refaults(_rounds(result, "before"))
    assert result["applied"] is True
    assert after[0] <= _PAGES * 1.1, after
    _assert_retained(after[1:])


def test_cpu_engine_sets_it_unless_told_not_to() -> None:
    result = _run(
        "from workers.engine import BUNDLED_MODEL\n"
        "from workers.llm import LLM\n"
        "off = LLM(BUNDLED_MODEL, device='cpu', num_kv_blocks=64, retain_host_memory=False)\n"
        "left = rounds()\n"
        "on = LLM(BUNDLED_MODEL, device='cpu', num_kv_blocks=64)\n"
        "rounds()\n"
        "print(json.dumps({'off': left, 'on': rounds()}))\n"
    )
    _assert_refaults(_rounds(result, "off"))
    _assert_retained(_rounds(result, "on"))
