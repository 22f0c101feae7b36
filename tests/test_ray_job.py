"""A real `ray start --head` on loopback + `ray job submit` of the launch entrypoint serves a request.

The head is started and stopped by the test, in its own temp dir. `ray start --head` turns token
authentication on, so the submitting shell sets RAY_AUTH_MODE=token (kept on, as in deploy docs).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from cluster.protocol import SamplingParams
from workers.llm import LLM

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
RAY = str(pathlib.Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ray_job_submit_serves_a_request() -> None:
    gcs_port, dash_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="pdray-")
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
    }
    env.pop("RAY_ADDRESS", None)
    start = [
        RAY,
        "start",
        "--head",
        f"--port={gcs_port}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash_port}",
        "--include-dashboard=true",
        "--num-cpus=4",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    started = subprocess.run(start, env=env, timeout=180, capture_output=True, text=True)
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    try:
        submit = [
            RAY,
            "job",
            "submit",
            f"--address=http://127.0.0.1:{dash_port}",
            "--working-dir",
            str(REPO),
            "--",
            sys.executable,
            "-m",
            "deploy.launch",
            "--config",
            "deploy/cpu-disagg.yaml",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "8",
        ]
        # NOTE: right after `ray start` the dashboard may have no job agent yet; it says so, and only
        # that answer is retried (bounded).
        deadline = time.monotonic() + 300
        while True:
            job = subprocess.run(submit, env=env, timeout=600, capture_output=True, text=True)
            not_ready = "No available agent" in job.stdout + job.stderr
            if not not_ready or time.monotonic() > deadline:
                break
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
        lines = [line for line in job.stdout.splitlines() if line.startswith(("PROMPT", "OUTPUT", "TOKENS"))]
        expected = LLM().generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert lines == [
            "PROMPT 'Once upon a time'",
            f"OUTPUT {expected.text!r}",
            f"TOKENS {len(expected.token_ids)} finish={expected.finish_reason.value if expected.finish_reason else None}",
        ]
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, timeout=120, capture_output=True)
