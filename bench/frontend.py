"""The front end's CPU per streamed token at GPU rates (``pdserve bench frontend``).

    pdserve bench frontend [--streams 32 256] [--rounds 3] [--output 96] [--prompt 256] [--clients 2]
                           [--text-prompts] [--split-output 384] [--gpu h100] [--model DIR]
                           [--num-decode-workers 1] [--profile-dir DIR] [--api-server-count N]

Starts ``pdserve serve MODEL --config deploy/mock-cluster.yaml --load-format mock --gpu GPU`` (mock
workers: Ray actors, so separate processes; each step waits the GPU's roofline estimate for MODEL, the
bundled tiny model by default), then for each ``--streams`` count runs ``--rounds`` rounds of that many
concurrent greedy streaming completions (``--prompt`` token ids in, or as many words of text with
``--text-prompts``, as users send them: the server tokenizes them; ``--output`` tokens out; each stream sends its requests one after another until the round has
``--min-round-tokens``), sent by ``--clients`` separate client processes (multiprocessing, spawn) over
kept-alive connections (opened by a short round first). For each round it reads the serving process's
CPU time (``/proc/PID/stat`` utime + stime) before and after, and prints:

* tokens/s (streamed tokens over the round's wall time);
* the serving process's CPU per streamed token (router + HTTP edge, one event loop: every token of every
  stream passes through it; the share spent in the kernel, socket writes mostly) and the ceiling per
  core it implies (1 / CPU per token); its idle CPU per second is printed once, before the rounds;
* TBT added over the mock step time: each gap between two tokens of a stream, as the client saw it (a
  chunk of k tokens: its gap, then k - 1 gaps of 0), less the profile's step time for the decode batch
  (``--streams`` / decode workers), p50 and p99;
* the client processes' own CPU per token and in all (a saturated load generator shows here).

With ``--api-server-count N`` (front-end replicas, ``deploy/replicas.py``) the serving processes are the
N replicas (the launching process only supervises): the figures are theirs together, and each round also
prints each replica's CPU per token it streamed (the ``x-pdserve-replica`` header says whose a stream
is); the ceiling is then per replica, each on a core of its own.

Then the medians over the rounds and the command. ``--split-output N`` runs the rounds again at N output
tokens a request and splits the serving process's CPU into a cost per request (HTTP parsing, tokenizing,
routing, signed ops, the finished request's metrics) and one per token (CPU per token at L tokens a
request = per request / L + per token). ``--profile-dir DIR``: py-spy records the serving
process during the last round of each count (``DIR/frontend-STREAMS.txt``, collapsed stacks; root or
ptrace rights) and its top frames are printed. A benchmark: figures, never pass/fail. The client is a raw
asyncio HTTP/1.1 client (a connection per stream, SSE parsed by hand) so that the load generator costs
little beside the server it measures (deploy/loadgen.py's SDK client costs several times more a token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START_LIMIT_S = 300.0
ROUND_LIMIT_S = 600.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
IDLE_S = 3.0
# --text-prompts: a prompt is --prompt of these words (256 words are ~400 tokens of the bundled model's)
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "what",
    "up",
    "out",
    "who",
    "time",
    "said",
    "may",
    "some",
    "them",
    "into",
    "only",
    "other",
    "then",
    "its",
    "could",
    "new",
    "more",
    "these",
    "two",
    "first",
    "any",
    "like",
    "now",
    "my",
]


@dataclass(frozen=True)
class Load:
    """One client process's share of a round: ``num_streams`` streams, each ``num_requests`` requests of
    ``max_tokens`` tokens one after the other."""

    num_streams: int
    prompt_len: int
    max_tokens: int
    seed: int
    num_requests: int = 1
    is_text: bool = False  # the prompt as text (tokenized by the server), else token ids


@dataclass
class ClientRound:
    """What one client process saw in a round."""

    num_tokens: int = 0
    num_errors: int = 0
    errors: list[str] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)  # between consecutive tokens of a stream
    cpu_s: float = 0.0
    wall_s: float = 0.0
    tokens_by_replica: dict[int, int] = field(default_factory=dict)  # -1: no replica header


# ---- the client (runs in the client processes) ------------------------------------------------------
async def _read_chunked(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked body; None at its end."""
    size_line = await reader.readline()
    size = int(size_line.split(b";", 1)[0], 16)
    if size == 0:
        await reader.readline()
        return None
    data = await reader.readexactly(size + 2)
    return data[:-2]


