"""The other ranks of a tensor-parallel worker: child processes of rank 0, living and dying with it.

Rank 0 (the worker's own process: the Ray actor, or an offline ``LLM``) starts ranks 1..N-1 with
``RankGroup.start`` before it builds its model runner. Each child is ``python -m workers.rank_main``
reading its spec as JSON on stdin (no pickle): its rank, the group's size, the engine config, the model
directory and the rendezvous file. All ranks join one group through a ``FileStore`` in a directory
only this user can read (the ranks share one node: the worker asks Ray for all of its ranks' devices,
which Ray places on one node; no port is opened for the rendezvous), then build the same runner with
the same calls, and the children follow rank 0's steps (``ModelRunner.follow``) until it says stop.

A worker is one unit:
  - a child dies with its parent: it asks the kernel for SIGKILL when rank 0 exits (PR_SET_PDEATHSIG),
    and checks rank 0 is still its parent after asking (rank 0 may have died before it asked);
  - rank 0 learns at once that a child exited (a watcher thread per child calls the handler set with
    ``on_rank_death``; a step's or a handoff's collective that failed for it calls it first,
    ``fail_if_a_rank_died``): a worker then fails as a whole (``Guard.fatal``: it says so and exits; Ray
    restarts it, and its new rank 0 starts new ranks);
  - a collective never waits forever: the group's timeout bounds it (a stopped, not dead, rank).
On CUDA rank r sees only its own device (``CUDA_VISIBLE_DEVICES`` narrowed to the r-th of the worker's).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from cluster.config import EngineConfig
from transfer.pairs import build_group
from workers.models.parallel import TensorParallel

logger = logging.getLogger(__name__)

# NOTE: a rank imports torch and joins before any model is built (seconds; two minutes covers a loaded box)
JOIN_TIMEOUT_S = 120.0
# NOTE: one collective of a step (or the start-up's model build on every rank, whose warm-up runs
# collectives) waits at most this long for a stopped rank; a dead one fails it at once
GROUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a child rank is told (JSON on its stdin)."""

    rank: int
    size: int
    store_path: str
    parent_pid: int
    model_dir: str
    engine: dict[str, Any]
    torch_threads: int
    device: str  # "cpu" or "cuda"


_death_handler: Callable[[str], None] | None = None


def on_rank_death(handler: Callable[[str], None] | None) -> None:
    """What this process does when one of its tensor-parallel ranks exits unasked (a worker: say so and
    exit, its ``Guard.fatal``). None: only log it; the next step then fails, naming the rank."""
    global _death_handler
    _death_handler = handler


