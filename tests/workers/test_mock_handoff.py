"""A mock engine with a cost profile hands KV over at its profile's link (transfer/paced_link.py), in a
whole cluster in this process (the real router, workers, roles, handshake and gloo pair): the worker's
log says the fraction of each block that moves; the decode side gets the signature word of every K and
V row of the prompt (every byte the mock wrote) and nothing else; the handoff counts the whole KV on the
link, inside one node (both bind loopback), and lasts at least what the link predicts for it."""

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


def test_a_mock_handoff_moves_every_byte_the_mock_wrote_and_waits_out_the_links_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    arch = ArchConfig.from_pretrained(BUNDLED_MODEL)
    rule = MockTokens.for_model(arch, Tokenizer.from_pretrained(BUNDLED_MODEL))
    num_layers, num_blocks = arch.num_hidden_layers, -(-len(PROMPT) // BLOCK_SIZE)
    row_bytes = arch.num_key_value_heads * arch.head_dim * 4  # one token's K (or V) in one layer, float32

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
        assert (
            said
            == [
                f"mock engine: KV handoffs move 8 B of each {row_bytes} B K/V row (1/{row_bytes // 8} of every "
                "block) over the real transfer path and wait out the rest of the link's time: 20 ms + bytes at "
                "1 GB/s inside a node, 0.1 GB/s between nodes (a peer at another address than 127.0.0.1)"
            ]
            * 2
        )  # the prefill worker's sender, the decode worker's receiver

        (deltas,) = cluster.generate([PROMPT], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)])
        assert [t for d in deltas for t in d.token_ids] == rule.continuation(PROMPT, MAX_TOKENS)
        cluster.wait_until_quiet()
        assert cluster.fatal == []

        # each layer's blocks once, layer-major; of each slot's K and V rows the first word: its signature
        assert [layer for layer, _, _ in received] == [
            i // num_blocks for i in range(num_layers * num_blocks)
        ]
        block_ids = [block_id for _, block_id, _ in received[:num_blocks]]
        for i, (layer, block_id, part) in enumerate(received):
            assert block_id == block_ids[i % num_blocks]
            want = torch.zeros(2, BLOCK_SIZE, dtype=torch.int64)
            for offset in range(BLOCK_SIZE):
                position = (i % num_blocks) * BLOCK_SIZE + offset
                if position < len(PROMPT):
                    for kv in (0, 1):
                        want[kv, offset] = kv_signature(PROMPT[position], position, layer, kv)
            assert torch.equal(part, want.view(-1)), (layer, block_id)

        receiver = cluster.workers["decode-0"].role.receiver  # type: ignore[union-attr]
        assert receiver is not None
        (result,) = receiver.results()
        link_nbytes = num_blocks * num_layers * 2 * BLOCK_SIZE * row_bytes
        assert (result.ok, result.num_blocks, result.nbytes) == (
            True,
            num_blocks,
            link_nbytes * 8 // row_bytes,
        )
        assert (result.link_nbytes, result.is_between_nodes) == (link_nbytes, False)
        assert result.link_seconds == LINK.transfer_s(link_nbytes) == 0.02 + link_nbytes / 1e9
        # NOTE: not a speed check: the receiver ends a paced handoff no sooner than the link's time
        assert result.seconds >= result.link_seconds
        assert receiver.stats().bytes_total == result.nbytes
    finally:
        cluster.close()
