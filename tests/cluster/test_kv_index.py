"""The router's KV index (cluster/router/kv_index.py): exact hits by tier along a prompt's chain of
blocks, removal, a new incarnation, a lost frame, a snapshot and when to ask for one, its bounds, and a
flood of events that stays within them."""

from __future__ import annotations

import random

import pytest

from cluster.block_hash import hash_full_blocks
from cluster.router.kv_index import RESYNC_INTERVAL_S, KvHit, KvIndex

BLOCK = 4
PROMPT = list(range(100, 121))  # 21 tokens: 5 full blocks, at most 5 usable ((21 - 1) // 4)
HASHES = hash_full_blocks(PROMPT, BLOCK)
DEVICE, HOST = 0, 1


def index(max_blocks: int = 1 << 20, max_workers: int = 64) -> KvIndex:
    return KvIndex(max_blocks, max_workers)


def hit(ix: KvIndex, worker_id: str = "w", num_tokens: int = len(PROMPT)) -> KvHit:
    return ix.hit(worker_id, HASHES, num_tokens, BLOCK)


def test_a_hit_is_the_held_chain_of_blocks_device_then_host() -> None:
    ix = index()
    ix.apply("w", "i0", 0, [(DEVICE, HASHES[0]), (DEVICE, HASHES[1]), (HOST, HASHES[2])], [])
    assert hit(ix) == KvHit(2, 1)
    ix.apply("w", "i0", 1, [(HOST, HASHES[4])], [])  # block 3 missing: block 4 is of no use
    assert hit(ix) == KvHit(2, 1)
    ix.apply("w", "i0", 2, [(DEVICE, HASHES[3]), (HOST, HASHES[0])], [])  # on both tiers: a device hit
    assert hit(ix) == KvHit(3, 2)  # device: blocks 0, 1, 3; host: 2, 4
    assert hit(ix, num_tokens=20) == KvHit(3, 1)  # the last token is always computed: 19 // 4 blocks
    assert hit(ix, num_tokens=0) == KvHit()
    assert hit(ix, "other") == KvHit()
    assert ix.match(HASHES, len(PROMPT), BLOCK) == {"w": KvHit(3, 2)}
    assert ix.num_blocks("w") == 5


def test_removal_per_tier_breaks_the_chain_where_it_happens() -> None:
    ix = index()
    ix.apply("w", "i0", 0, [(DEVICE, h) for h in HASHES[:4]] + [(HOST, HASHES[1])], [])
    ix.apply("w", "i0", 1, [], [(DEVICE, HASHES[1])])  # offloaded: the host still holds it
    assert hit(ix) == KvHit(3, 1)
    ix.apply("w", "i0", 2, [], [(HOST, HASHES[1]), (HOST, HASHES[3])])  # block 3 was never on host
    assert hit(ix) == KvHit(1, 0)
    assert ix.num_blocks("w") == 3  # blocks 0, 2, 3: block 1 is on no tier
    ix.apply("w", "i0", 3, [], [(DEVICE, h) for h in HASHES])
    assert (hit(ix), ix.num_blocks("w")) == (KvHit(), 0)


def test_a_new_incarnation_replaces_the_old_ones_entries() -> None:
    ix = index()
    ix.apply("w", "i0", 0, [(DEVICE, h) for h in HASHES], [])
    ix.apply("w", "i1", 0, [(HOST, HASHES[0])], [])
    assert (hit(ix), ix.num_blocks("w"), ix.incarnation("w")) == (KvHit(0, 1), 1, "i1")
    ix.forget("w", "i0")  # the old incarnation's death, told late: nothing of the new one goes
    assert ix.num_blocks("w") == 1
    ix.forget("w", "i1")
    assert (ix.worker_ids, ix.num_entries) == ([], 0)


def test_a_lost_frame_clears_the_worker_and_the_next_frames_refill_it() -> None:
    ix = index()
    ix.apply("w", "i0", 5, [(DEVICE, h) for h in HASHES[:3]], [])  # met mid-stream: taken as it is
    ix.apply("w", "i0", 6, [(DEVICE, HASHES[3])], [])
    assert (hit(ix), ix.num_gaps) == (KvHit(4, 0), 0)
    # frame 7 (which removed block 0, say) is lost: what frame 8 stores is all the index holds
    ix.apply("w", "i0", 8, [(DEVICE, HASHES[4])], [])
    assert (hit(ix), ix.num_blocks("w"), ix.num_gaps) == (KvHit(), 1, 1)
    ix.apply("w", "i0", 9, [(DEVICE, h) for h in HASHES[:4]], [])
    assert hit(ix) == KvHit(5, 0)
    ix.apply("w", "i0", 9, [], [])  # a repeated number is out of sequence too
    assert (ix.num_blocks("w"), ix.num_gaps) == (0, 2)


def test_a_snapshot_replaces_the_entries_and_makes_them_complete_again() -> None:
    ix = index()
    ix.apply("w", "i0", 0, [(DEVICE, h) for h in HASHES[:2]], [])  # seq 0: the worker's first snapshot
    assert ix.is_complete("w") and not ix.wants_snapshot("w", "i0", 0.0)
    ix.apply("w", "i0", 2, [(HOST, HASHES[4])], [])  # frame 1 lost
    assert (ix.is_complete("w"), ix.num_blocks("w"), ix.num_gaps) == (False, 1, 1)
    assert ix.wants_snapshot("w", "i0", 10.0)
    assert not ix.wants_snapshot("w", "i0", 10.0 + RESYNC_INTERVAL_S / 2)  # asked already
    ix.apply("w", "i0", 3, [(DEVICE, HASHES[3])], [])  # before the snapshot: taken, still incomplete
    assert ix.wants_snapshot("w", "i0", 10.0 + RESYNC_INTERVAL_S)  # no answer within the interval
    # the snapshot: blocks 0-2 on the device, 3 on the host; what was held before it goes (block 4)
    snapshot = [(DEVICE, h) for h in HASHES[:3]] + [(HOST, HASHES[3])]
    ix.apply("w", "i0", 9, snapshot[:2], [], reset=True)  # a reset is no gap, whatever its number
    ix.apply("w", "i0", 10, snapshot[2:], [])
    assert (hit(ix), ix.num_blocks("w"), ix.num_gaps, ix.num_snapshots) == (KvHit(3, 1), 4, 1, 1)
    assert ix.is_complete("w") and not ix.wants_snapshot("w", "i0", 100.0)
    assert ix.wants_snapshot("w", "i1", 100.0)  # another process of the worker: nothing known of it


