"""A Hugging Face hub cache laid out by hand (not a test module), for tests that run with no network.

``make_hub_cache(root, repo_id, checkpoint)`` writes ``root/hub/models--org--name/refs/<ref>`` and
``snapshots/<sha>/`` as huggingface_hub does, from a checkpoint directory whose single
``model.safetensors`` is split into two shards with a ``model.safetensors.index.json``, plus a
``consolidated.safetensors`` in another naming scheme (as Mistral repos ship): a loader that reads
every ``*.safetensors`` fails on it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_hub_cache(root: Path, repo_id: str, checkpoint: Path, sha: str, ref: str = "main") -> Path:
    """Returns the snapshot directory; ``root`` is what HF_HOME points at."""
    repo_dir = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / sha
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(sha)
    for path in checkpoint.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, snapshot / path.name)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n].contiguous() for n in shard_names}, str(snapshot / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(snapshot / "consolidated.safetensors"))
    return snapshot
