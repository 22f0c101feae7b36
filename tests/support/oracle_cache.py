"""Test utilities (not a test module): the random qwen3 checkpoint and transformers' greedy outputs on it,
built once per test session, or once per mutation run.

``PDSERVE_TEST_CACHE`` (set by tests/support/mutation.py, never in CI) names a directory where both are kept
across pytest processes: neither depends on pdserve's code (transformers builds and runs them), so the
hundreds of test runs of a mutation run need not rebuild them. Without it everything lives in the
session's temporary directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Any

from tests.support.hf_models import hf_greedy, make_random_hf_model

CACHE_ENV = "PDSERVE_TEST_CACHE"
_models: dict[pathlib.Path, str] = {}


def qwen3_model(tmp_path_factory: Any) -> str:
    """The random qwen3 checkpoint of tests/support/hf_models.py (seed 0)."""
    cache = os.environ.get(CACHE_ENV)
    if cache:
        path = pathlib.Path(cache) / "qwen3"
        if not (path / "config.json").exists():
            building = pathlib.Path(tempfile.mkdtemp(dir=cache))
            make_random_hf_model("qwen3", building)
            with contextlib.suppress(OSError):  # NOTE: atomic; a concurrent builder's copy is as good
                (building / "qwen3").rename(path)
        return str(path)
    base = tmp_path_factory.getbasetemp()
    if base not in _models:
        _models[base] = str(make_random_hf_model("qwen3", tmp_path_factory.mktemp("qwen3")))
    return _models[base]


def hf_reference(model_dir: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """``hf_greedy(model_dir, prompts, max_tokens)``, kept in the cache directory when there is one."""
    cache = os.environ.get(CACHE_ENV)
    if not cache:
        return hf_greedy(model_dir, prompts, max_tokens)
    key = hashlib.sha256(json.dumps([model_dir, prompts, max_tokens]).encode()).hexdigest()[:32]
    path = pathlib.Path(cache) / f"greedy-{key}.json"
    if path.exists():
        outputs: list[list[int]] = json.loads(path.read_text())
        return outputs
    outputs = hf_greedy(model_dir, prompts, max_tokens)
    partial = path.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps(outputs))
    partial.replace(path)
    return outputs
