"""The H100 throughput benchmark runs end to end on CPU at toy sizes (so it is not dead code before the
first GPU run): every section of its report is printed and the engine ends leak-free. Smaller benchmarks
run at toy sizes too."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_throughput_tiny_cpu_run_reports_every_section() -> None:
    result = subprocess.run(
        [sys.executable, "bench/gpu_throughput.py", "--device", "cpu", "--tiny", "--async-scheduling"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "async scheduling on" in out and "requests 12;" in out
    assert "Triton variants compiled during the timed run: 0" in out
    for label in ("all steps", "decode-only steps", "other steps"):
        assert f"  {label}" in out and "blocked on device" in out
    assert "kernels per decode-only step:" in out and "kernels per other step:" in out
    assert "host per step: schedule" in out and "achieved / floor" in out


def test_wire_deltas_bench_moves_every_delta_both_ways(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.wire_deltas import main

    assert main(["--running", "3", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("   3 running: a frame per delta ") and "one Deltas frame" in lines[1]
    assert len(lines) == 2


@pytest.mark.slow
def test_gc_pauses_bench_runs_both_modes_and_freezes_only_one() -> None:
    args = ["--requests", "6", "--max-num-seqs", "3", "--prompt-len", "4", "8", "--output-len", "3", "5"]
    result = subprocess.run(
        [sys.executable, "-m", "bench.gc_pauses", *args],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("plain :", "frozen:"))]
    assert [line.split(":")[0].strip() for line in lines] == ["plain", "frozen"]
    assert "(0 frozen)" in lines[0] and "(0 frozen)" not in lines[1]
    frozen = int(lines[1].split("(")[1].split(" frozen")[0])
    assert frozen > 10_000  # torch, the tokenizer and the model's modules at least
    for line in lines:
        assert "gen 2:" in line and "step p50" in line
