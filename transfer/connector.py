"""KVSender (prefill side) and KVReceiver (decode side): gather -> chunked staging -> channel -> scatter.

Each side runs ONE transfer thread that owns its ZMQ sockets and does one transfer at a time, so between
a given pair the handshake strictly orders the channel ops (frames: transfer/protocol.py). Within a
transfer the bytes move in chunks, pipelined: the sender gathers and checksums chunk i+1 while chunk i is
on the wire, the receiver verifies and scatters chunk i while chunk i+1 arrives (transfer/staging.py).
Every wait is bounded by `timeout_s` (and on the receiver by the request's deadline); a side that fails
sends an `abort` frame so its peer fails at once instead of waiting out its own timeout.

Peers are worker processes (worker id + incarnation), not ranks: each prefill/decode pair moves its bytes
over its own two-rank group, built on first use (transfer/pairs.py), and every handshake frame is signed
and checked (transfer/handshake.py). `drop_peer(worker_id, incarnation)` (either side, any thread) marks a
peer dead: the transfer in flight with it fails within one poll interval, queued work for it is dropped,
and it is never waited on again, so one dead peer does not stall the transfers of every other peer queued
behind it.

Block ownership: the sender never frees anything; see KVSender for `on_sent`.
"""

from __future__ import annotations

from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.side import DEFAULT_CHUNK_BYTES

__all__ = ["DEFAULT_CHUNK_BYTES", "KVReceiver", "KVSender"]