def test_entries_met_mid_stream_or_forgotten_are_not_complete() -> None:
    ix = index()
    ix.apply("w", "i0", 5, [(DEVICE, HASHES[0])], [])  # this router missed frames 0-4
    assert not ix.is_complete("w") and ix.wants_snapshot("w", "i0", 0.0)
    ix.apply("w", "i0", 6, [], [], reset=True)  # an empty snapshot: the worker holds nothing
    assert (ix.is_complete("w"), ix.num_blocks("w")) == (True, 0)
    ix.forget("w", "i0")  # unhealthy: its entries went
    assert not ix.is_complete("w") and ix.wants_snapshot("w", "i0", RESYNC_INTERVAL_S)
    ix.forget("w")  # gone for good: what was asked of it goes too
    assert ix.wants_snapshot("w", "i0", RESYNC_INTERVAL_S)


def test_a_worker_past_its_bound_loses_its_least_recently_stored_blocks() -> None:
    ix = index(max_blocks=3)
    ix.apply("w", "i0", 0, [(DEVICE, h) for h in HASHES[:3]], [])
    ix.apply("w", "i0", 1, [(HOST, HASHES[0])], [])  # stored again (another tier): now the newest
    ix.apply("w", "i0", 2, [(DEVICE, HASHES[3]), (DEVICE, HASHES[4])], [])
    assert (ix.num_blocks("w"), ix.num_evicted) == (3, 2)  # blocks 1 and 2 went
    assert hit(ix) == KvHit(1, 0)  # block 0, on both tiers; block 1 is gone, so 3 and 4 count for nothing


def test_past_the_worker_bound_the_one_heard_from_least_recently_goes() -> None:
    ix = index(max_workers=2)
    ix.apply("a", "i", 0, [(DEVICE, HASHES[0])], [])
    ix.apply("b", "i", 0, [(DEVICE, HASHES[0])], [])
    ix.apply("a", "i", 1, [], [])  # a is heard from again
    ix.apply("c", "i", 0, [(DEVICE, HASHES[0])], [])
    assert (sorted(ix.worker_ids), ix.num_workers_evicted) == (["a", "c"], 1)


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="KvIndex bounds must be >= 1"):
        KvIndex(0, 1)


def test_a_flood_of_events_stays_within_the_bounds_exactly() -> None:
    """64 workers' frames (a worker cap of 16, 500 blocks each) of random stores and removals, ~300k
    pairs in all (~40x what the index may hold), a few new incarnations and lost frames among them: at
    every frame each worker's entries are exactly a plain model's (same hashes, tiers and order), and
    the index never holds more than its bounds."""
    rng = random.Random(44)
    max_blocks, max_workers = 500, 16
    ix = index(max_blocks, max_workers)
    model: dict[str, dict[bytes, int]] = {}  # worker -> hash -> tier bits, least recently stored first
    incarnation: dict[str, str] = {}
    seq: dict[str, int] = {}
    heard: list[str] = []  # the indexed workers, least recently heard first
    hashes = [i.to_bytes(16, "big") for i in range(2000)]
    num_pairs = 0
    for step in range(3000):
        wid = f"w{rng.randrange(64)}"
        if wid not in incarnation or rng.random() < 0.01:  # a (re)started process
            incarnation[wid], seq[wid] = f"i{step}", rng.randrange(3)
            model[wid] = {}
        elif rng.random() < 0.02:  # a frame lost on the way
            seq[wid] += 1
            model[wid] = {}
        elif wid not in heard:  # dropped for the worker bound: its next frame starts it afresh
            model[wid] = {}
        stored = [(rng.randrange(2), rng.choice(hashes)) for _ in range(rng.randrange(150))]
        removed = [(rng.randrange(2), rng.choice(hashes)) for _ in range(rng.randrange(50))]
        num_pairs += len(stored) + len(removed)
        ix.apply(wid, incarnation[wid], seq[wid], stored, removed)
        seq[wid] += 1
        blocks = model[wid]
        for tier, h in removed:
            bits = blocks.get(h, 0) & ~(1 << tier)
            if bits:
                blocks[h] = bits
            else:
                blocks.pop(h, None)
        for tier, h in stored:
            blocks[h] = blocks.pop(h, 0) | (1 << tier)
        while len(blocks) > max_blocks:
            del blocks[next(iter(blocks))]
        heard = [*(w for w in heard if w != wid), wid][-max_workers:]
        # NOTE: no public view of a worker's entries: the index's own map, in its order
        assert list(ix._workers[wid].tiers.items()) == list(blocks.items())
        assert ix.worker_ids == heard
        assert ix.num_entries == sum(len(model[w]) for w in heard) <= max_blocks * max_workers
    assert num_pairs > 40 * max_blocks * max_workers // 4
    assert len(ix.worker_ids) == max_workers and ix.num_gaps > 0 and ix.num_evicted > 0
