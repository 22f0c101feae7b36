"""issue 31 row 2: the pair rendezvous on the router's store cannot be steered by a process without the
cluster secret. Every value a pair's group sets is signed over its full key (pair ends, generation) and
checked on get; a stranger's value (written before the rightful one, or copied from another key) is
ignored and counted, and the pair builds and carries bytes as if it were not there."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from cluster.frames import new_secret
from deploy.launch import KVStore
from tests.support.cluster_utils import wait_for
from transfer.pairs import PairChannel
from transfer.peers import DECODE_RANK, PREFILL_RANK, PairKey, PeerId
from transfer.rendezvous import (
    REASON_BAD_TAG,
    RejectCounter,
    SignedStore,
    rendezvous_key,
    sign_value,
)

KEY = PairKey(PeerId("prefill-0", "p0"), PeerId("decode-0", "d0"), 3)
TIMEOUT_S = 20.0

STRANGER = """
import datetime, sys
import torch.distributed as dist
host, port, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
store.set(key, b"127.0.0.1:1 a stranger's gloo address")
print(sorted(store.list_keys()))  # NOTE: what it can still see: key names, nothing secret
"""


def test_issue31_row2_a_strangers_rendezvous_value_is_ignored_and_the_pair_builds() -> None:
    """A process without the secret writes the decode rank's rendezvous key of a future generation before
    the pair is built: the prefill end ignores it (counted) until the decode end's signed value comes, and
    the pair carries bytes. Unsigned (today), the stranger's value is taken as the peer's address."""
    store = KVStore("127.0.0.1")
    secret = new_secret()
    prefill, decode = PairChannel(store.address, "127.0.0.1"), PairChannel(store.address, "127.0.0.1")
    for channel in (prefill, decode):
        channel.use_secret(secret)
    try:
        forged = f"{KEY.store_prefix()}/0/{DECODE_RANK}"  # gloo's key for rank 1's address
        subprocess.run(
            [sys.executable, "-c", STRANGER, *map(str, store.address), forged], check=True, timeout=60
        )
        built = prefill.connect(KEY, PREFILL_RANK)
        wait_for(lambda: prefill.rejected().get(REASON_BAD_TAG, 0) >= 1, TIMEOUT_S, "the forgery seen")
        decode.connect(KEY, DECODE_RANK).wait(TIMEOUT_S)
        built.wait(TIMEOUT_S)
        sent = torch.arange(16, dtype=torch.uint8)
        got = torch.zeros(16, dtype=torch.uint8)
        recv = decode.irecv(got, KEY, 7)
        prefill.isend(sent, KEY, 7).wait(TIMEOUT_S)
        recv.wait(TIMEOUT_S)
        assert torch.equal(got, sent)
        assert prefill.broken_pairs() == [] and decode.broken_pairs() == []
        assert set(prefill.rejected()) == {REASON_BAD_TAG} and decode.rejected() == {}
    finally:
        prefill.close()
        decode.close()
        store.close()


def test_issue31_row2_a_signed_value_is_bound_to_its_key() -> None:
    """A rightful value copied under another pair's or generation's key, a value signed with another
    secret, and an unsigned one never verify: get ignores each (counted) until its bound."""
    inner = dist.HashStore()
    key = rendezvous_key(new_secret())
    rejected = RejectCounter()
    store = SignedStore(inner, key, 0.2, rejected)
    store.set("pdserve/pair/a/b/0//0/0", b"addr")
    assert store.get("pdserve/pair/a/b/0//0/0") == b"addr"
    inner.set("pdserve/pair/a/b/1//0/0", inner.get("pdserve/pair/a/b/0//0/0"))  # replayed elsewhere
    inner.set(
        "pdserve/pair/a/c/0//0/0", sign_value(rendezvous_key(new_secret()), "pdserve/pair/a/c/0//0/0", b"x")
    )
    inner.set("pdserve/pair/a/d/0//0/0", b"plain")
    for name in ("pdserve/pair/a/b/1//0/0", "pdserve/pair/a/c/0//0/0", "pdserve/pair/a/d/0//0/0"):
        with pytest.raises(TimeoutError, match="verified"):
            store.get(name)
    assert rejected.snapshot()[REASON_BAD_TAG] >= 3


def test_issue31_row2_the_rightful_value_replaces_an_early_forgery() -> None:
    """A get that found a forgery keeps polling (bounded) and returns the rightful value set after it."""
    inner = dist.HashStore()
    key = rendezvous_key(new_secret())
    rejected = RejectCounter()
    store = SignedStore(inner, key, TIMEOUT_S, rejected)
    inner.set("k", b"forged")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(store.get("k")))
    reader.start()
    wait_for(lambda: rejected.snapshot().get(REASON_BAD_TAG, 0) >= 1, TIMEOUT_S, "the forgery seen")
    SignedStore(inner, key, TIMEOUT_S, RejectCounter()).set("k", b"rightful")
    reader.join(TIMEOUT_S)
    assert got == [b"rightful"]
