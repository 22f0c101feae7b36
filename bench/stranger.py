"""A stranger on the cluster network (issue 31, "Safe to expose"), on the two-host lab (bench/netns_lab.py):

    python -m bench.stranger          # root (network namespaces); prints figures, not a pass/fail test

Starts the lab and a cluster on it (prefill on host A with the router, decode on host B, the bundled tiny
model, CPU), runs a first wave of greedy requests, then acts from processes started in host B's namespace
that hold no cluster secret:

1. rendezvous: lists the router's store, overwrites every pair key there with garbage, writes the signed
   values of the current generation under the next generations' keys (a replay), then watches the store
   while decode-0 is killed and a fresh decode-1 is added, and writes a replayed value under every key of
   the new pair that is not there yet (compare-and-set: strictly before its rightful write).
2. frame: pushes one 400 MiB frame to the router's PULL socket while the router's process (this one)
   samples its VmRSS.
3. chunk: a live gloo connection cannot be injected into from here, so a KV sender in host B (it holds a
   secret of its own for the handshake, as the rightful peer would) replaces chunk 0 with a forgery sealed
   with a correct XXH3 digest before gloo carries it to a receiver on host A (the nonce, which travels in
   the clear, handed over by fixing it); once under integrity ``mac``, once under ``digest`` (a control).

Then a second wave of the same requests, and the counters, the leak check and whether outputs are equal.

NOTE: step 1 never overwrites a new pair's key after its rightful write: that is the denial of service
transfer/rendezvous.py documents (a check-then-set version of this script did so once by accident: that
pair's build waited out its 60 s group timeout, broken, and all 8 requests of the second wave failed).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

FORGED = b"198.18.255.9:1 a stranger's gloo address"
BIG_FRAME_BYTES = 400 << 20
NONCE = 0x5EED_0F_A11
SHAPE = (2, 16, 2, 4, 2, 8)  # a small KV cache: [L, blocks, 2, block_size, heads, dim] float32
ROW_BYTES = 2 * 4 * 2 * 8 * 4
PAIR = "pdserve/pair/"


def _split(key: str) -> tuple[str, int, str] | None:
    """``pdserve/pair/P/p/D/d/G//rest`` -> (ends ``P/p/D/d``, G, rest)."""
    parts = key[len(PAIR) :].split("/")
    if not key.startswith(PAIR) or len(parts) < 7 or not parts[4].isdigit():
        return None
    return "/".join(parts[:4]), int(parts[4]), "/".join(parts[6:])


def stranger_rendezvous(host: str, port: int) -> None:
    """In host B, no secret: overwrite, replay forward, then race every new pair until stdin closes."""
    import torch.distributed as dist

    store: Any = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
    now = [k for k in store.list_keys() if _split(k)]
    values = {k: store.get(k) for k in now}
    rests = sorted({s[2] for k in now if (s := _split(k))})
    for key in now:
        store.set(key, FORGED)
    replayed = []
    for key, value in values.items():
        ends, gen, rest = _split(key) or ("", 0, "")
        for ahead in (1, 2, 3):
            replayed.append(f"{PAIR}{ends}/{gen + ahead}//{rest}")
            store.set(replayed[-1], value)
    print(
        json.dumps({"keys_seen": now, "overwritten": len(now), "replayed_ahead": len(replayed)}), flush=True
    )
    known = {s[:2] for k in now + replayed if (s := _split(k))}  # NOTE: new pairs are the cluster's only
    by_rest = {(_split(k) or ("", 0, ""))[2]: v for k, v in values.items()}
    raced: dict[str, bool] = {}
    while not select.select([sys.stdin], [], [], 0)[0]:
        keys = set(store.list_keys())
        for pair in {s[:2] for k in keys if (s := _split(k))} - known:
            known.add(pair)
            for rest in rests:
                key = f"{PAIR}{pair[0]}/{pair[1]}//{rest}"
                # NOTE: set only if absent (atomic on the store server): strictly before the rightful write.
                # An overwrite after it is the documented denial of service (transfer/rendezvous.py).
                value = by_rest.get(rest, FORGED)
                raced[key] = key not in keys and bytes(store.compare_set(key, "", value)) == value
    won = [k for k, is_first in raced.items() if is_first and store.check([k])]
    survived = {k: store.get(k) in (FORGED, *values.values()) for k in won}
    print(json.dumps({"new_pair_keys": raced, "forgery_still_stored": survived}), flush=True)


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


def forge_send(host: str, port: int, bind: str, integrity: str) -> None:
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
    sender = KVSender(torch.randn(*SHAPE), me=PeerId("forger-b", "0"), channel=ForgingChannel((host, port), bind),
                      secret=bytes.fromhex(os.environ["FORGE_SECRET"]), on_sent=lambda r, ok: done.set(),
                      endpoint=f"tcp://{bind}:*", chunk_bytes=2 * ROW_BYTES, integrity=integrity, timeout_s=10)  # fmt: skip
    sender.start()
    print(sender.offer("r", [3, 4, 5], num_tokens=12).to_bytes().hex(), flush=True)
    done.wait(60)
    sender.close()


