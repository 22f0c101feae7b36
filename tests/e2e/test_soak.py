"""The soak benchmark's 24-second version (CI's 15-minute budget; `pdserve bench soak --minutes M` runs
longer): streaming traffic with kill -9, SIGSTOP and malformed frames every few seconds. Nothing may hang or leak, every failure must say what happened, and the cluster must be
whole again after every fault."""

from __future__ import annotations

import argparse

import pytest

from bench.soak import RSS_MIN_SPAN_S, fault_kinds, rss_growth, run_soak


@pytest.mark.slow
def test_a_24_second_soak_hangs_nothing_leaks_nothing_and_recovers() -> None:
    args = argparse.Namespace(
        minutes=0.4,  # NOTE: a fault 3 s after the cluster is whole again: each kind at least once
        config="deploy/cpu-disagg.yaml",
        concurrency=6,
        fault_every=3.0,
        seed=3,
        lab=False,
        out=None,
        faults="all",
        rss_warmup=120.0,
    )
    report = run_soak(args)
    tally = report["tally"]
    assert tally["ok"] > 0
    assert (tally["hung"], tally["unclear"]) == (0, 0), tally
    assert set(report["leaks"].values()) == {None}, report["leaks"]
    assert {f["kind"] for f in report["faults"]} >= {"kill9", "frames", "sigstop"}
    assert report["unrecovered"] == 0, report["faults"]


def test_rss_growth_leaves_out_the_warm_up_and_processes_too_short_lived() -> None:
    mib = 1 << 20
    long_lived = [(t, 100 * mib if t < 60 else 110 * mib if t < 200 else 121 * mib) for t in range(400)]
    short = [(t, t * mib) for t in range(100, 150)]
    steady, whole = rss_growth({("decode-0", 1): long_lived, ("decode-0", 2): short}, 60.0)
    assert steady == {"decode-0 (pid 1)": pytest.approx(10.0)}  # 110 -> 121 MiB after the warm-up
    assert whole == {"decode-0 (pid 1)": pytest.approx(21.0), "decode-0 (pid 2)": pytest.approx(49.0)}
    assert 400 - 60 >= RSS_MIN_SPAN_S > 150 - 100


def test_fault_kinds_are_checked_and_a_link_flap_needs_the_lab() -> None:
    assert fault_kinds("all", on_lab=True) == ["frames", "sigstop", "kill9", "link_flap"]
    assert fault_kinds("all", on_lab=False) == ["frames", "sigstop", "kill9"]
    assert fault_kinds("sigstop, frames", on_lab=False) == ["sigstop", "frames"]
    with pytest.raises(ValueError, match=r"unknown kinds \['oom'\]"):
        fault_kinds("kill9,oom", on_lab=True)
    with pytest.raises(ValueError, match="link_flap needs --lab"):
        fault_kinds("link_flap", on_lab=False)
    with pytest.raises(ValueError, match="unknown kinds"):
        fault_kinds("", on_lab=True)
