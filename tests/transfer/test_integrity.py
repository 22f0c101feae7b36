"""issue 31 row 3: KV chunks are authenticated with a MAC keyed from the cluster secret
(`transfer.integrity: mac`, the default), so a peer that saw the handshake (the nonce travels in the
clear) cannot send KV that verifies: a forged chunk with a correct XXH3 digest is rejected, counted and
never scattered. The header names the scheme and a receiver refuses a weaker one than its own."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq

from cluster.config import TransferConfig
from cluster.frames import new_secret
from transfer.channel import Channel, OpLane, PendingOp
from transfer.digest import DeviceMac
from transfer.peers import PairKey, PeerId
from transfer.protocol import (
    CHECKSUM_SCHEME,
    DEVICE_MAC_SCHEME,
    HOST_MAC_SCHEME,
    TransferChecksumError,
    TransferMismatchError,
    chunk_tag,
    tag_for_nonce,
)
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.staging import (
    TRAILER_BYTES,
    ChunkPlan,
    chunk_digest,
    chunk_digester,
    kv_mac_key,
    seal_chunk,
    verify_chunk,
    write_trailer,
)

NONCE = 0x5EED_0F_A11
SHAPE = (2, 16, 2, 4, 2, 8)  # [L, blocks, 2, block_size, heads, dim] float32: 256 B per block row
ROW_BYTES = 2 * 4 * 2 * 8 * 4
TIMEOUT_S = 10.0


class _Op(PendingOp):
    def __init__(
        self, done: Callable[[], bool], finish: Callable[[], None], cond: threading.Condition
    ) -> None:
        self._done, self._finish, self._cond = done, finish, cond

    def is_done(self) -> bool:
        with self._cond:
            return self._done()

    def wait(self, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(self._done, max(timeout_s, 0.0)):
                from transfer.protocol import TransferTimeoutError

                raise TransferTimeoutError("no bytes")
            self._finish()


class TamperChannel(Channel):
    """Both ends in one process; `tamper(tag, bytes)` is the man in the middle on the KV connection."""

    backend = "gloo"

    def __init__(self, tamper: Callable[[int, torch.Tensor], None]) -> None:
        self._cond = threading.Condition()
        self._mail: dict[int, torch.Tensor] = {}
        self._tamper = tamper

    def staging_device(self, kv_device: torch.device) -> torch.device:
        return torch.device("cpu")

    def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        wire = buf.view(-1).view(torch.uint8).clone()
        self._tamper(tag, wire)
        with self._cond:
            self._mail[tag] = wire
            self._cond.notify_all()
        return _Op(lambda: True, lambda: None, self._cond)

    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        flat = buf.view(-1).view(torch.uint8)
        return _Op(lambda: tag in self._mail, lambda: flat.copy_(self._mail.pop(tag)), self._cond)


def forge_with_xxh3(tag: int, wire: torch.Tensor) -> None:
    """A stranger who knows the nonce replaces chunk 0's payload and seals it with a correct XXH3 digest."""
    if tag == chunk_tag(tag_for_nonce(NONCE), 0):
        wire[:-TRAILER_BYTES] = 0x42
        write_trailer(wire, chunk_digest(wire, NONCE, 0))


