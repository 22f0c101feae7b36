"""The device digest (transfer/digest.py) run on CPU tensors: the same torch ops the GPU path queues.
It meets its plain-Python definition, catches every single changed byte and every exchange of two
different words, binds the chunk index and the nonce, and seals and checks a staging ring's chunks.

That a GPU computes the same digest as a CPU for the same bytes is only checked on a GPU
(`test_the_device_digest_is_equal_on_cpu_and_gpu`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from transfer.channel import TORCH_DTYPES
from transfer.digest import DEVICE_CHECKSUM_SCHEME, PRIMITIVE_ROOT, DeviceDigest, P, lane_keys
from transfer.protocol import (
    CHECKSUM_SCHEME,
    KVLayout,
    TransferChecksumError,
    TransferHeader,
    TransferMismatchError,
    tag_for_nonce,
    validate_header,
)
from transfer.ring import StagingRing
from transfer.staging import (
    TRAILER_BYTES,
    ChunkPlan,
    block_index,
    chunk_digester,
    chunk_view,
    kv_rows,
    read_trailer,
    seal_chunk,
    verify_chunk,
)

NONCE, OTHER_NONCE = 0x5EED_0000_1234, 0x5EED_0000_1235


def reference_digest(payload: bytes, nonce: int, chunk: int) -> int:
    """The digest as transfer/digest.py defines it, word by word in plain Python."""
    main = len(payload) - len(payload) % 4
    words = [int.from_bytes(payload[i : i + 4], "little") for i in range(0, main, 4)] + list(payload[main:])
    digest = 0
    for lane in range(2):
        r, k = lane_keys(nonce, lane)
        value = sum(w * pow(r, i, P) for i, w in enumerate(words)) + (chunk + 1) * k
        digest |= (value % P) << (32 * lane)
    return digest


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def digest_of(payload: torch.Tensor, nonce: int = NONCE, chunk: int = 0) -> int:
    return int(DeviceDigest(nonce)(payload, chunk))


def test_the_keys_are_primitive_roots_and_nonzero() -> None:
    for q in (2, 3, 7, 11, 31, 151, 331):  # NOTE: the prime factors of P - 1
        assert (P - 1) % q == 0 and pow(PRIMITIVE_ROOT, (P - 1) // q, P) != 1
    for nonce, lane in itertools.product((0, 1, NONCE, (1 << 63) - 1), (0, 1)):
        r, k = lane_keys(nonce, lane)
        assert all(pow(r, (P - 1) // q, P) != 1 for q in (2, 3, 7, 11, 31, 151, 331))
        assert 1 <= k < P


@pytest.mark.parametrize("nbytes", [1, 3, 4, 5, 64, 1027, 4096 + 7, 9000])
def test_the_digest_meets_its_definition(nbytes: int) -> None:
    payload = random_bytes(nbytes, nbytes)
    for nonce, chunk in [(NONCE, 0), (OTHER_NONCE, 5), (0, 1 << 20)]:
        assert digest_of(payload, nonce, chunk) == reference_digest(bytes(payload.tolist()), nonce, chunk)


def test_both_ends_get_the_same_digest_for_the_same_bytes_wherever_they_sit() -> None:
    payload = random_bytes(1000 + 3, 1)
    digest = digest_of(payload)
    big = random_bytes(4096, 2)
    big[128 : 128 + payload.numel()] = payload  # an aligned slot of a larger buffer
    odd = random_bytes(4096, 3)
    odd[7 : 7 + payload.numel()] = payload  # a start that is no word boundary
    sender, receiver = DeviceDigest(NONCE), DeviceDigest(NONCE)
    assert int(sender(big[128 : 128 + payload.numel()], 0)) == digest
    assert int(receiver(odd[7 : 7 + payload.numel()], 0)) == digest
    assert int(receiver(payload.clone(), 0)) == digest  # tables reused: the same again
    assert 0 <= digest < 1 << 63  # never the all-ones junk trailer


def test_every_single_changed_byte_is_caught() -> None:
    payload = random_bytes(515, 4)  # 128 words and 3 tail bytes
    digest = digest_of(payload)
    flips = random_bytes(payload.numel(), 5).clamp_(min=1)  # a nonzero xor for every byte
    for i in range(payload.numel()):
        for xor in (int(flips[i]), 1 << (i % 8), 0x80):
            bad = payload.clone()
            bad[i] ^= xor
            assert digest_of(bad) != digest, (i, xor)


def test_every_exchange_of_two_different_words_is_caught() -> None:
    payload = random_bytes(4 * 48, 6)
    words = payload.view(torch.int32)
    digest = digest_of(payload)
    num_checked = 0
    for i, j in itertools.combinations(range(words.numel()), 2):
        if int(words[i]) % P == int(words[j]) % P:
            continue
        bad = words.clone()
        bad[i], bad[j] = words[j], words[i]
        assert digest_of(bad.view(torch.uint8)) != digest, (i, j)
        num_checked += 1
    assert num_checked == 48 * 47 // 2  # NOTE: random words: none equal mod P here


def test_the_digest_is_fixed_by_the_nonce_and_binds_the_chunk_index() -> None:
    payload = random_bytes(2048, 7)
    assert digest_of(payload, NONCE, 3) == digest_of(payload.clone(), NONCE, 3)
    by_nonce = {digest_of(payload, nonce, 3) for nonce in range(NONCE, NONCE + 64)}
    by_chunk = {digest_of(payload, NONCE, chunk) for chunk in range(64)}
    assert len(by_nonce) == 64 and len(by_chunk) == 64


def test_a_ring_sealed_with_the_device_digest_round_trips_and_catches_a_flipped_bit() -> None:
    g = torch.Generator().manual_seed(1)
    kv = torch.randn((2, 32, 2, 4, 2, 8), generator=g).to(TORCH_DTYPES["bfloat16"])
    target = torch.randn((2, 32, 2, 4, 2, 8), generator=g).to(TORCH_DTYPES["bfloat16"])
    row_bytes = kv[0, 0].numel() * kv.element_size()
    src_ids, dst_ids = [5, 1, 30, 12, 7], [9, 10, 2, 3, 4]
    plan = ChunkPlan.create(2, len(src_ids), row_bytes, 3 * row_bytes)  # 10 rows -> 4 chunks
    nbytes = StagingRing.nbytes(plan, 2)
    send = StagingRing(
        plan, NONCE, 2, torch.empty(nbytes, dtype=torch.uint8), None, None, DEVICE_CHECKSUM_SCHEME
    )
    recv = StagingRing(
        plan, NONCE, 2, torch.empty(nbytes, dtype=torch.uint8), None, None, DEVICE_CHECKSUM_SCHEME
    )
    src_index, dst_index = block_index(src_ids, kv.device), block_index(dst_ids, kv.device)
    for c in range(plan.num_chunks):
        wire = send.fill(kv_rows(kv), src_index, c)
        assert read_trailer(wire) == reference_digest(bytes(wire[:-TRAILER_BYTES].tolist()), NONCE, c)
        recv.wire(c).copy_(wire)
        recv.drain(kv_rows(target), dst_index, c, "'r'")
    assert torch.equal(target[:, dst_ids].view(torch.uint8), kv[:, src_ids].view(torch.uint8))

    again = target.clone()
    recv.wire(1).copy_(send.fill(kv_rows(kv), src_index, 1))
    recv.wire(1)[17] ^= 4
    with pytest.raises(TransferChecksumError, match="chunk 1/4"):
        recv.drain(kv_rows(again), dst_index, 1, "'r'")
    assert torch.equal(again, target)


def test_sealed_bytes_verify_only_as_their_own_chunk_of_their_own_transfer() -> None:
    plan = ChunkPlan.create(1, 4, 60, 120)
    buf = torch.zeros(plan.stride * 2, dtype=torch.uint8)
    wire = chunk_view(buf, plan, 0)
    wire[:-TRAILER_BYTES] = random_bytes(120, 8)
    seal_chunk(wire, NONCE, 0, DeviceDigest(NONCE))
    verify_chunk(wire, plan, NONCE, 0, "'r'", DeviceDigest(NONCE))
    with pytest.raises(TransferChecksumError, match="chunk 1/2"):
        verify_chunk(wire, plan, NONCE, 1, "'r'", DeviceDigest(NONCE))
    with pytest.raises(TransferChecksumError, match="chunk 0/2"):
        verify_chunk(wire, plan, OTHER_NONCE, 0, "'r'", DeviceDigest(OTHER_NONCE))
    with pytest.raises(TransferChecksumError, match="chunk 0/2"):  # the XXH3 reading of the same trailer
        verify_chunk(wire, plan, NONCE, 0, "'r'")


def test_the_scheme_is_named_and_checked() -> None:
    assert isinstance(chunk_digester(DEVICE_CHECKSUM_SCHEME, NONCE), DeviceDigest)
    assert chunk_digester(CHECKSUM_SCHEME, NONCE) is None
    with pytest.raises(ValueError, match="checksum must be one of"):
        chunk_digester("crc32", NONCE)
    layout = KVLayout(2, 4, 2, 8, "bfloat16")
    header = TransferHeader(
        "r", 9, "p", "d", 0, "nccl", layout, "bfloat16", layout.layer_shape(1), 1,
        layout.bytes_per_block, 1, layout.bytes_per_block, CHECKSUM_SCHEME, tag_for_nonce(9),
    )  # fmt: skip
    expect = dict(
        request_id="r", nonce=9, src_worker_id="p", dst_worker_id="d", min_generation=0, backend="nccl",
        layout=layout, num_blocks=1,
    )  # fmt: skip
    with pytest.raises(
        TransferMismatchError, match=f"checksum is '{CHECKSUM_SCHEME}', expected '{DEVICE_CHECKSUM_SCHEME}'"
    ):
        validate_header(header, **expect, checksum=DEVICE_CHECKSUM_SCHEME)  # type: ignore[arg-type]
    header.checksum = DEVICE_CHECKSUM_SCHEME
    validate_header(header, **expect, checksum=DEVICE_CHECKSUM_SCHEME)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_digest_is_equal_on_cpu_and_gpu() -> None:
    payload = random_bytes((4 << 20) + 3, 9)
    digest = DeviceDigest(NONCE)
    on_gpu = digest(payload.cuda(), 7)
    assert on_gpu.is_cuda and int(on_gpu) == int(digest(payload, 7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_ring_staged_on_the_gpu_seals_and_checks_there() -> None:
    """The nccl / CUDA IPC case: KV cache and slots on the GPU, copies on a side stream, no host mirror."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn((2, 32, 2, 4, 2, 8), generator=g).to(torch.bfloat16).cuda()
    target = torch.zeros_like(kv)
    row_bytes = kv[0, 0].numel() * kv.element_size()
    src_ids, dst_ids = [5, 1, 30, 12, 7], [9, 10, 2, 3, 4]
    plan = ChunkPlan.create(2, len(src_ids), row_bytes, 3 * row_bytes)
    nbytes = StagingRing.nbytes(plan, 2)
    stream = torch.cuda.Stream()
    slots = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    with pytest.raises(ValueError, match="need the device digest"):
        StagingRing(plan, NONCE, 2, slots[0], None, stream)
    send = StagingRing(plan, NONCE, 2, slots[0], None, stream, DEVICE_CHECKSUM_SCHEME)
    recv = StagingRing(plan, NONCE, 2, slots[1], None, stream, DEVICE_CHECKSUM_SCHEME)
    src_index, dst_index = block_index(src_ids, kv.device), block_index(dst_ids, kv.device)
    with torch.cuda.stream(stream):
        for c in range(plan.num_chunks):
            wire = send.fill(kv_rows(kv), src_index, c)
            recv.wire(c).copy_(wire)
            recv.drain(kv_rows(target), dst_index, c, "'r'")
            host = wire.cpu()
            assert read_trailer(host) == reference_digest(bytes(host[:-TRAILER_BYTES].tolist()), NONCE, c)
        recv.finish()
        recv.wire(1).copy_(send.fill(kv_rows(kv), src_index, 1))
        recv.wire(1)[17] ^= 4
        with pytest.raises(TransferChecksumError, match="chunk 1/4"):
            recv.drain(kv_rows(target), dst_index, 1, "'r'")
    assert torch.equal(target[:, dst_ids].view(torch.uint8).cpu(), kv[:, src_ids].view(torch.uint8).cpu())
