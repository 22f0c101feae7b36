"""The cost profile a mock engine's steps wait by (``load_format: mock``, workers/mock_runner.py).

``--gpu NAME``: the planner's roofline estimate of a model's steps on that accelerator
(deploy/planner/profiles.py), written as a profile JSON under the pdserve cache so every worker of the
host reads the same file; ``--cost-profile PATH``: any profile (``pdserve plan calibrate``'s). Either one
is both the mock's step time and the router's predictions, so what the router predicts is what the
mock workers take. Its ``transfer`` is what a mock's KV handoff takes (transfer/paced_link.py): the GPU's
link inside a node and, from ``--gpu``, its NIC between nodes; its ``host_link_bytes_per_s`` what a mock's
host KV tier copies take (``kv_offload_gib``; workers/host_kv.py ``PacedHostCopies``): the GPU's PCIe.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.cost_model import CostProfile, default_profile_path
from cluster.hub import resolve_model
from deploy.planner.profiles import HARDWARE, ModelShape, roofline_profile

GPU_NAMES = tuple(sorted(HARDWARE))


def mock_profile_dir() -> Path:
    """Where ``--gpu`` profiles are written: beside the calibrated profile (``$PDSERVE_PROFILE``'s
    directory, else ``~/.cache/pdserve``), under ``mock/``."""
    return default_profile_path().parent / "mock"


def gpu_estimate(gpu: str, model: ModelShape) -> CostProfile:
    """The roofline estimate of ``model`` on ``gpu`` (deploy/planner/profiles.py), its handoffs taking the
    GPU's NIC between nodes (``Hardware.nic_gb_per_s``) where the estimate does not say."""
    if gpu not in HARDWARE:
        raise ValueError(f"gpu must be one of {sorted(HARDWARE)}, got {gpu!r}")
    hw = HARDWARE[gpu]
    profile = roofline_profile(hw, model)
    if profile.transfer.nic_bytes_per_s:
        return profile
    return replace(profile, transfer=replace(profile.transfer, nic_bytes_per_s=hw.nic_gb_per_s * 1e9))


def write_gpu_profile(
    gpu: str, model_dir: str | Path, dtype: str = "auto", directory: Path | None = None
) -> Path:
    """``gpu_estimate`` of ``model_dir``'s config.json on ``gpu``, written (or already there) as
    ``<directory>/<gpu>-<model>-<hash of config.json and dtype>.json``; returns its path."""
    if gpu not in HARDWARE:
        raise ValueError(f"gpu must be one of {sorted(HARDWARE)}, got {gpu!r}")
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
    profile = gpu_estimate(gpu, ModelShape.from_config(model_dir, dtype))
    digest = hashlib.blake2b(config.read_bytes() + dtype.encode(), digest_size=6).hexdigest()
    path = (directory or mock_profile_dir()) / f"{gpu}-{Path(model_dir).resolve().name}-{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{digest}.tmp")
    profile.save(tmp)
    tmp.replace(path)  # NOTE: atomic: a worker starting meanwhile reads the old file or the new one whole
    return path


def with_mock_profile(data: dict[str, Any], gpu: str | None, cost_profile: str | None) -> dict[str, Any]:
    """The cluster YAML mapping ``data`` with the mock's profile set (``data`` is not modified):
    ``gpu`` writes its estimate (``write_gpu_profile``) and names it as ``engine.mock_cost_profile`` and
    ``router.cost_profile``; else a mock engine without its own profile takes ``cost_profile`` (the
    ``--cost-profile`` flag), else the router's. Only the shared ``engine:`` section's load_format counts."""
    engine = dict(data.get("engine") or {})
    is_mock = engine.get("load_format") == "mock"
    if gpu is not None and not is_mock:
        raise ValueError("--gpu sets a mock engine's step times: give --load-format mock too")
    if gpu is not None and cost_profile is not None:
        raise ValueError("--gpu and --cost-profile both name the mock's cost profile: give one")
    if not is_mock:
        return data
    router = dict(data.get("router") or {})
    if gpu is not None:
        model = dict(data.get("model") or {})
        path = str(model.get("path") or "")
        revision = model.get("revision")
        if path:
            model_dir = resolve_model(path, revision if isinstance(revision, str) else None).path
        else:
            from workers.engine import BUNDLED_MODEL

            model_dir = BUNDLED_MODEL
        dtype = model.get("dtype") or "auto"
        profile = str(write_gpu_profile(gpu, model_dir, str(dtype)))
        engine["mock_cost_profile"] = router["cost_profile"] = profile
    elif not engine.get("mock_cost_profile"):
        profile = cost_profile if cost_profile is not None else str(router.get("cost_profile") or "")
        if profile:
            engine["mock_cost_profile"] = profile
    return {**data, "engine": engine, "router": router}
