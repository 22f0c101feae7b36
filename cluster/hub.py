"""Models by name: a local checkpoint directory or a Hugging Face repo id, resolved to a local directory
through ``huggingface_hub`` (its cache, ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, a revision).

Only what pdserve loads is fetched: the json/jinja/tokenizer files, then the weight shards that
``model.safetensors.index.json`` names (or ``model.safetensors`` alone), so a repo that also ships
``consolidated.safetensors`` or ``*.bin`` files does not download them.

Resolution runs once, on the driver, before any worker starts (``resolve_cluster_model``); the workers
get the local snapshot directory. This module imports no torch and no ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cluster.config import ClusterConfig

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# NOTE: everything pdserve reads besides the weights: config.json, generation_config.json,
# tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja, the index.
METADATA_PATTERNS = ["*.json", "*.jinja", "tokenizer*"]


class ModelNotFoundError(ValueError):
    """The model is neither a local directory nor a repo the hub (or its cache, offline) can give."""


@dataclass(frozen=True)
class ResolvedModel:
    """path: a local directory (empty: the bundled model). served_name: the name to serve it under when
    the user gave none (None: the directory's basename)."""

    path: str
    served_name: str | None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now rather than when huggingface_hub was imported."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> str:
    """Where the hub cache lives for this process: HF_HUB_CACHE, else $HF_HOME/hub, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cache_repo_name(path: str | Path) -> str | None:
    """``org/name`` for a snapshot directory of a hub cache (``models--org--name/snapshots/<sha>``)."""
    parts = Path(path).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


def _looks_like_path(name: str) -> bool:
    # NOTE: a repo id is "name" or "org/name"; anything else that does not exist is a missing directory
    return name.startswith(("/", "./", "../", "~", ".")) or name.count("/") > 1 or "\\" in name


def weight_files(model_dir: str | Path) -> list[str]:
    """The safetensors files to load from ``model_dir``, by name: the shards the index names, else
    ``model.safetensors``, else every ``*.safetensors`` (a checkpoint saved under another single name)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: weight_map must be a non-empty mapping of tensor -> file")
        return sorted(set(map(str, weight_map.values())))
    if (model_dir / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    return sorted(p.name for p in model_dir.glob("*.safetensors"))


def model_fingerprint(model_dir: str | Path) -> str:
    """What identifies a checkpoint wherever it lies: a hash of its config.json bytes and of its weight
    files' names and sizes. Two hosts serving one model from different paths (a Ray working_dir, a hub
    cache) agree on it; a different checkpoint or config does not. "" for a random-weight model dir."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if not config.is_file():
        return ""
    h = hashlib.blake2b(config.read_bytes(), digest_size=16)
    with contextlib.suppress(ValueError, OSError):
        for name in weight_files(model_dir):
            h.update(f"\0{name}\0{(model_dir / name).stat().st_size}".encode())
    return h.hexdigest()


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = is_offline()
    cache = hub_cache_dir()
    try:
        return str(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                allow_patterns=patterns,
                local_files_only=offline,
            )
        )
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {repo_id!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a local directory nor a Hugging Face repo (a gated or private "
            "repo needs HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        where = "offline (HF_HUB_OFFLINE=1)" if offline else "and the hub cannot be reached"
        raise ModelNotFoundError(
            f"model {repo_id!r}{'' if revision is None else f' revision {revision!r}'} is not a local "
            f"directory and not in the Hugging Face cache {cache} {where}: download it there first "
            "(huggingface-cli download) or pass a checkpoint directory"
        ) from None


def resolve_model(name: str, revision: str | None = None) -> ResolvedModel:
    """A local directory for ``name``: itself if it is one, else the hub snapshot of repo ``name``.

    Raises ModelNotFoundError (a ValueError) with what was tried.
    """
    if not name:
        return ResolvedModel("", None)
    local = Path(name).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ModelNotFoundError(
                f"revision {revision!r} applies to hub repo ids, not to directory {name!r}"
            )
        return ResolvedModel(str(local), cache_repo_name(local))
    if _looks_like_path(name) or local.exists():
        raise ModelNotFoundError(f"model directory {name!r} does not exist")
    snapshot = _download(name, revision, METADATA_PATTERNS)
    if not (Path(snapshot) / "config.json").is_file():
        raise ModelNotFoundError(f"model {name!r} has no config.json (is it a transformers checkpoint?)")
    index = Path(snapshot) / INDEX_FILE
    shards = weight_files(snapshot) if index.is_file() else [SINGLE_FILE]
    snapshot = _download(name, revision, shards)
    if not weight_files(snapshot):
        # NOTE: neither an index nor model.safetensors: take whatever single-file name it used.
        snapshot = _download(name, revision, ["*.safetensors"])
    missing = [f for f in weight_files(snapshot) if not (Path(snapshot) / f).is_file()]
    if missing or not weight_files(snapshot):
        raise ModelNotFoundError(f"model {name!r}: weight file(s) {missing or ['*.safetensors']} not found")
    logger.info("model %s%s resolved to %s", name, f"@{revision}" if revision else "", snapshot)
    return ResolvedModel(snapshot, name)


def resolve_cluster_model(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with ``model.path`` a local directory; the served name (unless the config sets one) is
    the repo id the user gave, or ``org/name`` for a hub-cache snapshot directory."""
    resolved = resolve_model(cfg.model.path, cfg.model.revision)
    if resolved.path == cfg.model.path and resolved.served_name is None:
        return cfg
    server = cfg.server
    if server.served_model_name is None and resolved.served_name is not None:
        server = dataclasses.replace(server, served_model_name=resolved.served_name)
    model = dataclasses.replace(cfg.model, path=resolved.path, revision=None)
    return dataclasses.replace(cfg, model=model, server=server)
