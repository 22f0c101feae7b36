"""KV movement between workers: handoff/header messages, signed handshake frames, channels (a
torch.distributed group per prefill/decode pair, CUDA IPC), and the sender/receiver connector that
gathers blocks into staging, moves them, verifies and scatters."""

from transfer.protocol import (
    KVHandoff,
    KVLayout,
    TransferChecksumError,
    TransferError,
    TransferHeader,
    TransferMismatchError,
    TransferPairError,
    TransferPeerLostError,
    TransferRejectedError,
    TransferTimeoutError,
)

__all__ = [
    "KVHandoff",
    "KVLayout",
    "TransferChecksumError",
    "TransferError",
    "TransferHeader",
    "TransferMismatchError",
    "TransferPairError",
    "TransferPeerLostError",
    "TransferRejectedError",
    "TransferTimeoutError",
]
