"""The host-memory KV tier: exact slots, copies and LRU order in the bookkeeping; outputs, bytes, events
and the leak invariant through the engine."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest
import torch

from cluster.block_hash import hash_full_blocks
from cluster.config import EngineConfig, ModelConfig
from cluster.protocol import SamplingParams
from cluster.router.kv_index import KvIndex
from cluster.wire import KvEvents, WorkerInfo
from workers.block_manager import KVCacheManager
from workers.engine import Engine
from workers.host_kv import GIB, HostKv, num_host_slots
from workers.host_tier import HostTier, KvCopies, LoadRule
from workers.kv_events import TIER_DEVICE, TIER_HOST
from workers.request import Request
from workers.worker_vitals import KV_SNAPSHOT_INTERVAL_S, Vitals


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


# ---- bookkeeping ---------------------------------------------------------------------------------------
def test_tier_takes_free_slots_then_evicts_its_least_recently_used_hash() -> None:
    tier = HostTier(2)
    assert tier.store(b"a") == 0
    assert tier.store(b"b") == 1
    assert tier.store(b"a") is None  # held already: made young, nothing to copy
    assert tier.store(b"c") == 1  # b is now the oldest
    assert tier.lookup([b"a", b"c", b"b"]) == [0, 1]
    assert tier.hashes() == [b"a", b"c"]
    tier.check()


def test_a_slot_a_batch_loads_is_never_the_one_its_offloads_overwrite() -> None:
    tier = HostTier(2)
    tier.store(b"a")
    tier.store(b"b")
    assert tier.take_hit([b"b", b"a"]) == [1, 0]  # both pinned
    assert tier.store(b"c") is None  # every slot pinned: the block is dropped
    tier.end_batch()
    assert tier.store(b"c") == 1  # b was made young first, then a: b is older
    assert tier.hashes() == [b"a", b"c"]
    tier.check()


def test_manager_offloads_evicted_blocks_and_loads_a_host_hit_into_fresh_blocks() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=True, num_host_blocks=4)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    assert kv.block_tables["a"] == [1, 2, 3]
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    kv.free("a")  # cached blocks 1, 2 at the back (2 evicted first), block 3 at the front
    assert kv.take_copies() is None
    b = req("b", [9, 9, 9, 9, 9, 9, 9])
    assert kv.allocate_slots(b, 7)  # 4 blocks: 3, 4, then the cached 2 and 1
    assert kv.block_tables["b"] == [3, 4, 2, 1]
    copies = kv.take_copies()
    assert copies == KvCopies(offload_blocks=[2, 1], offload_slots=[0, 1])
    kv.free("b")
    again = req("c", [1, 2, 3, 4, 5, 6])
    hit = kv.get_computed_blocks(again)
    assert hit.block_ids == [] and hit.host_hashes == hash_full_blocks([1, 2, 3, 4], 2)
    assert kv.allocate_slots(again, 2, hit)
    # b's blocks are not cached (no computed tokens): 3 4 2 1 were freed to the front, tail first
    assert kv.block_tables["c"] == [3, 4, 2]
    assert kv.take_copies() == KvCopies(load_slots=[1, 0], load_blocks=[3, 4])
    assert kv.prefix_cache is not None and kv.prefix_cache.lookup(hit.host_hashes) == [3, 4]
    kv.free("c")
    kv.check_no_leaks()


def test_the_load_rule_compares_a_copy_with_a_recompute_per_block() -> None:
    rule = LoadRule(bytes_per_block=1_000_000, block_size=16)
    assert rule.worth_loading() and rule.load_cost_ratio() is None  # no forward measured yet
    rule.observe_copy(1_000_000, 0.001)  # the first measurement replaces the nominal rate
    assert rule.copy_bytes_per_s == pytest.approx(1e9)
    rule.observe_forward(num_tokens=1000, seconds=0.01)  # 10 us a token
    assert rule.prefill_s_per_token == pytest.approx(1e-5)
    assert not rule.worth_loading()  # 1 ms to copy a block, 0.16 ms to recompute it
    assert rule.load_cost_ratio() == pytest.approx(1e-3 / 1.6e-4)
    rule.observe_forward(num_tokens=10, seconds=0.1)  # too few steps for a slope: the mean, ~109 us
    assert rule.prefill_s_per_token == pytest.approx(0.11 / 1010)
    assert rule.worth_loading()
    rule.observe_copy(1_000_000, 0.0005)  # then an EMA
    assert rule.copy_bytes_per_s == pytest.approx(1e9 + 0.2 * (2e9 - 1e9))


def test_the_load_rule_weighs_a_tokens_marginal_cost_not_a_steps_fixed_one() -> None:
    """Steps of 100 to 800 prompt tokens, each 10 ms of fixed cost + 1 us a token: spread over the tokens
    a token would look 28 us dear and loading a block (100 us) worth it; its marginal cost is 1 us."""
    rule = LoadRule(bytes_per_block=100_000, block_size=16, copy_bytes_per_s=1e9)
    for n in (100, 200, 400, 800):
        rule.observe_forward(n, 0.010 + n * 1e-6)
    assert rule.prefill_s_per_token == pytest.approx(1e-6)
    assert not rule.worth_loading()  # 16 us to recompute a block, 100 us to copy it
    alike = LoadRule(bytes_per_block=100_000, block_size=16, copy_bytes_per_s=1e9)
    for _ in range(4):
        alike.observe_forward(100, 0.0101)  # no spread of sizes: the mean
    assert alike.prefill_s_per_token == pytest.approx(0.0101 / 100)
    assert alike.worth_loading()


def test_the_budget_is_never_exceeded_and_a_budget_of_no_block_is_refused() -> None:
    assert num_host_slots(0.0, 4096) == 0
    assert num_host_slots(1.0, 3 << 20) == 341  # 341 * 3 MiB <= 1 GiB < 342 * 3 MiB
    kv = torch.zeros((2, 8, 2, 4, 2, 8))
    host = HostKv(kv, num_host_slots(0.0001, 2 * 2 * 4 * 2 * 8 * 4))
    assert host.num_bytes <= 0.0001 * GIB < host.num_bytes + host.bytes_per_block
    with pytest.raises(ValueError, match=r"kv_offload_gib \(1e-09\) holds no KV block"):
        num_host_slots(1e-9, 4096)


# ---- through the engine --------------------------------------------------------------------------------
def _conversations(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 400) for _ in range(48)]
    return [system + [rng.randrange(5, 400) for _ in range(rng.randrange(30, 70))] for _ in range(n)]


def _engine(**options: object) -> Engine:
    config = EngineConfig(num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=256, **options)  # type: ignore[arg-type]
    return Engine(config)


def _run_turns(engine: Engine, params: SamplingParams, num_turns: int = 3) -> list[list[list[int]]]:
    """Multi-turn: each turn's prompt is the history plus the last answer and a new message."""
    histories = _conversations(1, 6)
    outputs = []
    for turn in range(num_turns):
        for i, h in enumerate(histories):
            engine.add_request(f"t{turn}-{i}", h, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        answers = [got[f"t{turn}-{i}"] for i in range(len(histories))]
        outputs.append(answers)
        histories = [h + a + [7 + turn] * 12 for h, a in zip(histories, answers, strict=True)]
    return outputs


class _CheckedHostKv(HostKv):
    """Checks that every block loaded back holds exactly the bytes it was offloaded with."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        super().__init__(kv_cache, num_slots)
        self.written: dict[int, torch.Tensor] = {}
        self.num_checked = 0

    def apply(self, kv_cache: torch.Tensor, copies: KvCopies) -> None:
        for block, slot in zip(copies.offload_blocks, copies.offload_slots, strict=True):
            self.written[slot] = kv_cache[:, block].clone()
        super().apply(kv_cache, copies)
        for slot, block in zip(copies.load_slots, copies.load_blocks, strict=True):
            assert torch.equal(kv_cache[:, block], self.written[slot])
            self.num_checked += 1


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_outputs_with_the_tier_equal_outputs_without_and_reloaded_bytes_are_the_originals(
    is_async: bool, seeded: bool
) -> None:
    params = (
        SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
        if seeded
        else SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    )
    plain = _engine(async_scheduling=is_async)
    expected = _run_turns(plain, params)
    plain.check_no_leaks()
    tiered = _engine(async_scheduling=is_async, kv_offload_gib=0.002)
    host_kv = tiered.runner.host_kv
    assert host_kv is not None
    checked = _CheckedHostKv(tiered.runner.kv_cache, host_kv.slots.shape[0])
    tiered.runner.host_kv = checked
    assert _run_turns(tiered, params) == expected
    st, st0 = tiered.stats(), plain.stats()
    assert st.kv_offloaded_blocks > 0 and st.kv_loaded_blocks > 0
    assert checked.num_checked == st.kv_loaded_blocks
    assert st.prefix_cache_host_hits == st.kv_loaded_blocks * 16
    assert st.prefix_cache_hits > st0.prefix_cache_hits
    assert st.kv_offloaded_bytes == st.kv_offloaded_blocks * checked.bytes_per_block
    # fewer prompt tokens computed: a host hit is a block not recomputed
    assert st.num_prompt_tokens < st0.num_prompt_tokens
    # the load rule's own comparison, as the router reads it; no tier: nothing measured
    assert tiered.load_rule is not None and st.host_load_cost == tiered.load_rule.load_cost_ratio() >= 0
    assert st0.host_load_cost == -1.0
    tiered.check_no_leaks()


def test_a_preempted_request_comes_back_from_the_host_tier_with_the_same_tokens() -> None:
    def run(**options: object) -> tuple[dict[str, list[int]], Engine]:
        engine = Engine(
            EngineConfig(num_kv_blocks=14, max_num_seqs=4, max_num_batched_tokens=512, **options)  # type: ignore[arg-type]
        )
        for i, prompt in enumerate(_conversations(3, 4)):
            params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=i)
            engine.add_request(f"r{i}", prompt[:60], params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        engine.check_no_leaks()
        return got, engine

    expected, plain = run()
    got, tiered = run(kv_offload_gib=0.002)
    assert got == expected
    st = tiered.stats()
    assert st.num_preemptions > 0
    assert plain.stats().num_preemptions > 0
    assert st.kv_loaded_blocks > 0  # a preempted request's blocks came back instead of being recomputed
    assert st.num_prompt_tokens < plain.stats().num_prompt_tokens


def test_kv_events_name_each_tier_and_the_first_batch_is_a_snapshot() -> None:
    engine = _engine(kv_offload_gib=0.002)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    _run_turns(engine, params, num_turns=2)
    first = engine.take_kv_events()
    kv = engine.scheduler.kv
    assert kv.prefix_cache is not None and kv.host is not None
    assert sorted(first.stored) == sorted(
        [(TIER_DEVICE, h) for h in kv.prefix_cache.hashes()] + [(TIER_HOST, h) for h in kv.host.hashes()]
    )
    assert first.removed == []
    assert len(engine.take_kv_events()) == 0
    device_before, host_before = set(kv.prefix_cache.hashes()), set(kv.host.hashes())
    _run_turns(engine, params, num_turns=3)
    batch = engine.take_kv_events()
    device_after, host_after = set(kv.prefix_cache.hashes()), set(kv.host.hashes())

    def net(tier: int, before: set[bytes], after: set[bytes]) -> None:
        stored = {h for t, h in batch.stored if t == tier}
        removed = {h for t, h in batch.removed if t == tier}
        assert before - removed | stored == after
        assert stored <= after and not removed & after

    net(TIER_DEVICE, device_before, device_after)
    net(TIER_HOST, host_before, host_after)
    engine.check_no_leaks()


class _Frames:
    """An outbox that keeps what is sent (the Vitals under test send KvEvents frames only)."""

    def __init__(self) -> None:
        self.sent: list[KvEvents] = []

    def send(self, message: KvEvents) -> None:
        self.sent.append(message)


def test_a_snapshot_asked_for_holds_both_tiers_and_the_events_go_on_from_it() -> None:
    """``KvResync`` on the worker (workers/worker_vitals.py): the next KV events are a snapshot of both
    tiers, its first frame marked reset, numbered on from the last frame; changes not sent yet are in
    it, not sent again; a second ask within KV_SNAPSHOT_INTERVAL_S waits for the interval."""
    engine = _engine(kv_offload_gib=0.002)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    info = WorkerInfo(
        "prefill-0", "prefill", "i0", "tcp://x:1", "127.0.0.1", 16, 32, 512, 512, "/m", "cpu", 1
    )
    frames, now = _Frames(), [10.0]
    vitals = Vitals(
        info, engine, None, None, cast(Any, frames), 1.0, lambda: True, dict, clock=lambda: now[0]
    )
    _run_turns(engine, params, num_turns=2)
    vitals.send_kv_events()  # the first batch: a snapshot as it subscribes, but no reset asked
    assert [(f.seq, f.reset) for f in frames.sent] == [(0, False)]
    _run_turns(engine, params, num_turns=3)  # changes pending
    kv = engine.scheduler.kv
    assert kv.prefix_cache is not None and kv.host is not None

    def held() -> list[tuple[int, bytes]]:
        assert kv.prefix_cache is not None and kv.host is not None
        device = [(TIER_DEVICE, h) for h in kv.prefix_cache.hashes()]
        return sorted(device + [(TIER_HOST, h) for h in kv.host.hashes()])

    vitals.request_kv_snapshot()
    now[0] += 0.005  # within KV_EVENTS_INTERVAL_S of the last frame: nothing yet
    vitals.send_kv_events()
    assert len(frames.sent) == 1
    now[0] += 0.01
    vitals.send_kv_events()
    snapshot = frames.sent[1:]
    assert [(f.seq, f.reset) for f in snapshot] == [(1, True)] and vitals.num_kv_snapshots == 1
    assert sorted(snapshot[0].stored) == held() and snapshot[0].removed == []
    now[0] += 0.02
    vitals.send_kv_events()
    assert len(frames.sent) == 2  # what was pending is in the snapshot, not sent again
    _run_turns(engine, params, num_turns=1)
    vitals.request_kv_snapshot()  # within KV_SNAPSHOT_INTERVAL_S of the last one: the plain changes
    now[0] += 0.02
    vitals.send_kv_events()
    assert [(f.seq, f.reset) for f in frames.sent[2:]] == [(2, False)]
    now[0] += KV_SNAPSHOT_INTERVAL_S
    vitals.send_kv_events()  # the ask kept: a snapshot now
    assert [(f.seq, f.reset) for f in frames.sent[3:]] == [(3, True)] and vitals.num_kv_snapshots == 2
    assert sorted(frames.sent[3].stored) == held()
    # the index a router builds from every frame equals the tiers
    index = KvIndex(1 << 20, 4)
    for f in frames.sent:
        index.apply(f.worker_id, f.incarnation, f.seq, f.stored, f.removed, f.reset)
    assert index.num_blocks("prefill-0") == len({h for _, h in held()}) and index.num_gaps == 0
    engine.check_no_leaks()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("is_async", [False, True])
def test_on_cuda_the_tier_copies_in_stream_order_and_outputs_equal_without_it(is_async: bool) -> None:
    """On CUDA the copies are enqueued on the step's stream into pinned slots and the host never waits:
    outputs (float32, greedy) equal the tier-less engine's, and each reloaded block holds exactly the
    bytes it was offloaded with."""
    options: dict[str, object] = {"device": "cuda", "async_scheduling": is_async}
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    expected = _run_turns(_engine(model=ModelConfig(dtype="float32"), **options), params)
    tiered = _engine(model=ModelConfig(dtype="float32"), kv_offload_gib=0.002, **options)
    host_kv = tiered.runner.host_kv
    assert host_kv is not None and host_kv.slots.is_pinned()
    checked = _CheckedHostKv(tiered.runner.kv_cache, host_kv.slots.shape[0])
    tiered.runner.host_kv = checked
    assert _run_turns(tiered, params) == expected
    assert checked.num_checked == tiered.stats().kv_loaded_blocks > 0
    tiered.check_no_leaks()
