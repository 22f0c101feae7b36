"""KV-transfer pieces that run in one process: the protocol's messages, strict rebuilds and header checks,
the signed handshake frames, chunk plans, the keyed chunk digest (what it catches, with the exact error),
gather/scatter, and the staging ring."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from cluster.frames import FrameSigner, new_secret
from transfer.channel import TORCH_DTYPES
from transfer.handshake import HandshakeFrames, MessageKind, parse_body
from transfer.protocol import (
    CHECKSUM_SCHEME,
    KVHandoff,
    KVLayout,
    TransferChecksumError,
    TransferError,
    TransferHeader,
    TransferMismatchError,
    TransferRequest,
    request_from_dict,
    tag_for_nonce,
    to_dict,
    validate_header,
)
from transfer.ring import StagingRing
from transfer.staging import (
    TRAILER_BYTES,
    ChunkPlan,
    block_index,
    chunk_digest,
    chunk_view,
    gather_blocks,
    gather_chunk,
    junk_chunk,
    kv_rows,
    read_trailer,
    scatter_chunk,
    verify_chunk,
)

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 2, 32, 4, 2, 8
NONCE, OTHER_NONCE = 0x5EED_0000_1234, 0x5EED_0000_1235


def make_kv(seed: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(TORCH_DTYPES[dtype])


def as_bytes(kv: torch.Tensor) -> torch.Tensor:
    return kv.reshape(kv.shape[0], kv.shape[1], -1).view(torch.uint8)


def _header(layout: KVLayout, num_blocks: int = 3, nonce: int = 12345) -> TransferHeader:
    return TransferHeader(
        request_id="r",
        nonce=nonce,
        src_worker_id="prefill-0",
        dst_worker_id="decode-0",
        generation=2,
        backend="gloo",
        layout=layout,
        dtype=layout.dtype,
        shape=layout.layer_shape(num_blocks),
        num_blocks=num_blocks,
        nbytes=layout.bytes_per_block * num_blocks,
        num_chunks=num_blocks,
        chunk_bytes=layout.bytes_per_block,
        checksum=CHECKSUM_SCHEME,
        tag=tag_for_nonce(nonce),
    )


def test_protocol_round_trips_through_msgpack_and_validates_every_field() -> None:
    layout = KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, "bfloat16")
    header = _header(layout)
    assert TransferHeader.from_bytes(header.to_bytes()) == header
    handoff = KVHandoff("r", "prefill-0", "ab12", "tcp://127.0.0.1:5", layout, 11, 3, 123.5, ["aa", b"\x01"])
    assert KVHandoff.from_bytes(handoff.to_bytes()) == handoff
    frames = HandshakeFrames(new_secret(), "decode-0/cd34")
    assert frames.decode(frames.encode("decode-0/cd34", MessageKind.HEADER, 9, header=header)) == (
        MessageKind.HEADER,
        9,
        {"header": header},
    )

    expect = dict(
        request_id="r",
        nonce=12345,
        src_worker_id="prefill-0",
        dst_worker_id="decode-0",
        min_generation=2,
        backend="gloo",
        layout=layout,
        num_blocks=3,
    )
    validate_header(header, **expect)  # type: ignore[arg-type]
    validate_header(header, **{**expect, "min_generation": 1})  # type: ignore[arg-type]
    wrong: list[tuple[str, Any]] = [
        ("request_id", "q"),
        ("nonce", 1),
        ("src_worker_id", "prefill-1"),
        ("dst_worker_id", "decode-1"),
        ("min_generation", 3),  # the header's generation is older than the receiver accepts
        ("backend", "nccl"),
        ("layout", KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, "float16")),
        ("num_blocks", 4),
    ]
    for field_name, value in wrong:
        with pytest.raises(TransferMismatchError, match=field_name.removeprefix("min_")):
            validate_header(header, **{**expect, field_name: value})  # type: ignore[arg-type]
    bad_fields: list[tuple[str, Any]] = [
        ("dtype", "float32"),
        ("shape", [3, 2, 4, 2, 4]),
        ("nbytes", 1),
        ("tag", 3),
        ("checksum", "rowsum-trailer-v1"),  # the old scheme: a peer on old code is refused up front
        ("num_chunks", 2),
        ("chunk_bytes", layout.bytes_per_block + 1),
        ("chunk_bytes", 0),
    ]
    for field_name, value in bad_fields:
        bad = TransferHeader.from_bytes(header.to_bytes())
        setattr(bad, field_name, value)
        with pytest.raises(TransferMismatchError, match=field_name):
            validate_header(bad, **expect)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="not a msgpack map"):
        KVHandoff.from_bytes(b"\x81\x91\x01\x02")  # a map keyed by a list
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, 1, "int7")


def test_messages_are_rebuilt_strictly() -> None:
    request = TransferRequest("r", 5, "decode-0", "cd34", 1, 0, 3)
    assert request_from_dict(to_dict(request)) == request
    assert parse_body(MessageKind.REQUEST, {"nonce": 5, "request": to_dict(request)}) == (
        5,
        {"request": request},
    )
    bad: list[tuple[MessageKind, Any, str]] = [
        (MessageKind.REQUEST, {"nonce": 5, "request": {**to_dict(request), "generation": "1"}}, "generation"),
        (MessageKind.REQUEST, {"nonce": 5, "request": {**to_dict(request), "extra": 1}}, "unknown"),
        (MessageKind.REQUEST, {"nonce": 5, "request": {"request_id": "r"}}, "missing"),
        (MessageKind.ACK, {"nonce": 5, "num_slots": True}, "num_slots"),  # a bool is not an int
        (MessageKind.CREDIT, {"nonce": 5.0, "chunk": 1}, "nonce"),
        (MessageKind.DONE, {"nonce": 5, "more": 1}, "fields"),
        (MessageKind.ABORT, [5], "not a map"),
    ]
    for kind, body, what in bad:
        with pytest.raises(TransferError, match=what):
            parse_body(kind, body)
    handoff = to_dict(KVHandoff("r", "p", "ab", "tcp://x:1", KVLayout(1, 1, 1, 1, "uint8"), 1, 1, 1.0))
    with pytest.raises(TransferError, match=r"KVLayout\.num_layers"):
        KVHandoff.from_bytes(msgpack.packb({**handoff, "layout": {**handoff["layout"], "num_layers": 1.5}}))


def test_handshake_frames_count_what_they_drop() -> None:
    secret = new_secret()
    mine, theirs = HandshakeFrames(secret, "prefill-0/ab12"), HandshakeFrames(secret, "decode-0/cd34")
    good = theirs.encode("prefill-0/ab12", MessageKind.CREDIT, 3, chunk=1)
    assert mine.decode(good) == (MessageKind.CREDIT, 3, {"chunk": 1})
    signer = FrameSigner(secret)
    for frame in (
        good,  # replayed
        theirs.encode("prefill-0/ffff", MessageKind.DONE, 3),  # another process of the same worker
        FrameSigner(new_secret()).sign("prefill-0/ab12", "done", {"nonce": 3}),
        signer.sign("prefill-0/ab12", "credit", {"nonce": 3, "chunk": "1"}),
        signer.sign("prefill-0/ab12", "hello", {"nonce": 3}),
        b"PDC1" + b"\x00" * 8,
    ):
        assert mine.decode(frame) is None
    assert mine.rejected() == {
        "replayed": 1,
        "misaddressed": 1,
        "bad_mac": 1,
        "bad_field": 1,
        "unknown_tag": 1,
        "malformed": 1,
    }


def _seal(
    kv: torch.Tensor, block_ids: list[int], chunk_bytes: int, nonce: int = NONCE
) -> tuple[ChunkPlan, torch.Tensor]:
    """All chunks of `kv[:, block_ids]` gathered and sealed into one buffer (chunk c at c * stride)."""
    row_bytes = kv[0, 0].numel() * kv.element_size()
    plan = ChunkPlan.create(kv.shape[0], len(block_ids), row_bytes, chunk_bytes)
    buf = torch.empty(plan.num_chunks * plan.stride, dtype=torch.uint8)
    index = block_index(block_ids, kv.device)
    for c in range(plan.num_chunks):
        gather_chunk(kv_rows(kv), index, plan, c, chunk_view(buf, plan, c, c * plan.stride), nonce)
    return plan, buf


def _wire(plan: ChunkPlan, buf: torch.Tensor, chunk: int) -> torch.Tensor:
    return chunk_view(buf, plan, chunk, chunk * plan.stride)


def _verify(plan: ChunkPlan, buf: torch.Tensor, chunk: int, nonce: int = NONCE) -> None:
    verify_chunk(_wire(plan, buf, chunk), plan, nonce, chunk, "'r'")


def _swap(buf: torch.Tensor, a: int, b: int, length: int) -> torch.Tensor:
    out = buf.clone()
    first, second = buf[a : a + length].clone(), buf[b : b + length].clone()
    assert not torch.equal(first, second)  # NOTE: a swap of equal bytes would prove nothing
    out[a : a + length], out[b : b + length] = second, first
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_digest_catches_swapped_kv_swapped_tokens_a_flipped_byte_and_other_nonces(dtype: str) -> None:
    kv = make_kv(1, dtype)
    row_bytes = kv[0, 0].numel() * kv.element_size()
    token_bytes = NUM_HEADS * HEAD_DIM * kv.element_size()
    plan, buf = _seal(kv, [3, 9, 4, 17, 30], 4 * row_bytes)  # 10 rows: chunks of 4, 4, 2 rows
    for c in range(3):
        _verify(plan, buf, c)
    assert (plan.num_chunks, plan.wire_bytes(1)) == (3, 4 * row_bytes + TRAILER_BYTES)

    chunk1 = plan.stride  # chunk 1 starts here; its row 0 is block 4 of layer 0 (K half, then V half)
    half = row_bytes // 2
    tampered = {
        "K and V of one block swapped": _swap(buf, chunk1, chunk1 + half, half),
        "tokens 1 and 2 of one block swapped": _swap(buf, chunk1 + token_bytes, chunk1 + 2 * token_bytes, token_bytes),
        "two blocks swapped": _swap(buf, chunk1, chunk1 + row_bytes, row_bytes),
    }  # fmt: skip
    flipped = buf.clone()
    flipped[chunk1 + 5] ^= 1
    tampered["one bit flipped"] = flipped
    for what, bad in tampered.items():
        with pytest.raises(TransferChecksumError, match=r"chunk 1/3 .* of 'r'"):
            _verify(plan, bad, 1)
        _verify(plan, bad, 0)  # the other chunks still verify: the digest is per chunk
        _verify(plan, bad, 2)
        assert not torch.equal(bad, buf), what

    # the same bytes sealed by another transfer (another nonce) or for another position never verify
    _, other = _seal(kv, [3, 9, 4, 17, 30], 4 * row_bytes, nonce=OTHER_NONCE)
    assert torch.equal(_wire(plan, other, 1)[:-TRAILER_BYTES], _wire(plan, buf, 1)[:-TRAILER_BYTES])
    with pytest.raises(TransferChecksumError, match="chunk 1/3"):
        _verify(plan, other, 1)
    _verify(plan, other, 1, nonce=OTHER_NONCE)
    twice, repeated = _seal(kv, [3, 9, 4, 17] * 2, 4 * row_bytes)  # chunks 0 and 1: equal payloads
    first, second = _wire(twice, repeated, 0), _wire(twice, repeated, 1)
    assert torch.equal(first[:-TRAILER_BYTES], second[:-TRAILER_BYTES])
    with pytest.raises(TransferChecksumError, match="chunk 1/4"):
        verify_chunk(first, twice, NONCE, 1, "'r'")  # chunk 0's bytes delivered as chunk 1

    junk = _wire(plan, buf, 1).clone()
    junk_chunk(junk)
    assert read_trailer(junk) == (1 << 64) - 1 != chunk_digest(junk, NONCE, 1)
    with pytest.raises(TransferChecksumError):
        verify_chunk(junk, plan, NONCE, 1, "'r'")


def test_digest_is_xxh3_64_keyed_by_the_nonce_over_the_chunk_index_and_payload() -> None:
    import xxhash

    wire = torch.arange(64 + TRAILER_BYTES, dtype=torch.uint8)
    expected = xxhash.xxh3_64_intdigest((7).to_bytes(8, "little") + bytes(range(64)), seed=NONCE)
    assert chunk_digest(wire, NONCE, 7) == expected
    assert CHECKSUM_SCHEME == "xxh3_64-nonce-v2"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_round_trip_into_other_blocks(dtype: str) -> None:
    kv = make_kv(1, dtype)
    row_bytes = kv[0, 0].numel() * kv.element_size()
    src_ids, dst_ids = [3, 9, 4, 17, 30], [1, 2, 7, 8, 20]
    plan, buf = _seal(kv, src_ids, 4 * row_bytes)
    target = make_kv(2, dtype)
    before = as_bytes(target).clone()
    for c in range(plan.num_chunks):
        scatter_chunk(kv_rows(target), block_index(dst_ids, target.device), plan, c, _wire(plan, buf, c))
    assert torch.equal(as_bytes(target)[:, dst_ids], as_bytes(kv)[:, src_ids])
    others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert torch.equal(as_bytes(target)[:, others], before[:, others])
    assert torch.equal(gather_blocks(kv, src_ids), kv[:, src_ids])


def test_chunks_on_rows_that_are_not_word_multiples() -> None:
    g = torch.Generator().manual_seed(3)
    kv = torch.randint(0, 256, (2, 6, 2, 1, 1, 3), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    plan, buf = _seal(kv, [5, 2], 6 * 3)  # 6-byte rows, 3 per chunk: 4 rows -> 2 chunks
    assert plan.num_chunks == 2
    _verify(plan, buf, 0)
    _verify(plan, buf, 1)
    flipped = buf.clone()
    flipped[plan.stride + 2] ^= 4
    with pytest.raises(TransferChecksumError, match="chunk 1/2"):
        _verify(plan, flipped, 1)
    target = torch.zeros_like(kv)
    for c in range(2):
        scatter_chunk(kv_rows(target), block_index([1, 4], target.device), plan, c, _wire(plan, buf, c))
    assert torch.equal(target.view(torch.uint8)[:, [1, 4]], kv.view(torch.uint8)[:, [5, 2]])
    assert not target.view(torch.uint8)[:, [0, 2, 3, 5]].any()


def test_staging_rings_wrap_around_and_a_bad_chunk_is_not_scattered() -> None:
    """A sender ring and a receiver ring of 3 slots moving 7 chunks (the wire is a copy of the slot)."""
    kv, target = make_kv(1, "float32"), make_kv(2, "float32")
    row_bytes = kv[0, 0].numel() * kv.element_size()
    src_ids, dst_ids = [5, 1, 30, 12, 7, 8, 22], [9, 10, 2, 3, 4, 31, 17]
    plan = ChunkPlan.create(NUM_LAYERS, len(src_ids), row_bytes, 2 * row_bytes)  # 14 rows -> 7 chunks
    nbytes = StagingRing.nbytes(plan, 3)
    send = StagingRing(plan, NONCE, 3, torch.empty(nbytes, dtype=torch.uint8), None, None)
    recv = StagingRing(plan, NONCE, 3, torch.empty(nbytes, dtype=torch.uint8), None, None)
    src_index, dst_index = block_index(src_ids, kv.device), block_index(dst_ids, kv.device)
    before = as_bytes(target).clone()
    for c in range(plan.num_chunks):
        recv.wire(c).copy_(send.fill(kv_rows(kv), src_index, c))
        recv.drain(kv_rows(target), dst_index, c, "'r'")
        recv.release(c)
    recv.finish()
    assert torch.equal(as_bytes(target)[:, dst_ids], as_bytes(kv)[:, src_ids])
    others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert torch.equal(as_bytes(target)[:, others], before[:, others])
    assert send.gather_seconds > 0 and send.hash_seconds > 0 and recv.scatter_seconds > 0

    again = make_kv(2, "float32")
    wire = send.fill(kv_rows(kv), src_index, 4)
    recv.wire(4).copy_(wire)
    recv.wire(4)[3] ^= 1
    with pytest.raises(TransferChecksumError, match="chunk 4/7"):
        recv.drain(kv_rows(again), dst_index, 4, "'r'")
    assert torch.equal(again, make_kv(2, "float32"))