class _Connection:
    """One kept-alive HTTP/1.1 connection of a client process (a stream's, reused round after round)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, body: bytes) -> tuple[bytes, asyncio.StreamReader]:
        """Send a completion request; its response head and the reader of its body. A kept-alive
        connection the server closed meanwhile is opened again (once)."""
        for attempt in range(2):
            if self.writer is None or self.writer.is_closing():
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None and self.writer is not None
            self.writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % (self.host.encode(), self.port, len(body)) + body
            )
            try:
                return await self.reader.readuntil(b"\r\n\r\n"), self.reader
            except (asyncio.IncompleteReadError, ConnectionError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _stream(conn: _Connection, body: bytes, out: ClientRound) -> None:
    head, reader = await conn.request(body)
    if not head.startswith(b"HTTP/1.1 200"):
        out.num_errors += 1
        out.errors.append(head.split(b"\r\n", 1)[0].decode(errors="replace"))
        conn.close()
        return
    replica = -1
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"x-pdserve-replica:"):
            replica = int(line.split(b":", 1)[1])
    pending = b""
    last: float | None = None
    while (chunk := await _read_chunked(reader)) is not None:
        now = time.perf_counter()
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            obj = json.loads(event[6:])
            if "error" in obj:
                out.num_errors += 1
                out.errors.append(str(obj["error"])[:200])
                continue
            num = sum(len(c.get("token_ids") or ()) for c in obj["choices"])
            if num:
                if last is not None:
                    # NOTE: per token: a chunk of k tokens (a server that merged what the client had not
                    # read yet) is its gap, then k - 1 tokens that came with it
                    out.gaps_s.append(now - last)
                    out.gaps_s += [0.0] * (num - 1)
                last = now
                out.num_tokens += num
                out.tokens_by_replica[replica] = out.tokens_by_replica.get(replica, 0) + num


async def _client_round(conns: list[_Connection], load: Load) -> ClientRound:
    out = ClientRound()

    def body(stream: int, request: int) -> bytes:
        base = load.seed * 7919 + stream * 104729 + request * 15485863
        prompt: list[int] | str = [10 + (base + i * 31) % 200 for i in range(load.prompt_len)]
        if load.is_text:
            prompt = " ".join(WORDS[(base + i * 31) % len(WORDS)] for i in range(load.prompt_len))
        return json.dumps(
            {
                "prompt": prompt,
                "max_tokens": load.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()

    bodies = [[body(s, r) for r in range(load.num_requests)] for s in range(load.num_streams)]
    cpu0, t0 = time.process_time(), time.perf_counter()

    async def one(conn: _Connection, stream_bodies: list[bytes]) -> None:
        for request_body in stream_bodies:
            try:
                await _stream(conn, request_body, out)
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                conn.close()
                out.num_errors += 1
                out.errors.append(repr(e)[:200])

    await asyncio.gather(*(one(c, b) for c, b in zip(conns, bodies, strict=False)))
    out.cpu_s, out.wall_s = time.process_time() - cpu0, time.perf_counter() - t0
    return out


async def _client(url: str, pipe: Connection) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conns: list[_Connection] = []
    loop = asyncio.get_running_loop()
    while (load := await loop.run_in_executor(None, pipe.recv)) is not None:
        conns += [_Connection(host, int(port)) for _ in range(load.num_streams - len(conns))]
        pipe.send(await _client_round(conns, load))
    for conn in conns:
        conn.close()


def client_main(url: str, pipe: Connection) -> None:
    """A client process: runs each ``Load`` it is sent and answers its ``ClientRound``; None ends it.
    Its connections are kept alive from round to round (one per stream), as an HTTP client's pool."""
    asyncio.run(_client(url, pipe))


