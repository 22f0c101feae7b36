"""Control-plane cost of one engine step's token deltas: a worker's encode + send, the router's receive +
decode, per step, with each request's delta in a frame of its own (how workers sent them up to 1d5b092)
and with the step's deltas in one ``Deltas`` frame (what workers send now). Same process, real signed
frames over a ZMQ PUSH/PULL pair on 127.0.0.1; medians over ``--steps`` steps. ``--top-logprobs K``:
each delta carries its token's logprob and K top ones (a request that asked for logprobs).

    python -m bench.wire_deltas --running 16 64 256
    python -m bench.wire_deltas --running 256 --top-logprobs 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import zmq

from cluster.frames import new_secret
from cluster.protocol import TokenDelta, TokenLogprobs
from cluster.wire import EVENTS, ROUTER_ID, Deltas, WireDecoder, WireEncoder


def _step_deltas(num_running: int, step: int, top_logprobs: int | None) -> list[TokenDelta]:
    """One decode step's deltas: one token each, a few characters of text, as a worker makes them (with
    ``top_logprobs``: the token's logprob and that many top ones)."""
    token = 1000 + step
    if top_logprobs is None:
        return [TokenDelta(f"cmpl-{i:032x}", [token], " tok") for i in range(num_running)]
    top = list(range(token, token + top_logprobs))
    return [
        TokenDelta(
            f"cmpl-{i:032x}",
            [token],
            " tok",
            [TokenLogprobs(token, -0.25, top, [-0.25 - k for k in range(top_logprobs)])],
        )
        for i in range(num_running)
    ]


def measure(
    num_running: int, per_frame: int, steps: int, top_logprobs: int | None = None
) -> tuple[float, float]:
    """(worker ms, router ms) per step, medians, sending ``per_frame`` deltas per frame."""
    secret = new_secret()
    encoder, decoder = WireEncoder(secret), WireDecoder(secret, ROUTER_ID, EVENTS)
    ctx: zmq.Context[Any] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        worker: list[float] = []
        router: list[float] = []
        for step in range(steps + 3):
            deltas = _step_deltas(num_running, step, top_logprobs)
            t0 = time.perf_counter()
            for start in range(0, len(deltas), per_frame):
                push.send(encoder.encode(ROUTER_ID, Deltas("decode-0", deltas[start : start + per_frame])))
            t1 = time.perf_counter()
            got = 0
            while got < num_running:
                if not pull.poll(10_000):
                    raise TimeoutError("a frame did not arrive within 10 s")
                event = decoder.decode(pull.recv())
                if not isinstance(event, Deltas):
                    raise RuntimeError(f"the router's decoder rejected a frame: {decoder.rejected()}")
                got += len(event.deltas)
            t2 = time.perf_counter()
            if step >= 3:  # the first steps warm caches and the connection
                worker.append(t1 - t0)
                router.append(t2 - t1)
        return statistics.median(worker) * 1e3, statistics.median(router) * 1e3
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wire_deltas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top-logprobs", type=int, default=None, metavar="K")
    args = ap.parse_args(argv)
    print("ms per step (median): worker encode+send, router receive+decode")
    for n in args.running:
        one_each = measure(n, 1, args.steps, args.top_logprobs)
        batched = measure(n, n, args.steps, args.top_logprobs)
        print(
            f"{n:4d} running: a frame per delta {one_each[0]:6.3f} + {one_each[1]:6.3f}; "
            f"one Deltas frame {batched[0]:6.3f} + {batched[1]:6.3f} "
            f"({one_each[0] / batched[0]:.1f}x / {one_each[1] / batched[1]:.1f}x less)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
