"""PrefixPulls: a worker's half of pulling a prefix another worker holds (issue 44 item 3).

The router (cluster/router/pulls.py) pairs a holder (a prefill or decode worker whose device cache holds
more of a prompt's prefix) with a puller (the prefill worker it picked) before sending the prompt:

- holder, ``OfferPrefix``: its longest cached device prefix of the tokens is held (one more user of each
  block, under a pseudo block table named by the pull id: ``KVCacheManager.hold_prefix``) and offered to
  this worker's pull sender, under a lease bounded by the op's deadline. The hold ends when the sender
  is done (``on_sent``: sent, failed, or the lease expired, e.g. a puller that died) or on an Abort of
  the pull id that withdraws an offer not being fetched. Host-tier blocks are not offered.
- puller, ``FetchPrefix``: blocks are reserved for the offered blocks this cache lacks
  (``reserve_prefix``: fresh blocks for the transfer to write, nothing offloaded for them), fetched over
  the pull receiver (the usual transfer: its MAC, leases, bounded waits), then cached under their hashes
  with no user (``commit_prefix``), or freed on failure (a holder that died mid-pull: the fetch fails at
  once when its peer is dropped, else at the transfer's timeout or the deadline). The router then sends
  the prompt here, which finds those blocks as a prefix hit (or recomputes them).

Each side has its own channel (a pull pair is (holder as the sending rank, puller as the receiving
rank): not a handoff pair's key, and a channel holds one link per side of this worker). Everything here
runs on the step thread except the transfer callbacks, which only ``post``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from cluster.wire import FetchPrefix, OfferPrefix, PeerDead, PrefixFetched, PrefixOffered
from transfer.connector import KVReceiver, KVSender
from transfer.pairs import PairChannel
from transfer.protocol import KVHandoff, TransferError, TransferResult
from workers.mock_runner import paced_link
from workers.role import WorkerContext


@dataclass(frozen=True)
class HoldDone:
    """The pull sender is done with a hold (sent, failed, or its lease ran out)."""

    pull_id: str


@dataclass(frozen=True)
class PullDone:
    """The pull receiver finished a fetch (the future holds the result or the TransferError)."""

    pull_id: str
    future: Future[TransferResult]


class PrefixPulls:
    """See the module docstring. ``can_pull``: this worker fetches prefixes too (a prefill worker)."""

    def __init__(self, context: WorkerContext, can_pull: bool) -> None:
        self.ctx = context
        self.can_pull = can_pull
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._channels: list[PairChannel] = []
        self._holds: set[str] = set()  # pull ids held here (step thread)
        self._fetches: dict[str, int] = {}  # pull id -> blocks being fetched
        self.num_pulled_blocks = 0
        self.num_pulled_bytes = 0
        self.num_pull_failures = 0

    def start(self) -> None:
        ctx, cfg = self.ctx, self.ctx.transfer_config
        runner = ctx.engine.runner
        kv = runner.kv_relay or runner.kv_cache  # NOTE: at TP > 1 every rank's heads
        link = paced_link(runner.model, runner.kv_cache, ctx.bind_host)
        channel = ctx.channel()
        if channel is None:
            return
        self._channels.append(channel)
        self.sender = KVSender(
            kv,
            me=ctx.me,
            channel=channel,
            secret=ctx.secret,
            on_sent=lambda pull_id, ok: ctx.post(HoldDone(pull_id)),
            endpoint=f"tcp://{ctx.bind_host}:*",
            timeout_s=cfg.timeout_s,
            lease_s=cfg.lease_s,
            integrity=cfg.integrity,
            link=link,
        )
        self.sender.start()
        if not self.can_pull:
            return
        channel = ctx.channel()
        if channel is None:  # NOTE: cannot be: this worker moves KV (its sender has a channel)
            raise RuntimeError(f"{ctx.worker_id}: no KV channel for the pull receiver")
        self._channels.append(channel)
        self.receiver = KVReceiver(
            kv,
            me=ctx.me,
            channel=channel,
            secret=ctx.secret,
            timeout_s=cfg.timeout_s,
            integrity=cfg.integrity,
            link=link,
        )
        self.receiver.start()

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint if self.sender is not None else ""

    # ---- holder -----------------------------------------------------------------------------------------
    def on_offer(self, op: OfferPrefix) -> None:
        ctx, kv = self.ctx, self.ctx.engine.scheduler.kv
        # NOTE: an id in use is refused (the router's are random)
        if self.sender is None or op.pull_id in kv.block_tables:
            ctx.send(PrefixOffered(ctx.worker_id, op.pull_id, 0, error="no pull sender or an id in use"))
            return
        block_ids = kv.hold_prefix(op.pull_id, op.token_ids)
        if not block_ids:
            ctx.send(PrefixOffered(ctx.worker_id, op.pull_id, 0, error="no cached prefix"))
            return
        self._holds.add(op.pull_id)
        lease_s = min(ctx.transfer_config.lease_s, max(0.1, op.deadline - time.time()))
        handoff = self.sender.offer(
            op.pull_id, block_ids, num_tokens=len(block_ids) * kv.block_size, lease_s=lease_s
        )
        ctx.send(PrefixOffered(ctx.worker_id, op.pull_id, len(block_ids), handoff.to_bytes()))

    def _release(self, pull_id: str) -> None:
        if pull_id in self._holds:
            self._holds.discard(pull_id)
            self.ctx.engine.scheduler.kv.free(pull_id)

    # ---- puller -----------------------------------------------------------------------------------------
    def on_fetch(self, op: FetchPrefix) -> None:
        ctx, kv = self.ctx, self.ctx.engine.scheduler.kv
        if self.receiver is None or op.pull_id in kv.block_tables:
            self._answer(op.pull_id, 0, 0, "no pull receiver or an id in use")
            return
        try:
            handoff = KVHandoff.from_bytes(op.handoff)
        except (TransferError, ValueError, TypeError) as e:
            self._answer(op.pull_id, 0, 0, f"bad KV handoff: {e}")
            return
        reserved = kv.reserve_prefix(op.pull_id, op.token_ids, handoff.num_blocks)
        if reserved is None:
            self._answer(op.pull_id, 0, 0, "nothing missing here, or blocks short")
            return
        block_ids, num_held = reserved
        try:
            future = self.receiver.submit(handoff, block_ids[num_held:], num_held, deadline=op.deadline)
        except (TransferError, ValueError) as e:
            kv.free(op.pull_id)
            self._answer(op.pull_id, 0, 0, f"{type(e).__name__}: {e}")
            return
        self._fetches[op.pull_id] = len(block_ids) - num_held
        future.add_done_callback(lambda f: ctx.post(PullDone(op.pull_id, f)))

    def _on_fetched(self, cmd: PullDone) -> None:
        kv, pull_id = self.ctx.engine.scheduler.kv, cmd.pull_id
        num_blocks = self._fetches.pop(pull_id)
        try:
            result = cmd.future.result()
        except TransferError as e:
            kv.free(pull_id)  # NOTE: the transfer is over: nothing writes the fresh blocks any more
            self._answer(pull_id, 0, 0, f"{type(e).__name__}: {e}")
            return
        kv.commit_prefix(pull_id)  # NOTE: even if aborted meanwhile: its bytes landed whole
        self.num_pulled_blocks += num_blocks
        self.num_pulled_bytes += result.nbytes
        self._answer(pull_id, num_blocks, result.nbytes, "")

    def _answer(self, pull_id: str, num_blocks: int, nbytes: int, error: str) -> None:
        if error:
            self.num_pull_failures += 1
        self.ctx.send(PrefixFetched(self.ctx.worker_id, pull_id, num_blocks, nbytes, error))

    # ---- the step thread's commands ---------------------------------------------------------------------
    def handle(self, cmd: object) -> bool:
        """Take ``cmd`` if it is a pull's; False otherwise."""
        match cmd:
            case OfferPrefix():
                self.on_offer(cmd)
            case FetchPrefix():
                self.on_fetch(cmd)
            case HoldDone(pull_id=pull_id):
                self._release(pull_id)
            case PullDone():
                self._on_fetched(cmd)
            case _:
                return False
        return True

    def on_abort(self, pull_id: str) -> bool:
        """Let go of a pull (True: it was one of this worker's): a hold not being sent is withdrawn
        now (one in flight ends with its ``on_sent``), a fetch is cancelled (its blocks freed when it
        ends)."""
        if pull_id in self._holds:
            if self.sender is not None and self.sender.abort(pull_id):
                self._release(pull_id)
            return True
        if pull_id in self._fetches:
            if self.receiver is not None:
                self.receiver.cancel(pull_id)
            return True
        return False

    def on_peer_dead(self, op: PeerDead) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.drop_peer(op.worker_id, op.incarnation or None)

    # ---- observability ----------------------------------------------------------------------------------
    def threads(self) -> list[threading.Thread]:
        return [side.thread for side in (self.sender, self.receiver) if side is not None]

    def rejected_frames(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for side in (self.sender, self.receiver):
            if side is not None:
                for reason, n in side.rejected_frames().items():
                    counts[reason] = counts.get(reason, 0) + n
        return counts

    def check_leaks(self) -> None:
        sender = self.sender
        held = sender.num_held() + sender.num_parked() if sender is not None else 0
        if self._holds or self._fetches or held:
            raise AssertionError(
                f"prefix pulls left: holds {sorted(self._holds)}, fetches {sorted(self._fetches)}, "
                f"{held} offers or parked requests in the pull sender"
            )

    def close(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        for channel in self._channels:
            channel.close()
