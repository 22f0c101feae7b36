"""Test-session setup shared by every module."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.triton_mode import SKIP_REASON, interprets, selects_only_gpu_tests


def _cuda_available() -> bool:
    # NOTE: no GPU device node means no CUDA; only then is torch's (seconds-long) import skipped, so the
    # torch-free unit tests (and the mutation runner's many runs of them) start in well under a second.
    if not any(pathlib.Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: triton decides interpreter or compiled for its own library functions when it is first imported
    # (torch imports it lazily from many places), so it is settled here, before any test module is
    # imported: tests/support/triton_mode.py says which sessions interpret.
    env_value = os.environ.get("TRITON_INTERPRET")
    markexpr = str(config.getoption("markexpr") or "")
    needs_cuda_answer = env_value is None and selects_only_gpu_tests(markexpr)
    if interprets(needs_cuda_answer and _cuda_available(), markexpr, env_value):
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a session that interprets Triton on a CUDA machine, the gpu tests say how to run them."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not _cuda_available():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# ---- running a test under load --------------------------------------------------------------------------
NUM_BUSY_PROCESSES = 2  # NOTE: the CI machine's two cores; a user's machine is rarely idle when a worker dies


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--loaded",
        action="store_true",
        help="run every selected test under load (the `loaded` fixture): `make test-faults`",
    )


@pytest.fixture
def loaded() -> Iterator[None]:
    """Two busy processes at the test runner's own priority for the test's duration, stopped (and reaped)
    when it ends, however it ends."""
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(NUM_BUSY_PROCESSES)
    ]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()


@pytest.fixture(autouse=True)
def _under_load_when_asked(request: pytest.FixtureRequest) -> None:
    """A test marked ``loaded`` (or every test, with ``--loaded``) runs under the ``loaded`` fixture."""
    if request.node.get_closest_marker("loaded") is not None or request.config.getoption("--loaded"):
        request.getfixturevalue("loaded")
