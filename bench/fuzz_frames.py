"""Seeded malformed control frames (the live fuzz test, the soak benchmark).

Every frame made here must be rejected by its receiver, except the first copy of each replayed frame
(a harmless signed Abort of a request nobody has, or of a KV transfer nobody runs), which is accepted
once; ``num_bad`` counts the rest. KV senders' handshake sockets (``kv_targets``) are ZMQ ROUTER sockets:
send to the endpoints in ``FuzzPlan.dealer_endpoints`` from a DEALER socket.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgpack

from cluster.frames import FrameSigner, new_secret
from cluster.wire import EVENTS, OPS, ROUTER_ID
from transfer.handshake import MessageKind

KINDS = (
    "random_bytes",
    "wrong_shape_msgpack",
    "huge_map",
    "unknown_tag",
    "replay",
    "wrong_key",
    "four_bytes",
    "bad_field",
    "misaddressed",
)


@dataclass
class FuzzPlan:
    frames: list[tuple[str, bytes]] = field(default_factory=list)  # (endpoint, frame)
    dealer_endpoints: set[str] = field(default_factory=set)  # KV handshake sockets (ZMQ ROUTER)
    num_bad: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


def _random_object(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(7 if depth < 3 else 5)
    if choice == 0:
        return rng.randrange(-(2**40), 2**40)
    if choice == 1:
        return rng.random() * 1e6
    if choice == 2:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(8)))
    if choice == 3:
        return rng.randbytes(rng.randrange(8))
    if choice == 4:
        return None
    if choice == 5:
        return [_random_object(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_object(rng, depth + 1) for i in range(rng.randrange(4))}


def make_plan(
    seed: int,
    num_frames: int,
    secret: bytes,
    targets: dict[str, str],
    kv_targets: dict[str, str] | None = None,
) -> FuzzPlan:
    """``targets``: receiver id (a worker's peer name ``worker_id/incarnation``, as ops are addressed, or
    ROUTER_ID) -> its PULL endpoint; ``kv_targets``: a KV sender's peer name -> its handshake endpoint."""
    rng = random.Random(seed)
    signer, stranger = FrameSigner(secret), FrameSigner(new_secret())
    kv = dict(kv_targets or {})
    targets = {**targets, **kv}
    ids = sorted(targets)
    plan = FuzzPlan(dealer_endpoints=set(kv.values()))
    step = 0
    while len(plan.frames) < num_frames:
        kind = KINDS[step % len(KINDS)]
        step += 1
        to = ids[rng.randrange(len(ids))]
        if to in kv:
            tags = [k.value for k in MessageKind]
        else:
            tags = [cls.TAG for cls in (EVENTS if to == ROUTER_ID else OPS)]
        frames: list[bytes]
        if kind == "random_bytes":
            frames = [rng.randbytes(rng.randrange(512))]
        elif kind == "wrong_shape_msgpack":
            frames = [msgpack.packb(_random_object(rng))]
        elif kind == "huge_map":
            frames = [signer.sign(to, tags[0], {f"f{i}": i for i in range(5000)})]
        elif kind == "unknown_tag":
            frames = [signer.sign(to, f"no-such-op-{rng.randrange(10**6)}", {"request_id": "x"})]
        elif kind == "replay":
            if to == ROUTER_ID:  # NOTE: nothing the router accepts is harmless: replay a frame it rejects
                original = signer.sign(to, "no-such-event", {})
                frames = [original, original]
            elif to in kv:  # an abort of a transfer nobody runs
                original = signer.sign(
                    to, "abort", {"nonce": rng.randrange(2**40), "error_type": "", "message": ""}
                )
                plan.frames.append((targets[to], original))
                frames = [original] * (1 + rng.randrange(3))
            else:
                original = signer.sign(to, "abort", {"request_id": f"fuzz-nobody-{to}"})
                plan.frames.append((targets[to], original))  # accepted once: an abort of nothing
                frames = [original] * (1 + rng.randrange(3))
        elif kind == "wrong_key":
            frames = [stranger.sign(to, tags[rng.randrange(len(tags))], {"request_id": "x"})]
        elif kind == "four_bytes":
            frames = [bytes.fromhex("81910102")]
        elif kind == "bad_field":
            frames = [signer.sign(to, tags[rng.randrange(len(tags))], {"request_id": rng.randrange(100)})]
        else:  # misaddressed
            frames = [signer.sign(f"not-{to}", tags[0], {"request_id": "x"})]
        for frame in frames:
            plan.frames.append((targets[to], frame))
        plan.num_bad += len(frames)
        plan.by_kind[kind] = plan.by_kind.get(kind, 0) + len(frames)
    return plan
