"""The periodic stats line every worker logs (vLLM's "Avg prompt throughput ..." line, per worker).

Rates are over the interval since the previous line, from the cumulative counters of two
``WorkerStats`` snapshots: prompt and generation tok/s, prefix-cache hit rate, KV transfers; gauges
(running, waiting, waiting for KV, KV usage) are the latest snapshot's.
"""

from __future__ import annotations

import logging
import time

from cluster.protocol import WorkerStats

logger = logging.getLogger("workers.stats")


def format_stats_line(previous: WorkerStats, current: WorkerStats, seconds: float) -> str:
    """One line describing ``current`` and its rates since ``previous`` (``seconds`` apart)."""
    e0, e1 = previous.engine, current.engine
    t0, t1 = previous.transfer, current.transfer
    dt = max(seconds, 1e-9)
    queries = e1.prefix_cache_queries - e0.prefix_cache_queries
    hits = e1.prefix_cache_hits - e0.prefix_cache_hits
    hit_rate = f"{100.0 * hits / queries:.1f}%" if queries else "-"
    moved = t1.bytes_total - t0.bytes_total
    return (
        f"{current.worker_id} ({current.pool}): "
        f"prompt {(e1.num_prompt_tokens - e0.num_prompt_tokens) / dt:.1f} tok/s, "
        f"generation {(e1.num_generation_tokens - e0.num_generation_tokens) / dt:.1f} tok/s, "
        f"running {e1.num_running}, waiting {e1.num_waiting}, waiting for KV {current.num_waiting_for_kv}, "
        f"KV usage {100.0 * e1.kv_usage:.1f}%, prefix hit rate {hit_rate}, "
        f"transfers {t1.num_ok - t0.num_ok} ok / {t1.num_failed - t0.num_failed} failed "
        f"({moved / dt / 1e6:.1f} MB/s), preemptions {e1.num_preemptions - e0.num_preemptions}"
    )


class StatsLine:
    """Logs ``format_stats_line`` at INFO at most once per ``interval_s`` (0: never).

    ``maybe_log`` is called from the step thread on every loop; it only compares a clock otherwise.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: WorkerStats | None = None
        self._last_time = 0.0

    def maybe_log(self, stats: WorkerStats, now: float | None = None) -> str | None:
        """Log (and return) the line when the interval has passed since the last one, else None."""
        if self.interval_s <= 0:
            return None
        now = time.monotonic() if now is None else now
        if self._last is None:
            self._last, self._last_time = stats, now
            return None
        if now - self._last_time < self.interval_s:
            return None
        line = format_stats_line(self._last, stats, now - self._last_time)
        self._last, self._last_time = stats, now
        logger.info("%s", line)
        return line
