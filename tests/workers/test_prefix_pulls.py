"""The puller's half of a prefix pull (workers/prefix_pulls.py) on a real Engine, with the KV receiver
replaced by a fake the test ends: a fetch that fails (its holder died mid-transfer, junk in its blocks)
frees its reservation and caches nothing; one that lands caches the blocks with no user, and the prompt
then finds them as a prefix hit and decodes exactly as without the pull; the leak check is clean after
each."""

from __future__ import annotations

import time

import pytest

from cluster.config import TransferConfig
from cluster.wire import FetchPrefix, PrefixFetched
from tests.support.handoff_fakes import FakeReceiver, PrefillEngine, context, engine_config, greedy
from tests.support.hf_models import make_random_hf_model
from transfer.channel import layout_of
from transfer.protocol import KVHandoff
from workers.engine import Engine
from workers.prefix_pulls import PrefixPulls

PROMPT = list(range(3, 33))  # 7 full blocks of 4 tokens and 2 more


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_hf_model("qwen3", tmp_path_factory.mktemp("pulls")))


def fetch_op(engine: Engine, pull_id: str, num_blocks: int) -> FetchPrefix:
    layout = layout_of(engine.runner.kv_cache)
    handoff = KVHandoff(
        pull_id, "decode-0", "d0", "tcp://127.0.0.1:1", layout, num_blocks * 4, num_blocks, 0.0
    )
    return FetchPrefix(pull_id, PROMPT[: num_blocks * 4], handoff.to_bytes(), time.time() + 60)


def test_a_failed_fetch_frees_its_blocks_and_a_landed_one_is_a_prefix_hit(model_dir: str) -> None:
    holder = PrefillEngine(model_dir)
    _, rows = holder.prefill("h", PROMPT, greedy(2))  # the holder's KV of the prompt's 8 blocks
    reference = holder.engine
    reference.add_request("r", PROMPT, greedy(6))
    expected = [
        t for _ in range(20) if reference.has_unfinished() for d in reference.step() for t in d.token_ids
    ]

    engine = Engine(engine_config(model_dir))
    events: list[object] = []
    commands: list[object] = []
    pulls = PrefixPulls(context(engine, TransferConfig(), events, commands), can_pull=True)
    receiver = FakeReceiver(engine.runner.kv_cache)
    pulls.receiver = receiver  # type: ignore[assignment]
    kv = engine.scheduler.kv

    def drain() -> None:
        while commands:
            assert pulls.handle(commands.pop(0))

    # a fetch that fails mid-transfer (junk landed in its blocks): freed, nothing cached, the router told
    assert pulls.handle(fetch_op(engine, "pull:1", 7))
    fetch = receiver.fetches["pull:1"]
    assert (fetch.dst_block_ids, fetch.skip_first_n_blocks) == ([1, 2, 3, 4, 5, 6, 7], 0)
    assert kv.block_tables["pull:1"] == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(AssertionError, match="fetches \\['pull:1'\\]"):
        pulls.check_leaks()
    receiver.fail("pull:1", junk=True)
    drain()
    assert events == [
        PrefixFetched("worker-0", "pull:1", 0, 0, "TransferError: injected: the sender went away")
    ]
    assert kv.prefix_cache is not None and len(kv.prefix_cache) == 0
    engine.check_no_leaks()
    pulls.check_leaks()

    # an abort of a fetch in flight cancels it; its blocks are freed when it ends
    assert pulls.handle(fetch_op(engine, "pull:2", 7))
    assert pulls.on_abort("pull:2") and not pulls.on_abort("pull:unknown")
    drain()
    assert events[-1] == PrefixFetched(
        "worker-0", "pull:2", 0, 0, "TransferError: fetch of 'pull:2' cancelled"
    )
    engine.check_no_leaks()

    # one that lands: cached with no user; the prompt then hits all 7 blocks and decodes as without it
    assert pulls.handle(fetch_op(engine, "pull:3", 7))
    receiver.land("pull:3", rows[:, :7])
    drain()
    nbytes = rows[:, :7].numel() * rows.element_size()
    assert events[-1] == PrefixFetched("worker-0", "pull:3", 7, nbytes, "")
    assert (pulls.num_pulled_blocks, pulls.num_pulled_bytes, pulls.num_pull_failures) == (7, nbytes, 2)
    engine.check_no_leaks()
    pulls.check_leaks()
    engine.add_request("r", PROMPT, greedy(6))
    deltas = [d for _ in range(20) if engine.has_unfinished() for d in engine.step()]
    assert [t for d in deltas for t in d.token_ids] == expected
    assert deltas[0].num_cached_tokens == 28
    # nothing is missing any more: a second pull of it takes nothing
    assert pulls.handle(fetch_op(engine, "pull:4", 7))
    assert events[-1] == PrefixFetched("worker-0", "pull:4", 0, 0, "nothing missing here, or blocks short")
    engine.check_no_leaks()
    pulls.check_leaks()