class RankGroup:
    """Rank 0's handle on ranks 1..N-1 (``start``); ``tp`` is rank 0's place in the group, ``failure``
    why a rank exited unasked (None while every rank lives)."""

    def __init__(self, tp: TensorParallel, children: list[subprocess.Popen[bytes]], store_dir: str) -> None:
        self.tp = tp
        self.failure: str | None = None
        self._children = children
        self._store_dir = store_dir
        self._closing = threading.Event()
        self._store: Any = None
        self._threads = torch.get_num_threads()

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model_dir: str,
        device: torch.device,
    ) -> RankGroup:
        """Starts ranks 1..N-1 of ``config.tensor_parallel_size`` and joins the group with them (bounded
        by ``JOIN_TIMEOUT_S``). If a rank exits before ``close``, a watcher thread records it in
        ``failure`` and calls the process's handler (``on_rank_death``)."""
        size = config.tensor_parallel_size
        threads = torch.get_num_threads()  # NOTE: given back at close (an offline engine's process)
        if device.type == "cpu":
            # NOTE: the ranks share this process's cores: N ranks of all of them each oversubscribe them
            # (measured, bundled model, 16 running, 2 cores: 80 ms a step at TP=2 with 2 threads a rank,
            # 14 ms with 1; TP=1 takes 3-4 ms: a CPU rank pays ~10 ms of gloo collectives a step)
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        store_dir = tempfile.mkdtemp(prefix="pdserve-tp-")  # NOTE: mode 0700: only this user reads it
        store_path = os.path.join(store_dir, "rendezvous")
        visible = _visible_devices(size) if device.type == "cuda" else []
        children: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, size):
                spec = RankSpec(
                    rank=rank,
                    size=size,
                    store_path=store_path,
                    parent_pid=os.getpid(),
                    model_dir=model_dir,
                    engine=dataclasses.asdict(config),
                    torch_threads=torch.get_num_threads(),
                    device=device.type,
                )
                env = dict(os.environ)
                if visible:
                    env["CUDA_VISIBLE_DEVICES"] = visible[rank]
                child = subprocess.Popen(
                    [sys.executable, "-m", "workers.rank_main"], stdin=subprocess.PIPE, env=env
                )
                children.append(child)
                assert child.stdin is not None
                child.stdin.write(json.dumps(dataclasses.asdict(spec)).encode())
                child.stdin.close()
            import torch.distributed as dist

            store = dist.FileStore(store_path, size)
            tp = _join(store, size, device, children)
        except BaseException:
            _kill(children)
            shutil.rmtree(store_dir, ignore_errors=True)
            torch.set_num_threads(threads)
            raise
        ranks = cls(tp, children, store_dir)
        ranks._threads = threads
        ranks._store = store  # NOTE: torch keeps calling into the store while the group lives
        for rank, child in enumerate(children, start=1):
            threading.Thread(
                target=ranks._watch, args=(rank, child), name=f"tp-rank-{rank}-watch", daemon=True
            ).start()
        return ranks

    def _watch(self, rank: int, child: subprocess.Popen[bytes]) -> None:
        self._fail(rank, child, child.wait())

    def fail_if_a_rank_died(self, within_s: float = 2.0) -> None:
        """After a collective failed: if a rank exited (waited for up to ``within_s``: the failure may
        come a moment before the exit is seen), fail the worker as a unit now, before whatever failed
        reports anything (the process's handler usually exits it). Returns when every rank lives."""
        deadline = time.monotonic() + within_s
        for rank, child in enumerate(self._children, start=1):
            try:
                code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            self._fail(rank, child, code)
            return

    def _fail(self, rank: int, child: subprocess.Popen[bytes], code: int) -> None:
        """Rank ``rank`` exited unasked (not while closing): recorded, logged, the handler told."""
        if self._closing.is_set():
            return
        why = f"tensor-parallel rank {rank} (pid {child.pid}) exited with code {code}"
        self.failure = why
        logger.error("%s: this worker's ranks are one unit, so it fails as a whole", why)
        handler = _death_handler
        if handler is not None:
            handler(why)

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children]

    def close(self, stop: Callable[[], None] | None = None) -> None:
        """``stop()`` (rank 0 tells the ranks to leave their loop), then waits for them (bounded) and
        kills what is left (at once without ``stop``); removes the rendezvous directory. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if stop is None:  # NOTE: a failed start-up: the ranks wait in a collective, nothing to drain
            _kill(self._children)
        elif all(child.poll() is None for child in self._children):
            try:
                stop()
            except Exception as e:  # noqa: BLE001 (a broken group: the ranks are killed below)
                logger.warning("telling the tensor-parallel ranks to stop failed: %s", e)
        for child in self._children:
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=STOP_TIMEOUT_S)
        shutil.rmtree(self._store_dir, ignore_errors=True)
        torch.set_num_threads(self._threads)


def _join(
    store: Any, size: int, device: torch.device, children: list[subprocess.Popen[bytes]]
) -> TensorParallel:
    """Rank 0 joins the group (on a helper thread), failing at once if a rank exits first, or after
    ``JOIN_TIMEOUT_S``."""
    result: list[TensorParallel] = []
    errors: list[BaseException] = []

    def join() -> None:
        try:
            result.append(join_groups(store, 0, size, device))
        except BaseException as e:  # noqa: BLE001 (re-raised by the caller)
            errors.append(e)

    thread = threading.Thread(target=join, name="tp-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while thread.is_alive():
        thread.join(timeout=0.1)
        dead = [
            (rank, child.returncode) for rank, child in enumerate(children, 1) if child.poll() is not None
        ]
        if dead and thread.is_alive():
            raise RuntimeError(
                f"tensor-parallel rank {dead[0][0]} exited with code {dead[0][1]} while joining"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the tensor-parallel ranks did not join within {JOIN_TIMEOUT_S:g} s")
    if errors:
        raise errors[0]
    return result[0]


def join_groups(store: Any, rank: int, size: int, device: torch.device) -> TensorParallel:
    """This rank's place in its worker's step groups and KV groups (see ``TensorParallel.kv``): each a
    host (gloo) group and, on CUDA, a device (NCCL) group, built with ``transfer.pairs.build_group`` on
    loopback (the ranks share one node); every collective bounded by ``GROUP_TIMEOUT_S``."""

    def groups(prefix: str) -> tuple[Any, Any]:
        host = build_group(store, f"{prefix}host", rank, "gloo", "127.0.0.1", GROUP_TIMEOUT_S, size=size)
        if device.type != "cuda":
            return host, host
        device_group = build_group(store, f"{prefix}device", rank, "nccl", "", GROUP_TIMEOUT_S, device, size)
        return device_group, host

    kv = TensorParallel(rank, size, *groups("kv-"))
    return TensorParallel(rank, size, *groups(""), kv=kv)


def _visible_devices(size: int) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < size:
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; this process sees {len(devices)}")
    return devices[:size]


def _kill(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=STOP_TIMEOUT_S)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits; exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)
