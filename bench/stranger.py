"""A stranger on the cluster network (issue 31 "Safe to expose", issue 41 item 4), on the two-host lab
(bench/netns_lab.py):

    python -m bench.stranger          # root (network namespaces); prints figures, not a pass/fail test
    python -m bench.stranger --rendezvous-only    # part 1 only

Starts the lab and a cluster on it (prefill on host A with the router, decode on host B, the bundled tiny
model, CPU), runs a first wave of 8 greedy requests, then acts from processes started in host B's
namespace that hold no cluster secret:

1. rendezvous, twice: decode-N is killed and a fresh decode-(N+1) added, so the next wave builds a new
   pair; meanwhile the stranger attacks that pair's rendezvous everywhere it can reach, and the wave's 8
   requests are timed (a rendezvous it could stall would fail them at the transfer timeout, 20 s here,
   while the pair's build waits out its group timeout, 80 s). The cluster hosts no torch.distributed
   store any more (the TCPStore attacks of bench/results/stranger-2026-11-29.md, ``pre`` and ``late``,
   have nothing to aim at), so what is left is the link: every 20 ms the stranger sends forged
   ``rendezvous`` handshake frames (signed with a secret of its own) for every key of the new pair's
   first generations to the prefill worker's KV handshake socket, the one socket of the pair's link it
   can reach (the decode side only connects out).
2. frame: pushes one 400 MiB frame to the router's PULL socket while the router's process (this one)
   samples its VmRSS.
3. chunk: a live gloo connection cannot be injected into from here, so a KV sender in host B (it holds a
   secret of its own for the handshake, as the rightful peer would) replaces chunk 0 with a forgery sealed
   with a correct XXH3 digest before gloo carries it to a receiver on host A (the nonce, which travels in
   the clear, handed over by fixing it); once under integrity ``mac``, once under ``digest`` (a control).

Then what each wave did (transfers landed, latencies), the stranger's counts against the prefill worker's
refusals (``rendezvous_bad_tag``), the leak check and whether every wave's outputs equal the first's.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

FORGED = b"198.18.255.9:1 a stranger's gloo address"
BIG_FRAME_BYTES = 400 << 20
NONCE = 0x5EED_0F_A11
SHAPE = (2, 16, 2, 4, 2, 8)  # a small KV cache: [L, blocks, 2, block_size, heads, dim] float32
ROW_BYTES = 2 * 4 * 2 * 8 * 4
# NOTE: what a pair's group sets: gloo each rank's address ("0/0", "0/1"), NCCL the unique id ("0:1");
# generations 0-2 of each new pair
LINK_KEYS = ("0/0", "0/1", "0:1")
GENERATIONS = (0, 1, 2)
FRAME_EVERY_S = 0.02


class Stranger:
    """In host B, no secret: attacks the pairs named by the driver's last command (see the module
    docstring) until told otherwise; counts what it did."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        from cluster.frames import FrameSigner, new_secret

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(endpoint)
        self.signer = FrameSigner(new_secret())
        self.lock = threading.Lock()
        self.mode: str | None = None
        self.pairs: list[tuple[str, str]] = []
        self.counts: Counter[str] = Counter()
        self._next_frames = 0.0

    def command(self, line: str) -> dict[str, Any]:
        """Take one command; returns the JSON line that answers it."""
        cmd = json.loads(line)
        if "report" in cmd:
            with self.lock:
                counts, self.counts = dict(self.counts), Counter()
            return counts
        with self.lock:
            self.mode, self.pairs = cmd["mode"], [(str(p), str(d)) for p, d in cmd.get("pairs", [])]
        if self.mode is not None:
            self.turn(force_frames=True)  # NOTE: armed before the driver goes on
        return {"armed": self.mode}

    def turn(self, force_frames: bool = False) -> None:
        with self.lock:
            mode, pairs = self.mode, list(self.pairs)
        if mode is None:
            return
        if force_frames or time.monotonic() >= self._next_frames:
            self._next_frames = time.monotonic() + FRAME_EVERY_S
            self._frames_turn(pairs)

    def _frames_turn(self, pairs: list[tuple[str, str]]) -> None:
        for prefill, decode in pairs:
            for gen in GENERATIONS:
                for name in LINK_KEYS:
                    body = {"nonce": 0, "prefill": prefill, "decode": decode, "generation": gen, "key": name,
                            "value": FORGED}  # fmt: skip
                    self.sock.send(self.signer.sign(prefill, "rendezvous", body))
                    self._count("forged_rendezvous_frames")

    def _count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1


