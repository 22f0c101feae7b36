"""``pdserve plan spread``: the real sides of validations of the same seeded workloads held against each
other, recomputed from their request rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.cli import main as cli_main
from deploy.plan.spread import Validation, _first_runs, records_from_rows, spread
from deploy.plan.validate import request_rows
from deploy.planner.report import Slo, summarize
from deploy.planner.sim import RequestRecord

SLO = Slo(1000.0, 100.0)


def _rows(ttft_ms: float, gap_ms: float, n: int = 10) -> list[list[Any]]:
    """`n` requests of 3 tokens: TTFT `ttft_ms`, two gaps of `gap_ms` (prompt lengths 10, 11, ...)."""
    return [[10 + i, 3, ttft_ms, gap_ms, 3, [gap_ms, gap_ms]] for i in range(n)]


def _write(
    tmp_path: Path, name: str, real: list[list[Any]], sim: list[list[Any]], legacy: bool = False
) -> Path:
    data: dict[str, Any] = {
        "profile": {},
        "requests": {"w": {"real": real, "sim": sim}},
        "real_ttft_p90_ms_per_run": {"w": [0.0]},
    }
    if not legacy:  # NOTE: files before the runs / seeds / SLO were recorded: one profile, runs counted
        data |= {"profiles": [{}], "runs": {"w": 1}, "slo": {"ttft_ms": 1000.0, "tbt_ms": 100.0}}
    path = tmp_path / name / "validate.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return path


def test_rows_give_back_the_summaries_validate_printed() -> None:
    served = RequestRecord(10, 5, send_s=0.0, first_token_s=0.0125, num_tokens=3)
    served.gaps_s.extend([0.002, 0.004])
    slow = RequestRecord(12, 5, send_s=0.0, first_token_s=1.5, num_tokens=2)
    slow.gaps_s.extend([0.003])
    slow.finish_s = 1.503
    served.finish_s = 0.0185
    refused = RequestRecord(7, 2, send_s=0.0, rejected="too_long")
    records = [served, slow, refused]
    again = records_from_rows(request_rows(records))
    want, got = summarize("w", records, 1.0, SLO), summarize("w", again, 1.0, SLO)
    assert got.ttft_ms == pytest.approx(want.ttft_ms)
    assert got.tbt_ms == pytest.approx(want.tbt_ms)
    assert got.slo_attainment == want.slo_attainment == pytest.approx(1 / 3)  # slow misses TTFT, one refused
    assert got.num_rejected == want.num_rejected == 1


def test_every_ordered_pair_of_real_sides_and_each_sim_against_its_own(tmp_path: Path) -> None:
    # real TTFT 100 / 130 / 110 ms and gaps in the same ratio; each sim 5% over its own real side
    speeds = {"a": 100.0, "b": 130.0, "c": 110.0}
    paths = [
        _write(tmp_path, n, _rows(v, v / 10), _rows(v * 1.05, v / 10 * 1.05), legacy=n == "b")
        for n, v in speeds.items()
    ]
    result = spread([Validation.load(p, SLO) for p in paths])
    got = {(a, b): (f.ttft, f.tbt, f.attainment) for a, b, f in result.pairs}
    assert set(got) == {(a, b) for a in speeds for b in speeds if a != b}
    for (a, b), fig in got.items():
        expected = abs(speeds[a] - speeds[b]) / speeds[b] * 100
        assert fig == pytest.approx((expected, expected, 0.0)), (a, b)
    assert [(v, f.ttft, f.tbt) for v, f in result.sims] == [
        (n, pytest.approx(5.0), pytest.approx(5.0)) for n in speeds
    ]
    real, sim = result.by_workload["w"]
    median = (20 / 130 + 20 / 110) / 2 * 100  # of the six pairs' errors, above
    assert (real.ttft, real.tbt, real.attainment) == pytest.approx((median, median, 0.0))
    assert (sim.ttft, sim.tbt, sim.attainment) == pytest.approx((5.0, 5.0, 0.0))


def test_the_command_prints_the_floor_and_how_many_pairs_meet_the_goal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [
        str(_write(tmp_path, n, _rows(v, v / 10), _rows(v * 1.05, v / 10 * 1.05)))
        for n, v in (("a", 100.0), ("b", 130.0), ("c", 110.0))
    ]
    assert cli_main(["plan", "spread", *paths]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    # pairs: 30/100, 30/130, 10/100, 10/110, 20/110, 20/130: a vs b and b vs a miss 20%
    assert last == [
        "sim vs real, median over 3 files: max TTFT p90 error 5.0%, max TBT p90 error 5.0%, "
        "max SLO attainment error 0.0 points; 3 of 3 within 20% / 20% / 5 points",
        "real vs real, median over 6 pairs: max TTFT p90 error 16.8%, max TBT p90 error 16.8%, "
        "max SLO attainment error 0.0 points; 4 of 6 within 20% / 20% / 5 points",
    ]


def test_other_requests_are_not_the_same_workload(tmp_path: Path) -> None:
    a = _write(tmp_path, "a", _rows(100.0, 10.0), _rows(100.0, 10.0))
    b = _write(tmp_path, "b", _rows(100.0, 10.0, n=9), _rows(100.0, 10.0, n=9))
    with pytest.raises(ValueError, match="workload 'w': b ran other requests than a"):
        spread([Validation.load(a, SLO), Validation.load(b, SLO)])


def test_files_of_more_runs_compare_on_their_first_runs(tmp_path: Path) -> None:
    one = _write(tmp_path, "one", _rows(100.0, 10.0), _rows(100.0, 10.0))
    # a second run, far slower; its sim: one profile, the same two runs
    two_runs = _rows(110.0, 11.0) + _rows(300.0, 30.0)
    two = _write(tmp_path, "two", two_runs, two_runs)
    data = json.loads(two.read_text())
    data["runs"] = {"w": 2}
    two.write_text(json.dumps(data))
    both = [Validation.load(one, SLO), Validation.load(two, SLO)]
    with pytest.raises(ValueError, match="two ran it 2 times, one 1"):
        spread(both)
    result = spread(both, num_runs=1)  # the second run (300 ms) is left out on both sides
    assert [(a, b, f.ttft) for a, b, f in result.pairs] == [
        ("one", "two", pytest.approx(10 / 110 * 100)),
        ("two", "one", pytest.approx(10.0)),
    ]
    with pytest.raises(ValueError, match="fewer than 2 times"):
        spread(both, num_runs=2)


def test_the_first_runs_of_each_profiles_block() -> None:
    # the sim's rows: profile 0's runs 0 and 1, then profile 1's (two requests a run)
    rows = [[f"p{p}r{r}{i}"] for p in range(2) for r in range(2) for i in "xy"]
    assert _first_runs(rows, 2, 2, 1) == [["p0r0x"], ["p0r0y"], ["p1r0x"], ["p1r0y"]]
    assert _first_runs(rows, 2, 2, 2) == rows
    assert _first_runs(rows, 2, 2, None) == rows
    with pytest.raises(ValueError, match="do not split into 2 x 3 equal runs"):
        _first_runs(rows, 3, 2, 1)
