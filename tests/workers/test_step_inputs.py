"""Step inputs: the persistent block-table rows give exactly the arrays of the flattened path, step after
step, as tables grow, get replaced (preemption), and requests come and go; decode-only and mixed steps;
the counts a caller may pass (tokens, sampling sequences) change nothing."""

from __future__ import annotations

import random

import numpy as np

from cluster.protocol import SamplingParams
from workers.scheduler import ScheduledRequest
from workers.step_inputs import PersistentBlockTables, build_step_arrays

BLOCK_SIZE = 4
PARAMS = SamplingParams()


def _scheduled(
    request_id: str, start: int, num_new: int, table: list[int], needs_sample: bool = True
) -> ScheduledRequest:
    tokens = list(range(100 + start, 100 + start + num_new))
    return ScheduledRequest(request_id, tokens, start, table, needs_sample, num_new == 1, PARAMS, 0)


def _assert_same(sched: list[ScheduledRequest], tables: PersistentBlockTables) -> None:
    flat = build_step_arrays(sched, BLOCK_SIZE)
    persistent = build_step_arrays(sched, BLOCK_SIZE, tables)
    num_tokens = sum(len(s.token_ids) for s in sched)
    counted = build_step_arrays(sched, BLOCK_SIZE, tables, num_tokens, sum(s.needs_sample for s in sched))
    for other in (persistent, counted):
        for name in ("input_ids", "positions", "slots", "cu_q", "seq_lens", "block_tables", "logits_indices"):
            assert np.array_equal(getattr(flat, name), getattr(other, name)), name
        assert flat.sample_rows == other.sample_rows and flat.max_query_len == other.max_query_len


def test_persistent_rows_match_flattened_tables_over_many_steps() -> None:
    rng = random.Random(0)
    tables = PersistentBlockTables(num_rows=2, max_blocks=2)  # both grow during the run
    next_block = iter(range(1, 10_000))
    state: dict[str, tuple[int, list[int]]] = {}  # request id -> (tokens computed, its block list)
    seen_decode_only = seen_unsampled = False
    for step in range(60):
        if rng.random() < 0.3 or not state:
            state[f"r{step}"] = (0, [])
        if state and rng.random() < 0.15:  # a request ends
            gone = rng.choice(sorted(state))
            del state[gone]
            tables.remove(gone)
        if state and rng.random() < 0.1:  # preempted and resumed: a new block list, recomputed
            victim = rng.choice(sorted(state))
            state[victim] = (0, [])
        sched = []
        for rid in sorted(state, key=lambda r: state[r][0] == 0):  # decodes (computed > 0) first
            computed, blocks = state[rid]
            num_new = rng.randint(2, 9) if computed == 0 else 1
            while len(blocks) * BLOCK_SIZE < computed + num_new:
                blocks.append(next(next_block))
            if rng.random() < 0.2:
                blocks.append(next(next_block))  # held ahead (asynchronous scheduling)
            sched.append(_scheduled(rid, computed, num_new, blocks, computed > 0 or rng.random() < 0.7))
            state[rid] = (computed + num_new, blocks)
        _assert_same(sched, tables)
        decode_only = all(len(s.token_ids) == 1 for s in sched)
        seen_decode_only |= decode_only
        seen_unsampled |= not all(s.needs_sample for s in sched)
    assert seen_decode_only and seen_unsampled
    for rid in list(state):
        tables.remove(rid)
    assert tables.num_requests == 0


def test_decode_only_step_arrays() -> None:
    tables = PersistentBlockTables(num_rows=4, max_blocks=4)
    sched = [_scheduled("a", 5, 1, [7, 3]), _scheduled("b", 0, 1, [9]), _scheduled("c", 8, 1, [2, 4, 6])]
    arrays = build_step_arrays(sched, BLOCK_SIZE, tables, num_tokens=3, num_sampling=3)
    assert arrays.input_ids.tolist() == [105, 100, 108]
    assert arrays.positions.tolist() == [5, 0, 8]
    assert arrays.seq_lens.tolist() == [6, 1, 9]
    assert arrays.cu_q.tolist() == [0, 1, 2, 3]
    assert arrays.block_tables.tolist() == [[7, 3, 0], [9, 0, 0], [2, 4, 6]]
    assert arrays.slots.tolist() == [3 * 4 + 1, 9 * 4 + 0, 6 * 4 + 0]
    assert arrays.logits_indices.tolist() == [0, 1, 2] and arrays.sample_rows == [0, 1, 2]