@pytest.fixture
def fixed_nonce(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer.receiver as receiver_module

    monkeypatch.setattr(receiver_module.secrets, "randbits", lambda bits: NONCE)


def _transfer(
    sender_integrity: str, receiver_integrity: str, tamper: Callable[[int, torch.Tensor], None]
) -> Iterator[Any]:
    secret = new_secret()
    channel = TamperChannel(tamper)
    ctx: zmq.Context[Any] = zmq.Context()
    src = torch.randn(*SHAPE)
    dst = torch.zeros(*SHAPE)
    sent: list[bool] = []
    sender = KVSender(src, me=PeerId("p", "0"), channel=channel, secret=secret, on_sent=lambda r, ok: sent.append(ok),
                      zmq_context=ctx, chunk_bytes=2 * ROW_BYTES, integrity=sender_integrity, timeout_s=TIMEOUT_S)  # fmt: skip
    receiver = KVReceiver(dst, me=PeerId("d", "0"), channel=channel, secret=secret, zmq_context=ctx,
                          integrity=receiver_integrity, timeout_s=TIMEOUT_S)  # fmt: skip
    sender.start()
    receiver.start()
    try:
        handoff = sender.offer("r", [3, 4, 5], num_tokens=12)
        yield receiver.submit(handoff, [7, 8, 9]), receiver, src, dst
    finally:
        sender.close()
        receiver.close()
        ctx.destroy(linger=0)


def run_transfer(
    sender_integrity: str,
    receiver_integrity: str,
    tamper: Callable[[int, torch.Tensor], None] = lambda t, w: None,
) -> tuple[Any, KVReceiver, torch.Tensor, torch.Tensor]:
    gen = _transfer(sender_integrity, receiver_integrity, tamper)
    future, receiver, src, dst = next(gen)
    try:
        error: Any = future.exception(TIMEOUT_S * 2)
        return error, receiver, src, dst
    finally:
        gen.close()


def test_issue31_row3_the_default_integrity_is_a_mac() -> None:
    assert TransferConfig().integrity == "mac"
    with pytest.raises(ValueError, match="integrity must be one of"):
        TransferConfig(integrity="crc")


def test_issue31_row3_a_forged_chunk_with_a_correct_xxh3_digest_is_rejected_and_counted(
    fixed_nonce: None,
) -> None:
    error, receiver, _, dst = run_transfer("mac", "mac", forge_with_xxh3)
    assert isinstance(error, TransferChecksumError) and "MAC of chunk 0/3" in str(error)
    assert receiver.stats().num_rejected_chunks == 1 and receiver.stats().num_ok == 0
    assert torch.equal(dst, torch.zeros(*SHAPE))  # nothing of the forged chunk (nor after it) scattered


def test_issue31_row3_with_only_a_digest_the_same_forgery_lands(fixed_nonce: None) -> None:
    """What `mac` closes: under `digest` the stranger's chunk verifies and is scattered."""
    error, receiver, _, dst = run_transfer("digest", "digest", forge_with_xxh3)
    assert error is None and receiver.stats().num_rejected_chunks == 0
    assert bool((dst[0, 7].view(torch.uint8) == 0x42).all())


def test_issue31_row3_a_mac_transfer_arrives_intact() -> None:
    error, receiver, src, dst = run_transfer("mac", "mac")
    assert error is None
    assert torch.equal(dst[:, [7, 8, 9]], src[:, [3, 4, 5]])
    assert receiver.results()[-1].ok


def test_issue31_row3_a_receiver_refuses_a_weaker_scheme_and_takes_a_stronger_one() -> None:
    error, _, _, _ = run_transfer("digest", "mac")
    assert isinstance(error, TransferMismatchError)
    assert f"checksum is '{CHECKSUM_SCHEME}', expected '{HOST_MAC_SCHEME}' (integrity mac" in str(error)
    error, _, src, dst = run_transfer("mac", "digest")
    assert error is None and torch.equal(dst[:, [7, 8, 9]], src[:, [3, 4, 5]])


def _reference_device_mac(mac_key: bytes, nonce: int, payload: bytes, chunk: int) -> bytes:
    """DeviceMac's construction in plain integers (signed 16-bit words, rows of 1024, 4 lanes)."""
    p = (1 << 31) - 1
    nb = nonce.to_bytes(8, "little")

    def elements(raw: bytes, n: int) -> list[int]:
        return [1 + int.from_bytes(raw[8 * i : 8 * i + 8], "little") % (p - 1) for i in range(n)]

    keys = elements(hashlib.blake2b(b"poly31x4-keys" + nb, key=mac_key, digest_size=64).digest(), 8)
    pad_raw = hashlib.blake2b(b"poly31x4-pad" + nb + chunk.to_bytes(8, "little"), key=mac_key, digest_size=32)
    pads = [v - 1 for v in elements(pad_raw.digest(), 4)]
    words = [int.from_bytes(payload[i : i + 2], "little", signed=True) for i in range(0, len(payload) - 1, 2)]
    if len(payload) % 2:
        words.append(payload[-1])
    rows = [words[i : i + 1024] for i in range(0, len(words), 1024)] or [[]]
    out = b""
    for lane in range(4):
        r1, r2 = keys[lane], keys[4 + lane]
        total = sum(
            sum(w * pow(r1, l + 1, p) for l, w in enumerate(row)) % p * pow(r2, h + 1, p)  # noqa: E741
            for h, row in enumerate(rows)
        )
        out += ((total + pads[lane]) % p).to_bytes(4, "little")
    return out


def test_issue31_row3_the_device_mac_is_its_construction_and_catches_what_the_digest_cannot() -> None:
    """DeviceMac (GPU-staged chunks; run here on CPU) equals the reference bit for bit; flipping a byte,
    adding P to a 32-bit word (which the nonce-keyed polynomial digest cannot see), another chunk index,
    another nonce and another secret all change the tag."""
    key = kv_mac_key(new_secret())
    gen = torch.Generator().manual_seed(5)
    payload = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)
    mac = DeviceMac(key, NONCE)
    tag = bytes(mac(payload, 2).numpy())
    assert tag == _reference_device_mac(key, NONCE, bytes(payload.numpy()), 2)
    odd = payload[:4999]
    assert bytes(mac(odd, 0).numpy()) == _reference_device_mac(key, NONCE, bytes(odd.numpy()), 0)
    flipped = payload.clone()
    flipped[77] ^= 1
    plus_p, plus_p_other = payload.clone(), payload.clone()
    plus_p[:4] = torch.tensor(list((5).to_bytes(4, "little")), dtype=torch.uint8)
    plus_p_other[:4] = torch.tensor(list((5 + (1 << 31) - 1).to_bytes(4, "little")), dtype=torch.uint8)
    assert bytes(mac(plus_p, 2).numpy()) != bytes(mac(plus_p_other, 2).numpy())
    assert bytes(mac(flipped, 2).numpy()) != tag
    assert bytes(mac(payload, 3).numpy()) != tag
    assert bytes(DeviceMac(key, NONCE + 1)(payload, 2).numpy()) != tag
    assert bytes(DeviceMac(kv_mac_key(new_secret()), NONCE)(payload, 2).numpy()) != tag


def test_issue31_row3_sealed_chunks_verify_only_with_the_key_of_their_transfer() -> None:
    key = kv_mac_key(new_secret())
    plan = ChunkPlan.create(2, 4, ROW_BYTES, 2 * ROW_BYTES)
    for scheme in (HOST_MAC_SCHEME, DEVICE_MAC_SCHEME):
        wire = torch.randint(0, 256, (plan.wire_bytes(1),), dtype=torch.uint8)
        seal_chunk(wire, NONCE, 1, chunk_digester(scheme, NONCE, key))
        verify_chunk(wire, plan, NONCE, 1, "'r'", chunk_digester(scheme, NONCE, key))
        for other in (
            chunk_digester(scheme, NONCE + 1, key),
            chunk_digester(scheme, NONCE, kv_mac_key(new_secret())),
        ):
            with pytest.raises(TransferChecksumError, match="MAC of chunk 1/4"):
                verify_chunk(wire, plan, NONCE, 1, "'r'", other)
        with pytest.raises(TransferChecksumError, match="MAC of chunk 2/4"):
            verify_chunk(wire, plan, NONCE, 2, "'r'", chunk_digester(scheme, NONCE, key))
