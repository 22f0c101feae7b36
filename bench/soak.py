"""Soak benchmark (``pdserve bench soak``): mixed streaming traffic against a live cluster while faults
land every few seconds, then the verdict.

    pdserve bench soak --minutes 20 [--config deploy/cpu-disagg.yaml] [--lab] [--faults all]
        [--rss-warmup 120] [--out soak.json]

Traffic: ``--concurrency`` client loops send greedy and seeded-sampling requests (random token prompts,
8-200 tokens; 16-128 new tokens) through the router's streaming API; some clients abort mid-stream.
Faults, in turn every ``--fault-every`` seconds: kill -9 a worker (Ray restarts it; the router migrates
its requests and re-admits it), SIGSTOP a worker for 2.5 s then SIGCONT, a burst of malformed control
frames, and with ``--lab`` (two hosts on this machine, bench/netns_lab.py) a 3 s link flap. ``--faults``
picks a subset (e.g. no kill -9, so every worker process lives the whole run and its RSS can be judged).

Prints requests ok / migrated / aborted by the client / failed with a clear error / hung, leaked blocks
per worker, RSS growth per worker process (from the end of its warm-up, and warm-up included), and for
each fault the time until the cluster was whole again (every pool back to its size, all healthy, a
probe request answered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, PoolConfig
from cluster.protocol import RouterError, SamplingParams

HUNG_GRACE_S = 60.0  # a request silent this long past its deadline counts as hung
RECOVERY_BOUND_S = 180.0
RSS_MIN_SPAN_S = 300.0  # a steady-state RSS figure needs this long after the warm-up


@dataclass
class Tally:
    ok: int = 0
    migrated: int = 0  # finished after at least one migration (also counted in ok)
    aborted: int = 0  # by the client, on purpose
    failed: int = 0  # with an error that says what happened
    unclear: int = 0  # failed with an empty or generic message
    hung: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class FaultRecord:
    kind: str
    target: str
    at_s: float
    recovered_s: float | None  # None: not whole again within RECOVERY_BOUND_S


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Soak:
    """One soak run over a started cluster (``handle``), optionally on the two-host lab (``lab``)."""

    def __init__(self, handle: Any, args: argparse.Namespace, lab: Any = None) -> None:
        self.handle, self.args, self.lab = handle, args, lab
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.faults: list[FaultRecord] = []
        self.rss: dict[tuple[str, int], list[tuple[float, int]]] = {}  # (worker, pid) -> (t, bytes)
        self.stop = threading.Event()
        self.vocab = handle.model_info.vocab_size
        self.pool_sizes = {p: len(ids) for p, ids in self._pools().items()}
        self.t0 = time.monotonic()

    def _pools(self) -> dict[str, list[str]]:
        pools: dict[str, list[str]] = {}
        for w in self.handle.router.workers:
            pools.setdefault(w.pool, []).append(w.worker_id)
        return pools

    # ---- traffic --------------------------------------------------------------------------------------
    async def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while not self.stop.is_set():
            prompt = [rng.randrange(3, self.vocab) for _ in range(rng.randint(8, 200))]
            seeded = rng.random() < 0.5
            params = SamplingParams(
                max_tokens=rng.randint(16, 128),
                temperature=0.8 if seeded else 0.0,
                seed=rng.randrange(2**31) if seeded else None,
                ignore_eos=True,
            )
            abort_after = rng.randint(1, 8) if rng.random() < 0.1 else None
            await self.one(prompt, params, abort_after)

    async def one(self, prompt: list[int], params: SamplingParams, abort_after: int | None) -> None:
        deadline = time.monotonic() + self.handle.config.router.request_timeout_s + HUNG_GRACE_S
        stream = self.handle.agenerate(prompt, params).__aiter__()
        num_tokens = 0
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    delta = await asyncio.wait_for(stream.__anext__(), timeout=max(left, 0.001))
                except StopAsyncIteration:
                    self.tally.unclear += 1  # NOTE: a stream must end with a finish reason
                    return
                num_tokens += len(delta.token_ids)
                if abort_after is not None and num_tokens >= abort_after:
                    self.tally.aborted += 1
                    return
                if delta.finish_reason is not None:
                    self.tally.ok += 1
                    if delta.timings is not None and delta.timings.num_migrations:
                        self.tally.migrated += 1
                    return
        except TimeoutError:
            self.tally.hung += 1
        except RouterError as e:
            kind = type(e).__name__
            self.tally.errors[kind] = self.tally.errors.get(kind, 0) + 1
            if str(e).strip():
                self.tally.failed += 1
            else:
                self.tally.unclear += 1
        finally:
            await stream.aclose()

    # ---- faults ---------------------------------------------------------------------------------------
    def fault_loop(self) -> None:
        kinds = self.fault_kinds()
        n = 0
        while not self.stop.wait(self.args.fault_every):
            kind = kinds[n % len(kinds)]
            n += 1
            target = self._inject(kind)
            at = time.monotonic() - self.t0
            self.faults.append(FaultRecord(kind, target, at, self._await_recovery()))

    def fault_kinds(self) -> list[str]:
        return fault_kinds(self.args.faults, self.lab is not None)

    def _every_kind_landed(self) -> bool:
        return {f.kind for f in self.faults} >= set(self.fault_kinds())

    def _inject(self, kind: str) -> str:
        workers = [w for w in self.handle.router.workers if w.state.value == "healthy"]
        if kind == "frames":
            from bench.fuzz_frames import make_plan

            targets = {w.peer_name: w.info.request_endpoint for w in workers}  # ops go to a process
            plan = make_plan(self.rng.randrange(2**31), 200, self.handle.secret, targets)
            _send_frames(plan.frames)
            return f"{len(plan.frames)} frames"
        if kind == "link_flap":
            self.lab.link(False)
            self.stop.wait(3.0)
            self.lab.link(True)
            return "veth"
        victim = self.rng.choice(workers)
        if kind == "kill9":
            os.kill(victim.info.pid, signal.SIGKILL)
        else:
            os.kill(victim.info.pid, signal.SIGSTOP)
            self.stop.wait(2.5)
            os.kill(victim.info.pid, signal.SIGCONT)
        return victim.worker_id

    def _whole(self) -> bool:
        router = self.handle.router
        healthy: dict[str, int] = {}
        for w in router.workers:
            healthy[w.pool] = healthy.get(w.pool, 0) + w.healthy
        return router.is_healthy() and all(healthy.get(p, 0) >= n for p, n in self.pool_sizes.items())

    def _await_recovery(self) -> float | None:
        """Seconds until the cluster is whole again and answers a probe; None past the bound. The end of
        the traffic does not cut it short (the leak check needs every worker back)."""
        start = time.monotonic()
        while time.monotonic() - start < RECOVERY_BOUND_S:
            if self._whole():
                try:
                    self.handle.generate(
                        [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0), timeout_s=60
                    )
                    return time.monotonic() - start
                except RouterError:
                    pass
            time.sleep(0.1)  # NOTE: a bounded poll of the router's view
        return None

    def sample_rss(self) -> None:
        for w in self.handle.router.workers:
            rss = _rss_bytes(w.info.pid)
            if rss is not None:
                self.rss.setdefault((w.worker_id, w.info.pid), []).append((time.monotonic(), rss))

    # ---- the run --------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        faults = threading.Thread(target=self.fault_loop, name="soak-faults", daemon=True)

        async def traffic() -> None:
            clients = [asyncio.create_task(self.client(i)) for i in range(self.args.concurrency)]
            end = self.t0 + 60 * self.args.minutes
            # NOTE: a short run still sees every kind of fault once (bounded at 3x the asked duration)
            while time.monotonic() < end or (
                not self._every_kind_landed() and time.monotonic() < self.t0 + 180 * self.args.minutes
            ):
                self.sample_rss()
                await asyncio.sleep(1.0)  # NOTE: the run's own clock (a benchmark)
            self.stop.set()
            await asyncio.gather(*clients)

        faults.start()
        asyncio.run(traffic())
        faults.join(timeout=RECOVERY_BOUND_S + 30)
        self._await_recovery()
        self.handle.wait_until_quiet(timeout_s=120)
        leaks = self.handle.check_leaks()
        return self.report(leaks)

    def report(self, leaks: dict[str, str | None]) -> dict[str, Any]:
        growth, with_warmup = rss_growth(self.rss, self.args.rss_warmup)
        recovered = [f.recovered_s for f in self.faults if f.recovered_s is not None]
        return {
            "minutes": self.args.minutes,
            "tally": asdict(self.tally),
            "leaks": leaks,
            "rss_warmup_s": self.args.rss_warmup,
            "rss_growth_pct": growth,
            "rss_growth_incl_warmup_pct": with_warmup,
            "fault_kinds": self.fault_kinds(),
            "faults": [asdict(f) for f in self.faults],
            "recovery_s_median": statistics.median(recovered) if recovered else None,
            "recovery_s_max": max(recovered) if recovered else None,
            "unrecovered": sum(1 for f in self.faults if f.recovered_s is None),
        }


def rss_growth(
    samples: dict[tuple[str, int], list[tuple[float, int]]], warmup_s: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Per worker process, RSS growth in percent (1) from its first sample at least ``warmup_s`` after
    its first to its last, for processes sampled at least ``RSS_MIN_SPAN_S`` after their warm-up: what
    a leak would show; (2) from its first sample to its last, warm-up included (allocator and caches
    filling up), for every process sampled at least 10 times."""
    steady: dict[str, float] = {}
    whole: dict[str, float] = {}
    for (wid, pid), points in samples.items():
        name = f"{wid} (pid {pid})"
        if len(points) >= 10:
            whole[name] = 100.0 * (points[-1][1] - points[0][1]) / points[0][1]
        after = [(t, rss) for t, rss in points if t - points[0][0] >= warmup_s]
        if after and after[-1][0] - after[0][0] >= RSS_MIN_SPAN_S:
            steady[name] = 100.0 * (after[-1][1] - after[0][1]) / after[0][1]
    return steady, whole