# ---- the driver --------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of process ``pid`` (all its threads), from /proc, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def front_end_pids(server_pid: int) -> list[int]:
    """The processes that carry the tokens: the front-end replicas (children of ``server_pid`` running
    ``deploy.replicas``), else ``server_pid`` itself."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and b"deploy.replicas" in cmdline:
            pids.append(int(entry))
    return sorted(pids) or [server_pid]


def _cpu_of(pids: Sequence[int]) -> dict[int, tuple[float, float]]:
    return {pid: cpu_seconds(pid) for pid in pids}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass(frozen=True)
class RoundFigures:
    tokens_per_s: float
    server_us_per_token: float
    server_system_pct: float  # of the serving process's CPU, in the kernel (socket writes mostly)
    busiest_replica_us_per_token: float  # replicas: the highest of a replica's CPU per token it streamed
    tbt_added_p50_ms: float
    tbt_added_p99_ms: float
    client_us_per_token: float
    client_cpu_s: float
    num_errors: int


class Clients:
    """``num`` client processes (spawned), each running its share of every round."""

    def __init__(self, url: str, num: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(num):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_main, args=(url, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(
        self,
        num_streams: int,
        prompt_len: int,
        max_tokens: int,
        seed: int,
        num_requests: int = 1,
        is_text: bool = False,
    ) -> list[ClientRound]:
        num = len(self.conns)
        for k, conn in enumerate(self.conns):
            share = num_streams // num + (k < num_streams % num)
            conn.send(Load(share, prompt_len, max_tokens, seed * 1000 + k, num_requests, is_text))
        results = []
        for conn in self.conns:
            if not conn.poll(ROUND_LIMIT_S):
                raise TimeoutError(f"a client process did not finish its round within {ROUND_LIMIT_S} s")
            results.append(conn.recv())
        return results

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            conn.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def measure_round(
    clients: Clients,
    server_pid: int,
    num_streams: int,
    args: argparse.Namespace,
    seed: int,
    step_s: float,
    output: int,
) -> RoundFigures:
    pids = front_end_pids(server_pid)
    before, t0 = _cpu_of(pids), time.perf_counter()
    num_requests = max(1, -(-args.min_round_tokens // (num_streams * output)))
    results = clients.run(num_streams, args.prompt, output, seed, num_requests, args.text_prompts)
    wall, after = time.perf_counter() - t0, _cpu_of(pids)
    spent = {pid: sum(after[pid]) - sum(before[pid]) for pid in pids}
    cpu = sum(spent.values())
    user1 = system1 = 0.0
    user0 = system0 = 0.0
    for pid in pids:
        user0, system0 = user0 + before[pid][0], system0 + before[pid][1]
        user1, system1 = user1 + after[pid][0], system1 + after[pid][1]
    num_tokens = sum(r.num_tokens for r in results)
    by_replica: dict[int, int] = {}
    for r in results:
        for replica, n in r.tokens_by_replica.items():
            by_replica[replica] = by_replica.get(replica, 0) + n
    busiest = cpu / max(num_tokens, 1) * 1e6
    if len(pids) > 1:
        # NOTE: replica i is the i-th of the supervisor's replica children (spawned in slot order; a
        # restarted one comes later): matched by order, which holds while none has restarted
        per = [spent[pid] / max(by_replica.get(i, 0), 1) * 1e6 for i, pid in enumerate(pids)]
        busiest = max(per)
        shares = ", ".join(f"{i}: {by_replica.get(i, 0)} tok {u:.1f} us/tok" for i, u in enumerate(per))
        print(f"  replicas {shares}", flush=True)
    errors = [e for r in results for e in r.errors]
    if num_tokens == 0:
        raise RuntimeError(f"no token came back: {errors[:3]}")
    gaps = [g - step_s for r in results for g in r.gaps_s]
    client_cpu = sum(r.cpu_s for r in results)
    if errors:
        print(f"  {len(errors)} errors, e.g. {errors[:2]}", flush=True)
    return RoundFigures(
        num_tokens / wall,
        cpu / num_tokens * 1e6,
        100 * (system1 - system0) / max(cpu, 1e-9),
        busiest,
        _percentile(gaps, 0.5) * 1e3,
        _percentile(gaps, 0.99) * 1e3,
        client_cpu / num_tokens * 1e6,
        client_cpu,
        len(errors),
    )


def _median(rounds: Sequence[RoundFigures]) -> RoundFigures:
    return RoundFigures(
        *(statistics.median(getattr(r, name) for r in rounds) for name in RoundFigures.__annotations__)
    )


def _split(a: RoundFigures, a_tokens: int, b: RoundFigures, b_tokens: int) -> tuple[float, float]:
    """(CPU per request, CPU per token), in us, from the CPU per token at two output lengths:
    c = per_request / tokens + per_token."""
    per_request = (a.server_us_per_token - b.server_us_per_token) / (1 / a_tokens - 1 / b_tokens)
    return per_request, a.server_us_per_token - per_request / a_tokens


def _print_round(label: str, f: RoundFigures) -> None:
    print(
        f"{label}: {f.tokens_per_s:8.0f} tok/s | serving process(es) {f.server_us_per_token:6.1f} us/token "
        f"({f.server_system_pct:2.0f}% system; ceiling {1e6 / f.busiest_replica_us_per_token:7.0f} tok/s per "
        f"core{'' if f.busiest_replica_us_per_token == f.server_us_per_token else ' per replica'}) | TBT added p50 "
        f"{f.tbt_added_p50_ms:6.2f} ms, p99 {f.tbt_added_p99_ms:6.2f} ms | clients "
        f"{f.client_us_per_token:5.1f} us/token ({f.client_cpu_s:.2f} s CPU)"
        + (f" | {f.num_errors} errors" if f.num_errors else ""),
        flush=True,
    )


def _wait_healthy(url: str, num_workers: int, server: subprocess.Popen[bytes]) -> float:
    from bench.mock_cluster import worker_metric

    t0 = time.monotonic()
    while time.monotonic() - t0 < START_LIMIT_S:
        if server.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {server.returncode}")
        try:
            if sum(worker_metric(url, "pdserve_worker_healthy").values()) >= num_workers:
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001  NOTE: not listening yet
            pass
        time.sleep(0.5)  # NOTE: polling a condition with a bound
    raise TimeoutError(f"{num_workers} workers not healthy within {START_LIMIT_S} s")


def _decode_step_s(model: str, gpu: str, batch: int, context: int) -> float:
    """The profile's step time of one decode step of ``batch`` sequences at ``context`` positions."""
    from cluster.cost_model import CostProfile, shape_of
    from deploy.mock_profile import write_gpu_profile
    from workers.engine import BUNDLED_MODEL

    profile = CostProfile.load(write_gpu_profile(gpu, model or BUNDLED_MODEL))
    return profile.step_s(shape_of([(context, 1, True)] * batch))


