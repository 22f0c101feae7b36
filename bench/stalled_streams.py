"""Streams whose clients stop reading (issue 31 row 6): does the router process's memory stay bounded,
does it come back, and is the requests' KV freed on every worker?

    python bench/stalled_streams.py [--config deploy/cpu-disagg.yaml] [--streams 4] [--n 16]
        [--max-tokens 1500] [--logprobs 20] [--stall-timeout 30] [--unbounded]

Starts ``pdserve serve`` (a separate process: its RSS is the router's, with the HTTP edge), warms it
up, then opens ``--streams`` streaming completions (n choices each, ``ignore_eos``, top logprobs) on
raw sockets with a small receive buffer that read the response head and nothing more. Prints the
server's RSS before (baseline), its peak while the streams stall, after the stall timeout closed
them, and after the client sockets closed; how long until both workers' KV was all free again and
until the server closed the connections. ``--unbounded`` sets every bound out of reach (the
behaviour before the bounds: the router buffers whatever the workers generate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)  # NOTE: a bounded poll of another process's readiness
    raise TimeoutError(f"{url} not healthy within {timeout_s} s")


def kv_state(url: str) -> dict[str, tuple[float, float, float]]:
    """worker -> (free blocks, usable blocks, running requests), from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, list[float]] = {}
    names = {
        "pdserve_kv_cache_free_blocks": 0,
        "pdserve_kv_cache_total_blocks": 1,
        "pdserve_num_requests_running": 2,
    }
    for line in text.splitlines():
        m = re.match(r"(\w+)\{([^}]*)\} ([0-9.e+-]+)$", line)
        if m is None or m.group(1) not in names:
            continue
        worker = re.search(r'worker(?:_id)?="([^"]+)"', m.group(2))
        key = worker.group(1) if worker else m.group(2)
        out.setdefault(key, [0.0, 0.0, 0.0])[names[m.group(1)]] = float(m.group(3))
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def all_free(state: dict[str, tuple[float, float, float]]) -> bool:
    return bool(state) and all(free == total and running == 0 for free, total, running in state.values())


def stalled_stream(port: int, body: dict[str, object]) -> socket.socket:
    """POST a stream and read its response head only; then the socket reads nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # NOTE: before connect: a small window
    sock.settimeout(120)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    status = sock.recv(12)
    if status != b"HTTP/1.1 200":
        raise RuntimeError(f"stream refused: {status!r}")
    return sock


def num_stalled(url: str) -> int:
    """Streams the edge aborted for a client that read nothing (pdserve_request_errors_total)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'pdserve_request_errors_total\{[^}]*code="stream_stalled"[^}]*\} ([0-9.e+]+)', text)
    return int(float(m.group(1))) if m else 0


def read_all(port: int, body: dict[str, object]) -> int:
    """--reading: the same stream, read to its end by a client that keeps up; returns its bytes."""
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as r:
        return sum(len(chunk) for chunk in r.iter_bytes())


def write_config(args: argparse.Namespace, port: int) -> str:
    cfg = yaml.safe_load(Path(args.config).read_text())
    server = cfg.setdefault("server", {})
    server.update({"port": port, "stream_stall_timeout_s": args.stall_timeout})
    if args.unbounded:
        server.update({"stream_buffer_bytes": 1 << 40, "stream_stall_timeout_s": 3600.0})
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="stalled-streams-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "deploy" / "cpu-disagg.yaml"))
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--logprobs", type=int, default=20)
    p.add_argument("--stall-timeout", type=float, default=30.0)
    p.add_argument("--unbounded", action="store_true", help="every bound out of reach (the old behaviour)")
    p.add_argument("--hold-s", type=float, default=60.0, help="--unbounded: how long the streams stall")
    p.add_argument("--reading", action="store_true", help="the same streams, read by clients that keep up")
    p.add_argument("--keep-s", type=float, default=0.0, help="keep the server up this long at the end")
    p.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the server's environment (allocator knobs)"
    )
    args = p.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = write_config(args, port)
    pdserve = Path(sys.executable).with_name("pdserve")
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    proc = subprocess.Popen([str(pdserve), "serve", "--config", config], cwd=ROOT, env=env)
    try:
        wait_healthy(url, proc, 300)
        warm = {"prompt": PROMPT, "max_tokens": 64, "n": 2, "logprobs": args.logprobs, "stream": True}
        for _ in range(3):
            with httpx.stream("POST", f"{url}/v1/completions", json=warm, timeout=120) as r:
                for _line in r.iter_lines():
                    pass
        time.sleep(2.0)  # NOTE: let the warm-up's garbage settle before the baseline
        baseline = rss_mib(proc.pid)
        body = {
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "n": args.n,
            "logprobs": args.logprobs,
            "stream": True,
            "ignore_eos": True,
        }
        peak = [baseline]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], rss_mib(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        what = "read to the end" if args.reading else "their clients read nothing"
        print(
            f"{args.streams} streams x n={args.n} (max_tokens {args.max_tokens}, logprobs {args.logprobs}): "
            f"{what}",
            flush=True,
        )
        socks: list[socket.socket] = []
        readers: list[threading.Thread] = []
        if args.reading:
            readers = [threading.Thread(target=read_all, args=(port, body)) for _ in range(args.streams)]
            for r in readers:
                r.start()
        else:
            socks = [stalled_stream(port, body) for _ in range(args.streams)]
        t_free: float | None = None
        t_stalled: float | None = None
        limit_s = args.hold_s if args.unbounded else args.stall_timeout + 120
        while time.monotonic() - t0 < limit_s:
            if readers and not any(r.is_alive() for r in readers):
                break
            if t_free is None and all_free(kv_state(url)) and time.monotonic() - t0 > 1.0:
                t_free = time.monotonic() - t0
            if t_stalled is None and num_stalled(url) >= args.streams:
                t_stalled = time.monotonic() - t0
            if t_free is not None and t_stalled is not None:
                break
            time.sleep(0.25)  # NOTE: a bounded poll (limit_s) of the server's state
        for r in readers:
            r.join(600)
        time.sleep(2.0)
        after_abort = rss_mib(proc.pid)
        for s in socks:
            s.close()
        time.sleep(3.0)
        stop.set()
        sampler.join()
        after_close = rss_mib(proc.pid)
        final_kv = kv_state(url)
        print(f"router RSS baseline           {baseline:8.1f} MiB")
        print(f"router RSS peak while stalled {peak[0]:8.1f} MiB  (+{peak[0] - baseline:.1f} MiB)")
        print(
            f"router RSS after the aborts   {after_abort:8.1f} MiB  ({(after_abort / baseline - 1) * 100:+.1f} %)"
        )
        print(
            f"router RSS sockets closed     {after_close:8.1f} MiB  ({(after_close / baseline - 1) * 100:+.1f} %)"
        )
        print(
            f"KV all free on every worker after {t_free:.1f} s" if t_free is not None else "KV NOT all free"
        )
        if not args.reading:
            print(
                f"every stream aborted by the edge's stall timeout after {t_stalled:.1f} s"
                if t_stalled is not None
                else "streams NOT aborted by the edge's stall timeout"
            )
        for worker, (free, total, running) in sorted(final_kv.items()):
            print(f"  {worker}: {free:.0f} / {total:.0f} blocks free, {running:.0f} running")
        if args.keep_s:
            print(f"server pid {proc.pid} kept for {args.keep_s:g} s", flush=True)
            time.sleep(args.keep_s)
            print(f"router RSS at the end         {rss_mib(proc.pid):8.1f} MiB", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(config)


if __name__ == "__main__":
    main()