def fault_kinds(asked: str, on_lab: bool) -> list[str]:
    """The fault kinds of a run, in the order they take turns: those ``asked`` (comma-separated, or
    "all"); a link flap needs the lab."""
    known = ["frames", "sigstop", "kill9", "link_flap"]
    kinds = known if asked == "all" else [k.strip() for k in asked.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in known]
    if unknown or not kinds:
        raise ValueError(f"--faults: unknown kinds {unknown}; choose from {known} or 'all'")
    if not on_lab:
        if asked != "all" and "link_flap" in kinds:
            raise ValueError("--faults: link_flap needs --lab (a link to flap)")
        kinds = [k for k in kinds if k != "link_flap"]
    return kinds


def _send_frames(frames: Sequence[tuple[str, bytes]]) -> None:
    import zmq

    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sockets: dict[str, Any] = {}
        for endpoint, frame in frames:
            if endpoint not in sockets:
                sockets[endpoint] = ctx.socket(zmq.PUSH)
                sockets[endpoint].setsockopt(zmq.SNDTIMEO, 5_000)
                sockets[endpoint].connect(endpoint)
            sockets[endpoint].send(frame)
        for sock in sockets.values():
            sock.close(linger=5_000)
    finally:
        ctx.term()


def soak_config(path: str, on_lab: bool) -> ClusterConfig:
    """The config under test, made restartable: Ray restarts killed workers, transfers recompute; on the
    lab, prefill workers live on host A and the rest on host B."""
    cfg = ClusterConfig.from_yaml(path)

    def pool(pc: PoolConfig, host: str) -> PoolConfig:
        return replace(pc, max_restarts=1000, resources={host: 1.0} if on_lab else pc.resources)

    return replace(
        cfg,
        router=replace(cfg.router, health_interval_s=0.25, health_timeout_s=2.0),
        transfer=replace(cfg.transfer, failure_policy="recompute", timeout_s=10.0),
        prefill=pool(cfg.prefill, "host_a"),
        decode=pool(cfg.decode, "host_b"),
        colocated=pool(cfg.colocated, "host_b"),
    )


