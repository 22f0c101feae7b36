"""SignedStore: the store a pair's group rendezvouses through, with every value signed and checked.

The cluster's TCPStore (deploy/launch.py ``KVStore``) cannot authenticate its clients: any process that
reaches its port may list, read, write and delete keys. A pair's group (transfer/pairs.py) therefore
sees the store through a `SignedStore`: every value set through it (gloo's addresses, NCCL's unique id:
all a rendezvous writes and reads with set/get) is stored as ``MAGIC | tag | value`` where ``tag`` is
BLAKE2b-128 keyed with `rendezvous_key(secret)` over the FULL key (the pair's prefix: both ends'
worker ids and incarnations, and the generation) and the value. A get returns only a value whose tag
verifies for that very key: a stranger's value, a value copied from another pair or generation, or one
over `MAX_VALUE_BYTES` is counted (``rejected``), logged at a bounded rate and ignored, and the get
keeps polling for a value that verifies until the store's timeout.

What stays exposed (a store without client authentication): a stranger can still read every value
(worker names, gloo addresses: nothing secret), delete or overwrite a key after its rightful write (that
rendezvous then times out and the pair is rebuilt at its next generation: a denial of service, never a
pair steered to the stranger), and fill the store server's memory (torch's store has no cap; KVStore's
docstring). ``add`` / ``compare_set`` counters (unused by gloo's and NCCL's pair rendezvous) pass through
unsigned. A get reads a value whole before it can refuse it (the store has no size query).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import threading
import time
from collections import Counter
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

MAGIC = b"PDR1"
TAG_BYTES = 16
# NOTE: gloo writes ~170 B per rank (its address), NCCL a 128 B unique id; nothing bigger is pdserve's
MAX_VALUE_BYTES = 64 << 10
POLL_S = 0.01
REASON_BAD_TAG = "rendezvous_bad_tag"
REASON_TOO_LARGE = "rendezvous_too_large"


def rendezvous_key(secret: bytes) -> bytes:
    """The key rendezvous values are signed with (derived: never the cluster secret itself)."""
    return hashlib.blake2b(b"pdserve-rendezvous-v1", key=secret, digest_size=32).digest()


def _tag(key: bytes, name: str, value: bytes) -> bytes:
    encoded = name.encode()
    data = len(encoded).to_bytes(4, "little") + encoded + value
    return hashlib.blake2b(data, key=key, digest_size=TAG_BYTES).digest()


def sign_value(key: bytes, name: str, value: bytes) -> bytes:
    return MAGIC + _tag(key, name, value) + value


def open_value(key: bytes, name: str, stored: bytes) -> bytes | None:
    """The value of a stored ``MAGIC | tag | value`` if its tag verifies for `name`, else None."""
    head = len(MAGIC) + TAG_BYTES
    if len(stored) < head or not stored.startswith(MAGIC):
        return None
    value = stored[head:]
    return value if hmac.compare_digest(stored[len(MAGIC) : head], _tag(key, name, value)) else None


class RejectCounter:
    """Rendezvous values refused, by reason; thread-safe (pair builds run on their own threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: str, name: str) -> None:
        with self._lock:
            self._counts[reason] += 1
            total = sum(self._counts.values())
        if total <= 10 or total % 1000 == 0:  # NOTE: a flood of forgeries must not flood the log
            logger.warning("ignored rendezvous value #%d for %r: %s", total, name, reason)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class SignedStore(dist.Store):
    """A `dist.Store` over `inner` that signs what it sets and returns only what verifies (see the module
    docstring). ``timeout_s`` bounds a get that keeps finding values that do not verify.

    NOTE: torch calls it from C++ through a trampoline that looks the Python object up on every call: keep
    a reference for as long as a group may use it (PairChannel keeps it with the pair).
    """

    def __init__(self, inner: Any, key: bytes, timeout_s: float, rejected: RejectCounter) -> None:
        super().__init__()
        self._inner = inner
        self._key = key
        self._timeout_s = timeout_s
        self._rejected = rejected
        self._clones: list[SignedStore] = []  # NOTE: see the class docstring

    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, sign_value(self._key, key, raw))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:
            stored = self._inner.get(key)  # NOTE: waits (the store's timeout) until the key exists
            if len(stored) > MAX_VALUE_BYTES + len(MAGIC) + TAG_BYTES:
                self._rejected.add(REASON_TOO_LARGE, key)
            else:
                value = open_value(self._key, key, stored)
                if value is not None:
                    return value
                self._rejected.add(REASON_BAD_TAG, key)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no rendezvous value for {key!r} verified within {self._timeout_s:.1f}s")
            # NOTE: a bounded poll: the rightful end overwrites a stranger's early value when it sets its own
            time.sleep(POLL_S)

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self._inner.compare_set(key, expected, desired))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def clone(self) -> SignedStore:
        clone = SignedStore(self._inner.clone(), self._key, self._timeout_s, self._rejected)
        self._clones.append(clone)
        return clone
