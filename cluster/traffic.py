"""The router's memory of recent traffic, for live advice: arrival time and lengths of every request
that finished in the last ``window_s`` seconds (bounded). The planner replays it through the simulation
(deploy/planner/advice.py). Pure and cheap: one append per finished request."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrafficEntry:
    arrival_s: float  # time.time() when the router accepted it
    prompt_tokens: int
    output_tokens: int


class TrafficLog:
    """A sliding window of finished requests. Not thread-safe: the router's loop owns it."""

    def __init__(self, window_s: float = 600.0, max_entries: int = 20_000) -> None:
        if window_s <= 0 or max_entries < 1:
            raise ValueError(f"window_s must be > 0 and max_entries >= 1, got {window_s}, {max_entries}")
        self.window_s = window_s
        self._entries: deque[TrafficEntry] = deque(maxlen=max_entries)

    def record(self, arrival_s: float, prompt_tokens: int, output_tokens: int) -> None:
        self._entries.append(TrafficEntry(arrival_s, prompt_tokens, output_tokens))

    def snapshot(self, now: float) -> list[TrafficEntry]:
        """Entries that arrived within the window before ``now``, oldest first (older ones are dropped)."""
        horizon = now - self.window_s
        while self._entries and self._entries[0].arrival_s < horizon:
            self._entries.popleft()
        return sorted(self._entries, key=lambda e: e.arrival_s)

    def __len__(self) -> int:
        return len(self._entries)
