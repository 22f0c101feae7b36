"""Fail at startup, with what to install, when a pool asks for GPUs and torch cannot use CUDA.

Without this check a CPU-only torch on a GPU machine serves on CPU without a word (``device: auto``), and
a GPU pool on a machine Ray sees no GPU on waits out the placement timeout. A local cluster is checked
in the driver (its torch is the workers' torch); a remote cluster by a probe task on one GPU bundle.
"""

from __future__ import annotations

import logging
from typing import Any

from cluster.config import ClusterConfig

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 60.0
INSTALL_HINT = (
    "install a CUDA build of torch (e.g. `make setup-gpu`, or `pip install torch --index-url "
    "https://download.pytorch.org/whl/cu128` with the CUDA version your driver supports; README: "
    "'Install on a GPU machine'), or set num_gpus: 0 on every pool to serve on CPU"
)


class CudaUnavailableError(RuntimeError):
    """A pool asks for GPUs but torch has no CUDA (a CPU build) or sees no device."""


def gpu_pools(cfg: ClusterConfig) -> list[str]:
    pools = (
        [("colocated", cfg.colocated)]
        if cfg.router.mode == "colocated"
        else [
            ("prefill", cfg.prefill),
            ("decode", cfg.decode),
        ]
    )
    return [name for name, pool in pools if pool.num_workers and pool.num_gpus]


def torch_cuda_report() -> dict[str, Any]:
    """What this process's torch can do with CUDA (also the remote probe's answer)."""
    import torch

    return {
        "torch_version": str(torch.__version__),
        "cuda_version": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
        "device_count": int(torch.cuda.device_count()) if torch.version.cuda else 0,
    }


def cuda_problem(report: dict[str, Any], pools: list[str], where: str) -> str | None:
    """The error message for ``report`` (None when CUDA is usable)."""
    if report["cuda_available"]:
        return None
    asks = f"pool(s) {pools} ask for GPUs (num_gpus: 1)"
    if report["cuda_version"] is None:
        why = f"torch {report['torch_version']} on {where} is a CPU-only build (torch.version.cuda is None)"
    else:
        why = (
            f"torch {report['torch_version']} (CUDA {report['cuda_version']}) on {where} sees no CUDA device "
            "(check the NVIDIA driver and CUDA_VISIBLE_DEVICES)"
        )
    return f"{asks} but {why}: {INSTALL_HINT}"


def check_local(cfg: ClusterConfig) -> None:
    """Before a local Ray cluster starts: raise CudaUnavailableError if a GPU pool cannot get CUDA."""
    pools = gpu_pools(cfg)
    if not pools:
        return
    problem = cuda_problem(torch_cuda_report(), pools, "this machine")
    if problem is not None:
        raise CudaUnavailableError(problem)


def check_remote(cfg: ClusterConfig) -> None:
    """On a joined Ray cluster: probe one GPU bundle's torch. A probe that cannot be placed within
    the bound is left to the placement group's own timeout and message."""
    pools = gpu_pools(cfg)
    if not pools:
        return
    import ray

    probe = ray.remote(num_gpus=1, num_cpus=0)(torch_cuda_report).remote()
    try:
        report = ray.get(probe, timeout=_PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(probe, force=True)
        logger.warning("no GPU node answered the CUDA probe within %.0f s", _PROBE_TIMEOUT_S)
        return
    problem = cuda_problem(report, pools, "a GPU node of the Ray cluster")
    if problem is not None:
        raise CudaUnavailableError(problem)