def _py_spy(pid: int, path: Path, seconds: float) -> subprocess.Popen[bytes]:
    """py-spy records ``pid`` for ``seconds`` into ``path`` (collapsed stacks: one ``a;b;c COUNT`` a line)."""
    py_spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(py_spy), "record", "--pid", str(pid), "-o", str(path), "-d", str(int(seconds) + 1)]
    cmd += ["-f", "raw", "--nolineno", "-r", "1000", "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# NOTE: py-spy counts threads blocked in these as busy (a lock or a queue wait in C): left out
WAITS = (
    "_worker (concurrent",
    "Condition.wait (",
    "Selector.select (",
    "listen_error_messages (",
    "print_logs (",
)


def top_frames(path: Path, num: int = 12) -> list[tuple[str, float, float]]:
    """The ``num`` frames of a collapsed-stack profile with the most samples of their own, stacks that
    end in a wait left out: (frame, % of samples in it, % of samples in it or below it)."""
    own: dict[str, int] = {}
    below: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # NOTE: a frame name py-spy wrote with a newline in it (a code literal)
            continue
        frames, n = stack.split(";"), int(count)
        if any(wait in frames[-1] for wait in WAITS):
            continue
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            below[frame] = below.get(frame, 0) + n
    ranked = sorted(own.items(), key=lambda kv: -kv[1])[:num]
    return [(frame, 100 * n / total, 100 * below[frame] / total) for frame, n in ranked]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench frontend", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="model directory (default: the bundled tiny model)")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--config", default=str(REPO / "deploy" / "mock-cluster.yaml"))
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per stream")
    ap.add_argument("--output", type=int, default=96, help="output tokens per stream")
    ap.add_argument(
        "--text-prompts", action="store_true", help="prompts as text (tokenized by the server), not token ids"
    )
    ap.add_argument(
        "--split-output",
        type=int,
        default=0,
        help="also run the rounds at this many output tokens and split the serving process's CPU into a "
        "cost per request and one per token (CPU per token = per request / output + per token)",
    )
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument(
        "--min-round-tokens",
        type=int,
        default=20_000,
        help="a stream sends requests one after another until a round has this many tokens (CPU time is "
        "read in 10 ms ticks)",
    )
    ap.add_argument("--num-prefill-workers", type=int, default=1)
    ap.add_argument("--num-decode-workers", type=int, default=1)
    ap.add_argument("--num-kv-blocks", type=int, default=6144, help="per worker")
    ap.add_argument("--profile-dir", type=Path, default=None, help="py-spy the last round of each count")
    ap.add_argument("--api-server-count", type=int, default=1, help="front-end replicas")
    ap.add_argument("--extra", default="", help="more `pdserve serve` flags, one string")
    args = ap.parse_args(argv)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    num_workers = args.num_prefill_workers + args.num_decode_workers
    cmd = [
        sys.executable, "-m", "deploy.cli", "serve", *([args.model] if args.model else []),
        "--config", args.config, "--load-format", "mock", "--gpu", args.gpu, "--port", str(port),
        "--num-prefill-workers", str(args.num_prefill_workers),
        "--num-decode-workers", str(args.num_decode_workers), "--num-kv-blocks", str(args.num_kv_blocks),
        "--max-num-seqs", str(max(args.streams)), "--log-level", "WARNING",
        "--api-server-count", str(args.api_server_count), *shlex.split(args.extra),
    ]  # fmt: skip
    print(f"$ pdserve bench frontend {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(f"serving process: {shlex.join(cmd[2:])}  (on {os.cpu_count()} CPUs)", flush=True)
    log = tempfile.NamedTemporaryFile("wb", prefix="frontend-serve-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, "PDSERVE_ADMIN_KEY": secrets.token_hex(16)}
    server = subprocess.Popen(
        cmd, env=env, cwd=REPO, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
    )
    clients: Clients | None = None
    try:
        up_s = _wait_healthy(url, num_workers, server)
        print(f"{num_workers} mock workers healthy {up_s:.1f} s after the command; server log {log.name}")
        clients = Clients(url, args.clients)
        clients.run(8, args.prompt, 8, seed=0)  # NOTE: warm-up: the handoff pair, first-use paths
        pids = front_end_pids(server.pid)
        before, t0 = _cpu_of(pids), time.perf_counter()
        time.sleep(IDLE_S)  # NOTE: measuring the idle process, not waiting for readiness
        after, idle_s = _cpu_of(pids), time.perf_counter() - t0
        idle_cpu = sum(sum(after[p]) - sum(before[p]) for p in pids)
        print(
            f"serving process(es) {pids} idle: {idle_cpu / idle_s * 1e3:.0f} ms of CPU per s "
            "(heartbeats, Ray's threads; in every round's figure)",
            flush=True,
        )
        summary = []
        splits: list[tuple[int, tuple[float, float]]] = []
        for num_streams in args.streams:
            batch = -(-num_streams // args.num_decode_workers)
            step_s = _decode_step_s(args.model, args.gpu, batch, args.prompt + args.output // 2)
            num_requests = max(1, -(-args.min_round_tokens // (num_streams * args.output)))
            print(
                f"-- {num_streams} streams x {num_requests} requests x {args.output} tokens "
                f"({args.clients} client processes); "
                f"the mock's decode step at batch {batch}: {step_s * 1e3:.2f} ms",
                flush=True,
            )
            # NOTE: opens the streams' connections
            clients.run(num_streams, args.prompt, 4, seed=0, is_text=args.text_prompts)
            rounds = []
            for k in range(args.rounds):
                spy = None
                if args.profile_dir is not None and k == args.rounds - 1:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    num_tokens = max(args.min_round_tokens, num_streams * args.output)
                    expected_s = num_tokens / max(1.0, rounds[-1].tokens_per_s) if rounds else 10
                    spy = _py_spy(server.pid, args.profile_dir / f"frontend-{num_streams}.txt", expected_s)
                f = measure_round(clients, server.pid, num_streams, args, k + 1, step_s, args.output)
                _print_round(f"round {k + 1}", f)
                if spy is not None:
                    spy.wait(timeout=120)
                    print("  py-spy, the serving process's top frames (own %, with callees %):")
                    for frame, own_pct, below_pct in top_frames(
                        args.profile_dir / f"frontend-{num_streams}.txt"
                    ):
                        print(f"  {own_pct:5.1f} {below_pct:5.1f}  {frame}")
                rounds.append(f)
            med = _median(rounds)
            summary.append((num_streams, med))
            if args.split_output:
                longer = [
                    measure_round(clients, server.pid, num_streams, args, 100 + k, step_s, args.split_output)
                    for k in range(args.rounds)
                ]
                for k, f in enumerate(longer):
                    _print_round(f"round {k + 1} at {args.split_output} tokens", f)
                splits.append((num_streams, _split(med, args.output, _median(longer), args.split_output)))
        print("medians of the rounds:")
        for num_streams, med in summary:
            _print_round(f"{num_streams:4d} streams", med)
        for num_streams, (per_request_us, per_token_us) in splits:
            print(
                f"{num_streams:4d} streams: the serving process's CPU = {per_request_us:7.1f} us a request "
                f"+ {per_token_us:5.1f} us a token (from {args.output} and {args.split_output} tokens a request)"
            )
    finally:
        if clients is not None:
            clients.close()
        server.send_signal(signal.SIGINT)  # NOTE: pdserve serve shuts its cluster down on SIGINT
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
