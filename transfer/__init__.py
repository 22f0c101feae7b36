"""KV movement between workers: handoff/header messages, channels (torch.distributed, CUDA IPC), and the
sender/receiver connector that gathers blocks into staging, moves them, verifies and scatters."""

from transfer.protocol import (
    KVHandoff,
    KVLayout,
    TransferChecksumError,
    TransferError,
    TransferHeader,
    TransferMismatchError,
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
    "TransferPeerLostError",
    "TransferRejectedError",
    "TransferTimeoutError",
]