def stranger_rendezvous(endpoint: str) -> None:
    """In host B, no secret: one JSON command a line on stdin, one JSON answer a line on stdout."""
    stranger = Stranger(endpoint)
    lines: list[str] = []
    cond = threading.Condition()

    def read() -> None:
        for line in sys.stdin:
            with cond:
                lines.append(line)
                cond.notify()
        with cond:
            lines.append("")  # NOTE: EOF: stop
            cond.notify()

    threading.Thread(target=read, daemon=True).start()
    while True:
        with cond:
            cond.wait_for(lambda: bool(lines), 0.001)  # NOTE: a command is taken within a millisecond
            line = lines.pop(0) if lines else None
        if line == "":
            break
        if line is not None:
            print(json.dumps(stranger.command(line)), flush=True)
        stranger.turn()
    stranger.ctx.destroy(linger=2000)


def stranger_push(endpoint: str) -> None:
    """In host B: one 400 MiB frame; prints whether the receiver dropped the connection within 30 s."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)  # NOTE: one connection: its drop is the answer
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    start = time.monotonic()
    sock.send(b"x" * BIG_FRAME_BYTES)
    while time.monotonic() < start + 30:
        if monitor.poll(100) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            print(
                json.dumps({"answer": "dropped", "after_s": round(time.monotonic() - start, 3)}), flush=True
            )
            break
    else:
        print(json.dumps({"answer": "kept"}), flush=True)
    ctx.destroy(linger=0)


def forge_send(bind: str, integrity: str) -> None:
    """In host B: offer blocks 3..5, print the handoff, forge chunk 0 on its way into gloo."""
    import torch

    from transfer.channel import OpLane, PendingOp, _as_bytes
    from transfer.pairs import PairChannel
    from transfer.peers import PairKey, PeerId
    from transfer.protocol import chunk_tag, tag_for_nonce
    from transfer.sender import KVSender
    from transfer.staging import TRAILER_BYTES, chunk_digest, write_trailer

    class ForgingChannel(PairChannel):
        def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
            if tag == chunk_tag(tag_for_nonce(NONCE), 0):
                wire = _as_bytes(buf)
                wire[:-TRAILER_BYTES] = 0x42
                write_trailer(wire, chunk_digest(wire, NONCE, 0))
            return super().isend(buf, key, tag, lane)

    done = threading.Event()
    sender = KVSender(torch.randn(*SHAPE), me=PeerId("forger-b", "0"), channel=ForgingChannel(bind),
                      secret=bytes.fromhex(os.environ["FORGE_SECRET"]), on_sent=lambda r, ok: done.set(),
                      endpoint=f"tcp://{bind}:*", chunk_bytes=2 * ROW_BYTES, integrity=integrity, timeout_s=10)  # fmt: skip
    sender.start()
    print(sender.offer("r", [3, 4, 5], num_tokens=12).to_bytes().hex(), flush=True)
    done.wait(60)
    sender.close()


def forge_receive(bind: str, integrity: str, handoff_hex: str) -> None:
    """In host A: fetch the handoff into blocks 7..9 with the nonce fixed; print what landed."""
    import secrets

    import torch

    from transfer.pairs import PairChannel
    from transfer.peers import PeerId
    from transfer.protocol import KVHandoff
    from transfer.receiver import KVReceiver

    secrets.randbits = lambda k: NONCE  # NOTE: this process only: the nonce the stranger saw in the clear
    dst = torch.zeros(*SHAPE)
    receiver = KVReceiver(dst, me=PeerId("receiver-a", "0"), channel=PairChannel(bind),
                          secret=bytes.fromhex(os.environ["FORGE_SECRET"]), integrity=integrity, timeout_s=10)  # fmt: skip
    receiver.start()
    error = receiver.submit(KVHandoff.from_bytes(bytes.fromhex(handoff_hex)), [7, 8, 9]).exception(30)
    stats = receiver.stats()
    landed = bool((dst[0, 7].view(torch.uint8) == 0x42).all())
    print(json.dumps({"integrity": integrity, "error": f"{type(error).__name__}: {error}" if error else None,
                      "num_rejected_chunks": stats.num_rejected_chunks, "num_ok": stats.num_ok,
                      "dst_untouched": bool(torch.equal(dst, torch.zeros(*SHAPE))), "forgery_landed": landed}))  # fmt: skip
    receiver.close()


def _in_b(lab: Any, *args: str, **kw: Any) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", lab.ns, sys.executable, "-m", "bench.stranger", *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **kw.pop("env", {})}, **kw
    )


def _last_json(out: str, err: str) -> dict[str, Any]:
    lines = out.strip().splitlines()
    if not lines:
        raise RuntimeError(f"a stranger's process printed nothing:\n{err[-3000:]}")
    return dict(json.loads(lines[-1]))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def part_frame(lab: Any, endpoint: str) -> dict[str, Any]:
    """The router's process (this one) samples its VmRSS every 10 ms while a stranger in B pushes the frame."""
    samples, stop = [_rss()], threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            samples.append(_rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, _ = _in_b(lab, "push", endpoint).communicate(timeout=120)
    stop.set()
    sampler.join()
    mib = 1 << 20
    return {"answer": _last_json(out, ""), "rss_before_mib": round(samples[0] / mib, 1),
            "rss_peak_mib": round(max(samples) / mib, 1), "rss_after_mib": round(samples[-1] / mib, 1)}  # fmt: skip


def part_chunk(lab: Any, integrity: str) -> dict[str, Any]:
    from cluster.frames import new_secret

    env = {"FORGE_SECRET": new_secret().hex()}
    sender = _in_b(lab, "forge-send", lab.ip_b, integrity, env=env)
    try:
        handoff = (sender.stdout.readline() if sender.stdout else "").strip()
        cmd = [sys.executable, "-m", "bench.stranger", "forge-receive", lab.ip_a, integrity, handoff]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        sender.wait(timeout=90)
        return _last_json(done.stdout, done.stderr)
    finally:
        sender.kill()


class Driver:
    """The router's process talking to the stranger's (one command a line, one answer a line)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the stranger's process ended")
        return dict(json.loads(line))


async def timed_wave(handle: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[Any, float]]:
    """Each request's outputs (or its error) and its seconds, all sent at once."""
    from cluster.protocol import RouterError
    from tests.support.cluster_utils import collect
    from tests.support.two_host_driver import greedy

    async def one(i: int) -> tuple[Any, float]:
        t0 = time.monotonic()
        try:
            out: Any = await collect(handle, prompts[i], greedy(max_tokens[i]), f"r{i}-{time.monotonic_ns()}")
        except RouterError as e:
            out = {"error": type(e).__name__, "message": str(e)}
        return out, time.monotonic() - t0

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _peer(handle: Any, worker_id: str) -> tuple[str, str]:
    """(its peer name, its KV endpoint) of a live worker in the router's eyes."""
    [ref] = [w for w in handle.router.workers if w.worker_id == worker_id and w.state != "dead"]
    return f"{ref.worker_id}/{ref.info.incarnation}", ref.info.kv_endpoint


def _fresh_stats(handle: Any) -> list[Any]:
    """Every live worker's stats, from a heartbeat sent after this call (bounded)."""
    from tests.support.cluster_utils import wait_for

    since = time.monotonic()
    live = [w for w in handle.router.workers if w.state != "dead"]
    wait_for(lambda: all(w.last_beat > since for w in live), 10, "fresh heartbeats")
    return list(handle.worker_stats())


def _decode_stats(handle: Any, worker_id: str) -> Any:
    return next(s for s in _fresh_stats(handle) if s.worker_id == worker_id)


def _wave_line(name: str, timed: list[tuple[Any, float]], stats: Any, first: list[Any]) -> str:
    seconds = [s for _, s in timed]
    outputs = [o for o, _ in timed]
    errors = [o for o in outputs if not isinstance(o, list)]
    return (f"{name}: {len(outputs) - len(errors)}/{len(outputs)} ok, outputs equal to wave 1: "
            f"{outputs == first}; seconds per request: max {max(seconds):.2f}, median "
            f"{statistics.median(seconds):.2f}; {stats.worker_id}: transfers_ok={stats.transfer.num_ok} "
            f"failed={stats.transfer.num_failed} broken={stats.broken_peers} "
            f"rejected_frames={stats.rejected_frames}; errors: {errors}")  # fmt: skip


def run_bench(lab: Any, rendezvous_only: bool = False) -> None:
    import ray

    from deploy.launch import build_cluster
    from tests.support.cluster_utils import shared_prefix_prompts, wait_for
    from tests.support.two_host_driver import lab_config

    prompts = shared_prefix_prompts(8, seed=31, vocab=1229)
    max_tokens = [8 + i % 3 * 4 for i in range(len(prompts))]
    ray.init(address=lab.address, _node_ip_address=lab.ip_a, log_to_driver=False)
    handle = build_cluster(lab_config({}))
    watcher: subprocess.Popen[str] | None = None
    try:
        first_timed = asyncio.run(timed_wave(handle, prompts, max_tokens))
        first = [o for o, _ in first_timed]
        print(_wave_line("wave 1", first_timed, _decode_stats(handle, "decode-0"), first), flush=True)
        prefill, endpoint = _peer(handle, "prefill-0")
        print(f"the stranger: the cluster hosts no TCPStore (the pairs rendezvous over their signed links); "
              f"prefill-0's KV handshake socket {endpoint}", flush=True)  # fmt: skip
        watcher = _in_b(lab, "rendezvous", endpoint, stdin=subprocess.PIPE)
        stranger = Driver(watcher)
        totals: Counter[str] = Counter()
        old = "decode-0"
        for n in (1, 2):
            handle.kill_worker(old)
            wait_for(lambda: any(w.worker_id == old and w.state == "dead"  # noqa: B023
                                 for w in handle.router.workers), 30, "the decode worker dead")  # fmt: skip
            [new] = handle.scale("decode", 1)
            decode, _ = _peer(handle, new)
            print(f"decode pool after the kill: [{decode}]", flush=True)
            stranger.ask(mode="frames", pairs=[[prefill, decode]])
            timed = asyncio.run(timed_wave(handle, prompts, max_tokens))
            stranger.ask(mode=None)
            counts = stranger.ask(report=True)
            totals.update(counts)
            print(f"stranger (frames, pair {prefill} | {decode}): {json.dumps(counts)}", flush=True)
            print(_wave_line(f"wave {n + 1}", timed, _decode_stats(handle, new), first), flush=True)
            old = new
        if not rendezvous_only:
            print("frame:", json.dumps(part_frame(lab, handle.router.endpoint)), flush=True)
            print("router rejected frames after the push:", handle.router.rejected_frames(), flush=True)
            for integrity in ("mac", "digest"):
                print(f"chunk ({integrity}):", json.dumps(part_chunk(lab, integrity)), flush=True)
        handle.wait_until_quiet(timeout_s=60)
        stats = _fresh_stats(handle)
        print("leaks:", handle.check_leaks())
        for s in stats:
            print(f"{s.worker_id}: rejected_frames={s.rejected_frames} num_rejected_chunks="
                  f"{s.transfer.num_rejected_chunks} transfers_ok={s.transfer.num_ok} broken={s.broken_peers}")  # fmt: skip
        [pre] = [s for s in stats if s.worker_id == "prefill-0"]
        print(f"forged rendezvous frames sent: {totals['forged_rendezvous_frames']}; prefill-0 counted "
              f"rendezvous_bad_tag={pre.rejected_frames.get('rendezvous_bad_tag', 0)} "
              f"bad_mac={pre.rejected_frames.get('bad_mac', 0)}", flush=True)  # fmt: skip
        print("router rejected frames:", handle.router.rejected_frames(), flush=True)
    finally:
        if watcher is not None:
            watcher.kill()
        handle.shutdown()
        ray.shutdown()


def main(argv: list[str]) -> int:
    roles: dict[str, Any] = {"rendezvous": stranger_rendezvous, "push": stranger_push,
             "forge-send": forge_send, "forge-receive": forge_receive}  # fmt: skip
    if argv and argv[0] in roles:
        roles[argv[0]](*argv[1:])
        return 0
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m bench.stranger",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rendezvous-only", action="store_true", help="part 1 only (the rendezvous waves)")
    args = ap.parse_args(argv)
    from bench.netns_lab import two_host_lab

    os.environ["RAY_AUTH_MODE"] = "token"  # NOTE: the lab's Ray runs token auth; Ray reads it at import
    with two_host_lab() as lab:
        print(f"lab: host A {lab.ip_a}, host B {lab.ip_b} (netns {lab.ns})", flush=True)
        run_bench(lab, rendezvous_only=args.rendezvous_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
