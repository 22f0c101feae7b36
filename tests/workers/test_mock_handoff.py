"""A mock engine with a cost profile hands KV over at its profile's link (transfer/paced_link.py), in a
whole cluster in this process (the real router, workers, roles, handshake and gloo pair): the worker's
log says the fraction of each block that moves; the decode side gets the first word of each block's K
and V in every layer (the signature the mock wrote for the block's first slot) and nothing else; the
handoff counts the whole KV on the link, inside one node (both bind loopback), and lasts at least what
the link predicts for it."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import transfer.ring
from cluster.config import EngineConfig
from cluster.cost_model import CostProfile, LinearStepCost, TransferCost
from cluster.protocol import SamplingParams
from cluster.tokenizer import Tokenizer
from tests.support.local_cluster import LocalCluster, engine_config
from transfer.staging import ChunkPlan
from workers.engine import BUNDLED_MODEL
from workers.mock_runner import MockTokens, kv_signature
from workers.models.arch import ArchConfig

BLOCK_SIZE = 4
PROMPT = [41, *range(200, 212)]  # 13 tokens: 4 blocks, the last one partial
MAX_TOKENS = 5
# NOTE: a slow link, so the wait is most of the handoff: 20 ms + 1 ms per MB, 10x slower between nodes
LINK = TransferCost(latency_s=0.02, bytes_per_s=1e9, nic_bytes_per_s=1e8)


def _profile(tmp_path: Path) -> str:
    step = LinearStepCost(1e-3, 1e-5, 0.0, 1e-5, 0.0, 0.0)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(CostProfile("test", "test", step, LINK, 1024).to_dict()))
    return str(path)


def mock_config(profile: str) -> EngineConfig:
    base = engine_config(BUNDLED_MODEL, load_format="mock", block_size=BLOCK_SIZE, num_kv_blocks=64)
    return replace(base, mock_cost_profile=profile)


def test_a_mock_handoff_moves_each_blocks_signature_and_waits_out_the_links_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    arch = ArchConfig.from_pretrained(BUNDLED_MODEL)
    rule = MockTokens.for_model(arch, Tokenizer.from_pretrained(BUNDLED_MODEL))
    num_layers, num_blocks = arch.num_hidden_layers, -(-len(PROMPT) // BLOCK_SIZE)
    half = BLOCK_SIZE * arch.num_key_value_heads * arch.head_dim * 4  # a block's K (or V) in a layer, f32

    # every chunk the decode side scatters: (layer, decode-side block id, the row part it received)
    received: list[tuple[int, int, torch.Tensor]] = []
    scatter = transfer.ring.scatter_rows

    def recording(
        rows: torch.Tensor, index: torch.Tensor, plan: ChunkPlan, chunk: int, src: torch.Tensor
    ) -> None:
        for layer, first, last, row in plan.segments(chunk):
            for i, block_id in enumerate(index[first:last].tolist()):
                received.append((layer, block_id, src[row + i].clone()))
        scatter(rows, index, plan, chunk, src)

    monkeypatch.setattr(transfer.ring, "scatter_rows", recording)
    with caplog.at_level(logging.INFO, logger="workers.mock_runner"):
        cluster = LocalCluster(mock_config(_profile(tmp_path)), {"prefill": 1, "decode": 1})
    try:
        said = [r.getMessage() for r in caplog.records if "KV handoffs move" in r.getMessage()]
        line = (
            f"mock engine: KV handoffs move 8 B of each block's K and V per layer (1/{half // 8} of every "
            f"block, 16 of {2 * half} B) over the real transfer path and wait out the rest of the link's "
            "time: 20 ms + bytes at 1 GB/s inside a node, 0.1 GB/s between nodes (a peer at another address "
            "than 127.0.0.1)"
        )
        # the prefill worker's sender, the decode worker's receiver, and each worker's prefix pulls
        # (workers/prefix_pulls.py: one link for its pull sender and, on the prefill worker, receiver)
        assert said == [line] * 4

        (deltas,) = cluster.generate([PROMPT], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)])
        assert [t for d in deltas for t in d.token_ids] == rule.continuation(PROMPT, MAX_TOKENS)
        cluster.wait_until_quiet()
        assert cluster.fatal == []

        # each layer's blocks once, layer-major; of each block's K and V the first word: the signature of
        # its first slot
        assert [layer for layer, _, _ in received] == [
            i // num_blocks for i in range(num_layers * num_blocks)
        ]
        block_ids = [block_id for _, block_id, _ in received[:num_blocks]]
        decode_kv = cluster.workers["decode-0"].engine.runner.kv_cache
        for i, (layer, block_id, part) in enumerate(received):
            assert block_id == block_ids[i % num_blocks]
            position = (i % num_blocks) * BLOCK_SIZE
            want = [kv_signature(PROMPT[position], position, layer, kv) for kv in (0, 1)]
            assert part.tolist() == want, (layer, block_id)
            # the decode side's block holds those words at the head of its K and V, and (a full block: its
            # own decode steps write past the prompt's last one) nothing else
            words = decode_kv[layer, block_id].reshape(2, -1).view(torch.uint8).view(torch.int64)
            assert words[:, 0].tolist() == want
            assert i % num_blocks == num_blocks - 1 or not words[:, 1:].any()

        receiver = cluster.workers["decode-0"].role.receiver  # type: ignore[union-attr]
        assert receiver is not None
        (result,) = receiver.results()
        link_nbytes = num_blocks * num_layers * 2 * half
        assert (result.ok, result.num_blocks, result.nbytes) == (
            True,
            num_blocks,
            num_blocks * num_layers * 16,
        )
        assert (result.link_nbytes, result.is_between_nodes) == (link_nbytes, False)
        assert result.link_seconds == LINK.transfer_s(link_nbytes) == 0.02 + link_nbytes / 1e9
        # NOTE: not a speed check: the receiver ends a paced handoff no sooner than the link's time
        assert result.seconds >= result.link_seconds
        assert receiver.stats().bytes_total == result.nbytes
    finally:
        cluster.close()
