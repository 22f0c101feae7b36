"""A paced handoff's pieces (transfer/paced_link.py), in one process: what part of each block moves and
the fraction said of it, one node or two from the sender's endpoint, the link's predicted time, the
header that carries the part (a receiver of another part refuses it), and a ring moving that part under
a real MAC: the destination gets exactly the first bytes of each block's K and V, nothing else changes,
and a flipped byte is refused."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest
import torch

from cluster.cost_model import TransferCost
from transfer.paced_link import PacedLink, endpoint_host
from transfer.protocol import (
    HOST_MAC_SCHEME,
    KVLayout,
    TransferChecksumError,
    TransferHeader,
    TransferMismatchError,
    moved_row_bytes,
    tag_for_nonce,
    validate_header,
)
from transfer.ring import StagingRing
from transfer.staging import ChunkPlan, block_index, kv_mac_key, kv_rows

LLAMA_3_8B = KVLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
H100 = TransferCost(latency_s=1e-3, bytes_per_s=450e9, nic_bytes_per_s=50e9)
NONCE = 0x5EED_0000_4242


def test_a_paced_link_moves_the_first_word_of_each_blocks_k_and_v_and_says_the_fraction() -> None:
    link = PacedLink(H100, "127.0.0.1")
    assert (link.sample_bytes_for(LLAMA_3_8B), link.fraction(LLAMA_3_8B)) == (8, Fraction(1, 4096))
    assert moved_row_bytes(LLAMA_3_8B, 8) == 16
    assert moved_row_bytes(LLAMA_3_8B) == LLAMA_3_8B.bytes_per_block // 32 == 65536
    assert link.describe(LLAMA_3_8B) == (
        "KV handoffs move 8 B of each block's K and V per layer (1/4096 of every block, 16 of 65536 B) over "
        "the real transfer path and wait out the rest of the link's time: 1 ms + bytes at 450 GB/s inside a "
        "node, 50 GB/s between nodes (a peer at another address than 127.0.0.1)"
    )
    # a block's K no longer than the sample, or not whole words: every byte moves
    for block_size, head_dim, dtype in ((1, 4, "float16"), (1, 3, "float16"), (3, 5, "uint8")):
        layout = KVLayout(2, block_size, 1, head_dim, dtype)
        assert (link.sample_bytes_for(layout), link.fraction(layout)) == (0, Fraction(1))
    assert link.describe(KVLayout(2, 1, 1, 4, "float16")).startswith(
        "KV handoffs move every byte (a block's K is no longer than the sample) over the real transfer path"
    )
    with pytest.raises(ValueError, match="sample_bytes must be a positive multiple of 8, got 12"):
        PacedLink(H100, "127.0.0.1", sample_bytes=12)


def test_one_node_is_one_address_and_the_link_predicts_nvlink_inside_it_and_the_nic_between() -> None:
    link = PacedLink(H100, "10.0.0.5")
    assert not link.is_between_nodes("tcp://10.0.0.5:41234")
    assert link.is_between_nodes("tcp://10.0.0.6:41234")
    assert link.is_between_nodes("tcp://127.0.0.1:41234")
    with pytest.raises(ValueError, match="expected a tcp://HOST:PORT endpoint, got 'ipc:///tmp/kv'"):
        endpoint_host("ipc:///tmp/kv")
    nbytes = 2048 * 128 * 1024  # a 2,048-token prompt of Llama-3-8B: 256 MiB
    assert link.link_s(nbytes, between_nodes=False) == 1e-3 + nbytes / 450e9
    assert link.link_s(nbytes, between_nodes=True) == 1e-3 + nbytes / 50e9
    assert link.link_s(0, between_nodes=True) == 1e-3
    # a profile that names no NIC (a calibrated one, of one host) has one link
    one_link = PacedLink(TransferCost(3e-3, 1e9), "10.0.0.5")
    assert one_link.link_s(nbytes, between_nodes=True) == one_link.link_s(nbytes, between_nodes=False)
    assert one_link.link_s(nbytes, between_nodes=True) == 3e-3 + nbytes / 1e9


def _header(layout: KVLayout, num_blocks: int, sample_bytes: int) -> TransferHeader:
    nbytes = layout.num_layers * num_blocks * moved_row_bytes(layout, sample_bytes)
    return TransferHeader(
        request_id="r",
        nonce=NONCE,
        src_worker_id="prefill-0",
        dst_worker_id="decode-0",
        generation=0,
        backend="gloo",
        layout=layout,
        dtype=layout.dtype,
        shape=layout.layer_shape(num_blocks),
        num_blocks=num_blocks,
        nbytes=nbytes,
        num_chunks=1,
        chunk_bytes=nbytes,
        checksum=HOST_MAC_SCHEME,
        tag=tag_for_nonce(NONCE),
        sample_bytes=sample_bytes,
    )


def test_the_header_carries_the_part_of_each_row_and_a_receiver_of_another_part_refuses_it() -> None:
    header = _header(LLAMA_3_8B, 3, 8)
    assert header.nbytes == 32 * 3 * 2 * 8
    assert TransferHeader.from_bytes(header.to_bytes()) == header

    def check(h: TransferHeader, sample_bytes: int) -> None:
        validate_header(
            h,
            request_id="r",
            nonce=NONCE,
            src_worker_id="prefill-0",
            dst_worker_id="decode-0",
            min_generation=0,
            backend="gloo",
            layout=LLAMA_3_8B,
            num_blocks=3,
            checksum=HOST_MAC_SCHEME,
            sample_bytes=sample_bytes,
        )

    check(header, 8)
    check(_header(LLAMA_3_8B, 3, 0), 0)
    with pytest.raises(TransferMismatchError, match="sample_bytes is 8, expected 0"):
        check(header, 0)
    with pytest.raises(TransferMismatchError, match="sample_bytes is 0, expected 8"):
        check(_header(LLAMA_3_8B, 3, 0), 8)
    with pytest.raises(TransferMismatchError, match=f"nbytes is {header.nbytes + 16}, expected"):
        check(replace(header, nbytes=header.nbytes + 16), 8)
    with pytest.raises(TransferMismatchError, match="chunk_bytes is 100, expected a multiple of 16"):
        check(replace(header, chunk_bytes=100, num_chunks=-(-header.nbytes // 100)), 8)


def test_a_ring_moves_the_first_bytes_of_each_blocks_k_and_v_under_a_mac_and_nothing_else() -> None:
    layout = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")  # K: 128 B
    shape = (3, 12, 2, 4, 2, 8)
    src = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    dst = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before = dst.clone()
    sample = PacedLink(H100, "127.0.0.1", sample_bytes=16).sample_bytes_for(layout)
    row_bytes = moved_row_bytes(layout, sample)
    assert (sample, row_bytes) == (16, 32)
    src_ids, dst_ids = [5, 1, 9, 2], [3, 7, 11, 4]
    # 12 rows of 32 B in chunks of 5 rows: 3 chunks, one across a layer's end
    plan = ChunkPlan.create(3, len(src_ids), row_bytes, 5 * row_bytes)
    nbytes = StagingRing.nbytes(plan, 2)
    mac_key = kv_mac_key(b"s" * 32)

    def ring() -> StagingRing:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return StagingRing(plan, NONCE, 2, buf, None, None, HOST_MAC_SCHEME, mac_key)

    send, recv = ring(), ring()
    src_index, dst_index = block_index(src_ids, src.device), block_index(dst_ids, dst.device)
    for c in range(plan.num_chunks):
        wire = send.fill(kv_rows(src, sample), src_index, c)
        assert wire.numel() == plan.wire_bytes(c)
        recv.wire(c).copy_(wire)
        recv.drain(kv_rows(dst, sample), dst_index, c, "'r'")
        recv.release(c)
    recv.finish()

    def words(kv: torch.Tensor) -> torch.Tensor:  # [L, blocks, K and V, int64 words of a block's K]
        return kv.view(3, 12, 2, 64).view(torch.uint8).view(torch.int64)

    expected = words(before).clone()
    expected[:, dst_ids, :, :2] = words(src)[:, src_ids, :, :2]
    assert torch.equal(words(dst), expected)

    # a flipped byte of a chunk of part-blocks fails its MAC before anything is scattered
    wire = send.fill(kv_rows(src, sample), src_index, 1)
    recv.wire(1).copy_(wire)
    recv.wire(1)[5] ^= 1
    again = before.clone()
    with pytest.raises(TransferChecksumError, match="MAC of chunk 1/3"):
        recv.drain(kv_rows(again, sample), dst_index, 1, "'r'")
    assert torch.equal(again, before)
