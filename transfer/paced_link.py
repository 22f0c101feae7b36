"""PacedLink: a mock engine's KV handoffs at the speed of the link its cost profile names.

A mock cluster (``load_format: mock``) rehearses GPU workers on a CPU host; moving every byte of the
model's KV over this host's loopback (gloo, ~1 GB/s) makes a handoff take the host's time, not the GPU
link's (an 8B model's 2,048-token prompt: 256 MiB, ~0.3 s here against ~1.6 ms over NVLink). A paced
handoff instead:

1. moves the first `sample_bytes` (8: one word) of each block's K and of its V, in every layer, over the
   real transfer path: the same handshake, pair, chunks, MAC or digest and scatter. That word is the
   signature the mock's forward wrote for the block's first slot (``workers/mock_runner.kv_signature``:
   its token, position, layer, K or V), so the decode side's blocks can be checked against the rule,
   and a corrupt chunk is still refused;
2. then the receiver waits until the handoff has taken what the link predicts for the whole KV of those
   blocks (``TransferCost.transfer_s``), counted from the sender's header: the node's link (NVLink)
   between two workers of one node, the NIC between nodes. Where the real part alone took longer, nothing
   is waited (the handoff took its real time: ``TransferResult.paced_seconds`` 0 and ``seconds`` >
   ``link_seconds``).

NOTE: why one word of each block's K and V (1/4,096 of a Llama-3-8B block), not the signature of every
slot (every byte the mock writes; 1/256): those are one word in every 2 KiB row, so gathering them touches
a cache line of every row and half of the pages of the cache's blocks: measured in a 1P+1D mock cluster on
the 2-core box, a 2,048-token handoff spent 5-8 ms gathering them and 3-6 ms scattering (13-20 ms in all
against the link's 1.7 ms). Two words a block row touch two lines of it.

One node or two: the sender's handshake endpoint (``KVHandoff.src_endpoint``) against the address this
worker binds (``WorkerContext.bind_host``): a worker binds its node's own address (loopback when the
whole cluster is one host), so the same address is the same node.

Both ends must agree: the header carries `sample_bytes` and a receiver refuses a header whose part of a
block is not its own (a paced sender and a whole-block receiver never mix).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from urllib.parse import urlsplit

from cluster.cost_model import TransferCost
from transfer.protocol import KVLayout, half_row_bytes

SIGNATURE_BYTES = 8  # of each block's K and V: the word a mock forward writes first (workers/mock_runner.py)


def sample_bytes_of(layout: KVLayout, sample_bytes: int) -> int:
    """What a paced copy of `layout` moves of each block's K and V in a layer: `sample_bytes`, or 0 (all
    of it) where a block's K is no longer than that or not whole words."""
    half = half_row_bytes(layout)
    return sample_bytes if sample_bytes < half and half % 8 == 0 else 0


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint (ValueError when it is not one)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname:
        raise ValueError(f"expected a tcp://HOST:PORT endpoint, got {endpoint!r}")
    return parts.hostname


@dataclass(frozen=True)
class PacedLink:
    """How one worker's KV handoffs move when its engine is a mock with a cost profile (see the module
    docstring). `cost`: the profile's handoff cost (latency, the node's link, the NIC); `host`: the
    address this worker binds; `sample_bytes`: the part of each block's K and of its V that really moves."""

    cost: TransferCost
    host: str
    sample_bytes: int = SIGNATURE_BYTES

    def __post_init__(self) -> None:
        if self.sample_bytes < 1 or self.sample_bytes % 8:
            raise ValueError(
                f"PacedLink.sample_bytes must be a positive multiple of 8, got {self.sample_bytes}"
            )

    def sample_bytes_for(self, layout: KVLayout) -> int:
        """What a handoff of `layout` moves of each block's K and V in a layer: `sample_bytes`, or 0 (all
        of it) where a block's K is no longer than that or not whole words."""
        return sample_bytes_of(layout, self.sample_bytes)

    def fraction(self, layout: KVLayout) -> Fraction:
        """The fraction of every block's bytes that moves."""
        sample = self.sample_bytes_for(layout)
        return Fraction(sample, half_row_bytes(layout)) if sample else Fraction(1)

    def is_between_nodes(self, src_endpoint: str) -> bool:
        """Whether the sender at `src_endpoint` is on another node than this worker."""
        return endpoint_host(src_endpoint) != self.host

    def link_s(self, link_nbytes: int, between_nodes: bool) -> float:
        """What the link predicts for a handoff of `link_nbytes` (the blocks' whole KV)."""
        return self.cost.transfer_s(link_nbytes, between_nodes)

    def describe(self, layout: KVLayout) -> str:
        """One line for the worker's log: the fraction moved and the link's figures."""
        fraction, sample = self.fraction(layout), self.sample_bytes_for(layout)
        part = (
            f"{sample} B of each block's K and V per layer ({fraction} of every block, "
            f"{2 * sample} of {2 * half_row_bytes(layout)} B)"
            if sample
            else "every byte (a block's K is no longer than the sample)"
        )
        nic = self.cost.nic_bytes_per_s or self.cost.bytes_per_s
        return (
            f"KV handoffs move {part} over the real transfer path and wait out the rest of the link's "
            f"time: {self.cost.latency_s * 1e3:g} ms + bytes at {self.cost.bytes_per_s / 1e9:g} GB/s inside "
            f"a node, {nic / 1e9:g} GB/s between nodes (a peer at another address than {self.host})"
        )
