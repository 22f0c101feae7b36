"""``pdserve bench multiturn`` at its smallest against the stub server: each turn's prompt is the history
the server saw and produced plus the new message, turns are grouped by index, and the hit rates by tier
come from the server's counters. Speed is not asserted (benchmarks print it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.multiturn import Turn, Workload, build_messages, comparison_table, main, summarize
from cluster.http.app import create_app
from deploy.loadgen import Record
from tests.support.stub_router import VOCAB_SIZE, ServerThread, StubRouter, expected_tokens, make_tokenizer

ARGS = ["--conversations", "2", "--turns", "3", "--system-prompt-len", "4", "--message-len", "5"]
ARGS += ["--output-len", "3", "--think-time-s", "0", "--block-size", "4"]


def test_each_turn_sends_the_history_and_the_report_groups_turns(tmp_path: Path) -> None:
    router = StubRouter(max_model_len=64)
    router.num_cached_tokens = 3
    with ServerThread(create_app(router, make_tokenizer())) as s:
        assert main(["--url", s.url, *ARGS, "--out", str(tmp_path)]) == 0
    w = Workload(2, 3, 4, 5, 3, 0.0)
    system, messages = build_messages(w, VOCAB_SIZE)
    assert len(system) == 4 and all(10 <= t < VOCAB_SIZE // 4 for t in system)
    sent = {tuple(call.prompt_token_ids): call.params for call in router.calls}
    assert len(router.calls) == len(sent) == 6
    for c in range(2):
        history = system
        for t in range(3):
            prompt = history + messages[c][t]
            params = sent[tuple(prompt)]  # the exact prompt was sent
            assert params.max_tokens == 3 and params.ignore_eos
            history = prompt + expected_tokens(prompt, params)  # the stub's answer, appended
    result = json.loads((tmp_path / "server.json").read_text())
    summary = result["summary"]
    assert [(p["turn"], p["count"], p["errors"], p["prompt_len"]) for p in summary["per_turn"]] == [
        (1, 2, 0, 9),
        (2, 2, 0, 17),
        (3, 2, 0, 25),
    ]
    # the stub reports 3 cached prompt tokens for every request
    assert [p["cached_ratio"] for p in summary["per_turn"]] == [3 / 9, 3 / 17, 3 / 25]
    assert sorted((r["conversation"], r["turn"], r["prompt_len"]) for r in result["turns"]) == [
        (c, t, 9 + 8 * (t - 1)) for c in range(2) for t in (1, 2, 3)
    ]
    # 1 shared system block, then ceil(25 / 4) - 1 of each conversation; the stub's prefill-0 has 40
    assert summary["kv"] == {
        "block_size": 4,
        "working_set_blocks": 13,
        "prefill_pool": "prefill",
        "device_blocks": 40,
        "device_to_working_set": 40 / 13,
        "host_blocks": 0,
    }
    # 3 of every prompt's tokens cached (the stub's usage); the stub's counters did not move
    assert summary["hits"]["usage"] == {"prompt_tokens": 102, "cached_tokens": 18, "cached_ratio": 18 / 102}
    assert summary["hits"]["device_hit_rate"] is None and summary["hits"]["queries"] == 0.0
    assert summary["same_prefill_worker_ratio"] is None and summary["prefill_workers"] == {}  # no route
    table = (tmp_path / "comparison.md").read_text().splitlines()
    assert table[2].startswith("| server | 6/6 |") and [line[:4] for line in table[-3:]] == [
        "| 1 ",
        "| 2 ",
        "| 3 ",
    ]


def test_hit_rates_by_tier_and_stickiness_from_usage_counters_and_routes() -> None:
    w = Workload(1, 2, 0, 16, 4, 0.0)
    turns = [
        Turn(0, 1, Record(16, 4, ttft_s=0.01, cached_tokens=0), "colocated-0", "colocated/kv_index_miss"),
        Turn(
            0, 2, Record(36, 4, ttft_s=0.02, cached_tokens=32), "colocated-0", "colocated/kv_index_host_hit"
        ),
    ]
    before = {"colocated": {"queries": 100.0, "hits": 10.0, "host_hits": 0.0, "device_blocks": 8.0}}
    after = {
        "colocated": {"queries": 300.0, "hits": 110.0, "host_hits": 16.0, "loaded_bytes": 65536.0},
        "decode": {"queries": 5.0},
    }
    s = summarize(turns, 1.0, before, after, w, 16)
    h = s["hits"]
    # as the prefill pool's counters moved: 200 tokens looked up, 100 found, 16 of them in the host tier
    assert (h["queries"], h["hits"], h["host_hits"], h["loaded_bytes"]) == (200.0, 100.0, 16.0, 65536.0)
    assert (h["device_hit_rate"], h["host_hit_rate"]) == (0.42, 0.08)
    # per request (usage): 32 of 52 prompt tokens cached
    assert h["usage"] == {"prompt_tokens": 52, "cached_tokens": 32, "cached_ratio": 32 / 52}
    assert s["per_pool"]["decode"] == {"queries": 5.0}
    assert s["routes"] == {"colocated/kv_index_miss": 1, "colocated/kv_index_host_hit": 1}
    assert s["same_prefill_worker_ratio"] == 1.0 and s["prefill_workers"] == {"colocated-0": 2}
    assert s["kv"]["working_set_blocks"] == 3  # ceil((2 * 16 + 4) / 16)
    assert s["ttft_ms_later"]["p50"] == pytest.approx(20.0)
    assert s["server_ms_later"] == {"queue": None, "prefill": None, "ttft": None}  # no server split


def test_the_router_split_of_later_turns_and_the_ratio_against_the_first_run() -> None:
    w = Workload(1, 2, 0, 16, 4, 0.0)

    def turn(k: int, ttft_s: float, split: dict[str, float] | None) -> Turn:
        return Turn(
            0, k, Record(16, 4, ttft_s=ttft_s, server=split), "prefill-0", "disaggregated/kv_index_miss"
        )

    split = {"queue_s": 0.002, "prefill_s": 0.030, "ttft_s": 0.033}
    off = summarize([turn(1, 0.02, split), turn(2, 0.060, split)], 1.0, {}, {}, w, 16)
    on = summarize(
        [turn(1, 0.02, None), turn(2, 0.024, {"queue_s": 0.001, "prefill_s": 0.018})], 1.0, {}, {}, w, 16
    )
    assert off["server_ms_later"] == pytest.approx({"queue": 2.0, "prefill": 30.0, "ttft": 33.0})
    assert on["server_ms_later"] == pytest.approx({"queue": 1.0, "prefill": 18.0, "ttft": 0.0})
    rows = comparison_table({"off": off, "on": on}).splitlines()
    assert rows[2].split(" | ")[5:7] == ["1.00x", "2.0 / 30.0"]
    assert rows[3].split(" | ")[5:7] == ["2.50x", "1.0 / 18.0"]
