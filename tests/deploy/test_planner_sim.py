"""The planner's simulation twin under hand-computable cost models: exact schedules, times and leaks."""

from __future__ import annotations

from dataclasses import replace

from cluster.config import EngineConfig
from cluster.cost_model import CostProfile, LinearStepCost, StepShape, TransferCost
from deploy.planner.report import Slo, summarize_result
from deploy.planner.sim import RequestRecord, SimResult, Simulation
from deploy.planner.twin import SimConfig, SimWorker
from deploy.planner.workload import SimRequest, Workload


def profile(
    step: LinearStepCost | None = None, *, hop_s: float = 0.0, http_s: float = 0.0, kv: int = 1000
) -> CostProfile:
    return CostProfile(
        "test",
        "hand-made",
        step or constant(0.010),
        TransferCost(latency_s=0.005, bytes_per_s=1e6),
        kv_bytes_per_token=kv,
        hop_s=hop_s,
        http_s=http_s,
    )


def constant(seconds: float) -> LinearStepCost:
    return LinearStepCost(seconds, 0.0, 0.0, 0.0, 0.0, 0.0)


def config(mode: str = "colocated", *, blocks: int = 64, budget: int = 1024, **pools: int) -> SimConfig:
    engine = EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=8)
    return SimConfig(mode, engine=engine, num_kv_blocks=blocks, max_model_len=256, **pools)


def workload(*requests: tuple[float, int, int]) -> Workload:
    return Workload("hand", [SimRequest(t, p, o) for t, p, o in requests], vocab_size=500)


Step = tuple[str, int, StepShape, int]


def run(cfg: SimConfig, prof: CostProfile, wl: Workload) -> tuple[SimResult, list[Step]]:
    """Every step as (worker, start in microseconds, shape, duration in microseconds)."""
    steps: list[Step] = []

    def on_step(w: SimWorker, t: float, shape: StepShape, step_s: float) -> None:
        steps.append((w.worker_id, round(t * 1e6), shape, round(step_s * 1e6)))

    sim = Simulation(cfg, prof, wl, on_step=on_step)
    result = sim.run()
    for w in sim.workers:
        w.scheduler.check_no_leaks()
    assert sim.flights == {}
    return result, steps


def us(record: RequestRecord) -> tuple[int | None, list[int], int | None]:
    """(TTFT, gaps, E2E) in microseconds."""
    ttft, e2e = record.ttft_s, record.e2e_s
    return (
        None if ttft is None else round(ttft * 1e6),
        [round(g * 1e6) for g in record.gaps_s],
        None if e2e is None else round(e2e * 1e6),
    )


def decodes(*starts: int) -> StepShape:
    """Decode-only step of sequences at these positions (padded to the longest)."""
    return StepShape(0, 0, len(starts), sum(starts), 0, len(starts) * max(starts))


