"""The soak benchmark's 60-second version: streaming traffic with kill -9, SIGSTOP and malformed frames
every few seconds. Nothing may hang or leak, every failure must say what happened, and the cluster must be
whole again after every fault."""

from __future__ import annotations

import argparse

import pytest

from bench.soak import run_soak

pytestmark = pytest.mark.slow


def test_one_minute_soak_hangs_nothing_leaks_nothing_and_recovers() -> None:
    args = argparse.Namespace(
        minutes=1.0,
        config="deploy/cpu-disagg.yaml",
        concurrency=6,
        fault_every=6.0,
        seed=3,
        lab=False,
        out=None,
    )
    report = run_soak(args)
    tally = report["tally"]
    assert tally["ok"] > 0
    assert (tally["hung"], tally["unclear"]) == (0, 0), tally
    assert set(report["leaks"].values()) == {None}, report["leaks"]
    assert {f["kind"] for f in report["faults"]} >= {"kill9", "frames", "sigstop"}
    assert report["unrecovered"] == 0, report["faults"]
