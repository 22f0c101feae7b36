"""A child rank of a tensor-parallel worker (``python -m workers.rank_main``, started by
``workers.rank_process.RankGroup``): read the spec, join the groups, build the same runner as rank 0,
serve rank 0's KV relay on a thread, follow its steps until it says stop."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from cluster.config import EngineConfig, from_dict
from workers.model_runner import ModelRunner
from workers.parallel_kv import KvFollower
from workers.rank_process import RankSpec, die_with_parent, join_groups

logger = logging.getLogger(__name__)


def _run_or_exit(target: Callable[[], None]) -> None:
    """A rank's second thread: if it dies, the rank exits (rank 0's watcher then fails the worker)."""
    try:
        target()
    except BaseException:
        logger.exception("the KV thread of this tensor-parallel rank died")
        logging.shutdown()
        os._exit(1)


def main() -> None:
    """A child rank: read the spec, join, build the runner, follow rank 0's steps until told to stop."""
    spec = RankSpec(**json.loads(sys.stdin.read()))
    die_with_parent(spec.parent_pid)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank-{spec.rank} %(levelname)s %(message)s"
    )
    torch.set_num_threads(spec.torch_threads)
    config = from_dict(EngineConfig, spec.engine, "engine")
    device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
    store = dist.FileStore(spec.store_path, spec.size)
    tp = join_groups(store, spec.rank, spec.size, device)
    runner = ModelRunner(config, spec.model_dir, tp)
    logger.info("rank %d of %d ready", spec.rank, spec.size)
    if tp.kv is not None:
        kv = KvFollower(tp.kv, runner.kv_cache, tp.sharding(runner.arch))
        threading.Thread(target=_run_or_exit, args=(kv.run,), name="tp-kv", daemon=True).start()
    runner.follow()
    logger.info("rank %d of %d stopped", spec.rank, spec.size)
    logging.shutdown()
    os._exit(0)  # NOTE: nothing left to flush; skips tearing down torch's state (seconds on a busy box)


if __name__ == "__main__":
    main()
