"""A mock cluster as a user starts one: ``pdserve serve MODEL --config deploy/mock-cluster.yaml --gpu h100``
for a model given by its config.json alone (no weights, no tokenizer), Ray actors, the HTTP API. It
streams the mock's rule token for token, each handoff moves the first word of each block's K and V in
the model's real KV layout (bf16, 28 layers: 1/4096 of each block, transfer/paced_link.py) and waits out
the rest of the H100's link, and the router predicts with the very profile the workers wait by."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from cluster.cost_model import CostProfile, TransferCost
from deploy.cli import build_parser
from deploy.cli_args import build_config
from deploy.http_host import start_http
from deploy.launch import build_cluster
from deploy.planner.profiles import HARDWARE, ModelShape, roofline_profile
from tests.support.cluster_utils import wait_for
from workers.mock_runner import MockTokens
from workers.models.arch import ArchConfig

ray = pytest.importorskip("ray")  # NOTE: this test starts a Ray cluster; a bare GPU machine has none

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "bench" / "configs" / "qwen3-0.6b")
BLOCK_SIZE = 16
PROMPTS = [[1000 + 13 * i + j for j in range(n)] for i, n in enumerate([5, 16, 40])]
MAX_TOKENS = 6


def test_a_mock_cluster_from_the_cli_serves_the_rule_and_moves_the_models_kv_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_PROFILE", str(tmp_path / "cpu-profile.json"))  # --gpu writes beside it
    flags = ["--config", "deploy/mock-cluster.yaml", "--gpu", "h100", "--num-kv-blocks", "16"]
    sizes = ["--num-prefill-workers", "1", "--num-decode-workers", "1", "--max-num-batched-tokens", "256"]
    cfg = build_config(build_parser().parse_args(["serve", MODEL, *flags, *sizes]))
    engine = cfg.engine_config("decode")
    (written,) = (tmp_path / "mock").iterdir()
    assert engine.load_format == "mock" and engine.mock_cost_profile == cfg.router.cost_profile == str(
        written
    )
    estimate = roofline_profile(HARDWARE["h100"], ModelShape.from_config(MODEL))
    nic = TransferCost(estimate.transfer.latency_s, estimate.transfer.bytes_per_s, 50e9)  # the H100's NIC
    assert CostProfile.load(written) == replace(estimate, transfer=nic)
    rule = MockTokens.for_model(ArchConfig.from_pretrained(MODEL), None)
    expected = [rule.continuation(prompt, MAX_TOKENS) for prompt in PROMPTS]

    handle = build_cluster(cfg)
    try:
        with start_http(handle) as http:
            for prompt, want in zip(PROMPTS, expected, strict=True):
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
                answer = httpx.post(f"{http.url}/v1/completions", json=body, timeout=60).json()
                assert answer["choices"][0]["token_ids"] == want
        # each prompt's blocks moved once: 8 B of each block's K and V (16 slots x 8 heads x 128 x bf16)
        bytes_per_block = 28 * 2 * 8
        moved = sum(-(-len(p) // BLOCK_SIZE) for p in PROMPTS) * bytes_per_block

        def decode_bytes() -> int:
            stats = [w.stats for w in handle.router.workers if w.pool == "decode" and w.stats is not None]
            return sum(s.transfer.bytes_total for s in stats)

        wait_for(lambda: decode_bytes() == moved, 10, "the decode worker's heartbeat counting every handoff")
        assert (
            handle.router.predictor is not None
            and handle.router.predictor.profile.name == "H100 SXM / qwen3-0.6b"
        )
    finally:
        handle.shutdown()