def prefill(n: int, start: int = 0) -> StepShape:
    """One prompt chunk of n tokens from position ``start``, alone in its step."""
    return StepShape(n, 1, 0, 0, n * start + n * (n + 1) // 2)


def test_three_requests_colocated() -> None:
    # A at 0 (6 + 3 tokens), B at 5 ms (3 + 2), C at 31 ms (5 + 1); 10 ms steps, 1 ms hop, 2 ms HTTP.
    result, steps = run(
        config(num_colocated=1),
        profile(hop_s=0.001, http_s=0.002),
        workload((0.0, 6, 3), (0.005, 3, 2), (0.031, 5, 1)),
    )
    w = "colocated-0"
    assert steps == [
        (w, 3000, prefill(6), 10000),  # A arrives at 3 ms (2 ms HTTP + 1 ms hop)
        (w, 13000, StepShape(3, 1, 1, 6, 6, 6), 10000),  # B (queued at 8 ms) joins A's first decode
        (w, 23000, decodes(7, 3), 10000),
        (w, 34000, prefill(5), 10000),  # the worker idled from 33 ms until C came
    ]
    a, b, c = result.records
    assert us(a) == (16000, [10000, 10000], 36000)
    assert us(b) == (21000, [10000], 31000)
    assert us(c) == (16000, [], 16000)
    assert [r.num_tokens for r in result.records] == [3, 2, 1]
    assert result.num_steps == 4 and result.num_preemptions == 0


def test_chunked_prefill_under_the_token_budget() -> None:
    # budget 8: A's 20-token prompt takes three chunks; B (3 tokens) fits beside the last one.
    cost = LinearStepCost(0.001, 0.001, 0.0, 0.0005, 0.0, 0.0)  # 1 ms + 1 ms / prompt token + 0.5 ms / decode
    result, steps = run(config(num_colocated=1, budget=8), profile(cost), workload((0.0, 20, 2), (0.0, 3, 3)))
    w = "colocated-0"
    assert steps == [
        (w, 0, prefill(8), 9000),
        (w, 9000, prefill(8, 8), 9000),
        (w, 18000, StepShape(7, 2, 0, 0, (4 * 16 + 10) + 6), 8000),  # A's last 4 tokens + B's 3
        (w, 26000, decodes(20, 3), 2000),
        (w, 28000, decodes(4), 1500),  # A finished (2 tokens); B decodes alone
    ]
    a, b = result.records
    assert us(a) == (26000, [2000], 28000)
    assert us(b) == (26000, [2000, 1500], 29500)


def test_preemption_by_recompute_and_prefix_hit() -> None:
    # 4 usable blocks of 4 tokens. A (6 + 6) and B (5 + 4) both grow a third block; B, the newest, is
    # preempted at 30 ms, waits (its cached first block is a hit but a second block is short) until A
    # finishes, then recomputes its last 3 tokens from that hit and decodes on.
    result, steps = run(config(num_colocated=1, blocks=5), profile(), workload((0.0, 6, 6), (0.0, 5, 4)))
    assert [(t, shape) for _, t, shape, _ in steps] == [
        (0, prefill(6)),  # B reached the worker while this step ran
        (10000, StepShape(5, 1, 1, 6, 15, 6)),
        (20000, decodes(7, 5)),
        (30000, decodes(8)),  # B preempted
        (40000, decodes(9)),
        (50000, decodes(10)),  # A's 6th token: A finishes, frees its blocks
        (60000, StepShape(3, 1, 0, 0, 3 * 4 + 6)),  # B: 4 tokens from the prefix cache, 3 recomputed
        (70000, decodes(7)),
    ]
    assert {x[3] for x in steps} == {10000}
    a, b = result.records
    assert us(a) == (10000, [10000] * 5, 60000)
    assert us(b) == (20000, [10000, 40000, 10000], 80000)
    assert result.num_preemptions == 1
    # the cache counts a lookup once its blocks are taken: B's first block, looked up at 40, 50 and 60 ms,
    # was taken at 60 ms
    assert result.prefix_hit_tokens == 4


def without_early_admission(cfg: SimConfig) -> SimConfig:
    """The router's usual handoff path: the decode worker is picked and reserves at the handoff."""
    return replace(cfg, router=replace(cfg.router, early_decode_admission=False))


def test_disaggregated_handoff_times() -> None:
    # prefill 10 ms -> first token (+1 ms hop, +2 ms HTTP); router hands off (+1 ms hop to the decode
    # worker); 2 blocks x 4 tokens x 1000 B at 1 MB/s + 5 ms = 13 ms transfer; then 10 ms decode steps.
    cfg = without_early_admission(config("disaggregated", num_prefill=1, num_decode=1))
    result, steps = run(cfg, profile(hop_s=0.001, http_s=0.002), workload((0.0, 6, 3)))
    assert steps == [
        ("prefill-0", 3000, prefill(6), 10000),
        ("decode-0", 28000, decodes(6), 10000),
        ("decode-0", 38000, decodes(7), 10000),
    ]
    (a,) = result.records
    assert us(a) == (16000, [25000, 10000], 51000)
    assert round(a.transfer_s * 1e6) == 13000
    assert a.route == "disaggregated"


def test_early_decode_admission_moves_the_kv_as_the_prefill_offers_it() -> None:
    # as above, but the decode worker reserves at dispatch (told at 3 ms): the KV moves 13-26 ms, from the
    # prefill's end instead of the handoff's arrival (15 ms); the first token (there at 15 ms) waits for it
    cfg = config("disaggregated", num_prefill=1, num_decode=1)
    assert cfg.router.early_decode_admission
    result, steps = run(cfg, profile(hop_s=0.001, http_s=0.002), workload((0.0, 6, 3)))
    assert steps == [
        ("prefill-0", 3000, prefill(6), 10000),
        ("decode-0", 26000, decodes(6), 10000),
        ("decode-0", 36000, decodes(7), 10000),
    ]
    (a,) = result.records
    assert us(a) == (16000, [23000, 10000], 49000)
    assert round(a.transfer_s * 1e6) == 13000
    # one token: nothing to decode, no early admission
    result, steps = run(cfg, profile(hop_s=0.001, http_s=0.002), workload((0.0, 6, 1)))
    assert [w for w, *_ in steps] == ["prefill-0"] and result.records[0].transfer_s == 0.0


def test_early_reservations_can_leave_a_committed_request_no_block_to_grow_into() -> None:
    # 6 usable blocks of 4 tokens per worker; prompts of 12 tokens (3 blocks), 2 tokens out, all at 0 ms
    # (hop/HTTP 0): the decode worker reserves A's and B's prompt blocks at dispatch (early decode
    # admission), C's waits. Prefill: A 0-10, B 10-20, C once A's KV has left (27-37).
    # KV (3 blocks x 4 x 1000 B at 1 MB/s + 5 ms = 17 ms, one at a time): A's 10-27, B's 27-44, C's 44-61.
    # A commits at 27 with no free block for its next token: preempted (recompute), its blocks go to C's
    # waiting reservation; B at 44 the same; C decodes at 61; then A (8 tokens cached) and B recompute.
    cfg = config("disaggregated", blocks=7, num_prefill=1, num_decode=1)
    result, steps = run(cfg, profile(), workload((0.0, 12, 2), (0.0, 12, 2), (0.0, 12, 2)))
    assert steps == [
        ("prefill-0", 0, prefill(12), 10000),
        ("prefill-0", 10000, prefill(12), 10000),
        ("prefill-0", 27000, prefill(12), 10000),
        ("decode-0", 61000, decodes(12), 10000),
        ("decode-0", 71000, prefill(5, 8), 10000),
        ("decode-0", 81000, prefill(13), 10000),
    ]
    assert [round(r.transfer_s * 1e6) for r in result.records] == [17000, 24000, 24000]
    assert [us(r) for r in result.records] == [
        (10000, [81000], 91000),
        (20000, [61000], 81000),
        (37000, [34000], 71000),
    ]
    assert result.num_preemptions == 2
    # (hop 0: each handoff reaches the decode worker as its prefill offers the KV, so the usual path,
    # which reserves at the handoff, runs the same schedule)
    _, plain = run(
        without_early_admission(cfg), profile(), workload((0.0, 12, 2), (0.0, 12, 2), (0.0, 12, 2))
    )
    assert plain == steps


def test_transfers_queue_on_the_decode_workers_link() -> None:
    # B's prefill ends at 20 ms while A's handoff (10 -> 23 ms) still holds the link: B's starts at 23 ms
    cfg = config("disaggregated", num_prefill=1, num_decode=1)
    result, steps = run(cfg, profile(), workload((0.0, 8, 2), (0.0, 8, 2)))
    assert [round(r.transfer_s * 1e6) for r in result.records] == [13000, 3000 + 13000]
    assert [(w, t) for w, t, _, _ in steps] == [
        ("prefill-0", 0),  # A alone: B reached the worker while this step ran
        ("prefill-0", 10000),  # B (A is held for its handoff, no longer scheduled)
        ("decode-0", 23000),  # A's KV landed at 23 ms: its second (last) token
        ("decode-0", 36000),  # B's KV landed at 36 ms
    ]


def test_conditional_mode_without_cost_routing_sends_short_prompts_to_decode() -> None:
    cfg = config("conditional", num_prefill=1, num_decode=1)
    cfg = replace(cfg, router=replace(cfg.router, conditional_max_prompt_tokens=4), cost_routing=False)
    result, steps = run(cfg, profile(), workload((0.0, 4, 1), (0.0, 5, 1)))
    assert [(r.route, r.route_reason) for r in result.records] == [
        ("conditional", "short_prompt"),
        ("disaggregated", "long_prompt"),
    ]
    assert [(w, s.num_prefill_tokens) for w, _, s, _ in steps] == [("decode-0", 4), ("prefill-0", 5)]


def test_queue_full_is_a_rejection() -> None:
    cfg = config(num_colocated=1)
    cfg = replace(cfg, router=replace(cfg.router, max_pending_requests=1))
    result, _ = run(cfg, profile(), workload((0.0, 4, 2), (0.0, 4, 2)))
    assert [r.rejected for r in result.records] == [None, "queue_full"]


def test_cpu_workers_sharing_a_host_stretch_their_steps() -> None:
    # two colocated CPU workers on one core: the second starts its step while the first is busy, so
    # its step takes twice as long (the stretch is fixed when a step starts)
    shared = replace(profile(), host_cpus=1.0)
    result, steps = run(config(num_colocated=2), shared, workload((0.0, 4, 1), (0.0, 4, 1)))
    assert [(w, t, d) for w, t, _, d in steps] == [("colocated-0", 0, 10000), ("colocated-1", 0, 20000)]
    assert [us(r)[0] for r in result.records] == [10000, 20000]


def test_front_end_handles_one_token_at_a_time() -> None:
    # 1 ms of front-end CPU per token: the three tokens of the second step reach their clients 1 ms apart
    serial = replace(profile(), frontend_cpu_per_token_s=0.001)
    result, steps = run(config(num_colocated=1), serial, workload((0.0, 4, 3), (0.0, 4, 1), (0.0, 4, 1)))
    assert [t for _, t, _, _ in steps] == [0, 10000, 20000]
    a, b, c = result.records
    assert us(a) == (11000, [10000, 10000], 31000)
    assert (us(b)[0], us(c)[0]) == (22000, 23000)


def test_front_end_shares_itself_between_new_requests() -> None:
    # 2 ms of front-end work per new request. Three sent at once share it: all routed at 6 ms (the
    # first delivered starts a step alone, as in every simulated tie; the two others take the next). A
    # fourth at 40 ms has it to itself: routed at 42 ms, TTFT 12 ms.
    edge = replace(profile(), frontend_s_per_request=0.002)
    wl = workload((0.0, 4, 1), (0.0, 4, 1), (0.0, 4, 1), (0.040, 4, 1))
    result, steps = run(config(num_colocated=1), edge, wl)
    assert [(t, shape.num_prefill_seqs) for _, t, shape, _ in steps] == [(6000, 1), (16000, 2), (42000, 1)]
    assert [us(r)[0] for r in result.records] == [16000, 26000, 26000, 12000]
    # A at 0, B at 1 ms: A has 1 ms alone, then both share it: A is done at 3 ms, B (1 ms of its 2 then)
    # at 4 ms. A's step runs 3-13 ms; B's waits for it: 13-23 ms.
    result, steps = run(config(num_colocated=1), edge, workload((0.0, 4, 1), (0.001, 4, 1)))
    assert [t for _, t, _, _ in steps] == [3000, 13000]
    assert [us(r)[0] for r in result.records] == [13000, 22000]
    # On a host of one core, a step that starts while the front end holds a request is stretched by
    # 2 (the worker and the front end): A's step lasts 20 ms, B's (started with the front end idle) 10.
    one_core = replace(edge, host_cpus=1.0)
    result, steps = run(config(num_colocated=1), one_core, workload((0.0, 4, 1), (0.001, 4, 1)))
    assert [(t, d) for _, t, _, d in steps] == [(3000, 20000), (23000, 10000)]
    assert [us(r)[0] for r in result.records] == [23000, 32000]


def test_a_front_end_that_takes_new_requests_in_order() -> None:
    # as above with frontend_fifo: the three sent at once are routed 2 ms apart (2, 4, 6 ms): A's step
    # runs 2-12 ms alone, B and C share the next (12-22); the fourth, alone again, at 42 ms
    edge = replace(profile(), frontend_s_per_request=0.002, frontend_fifo=True)
    wl = workload((0.0, 4, 1), (0.0, 4, 1), (0.0, 4, 1), (0.040, 4, 1))
    result, steps = run(config(num_colocated=1), edge, wl)
    assert [(t, shape.num_prefill_seqs) for _, t, shape, _ in steps] == [(2000, 1), (12000, 2), (42000, 1)]
    assert [us(r)[0] for r in result.records] == [12000, 22000, 22000, 12000]


def test_a_handoff_beside_a_spinning_sender_takes_longer() -> None:
    # the reservations test's load (6 usable blocks, three 12-token prompts at 0 ms) with handoffs 3x
    # slower beside a spinning worker: A's KV leaves as B's prefill starts (blocks for B: 17 ms, 10-27);
    # when B's KV is offered (20 ms) C waits for blocks the prefill worker has not: it spins, and B's
    # handoff takes 3 x 17 = 51 ms (27-78); C's (prefilled 27-37 once A's blocks are back) 51 ms too
    # (78-129): the decode worker spins then (A, committed at 27 with no block to grow into, waits)
    cfg = config("disaggregated", blocks=7, num_prefill=1, num_decode=1)
    slow = replace(profile(), spinning_transfer_scale=3.0)
    result, steps = run(cfg, slow, workload((0.0, 12, 2), (0.0, 12, 2), (0.0, 12, 2)))
    assert [round(r.transfer_s * 1e6) for r in result.records] == [17000, 58000, 92000]
    assert [(w, t) for w, t, _, _ in steps][:3] == [
        ("prefill-0", 0),
        ("prefill-0", 10000),
        ("prefill-0", 27000),
    ]


def test_slo_admission_refuses_what_would_queue_past_the_ttft_slo() -> None:
    # 4-token budget, 10 ms steps, TTFT SLO 25 ms, three 4-token prompts at once: the router predicts 1, 2
    # and 3 steps of queue (10, 20, 30 ms) and refuses the third, which counts as a miss
    cfg = config(num_colocated=1, budget=4)
    cfg = replace(cfg, router=replace(cfg.router, admission="slo", ttft_slo_ms=25.0))
    result, _ = run(cfg, profile(), workload((0.0, 4, 2), (0.0, 4, 2), (0.0, 4, 2)))
    assert [r.rejected for r in result.records] == [None, None, "slo_unattainable"]
    assert [r.num_tokens for r in result.records] == [2, 2, 0]
    summary = summarize_result(result, Slo(ttft_ms=1000.0, tbt_ms=1000.0))
    assert (summary.num_rejected, summary.slo_attainment) == (1, 2 / 3)


def test_delivery_jitter_delays_tokens_in_order_and_leaves_the_schedule_alone() -> None:
    # 40 requests of 6 tokens, 1 s apart (each alone): jitter moves only what the client sees
    wl = workload(*((float(i), 4, 6) for i in range(40)))
    plain, plain_steps = run(config(num_colocated=1), profile(), wl)
    jittery = replace(profile(), delivery_jitter_s=0.004)
    result, steps = run(config(num_colocated=1), jittery, wl)
    assert steps == plain_steps
    delays = []
    for a, b in zip(plain.records, result.records, strict=True):
        assert b.num_tokens == a.num_tokens == 6
        assert all(g >= 0.0 for g in b.gaps_s)  # a stream's tokens arrive in order
        assert b.first_token_s is not None and a.first_token_s is not None
        delays.append(b.first_token_s - a.first_token_s)
    assert min(delays) > 0.0
    # exponential delays of mean 4 ms: the sample mean of 40 (seed 0) within 30% of it
    assert 0.0028 < sum(delays) / len(delays) < 0.0052
    # the same seed gives the same run; another seed another
    again = Simulation(config(num_colocated=1), jittery, wl).run()
    other = Simulation(config(num_colocated=1), jittery, wl, seed=1).run()
    assert [us(r) for r in again.records] == [us(r) for r in result.records]
    assert [us(r) for r in other.records] != [us(r) for r in result.records]


def test_delivery_jitter_by_batch_follows_the_tokens_a_step_streams() -> None:
    # a table with no jitter for a step of one token and 4 ms for steps of 4: requests that run alone
    # arrive exactly as without jitter; of four sent at once, the first prefills alone (its first token
    # is not delayed), the three others' first tokens come from a step that streams 3 or 4
    table = replace(profile(), delivery_jitter_by_batch=((1, 0.0), (4, 0.004)))
    alone = workload(*((float(i), 4, 6) for i in range(10)))
    plain, _ = run(config(num_colocated=1), profile(), alone)
    result, _ = run(config(num_colocated=1), table, alone)
    assert [us(r) for r in result.records] == [us(r) for r in plain.records]
    together = workload(*((0.0, 4, 6) for _ in range(4)))
    plain, plain_steps = run(config(num_colocated=1), profile(), together)
    result, steps = run(config(num_colocated=1), table, together)
    assert steps == plain_steps
    delays = [
        b.first_token_s - a.first_token_s
        for a, b in zip(plain.records, result.records, strict=True)
        if a.first_token_s is not None and b.first_token_s is not None
    ]
    assert len(delays) == 4 and delays[0] == 0.0 and min(delays[1:]) > 0.0


def test_the_contended_jitter_delays_only_tokens_of_steps_that_end_beside_another_workers_step() -> None:
    # 10 ms steps, hop/HTTP 0. A: prefill 0-10 ms (the decode worker idle), KV lands at 19 ms, decodes
    # 19-29 (ends while B prefills 20-30: delayed), 29-39, 39-49, 49-59 (the prefill worker idle). B's
    # only token leaves its prefill at 30 ms, while A's decode step 29-39 runs: delayed.
    cfg = config("disaggregated", num_prefill=1, num_decode=1)
    wl = workload((0.0, 4, 5), (0.020, 4, 1))
    plain, plain_steps = run(cfg, profile(), wl)
    assert [us(r) for r in plain.records] == [
        (10000, [19000, 10000, 10000, 10000], 59000),
        (10000, [], 10000),
    ]
    result, steps = run(cfg, replace(profile(), delivery_jitter_contended_s=0.0005), wl)
    assert steps == plain_steps
    (a_ttft, a_gaps, a_e2e), (b_ttft, b_gaps, _) = (us(r) for r in result.records)
    delay = a_gaps[0] - 19000
    assert (a_ttft, a_e2e, b_gaps) == (10000, 59000, [])
    assert delay > 0 and a_gaps == [19000 + delay, 10000 - delay, 10000, 10000]
    assert b_ttft is not None and b_ttft > 10000


def test_a_prefill_step_beside_a_busy_decode_worker_stretches_by_the_prefill_weight() -> None:
    # one core, 10 ms steps, hop/HTTP 0. A: prefill 0-10 ms alone, KV (4 tokens x 1000 B at 1 MB/s + 5 ms)
    # lands at 19 ms, its decodes run from 19 ms. B arrives at 20 ms: its prefill starts beside A's
    # decode step (demand 2): 20 ms with weight 1 (demand / cores), (1 + 3 x 1) / 1 = 40 ms with weight 3.
    # The decode step that starts at 29 ms (beside B's prefill) takes 20 ms either way.
    wl = workload((0.0, 4, 5), (0.020, 4, 1))
    for weight, prefill_s in ((1.0, 20000), (3.0, 40000)):
        shared = replace(profile(), host_cpus=1.0, prefill_weight=weight)
        _, steps = run(config("disaggregated", num_prefill=1, num_decode=1), shared, wl)
        assert [(w, t, d) for w, t, _, d in steps if w == "prefill-0"] == [
            ("prefill-0", 0, 10000),
            ("prefill-0", 20000, prefill_s),
        ]
        assert [(t, d) for w, t, _, d in steps if w == "decode-0"][:2] == [(19000, 10000), (29000, 20000)]


def test_a_handoff_that_finishes_beside_a_step_costs_the_step_after_it() -> None:
    # 10 ms steps, hop/HTTP 0, a handoff of a 6-token prompt: 2 blocks x 4 tokens x 1000 B at 1 MB/s + 5 ms
    # = 13 ms, one at a time on the decode worker's link. A handoff that finishes during a step of its
    # receiving worker costs 4 ms, of its sending worker 3 ms: charged to that worker's next step.
    # A@0 prefills 0-10, its KV moves 10-23 while both workers are idle: no charge. B@12 prefills
    # 12-22, C@15 22-32, D@30 32-45 (+3: A's send finished at 23, beside C's step). B's KV moves 23-36
    # (behind A's), C's 36-49, D's 57-70 (its handoff waited in the decode worker's inbox from 45).
    # The decode worker: A's decodes from 23; B's KV landed beside the step at 33, C's beside the one at
    # 43, D's beside the one at 57: each next step takes 14 ms.
    cfg = without_early_admission(config("disaggregated", num_prefill=1, num_decode=1))
    prof = replace(profile(), handoff_receive_step_s=0.004, handoff_send_step_s=0.003)
    wl = workload((0.0, 6, 4), (0.012, 6, 2), (0.015, 6, 2), (0.030, 6, 2))
    result, steps = run(cfg, prof, wl)
    assert steps == [
        ("prefill-0", 0, prefill(6), 10000),
        ("prefill-0", 12000, prefill(6), 10000),
        ("prefill-0", 22000, prefill(6), 10000),
        ("decode-0", 23000, decodes(6), 10000),
        ("prefill-0", 32000, prefill(6), 13000),
        ("decode-0", 33000, decodes(7), 10000),
        ("decode-0", 43000, decodes(8, 6), 14000),
        ("decode-0", 57000, decodes(6), 14000),
        ("decode-0", 71000, decodes(6), 14000),
    ]
    # the twin counts what it charged: A's send on the prefill worker, B's, C's and D's receives
    assert result.worker_charged_handoffs == {"prefill-0": 1, "decode-0": 3}
    # (a transfer's time runs from the decode worker's turn that takes its handoff: C's from 33 ms, D's from 57)
    assert [round(r.transfer_s * 1e6) for r in result.records] == [13000, 14000, 16000, 13000]
    # without the costs, the same schedule at 10 ms a step
    _, plain = run(cfg, profile(), wl)
    assert [(w, t, d) for w, t, _, d in plain][:6] == [
        ("prefill-0", 0, 10000),
        ("prefill-0", 12000, 10000),
        ("prefill-0", 22000, 10000),
        ("decode-0", 23000, 10000),
        ("prefill-0", 32000, 10000),
        ("decode-0", 33000, 10000),
    ]