def print_report(report: dict[str, Any]) -> None:
    t = report["tally"]
    print(
        f"soak {report['minutes']} min: ok {t['ok']} (migrated {t['migrated']}), client aborts {t['aborted']}, "
        f"failed with a clear error {t['failed']} {t['errors'] or ''}, unclear {t['unclear']}, hung {t['hung']}"
    )
    leaked = {w: v for w, v in report["leaks"].items() if v is not None}
    print(f"leaked blocks: {leaked or 'none'} ({len(report['leaks'])} workers checked)")
    for key, what in (
        ("rss_growth_pct", f"after a {report['rss_warmup_s']:.0f} s warm-up"),
        ("rss_growth_incl_warmup_pct", "warm-up included"),
    ):
        growth = report[key]
        if not growth:
            print(f"RSS growth per worker process ({what}): no process lived long enough")
            continue
        worst = max(growth.items(), key=lambda kv: kv[1])
        print(f"RSS growth per worker process ({what}): max {worst[1]:+.1f}% ({worst[0]}); " + ", ".join(
            f"{k} {v:+.1f}%" for k, v in sorted(growth.items())))  # fmt: skip
    kinds: dict[str, list[float]] = {}
    for f in report["faults"]:
        if f["recovered_s"] is not None:
            kinds.setdefault(f["kind"], []).append(f["recovered_s"])
    print(
        f"faults {len(report['faults'])}, unrecovered {report['unrecovered']}; time to whole again: "
        + ", ".join(
            f"{k} median {statistics.median(v):.1f} s max {max(v):.1f} s" for k, v in sorted(kinds.items())
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--config", default="deploy/cpu-disagg.yaml")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--fault-every", type=float, default=5.0, help="seconds between faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--faults",
        default="all",
        help="fault kinds taking turns, comma-separated: frames,sigstop,kill9,link_flap (default all; "
        "link_flap only with --lab)",
    )
    ap.add_argument(
        "--rss-warmup",
        type=float,
        default=120.0,
        help="seconds of a worker process's life left out of its steady-state RSS growth",
    )
    ap.add_argument("--lab", action="store_true", help="run on the two-host lab (root, netns)")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    try:
        fault_kinds(args.faults, args.lab)
    except ValueError as e:
        ap.error(str(e))
    if args.lab:
        # NOTE: the lab's Ray cluster runs token auth, and Ray reads this once, at import
        os.environ["RAY_AUTH_MODE"] = "token"
    report = run_soak(args)
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from deploy.launch import build_cluster

    lab = None
    if args.lab:
        from bench.netns_lab import start_lab

        lab = start_lab()
    try:
        if lab is not None:
            ray.init(address=lab.address, _node_ip_address=lab.ip_a, log_to_driver=False)
        handle = build_cluster(soak_config(args.config, lab is not None))
        try:
            return Soak(handle, args, lab).run()
        finally:
            handle.shutdown()
    finally:
        if lab is not None:
            ray.shutdown()
            lab.stop()


if __name__ == "__main__":
    raise SystemExit(main())
