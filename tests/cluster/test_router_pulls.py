"""The router's half of prefix pulls (cluster/router/pulls.py) over fakes: which holder, when not, the ops
sent, and how every ending sends the flight's Generate exactly once (or none, for a flight that moved on)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.block_hash import hash_full_blocks
from cluster.config import RouterConfig
from cluster.router.kv_index import KvIndex
from cluster.router.membership import WorkerRef
from cluster.router.pulls import Pulls
from cluster.router.routing import Route
from cluster.wire import Abort, FetchPrefix, OfferPrefix, PrefixFetched, PrefixOffered, WorkerInfo

BS = 4
TOKENS = list(range(3, 3 + 16 * BS + 2))  # 16 full blocks and 2 tokens
HASHES = hash_full_blocks(TOKENS, BS)


def worker(wid: str, pool: str, pull_endpoint: str = "tcp://127.0.0.1:1") -> WorkerRef:
    info = WorkerInfo(
        wid,
        pool,
        "inc",
        "tcp://x",
        "127.0.0.1",
        BS,
        64,
        1024,
        512,
        "/m",
        "cpu",
        1,
        pull_endpoint=pull_endpoint,
    )
    return WorkerRef(info, socket=None)  # type: ignore[arg-type]  # NOTE: the fake members send nothing


@dataclass
class FakeMembers:
    workers: list[WorkerRef]
    sent: list[tuple[str, Any]] = field(default_factory=list)

    def healthy(self, pool: str) -> list[WorkerRef]:
        return [w for w in self.workers if w.pool == pool]

    def send(self, w: WorkerRef, op: Any) -> None:
        self.sent.append((w.worker_id, op))


@dataclass
class FakeFlight:
    prefill: WorkerRef | None
    deadline: float = 1e12
    attempt: int = 0
    is_ended: bool = False
    wire_id: str = "r1"


def setup(
    num_held: dict[str, int], min_blocks: int = 8
) -> tuple[Pulls, FakeMembers, list[tuple[Any, str, bool]], dict[str, WorkerRef]]:
    refs = {w.worker_id: w for w in (worker("prefill-0", "prefill"), worker("prefill-1", "prefill"))}
    refs["decode-0"] = worker("decode-0", "decode")
    refs["colocated-9"] = worker("colocated-9", "decode", pull_endpoint="")  # no pull sender: never asked
    index = KvIndex(1 << 10, 16)
    for wid, n in num_held.items():
        index.apply(wid, "inc", 0, [(0, h) for h in HASHES[:n]], [])
    members = FakeMembers(list(refs.values()))
    generated: list[tuple[Any, str, bool]] = []
    pulls = Pulls(
        RouterConfig(pull_min_blocks=min_blocks, pull_timeout_s=5.0),
        members,  # type: ignore[arg-type]
        index,
        None,
        lambda f, w, hold: generated.append((f, w.worker_id, hold)),
        lambda f, e: pytest.fail(f"flight failed: {e}"),
    )
    return pulls, members, generated, refs


def route(w: WorkerRef) -> Route[WorkerRef]:
    return Route("disaggregated", "kv_index_device_hit", w, hold=True, block_hashes=HASHES)


def test_the_holder_with_the_most_device_blocks_is_asked_then_the_puller_fetches_and_the_prompt_goes() -> (
    None
):
    async def main() -> None:
        pulls, members, generated, refs = setup(
            {"prefill-0": 2, "prefill-1": 9, "decode-0": 14, "colocated-9": 16}
        )
        flight = FakeFlight(refs["prefill-0"])
        assert pulls.start(flight, route(refs["prefill-0"]), TOKENS)  # type: ignore[arg-type]
        [(to, offer)] = members.sent
        assert to == "decode-0" and isinstance(offer, OfferPrefix) and offer.token_ids == TOKENS[: 14 * BS]
        pulls.on_answer(
            refs["prefill-1"], PrefixOffered("prefill-1", offer.pull_id, 14, b"h")
        )  # not its holder
        assert len(members.sent) == 1
        pulls.on_answer(refs["decode-0"], PrefixOffered("decode-0", offer.pull_id, 14, b"h"))
        to, fetch = members.sent[1]
        assert to == "prefill-0" and fetch == FetchPrefix(
            offer.pull_id, offer.token_ids, b"h", offer.deadline
        )
        assert generated == []
        pulls.on_answer(refs["prefill-0"], PrefixFetched("prefill-0", offer.pull_id, 12, 4096))
        assert generated == [(flight, "prefill-0", True)] and len(pulls) == 0
        assert len(members.sent) == 2  # a pull that succeeded leaves nothing to abort
        assert pulls.counts["pulled"] == 1

    asyncio.run(main())


@pytest.mark.parametrize(
    ("held", "min_blocks", "puller"),
    [
        ({"prefill-0": 2, "decode-0": 9}, 8, "prefill-0"),  # 7 more blocks < 8
        ({"prefill-0": 2, "decode-0": 16}, 0, "prefill-0"),  # pulls off
        ({"decode-0": 16}, 8, "decode-0"),  # a decode worker prefilling (conditional) pulls nothing
        ({"colocated-9": 16}, 8, "prefill-0"),  # the only holder has no pull sender
    ],
)
def test_no_pull(held: dict[str, int], min_blocks: int, puller: str) -> None:
    async def main() -> None:
        pulls, members, _, refs = setup(held, min_blocks)
        assert not pulls.start(FakeFlight(refs[puller]), route(refs[puller]), TOKENS)  # type: ignore[arg-type]
        assert members.sent == [] and len(pulls) == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    "ending", ["offer_failed", "fetch_failed", "holder_died", "puller_died", "timed_out"]
)
def test_every_ending_sends_the_prompt_once_and_aborts_what_is_held(ending: str) -> None:
    async def main() -> None:
        pulls, members, generated, refs = setup({"decode-0": 16})
        puller, holder = refs["prefill-0"], refs["decode-0"]
        flight = FakeFlight(puller)
        if ending == "timed_out":
            flight.deadline = 0.0  # NOTE: the pull's deadline is the flight's when sooner: it expires at once
        assert pulls.start(flight, route(puller), TOKENS)  # type: ignore[arg-type]
        pull_id = members.sent[0][1].pull_id
        if ending == "offer_failed":
            pulls.on_answer(holder, PrefixOffered("decode-0", pull_id, 0, error="no cached prefix"))
        elif ending == "fetch_failed":
            pulls.on_answer(holder, PrefixOffered("decode-0", pull_id, 16, b"h"))
            pulls.on_answer(puller, PrefixFetched("prefill-0", pull_id, 0, error="TransferPeerLostError"))
        elif ending == "holder_died":
            holder.died.set()
            pulls.on_dead(holder)
        elif ending == "puller_died":
            flight.attempt = 1  # NOTE: the router migrated it before its pulls heard of the death
            puller.died.set()
            pulls.on_dead(puller)
        else:
            for _ in range(100):  # bounded: the timer runs on this loop
                if not len(pulls):
                    break
                await asyncio.sleep(0.01)
        assert len(pulls) == 0
        assert generated == ([] if ending == "puller_died" else [(flight, "prefill-0", True)])
        aborts = [(to, op) for to, op in members.sent if isinstance(op, Abort)]
        alive = [w for w in ("decode-0", "prefill-0") if not refs[w].died.is_set()]
        assert aborts == [(w, Abort(pull_id)) for w in alive]
        # a late answer of the ended pull changes nothing
        pulls.on_answer(puller, PrefixFetched("prefill-0", pull_id, 16, 1))
        assert len(generated) == (0 if ending == "puller_died" else 1)

    asyncio.run(main())
