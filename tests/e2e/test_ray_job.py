"""A real `ray start --head` on loopback + `ray job submit` of the launch entrypoint serves a request.

The test owns its Ray: `ray start --head --block` in its own session (process group) and temp dir, with
ports Ray picks itself (GCS port 0, the dashboard's own free-port probe) or, for the client server that
needs a fixed one, a random port retried if taken. It stops only what it started: SIGTERM to `ray start`
(Ray's handler stops every process it launched), then SIGKILL to what is left of that process group or
still names its temp dir. Never `ray stop`, which would stop every Ray on the machine.
`ray start --head` turns token authentication on, so the submitting shell sets RAY_AUTH_MODE=token.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from cluster.protocol import SamplingParams
from tests.support.cluster_utils import submit_job, wait_for
from workers.llm import LLM

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
RAY = str(pathlib.Path(sys.executable).with_name("ray"))
BIND_ERRORS = ("already in use", "Failed to bind", "EADDRINUSE")
START_ATTEMPTS = 3


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def _stop_head(head: subprocess.Popen[bytes], temp_dir: str) -> None:
    """Stop one `ray start --block` we launched and everything it started; nothing else."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(head.pid, signal.SIGKILL)  # its own process group: start_new_session below
    head.wait(timeout=30)
    for pid in _pids_naming(temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _pids_naming(temp_dir), 30, f"processes of {temp_dir} gone")


def _start_head(env: dict[str, str], temp_dir: str) -> tuple[subprocess.Popen[bytes], str] | str:
    """One attempt: (process, dashboard URL) once Ray says it is up, or the output of a failed start."""
    log_path = pathlib.Path(temp_dir) / "ray-start.log"
    cmd = [
        RAY, "start", "--head", "--block", "--port=0", "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--dashboard-agent-listen-port=0",
        f"--ray-client-server-port={random.randrange(20000, 40000)}",
        "--num-cpus=4", "--disable-usage-stats", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        url = re.search(r"RAY_API_SERVER_ADDRESS='(http://[^']+)'", text)
        if head.poll() is not None:
            _stop_head(head, temp_dir)  # whatever it started before failing
            return log_path.read_text(errors="replace")
        if url and "block forever" in text:
            return head, url.group(1)
        time.sleep(0.2)  # NOTE: polling the start log, bounded by the deadline
    _stop_head(head, temp_dir)
    return log_path.read_text(errors="replace") + "\n(ray start not up within 180 s)"


@contextlib.contextmanager
def own_ray_head(env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A private Ray head; yields (the `ray start` process, its dashboard URL)."""
    failures = []
    for _ in range(START_ATTEMPTS):
        temp_dir = tempfile.mkdtemp(prefix="pdray-")
        started = _start_head(env, temp_dir)
        if isinstance(started, str):
            shutil.rmtree(temp_dir, ignore_errors=True)
            failures.append(started[-3000:])
            if any(e in started for e in BIND_ERRORS):
                continue  # a port was taken: try again with other ports
            break
        head, url = started
        try:
            yield head, url
        finally:
            _stop_head(head, temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
        return
    raise AssertionError("ray start failed:\n" + "\n----\n".join(failures))


def test_ray_job_submit_serves_a_request() -> None:
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
    }
    env.pop("RAY_ADDRESS", None)
    with own_ray_head(env) as (head, dashboard_url):
        submit = [
            RAY, "job", "submit", f"--address={dashboard_url}", "--working-dir", str(REPO), "--",
            sys.executable, "-m", "deploy.launch", "--config", "deploy/cpu-disagg.yaml",
            "--prompt", "Once upon a time", "--max-tokens", "8",
        ]  # fmt: skip
        job = submit_job(submit, env=env, timeout_s=600, alive=lambda: head.poll() is None)
        assert head.poll() is None, "our ray head exited during the test"
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    lines = [line for line in job.stdout.splitlines() if line.startswith(("PROMPT", "OUTPUT", "TOKENS"))]
    llm = LLM(device="cpu")
    expected = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert lines == [
        "PROMPT 'Once upon a time'",
        f"OUTPUT {expected.text!r}",
        f"TOKENS {len(expected.token_ids)} finish={expected.finish_reason.value if expected.finish_reason else None}",
    ]
