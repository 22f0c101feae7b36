"""bench/gpu_first_contact.sh --dry-run, as CI runs it: on a machine without Ray or the cryptography package
(a bare lent GPU machine has neither) the whole suite collects without an error, the plan names every step, and the caps fit one
device call of at most 9 minutes."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
BARE_MACHINE = """
import sys

class _Bare:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "cryptography"):
            raise ModuleNotFoundError(f"No module named {name!r} (a bare GPU machine)", name=name)
        return None

sys.meta_path.insert(0, _Bare())
"""


def test_the_dry_run_collects_every_test_on_a_bare_machine_and_plans_under_nine_minutes(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BARE_MACHINE)
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "PYTHONPATH": str(tmp_path / "site")}  # fmt: skip
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", "bench/gpu_first_contact.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\) in", proc.stdout)
    assert collected is not None, proc.stdout  # (pytest says ", N errors" before " in" when a file fails)
    assert int(collected[1]) >= 20  # the gpu tests, every one collected without Ray or cryptography
    plan = re.findall(r"^(\w+)\s+(\d+)s\s+would run: (.*)$", proc.stdout, re.MULTILINE)
    assert [name for name, _, _ in plan] == ["env", "async", "tests", "sync", "digest", "profile", "tp"]
    assert sum(int(cap) for _, cap, _ in plan) + 7 * 15 <= 9 * 60  # each cap plus its 15 s kill grace
    assert "-m gpu" in plan[2][2] and "--no-async-scheduling" in plan[3][2]
    assert "bench/tp_step.py --tp 1 2" in plan[6][2]
    assert (tmp_path / "out" / "summary.txt").read_text().count("would run") == 7
