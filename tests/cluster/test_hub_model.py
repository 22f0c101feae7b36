"""Models by name through a hub cache laid out by the test (HF_HUB_OFFLINE=1, no network): repo ids and
revisions resolve to snapshots, the served name is the repo id, and only the indexed shards load."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ModelConfig, ServerConfig
from cluster.hub import (
    ModelNotFoundError,
    cache_repo_name,
    model_fingerprint,
    resolve_cluster_model,
    resolve_model,
    weight_files,
)
from cluster.protocol import SamplingParams
from tests.support.hf_models import make_random_hf_model
from tests.support.hub_cache import make_hub_cache
from workers.engine import BUNDLED_MODEL
from workers.llm import LLM

REPO_ID = "pdserve-test/tiny-qwen3"
SHA_MAIN = "a" * 40
SHA_V1 = "b" * 40


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """(HF_HOME, the original checkpoint, the main snapshot, the v1 snapshot of another checkpoint)."""
    root = tmp_path_factory.mktemp("hub")
    source = make_random_hf_model("qwen3", root / "src", seed=0)
    other = make_random_hf_model("qwen3", root / "src-v1", seed=1)
    home = root / "hf"
    main = make_hub_cache(home, REPO_ID, source, SHA_MAIN)
    v1 = make_hub_cache(home, "pdserve-test/other", other, SHA_V1)
    (home / "hub" / "models--pdserve-test--tiny-qwen3" / "snapshots" / SHA_V1).symlink_to(
        v1, target_is_directory=True
    )
    (home / "hub" / "models--pdserve-test--tiny-qwen3" / "refs" / "v1").write_text(SHA_V1)
    return home, source, main, v1


@pytest.fixture
def offline(hub: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("HF_HOME", str(hub[0]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield hub[0]


def test_weight_files_follow_the_index(hub: tuple[Path, Path, Path, Path], tmp_path: Path) -> None:
    _, source, main, _ = hub
    assert weight_files(main) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert weight_files(source) == ["model.safetensors"]
    (tmp_path / "consolidated.safetensors").write_bytes(b"")
    assert weight_files(tmp_path) == ["consolidated.safetensors"]


def test_repo_ids_and_revisions_resolve_offline(hub: tuple[Path, Path, Path, Path], offline: Path) -> None:
    _, _, main, v1 = hub
    assert resolve_model(REPO_ID) == resolve_model(REPO_ID, "main")
    resolved = resolve_model(REPO_ID)
    assert (Path(resolved.path), resolved.served_name) == (main, REPO_ID)
    assert Path(resolve_model(REPO_ID, "v1").path) == main.parent / SHA_V1
    assert Path(resolve_model(REPO_ID, SHA_V1).path).resolve() == v1
    assert resolve_model(str(main)).served_name == REPO_ID and cache_repo_name(main) == REPO_ID
    assert resolve_model("").path == "" and resolve_model(str(hub[1])).served_name is None
    with pytest.raises(
        ModelNotFoundError,
        match=r"'pdserve-test/missing' is not a local directory and not in the Hugging Face cache .* offline \(HF_HUB_OFFLINE=1\)",
    ):
        resolve_model("pdserve-test/missing")
    with pytest.raises(ModelNotFoundError, match="revision 'v9'"):
        resolve_model(REPO_ID, "v9")
    with pytest.raises(ModelNotFoundError, match=r"model directory '\./no/such/dir' does not exist"):
        resolve_model("./no/such/dir")


def test_cluster_config_serves_the_repo_id(hub: tuple[Path, Path, Path, Path], offline: Path) -> None:
    cfg = ClusterConfig(model=ModelConfig(path=REPO_ID, revision="v1"))
    resolved = resolve_cluster_model(cfg)
    assert resolved.model == dataclasses.replace(cfg.model, path=str(hub[2].parent / SHA_V1), revision=None)
    assert resolved.server.served_model_name == REPO_ID
    named = dataclasses.replace(cfg, server=ServerConfig(served_model_name="mine"))
    assert resolve_cluster_model(named).server.served_model_name == "mine"
    plain = ClusterConfig()
    assert resolve_cluster_model(plain) is plain


def test_the_snapshot_generates_like_the_original_checkpoint(hub: tuple[Path, Path, Path, Path]) -> None:
    """Loading the snapshot reads the two indexed shards and never consolidated.safetensors (whose
    tensor name no model has: reading it would raise)."""
    _, source, main, _ = hub
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 42, 99], [7, 7, 300]]
    options = {"device": "cpu", "num_kv_blocks": 32, "block_size": 4}
    ours = [o.token_ids for o in LLM(str(main), **options).generate(prompts, params)]
    reference = [o.token_ids for o in LLM(str(source), **options).generate(prompts, params)]
    assert ours == reference and all(len(ids) == 8 for ids in ours)


def test_a_checkpoint_has_one_fingerprint_wherever_it_lies(tmp_path: Path) -> None:
    """Workers on two hosts hold one model at two paths (each node's copy of a Ray working_dir): the
    router admits both by the fingerprint; another config or other weights is another model."""
    bundled = Path(BUNDLED_MODEL)
    a, b = shutil.copytree(bundled, tmp_path / "a"), shutil.copytree(bundled, tmp_path / "b")
    assert model_fingerprint(a) == model_fingerprint(b) == model_fingerprint(bundled) != ""
    config = Path(b) / "config.json"
    config.write_text(config.read_text().replace("}", ', "unused": 1}', 1))
    assert model_fingerprint(b) != model_fingerprint(a)
    with open(Path(a) / "model.safetensors", "ab") as f:
        f.write(b"\0")
    assert model_fingerprint(a) not in (model_fingerprint(bundled), model_fingerprint(b))
    assert model_fingerprint(tmp_path) == ""
