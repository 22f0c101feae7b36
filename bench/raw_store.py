"""The torch.distributed TCPStore the transfer benchmarks host for their raw two-rank groups (the wire
alone, ``transfer.pairs.build_group`` given its address) and for what their processes pass each other.

A benchmark's own: a cluster hosts no store (each KV-transfer pair rendezvous over its own signed
handshake link, transfer/rendezvous.py). torch's store cannot authenticate its clients, so this one is
bound to ``host`` only and lives only as long as the benchmark.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any


class RawStore:
    """A TCPStore server listening on ``host`` only, at a free port (``address``); ``close`` drops it.

    NOTE: given no socket, torch's store server listens on every interface, so it gets one already bound
    and listening (``master_listen_fd``, which the store owns and closes).
    """

    def __init__(self, host: str) -> None:
        import torch.distributed as dist

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(1024)
            self.address: tuple[str, int] = (host, int(listener.getsockname()[1]))
            self._store: Any = dist.TCPStore(
                host,
                self.address[1],
                None,
                True,
                datetime.timedelta(seconds=60),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # NOTE: the store owns the descriptor now

    def close(self) -> None:
        self._store = None