def forge_receive(host: str, port: int, bind: str, integrity: str, handoff_hex: str) -> None:
    """In host A: fetch the handoff into blocks 7..9 with the nonce fixed; print what landed."""
    import secrets

    import torch

    from transfer.pairs import PairChannel
    from transfer.peers import PeerId
    from transfer.protocol import KVHandoff
    from transfer.receiver import KVReceiver

    secrets.randbits = lambda k: NONCE  # NOTE: this process only: the nonce the stranger saw in the clear
    dst = torch.zeros(*SHAPE)
    receiver = KVReceiver(dst, me=PeerId("receiver-a", "0"), channel=PairChannel((host, port), bind),
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
    from deploy.launch import KVStore

    store, env = KVStore(lab.ip_a), {"FORGE_SECRET": new_secret().hex()}
    addr = [store.address[0], str(store.address[1])]
    sender = _in_b(lab, "forge-send", *addr, lab.ip_b, integrity, env=env)
    try:
        handoff = (sender.stdout.readline() if sender.stdout else "").strip()
        cmd = [sys.executable, "-m", "bench.stranger", "forge-receive", *addr, lab.ip_a, integrity, handoff]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        sender.wait(timeout=90)
        return _last_json(done.stdout, done.stderr)
    finally:
        sender.kill()
        store.close()


def run_bench(lab: Any) -> None:
    import ray

    from deploy.launch import start_cluster
    from tests.support.cluster_utils import shared_prefix_prompts, wait_for
    from tests.support.two_host_driver import lab_config, run_all

    prompts = shared_prefix_prompts(8, seed=31, vocab=1229)
    max_tokens = [8 + i % 3 * 4 for i in range(len(prompts))]
    ray.init(address=lab.address, _node_ip_address=lab.ip_a, log_to_driver=False)
    handle = start_cluster(lab_config({}))
    watcher: subprocess.Popen[str] | None = None
    try:
        first = asyncio.run(run_all(handle, prompts, max_tokens))
        print(f"wave 1: {sum(isinstance(o, list) for o in first)}/{len(first)} ok", flush=True)
        if handle._kv_store is None:
            raise RuntimeError("a disaggregated cluster has a KV store; this one has none")
        store = handle._kv_store.address  # NOTE: the router process's TCPStore (deploy/launch.py KVStore)
        watcher = _in_b(lab, "rendezvous", store[0], str(store[1]), stdin=subprocess.PIPE)
        print("rendezvous, before the rebuild:", watcher.stdout.readline().strip() if watcher.stdout else "")
        handle.kill_worker("decode-0")
        wait_for(lambda: any(w.worker_id == "decode-0" and w.state == "dead" for w in handle.router.workers),
                 30, "decode-0 dead in the router's eyes")  # fmt: skip
        print("decode pool after the kill:", handle.scale("decode", 1), flush=True)
        print("frame:", json.dumps(part_frame(lab, handle.router.endpoint)), flush=True)
        print("router rejected frames after the push:", handle.router.rejected_frames(), flush=True)
        for integrity in ("mac", "digest"):
            print(f"chunk ({integrity}):", json.dumps(part_chunk(lab, integrity)), flush=True)
        second = asyncio.run(run_all(handle, prompts, max_tokens))
        out, _ = watcher.communicate(timeout=30)
        print("rendezvous, the rebuild:", out.strip(), flush=True)
        since = time.monotonic()
        live = [w for w in handle.router.workers if w.state != "dead"]
        wait_for(lambda: all(w.last_beat > since for w in live), 10, "fresh heartbeats")
        handle.wait_until_quiet(timeout_s=60)
        errors = [o for o in first + second if not isinstance(o, list)]
        print(f"wave 2: outputs equal to wave 1: {first == second}; client errors: {errors}")
        print("leaks:", handle.check_leaks())
        for s in handle.worker_stats():
            print(f"{s.worker_id}: rejected_frames={s.rejected_frames} num_rejected_chunks="
                  f"{s.transfer.num_rejected_chunks} transfers_ok={s.transfer.num_ok} broken={s.broken_peers}")  # fmt: skip
        print("router rejected frames:", handle.router.rejected_frames(), flush=True)
    finally:
        if watcher is not None:
            watcher.kill()
        handle.shutdown()
        ray.shutdown()


def main(argv: list[str]) -> int:
    roles: dict[str, Any] = {"rendezvous": lambda h, p: stranger_rendezvous(h, int(p)), "push": stranger_push,
             "forge-send": lambda h, p, b, i: forge_send(h, int(p), b, i),
             "forge-receive": lambda h, p, b, i, x: forge_receive(h, int(p), b, i, x)}  # fmt: skip
    if argv and argv[0] in roles:
        roles[argv[0]](*argv[1:])
        return 0
    from bench.netns_lab import two_host_lab

    os.environ["RAY_AUTH_MODE"] = "token"  # NOTE: the lab's Ray runs token auth; Ray reads it at import
    with two_host_lab() as lab:
        print(f"lab: host A {lab.ip_a}, host B {lab.ip_b} (netns {lab.ns})", flush=True)
        run_bench(lab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
