"""Two hosts on one machine, for testing what crosses a network (not a test module).

Host A is the root network namespace, host B a namespace joined to it by a veth pair (198.18.N.1 on A,
198.18.N.2 on B; 198.18.0.0/15 is the benchmark range, on interfaces made here only). Each host runs a Ray
node started by this module in the foreground (``ray start --block``, its own process group): the head on A
with the custom resource ``host_a``, a worker node on B with ``host_b``, so a pool pins itself to a host
with ``resources: {host_b: 1}``. ``stop()`` ends exactly those Ray processes and deletes the namespace and
the link, whatever happened before.

    python -m bench.netns_lab up        # prints the Ray address and the link; Ctrl-C tears it down
    with two_host_lab() as lab: ...     # tests; skipped (with the reason) where netns is refused

``lab.link(False)`` takes the link down, ``lab.rate_limit("1gbit")`` adds a tbf qdisc on both ends,
``lab.link_bytes()`` reads the veth's byte counters on host A.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_RAY = str(Path(sys.executable).with_name("ray"))
_START_TIMEOUT_S = 120.0


class LabUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, or refused)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


def netns_refusal() -> str | None:
    """Why a lab cannot be made here, or None if it can."""
    name = f"pdprobe{os.getpid()}"
    try:
        done = _run("ip", "netns", "add", name, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` is not available: {e}"
    if done.returncode != 0:
        return f"`ip netns add` was refused: {done.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


@dataclass
class Lab:
    ns: str
    veth_a: str
    veth_b: str
    ip_a: str
    ip_b: str
    temp_dir: str
    ray_port: int = 0
    dashboard_port: int = 0
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.ip_a}:{self.ray_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.ip_a}:{self.dashboard_port}"

    def link(self, up: bool) -> None:
        _run("ip", "link", "set", self.veth_a, "up" if up else "down")

    def rate_limit(self, rate: str) -> None:
        """A token-bucket limit on both directions of the link (tc tbf; netem does not exist here)."""
        for prefix in ((), ("ip", "netns", "exec", self.ns)):
            dev = self.veth_b if prefix else self.veth_a
            _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                 "latency", "50ms")  # fmt: skip

    def clear_rate_limit(self) -> None:
        for prefix in ((), ("ip", "netns", "exec", self.ns)):
            dev = self.veth_b if prefix else self.veth_a
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def link_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes of host A's end of the link."""
        stats = Path(f"/sys/class/net/{self.veth_a}/statistics")
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def stop(self) -> None:
        for proc in reversed(self.processes):
            _end(proc)
        self.processes.clear()
        _run("ip", "link", "del", self.veth_a, check=False)
        _run("ip", "netns", "del", self.ns, check=False)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """End a `ray start --block` and every process it started (its own process group), bounded.

    NOTE: SIGINT, not SIGTERM: `ray start --head --block` stops its node on SIGINT in ~1.5 s, while on
    SIGTERM it sat out the whole 30 s bound here once the other host was gone (the test's teardown)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _free_subnet() -> int:
    used = _run("ip", "-o", "addr").stdout
    for _ in range(200):
        n = random.randrange(100, 250)
        if f"198.18.{n}." not in used:
            return n
    raise LabUnavailable("no free 198.18.N.0/24 subnet")


def _wait_for_nodes(address: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    script = (
        "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    while time.monotonic() < deadline:
        done = subprocess.run(
            [sys.executable, "-c", script, address], capture_output=True, text=True, timeout=120, check=False,
            env=env,
        )  # fmt: skip
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(1.0)  # NOTE: a bounded poll of the cluster's membership
    raise TimeoutError(f"the lab's Ray cluster at {address} did not reach {count} nodes in {timeout_s} s")


def start_lab(cpus_per_host: int = 8, start_ray: bool = True) -> Lab:
    """Make the link and the namespace, start both Ray nodes (unless told not to: a link-only lab);
    raise LabUnavailable where refused."""
    refusal = netns_refusal()
    if refusal is not None:
        raise LabUnavailable(refusal)
    n = _free_subnet()
    tag = f"{os.getpid() % 10000}{n}"
    lab = Lab(f"pdlab{tag}", f"pda{tag}", f"pdb{tag}", f"198.18.{n}.1", f"198.18.{n}.2",
              tempfile.mkdtemp(prefix="pdlab-"))  # fmt: skip
    try:
        _run("ip", "netns", "add", lab.ns)
        _run("ip", "link", "add", lab.veth_a, "type", "veth", "peer", "name", lab.veth_b)
        _run("ip", "link", "set", lab.veth_b, "netns", lab.ns)
        _run("ip", "addr", "add", f"{lab.ip_a}/24", "dev", lab.veth_a)
        _run("ip", "link", "set", lab.veth_a, "up")
        in_ns = ("ip", "netns", "exec", lab.ns)
        _run(*in_ns, "ip", "addr", "add", f"{lab.ip_b}/24", "dev", lab.veth_b)
        _run(*in_ns, "ip", "link", "set", lab.veth_b, "up")
        _run(*in_ns, "ip", "link", "set", "lo", "up")
        if start_ray:
            _start_ray(lab, cpus_per_host)
    except BaseException:
        lab.stop()
        raise
    return lab


def _start_ray(lab: Lab, cpus: int) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    for attempt in range(5):  # NOTE: ports are taken, not reserved: retry on a clash
        lab.ray_port, lab.dashboard_port = random.randrange(20000, 30000), random.randrange(30000, 40000)
        client_port, agent_port = random.randrange(40000, 45000), random.randrange(45000, 50000)
        head = subprocess.Popen(
            [_RAY, "start", "--head", "--block", f"--node-ip-address={lab.ip_a}", f"--port={lab.ray_port}",
             f"--dashboard-host={lab.ip_a}", f"--dashboard-port={lab.dashboard_port}", f"--num-cpus={cpus}",
             '--resources={"host_a": 64}', f"--temp-dir={lab.temp_dir}", "--include-dashboard=true",
             f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_port}"],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait_for_nodes(lab.address, 1, 60)
        except TimeoutError:
            _end(head)
            if attempt == 4:
                raise
            continue
        lab.processes.append(head)
        break
    node = subprocess.Popen(
        ["ip", "netns", "exec", lab.ns, _RAY, "start", "--block", f"--address={lab.address}",
         f"--node-ip-address={lab.ip_b}", f"--num-cpus={cpus}", '--resources={"host_b": 64}',
         f"--temp-dir={os.path.join(lab.temp_dir, 'host_b')}"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    # NOTE: host B has a temp dir of its own, as a real host would: sharing the head's session dir, both
    # nodes' runtime-env agents unpack and delete the same working_dir package under a running job.
    lab.processes.append(node)
    _wait_for_nodes(lab.address, 2, _START_TIMEOUT_S)


@contextlib.contextmanager
def two_host_lab(cpus_per_host: int = 8, start_ray: bool = True) -> Iterator[Lab]:
    lab = start_lab(cpus_per_host, start_ray)
    try:
        yield lab
    finally:
        lab.stop()


def main() -> int:
    if sys.argv[1:] != ["up"]:
        print(__doc__)
        return 2
    with two_host_lab() as lab:
        print(f"RAY_ADDRESS={lab.address}  (host A {lab.ip_a}, host B {lab.ip_b} in netns {lab.ns})")
        print(f"dashboard {lab.dashboard_url}; link {lab.veth_a} <-> {lab.veth_b}; Ctrl-C tears it down")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
