"""Structured-output grammars compile here, on a bounded pool of helper threads, never on a step thread.

xgrammar's compile is C++ that releases the GIL (a 2.7 s compile of a 9,500-rule grammar left a Python
loop on another thread with gaps of at most 9 ms), so a compile costs the step thread nothing but a
core. What bounds it:

- size caps, checked before anything is submitted: ``max_spec_chars`` (spec text) and
  ``max_grammar_rules`` (EBNF rules): over either, the spec fails at once;
- a time budget: a compile running longer than ``timeout_s`` fails every request waiting for it, and
  its spec is remembered as too complex (a repeat fails at once). The thread itself cannot be stopped
  (xgrammar has no cancel): it finishes the compile and its result is thrown away;
- ``num_threads`` threads, and at most ``max_pending`` specs queued or compiling: a distinct spec over
  that fails at once (QUEUE_FULL: retry later); a spec that waited ``timeout_s`` for a free thread
  fails the same way, and is never compiled;
- one compile per identical spec: every request asking for a spec already compiling shares its
  :class:`CompileTicket`.

Requests are not known here (the engine keeps which request waits for which ticket); neither is the
client a request came from, so there is no per-client cap on compiles in flight (``max_pending`` is
per worker).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from cluster.config import EngineConfig
from cluster.protocol import ErrorCode, StructuredOutput

# NOTE: bounds the memory of the too-complex set (one spec text each, at most max_spec_chars)
MAX_REMEMBERED_FAILURES = 256
# NOTE: compile threads run at the lowest CPU priority (Linux: a thread is a task with its own nice
# value), so on a worker with few cores the step thread wins a contended core over a long compile
COMPILE_THREAD_NICE = 19


def _lower_priority() -> None:
    # NOTE: not Linux (or not allowed): the same priority as the rest
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_THREAD_NICE)


SpecKey = tuple[str, str, tuple[str, ...]]


@dataclass(frozen=True)
class CompileLimits:
    """The pool's bounds (EngineConfig's ``structured_*`` keys)."""

    num_threads: int = 2
    timeout_s: float = 5.0
    max_pending: int = 64
    max_spec_chars: int = 256 * 1024
    max_grammar_rules: int = 2000

    @classmethod
    def from_config(cls, config: EngineConfig) -> CompileLimits:
        return cls(
            config.structured_compile_threads,
            config.structured_compile_timeout_s,
            config.structured_max_pending_compiles,
            config.structured_max_spec_chars,
            config.structured_max_grammar_rules,
        )


class CompileFailed(ValueError):
    """A spec that will not compile (in time, or at all); ``code`` is what the client is told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message[:500])
        self.code = code


@dataclass(frozen=True)
class RequestFailure:
    """A request the engine ended because its grammar failed; the worker sends it as RequestFailed."""

    request_id: str
    code: ErrorCode
    message: str


def too_complex(spec: StructuredOutput, limits: CompileLimits) -> str | None:
    """Why ``spec`` is over the size caps (naming the limit), or None: cheap, before any compile."""
    text = spec.spec if spec.kind != "choice" else "".join(spec.choices)
    if len(text) > limits.max_spec_chars:
        return (
            f"structured output {spec.kind} is {len(text)} characters, over the limit of "
            f"{limits.max_spec_chars} (structured_max_spec_chars)"
        )
    if spec.kind == "grammar":
        num_rules = spec.num_grammar_rules
        if num_rules > limits.max_grammar_rules:
            return (
                f"structured output grammar has {num_rules} rules, over the limit of "
                f"{limits.max_grammar_rules} (structured_max_grammar_rules)"
            )
    return None


class CompileTicket:
    """One spec's compile, shared by every request that asked for it before it ended. ``future`` is None
    for a ticket that failed before it was submitted (``failure`` says why)."""

    def __init__(self, key: SpecKey, submitted_at: float, failure: CompileFailed | None = None) -> None:
        self.key = key
        self.submitted_at = submitted_at
        self.failure = failure
        self.future: Future[Any] | None = None
        self.started_at: float | None = None  # set by the compile thread
        self.compile_s: float | None = None  # set by the compile thread once done
        self.is_abandoned = False  # waited too long for a thread: never compiled

    @classmethod
    def done(cls, key: SpecKey, compiled: Any) -> CompileTicket:
        ticket = cls(key, 0.0)
        future: Future[Any] = Future()
        future.set_result(compiled)
        ticket.future, ticket.compile_s = future, 0.0
        return ticket


class CompilePool:
    """``submit`` a spec, then ``poll`` its ticket (never blocks) until it returns the compiled grammar or
    raises :class:`CompileFailed`. ``compile_fn`` compiles one spec (any thread; raises ValueError for
    a spec it rejects); ``on_compiled`` receives each compile that finished within the budget (to
    cache it). Lifecycle: ``close`` at shutdown (running compiles finish in the background)."""

    def __init__(
        self,
        compile_fn: Callable[[StructuredOutput], Any],
        limits: CompileLimits,
        on_compiled: Callable[[StructuredOutput, Any], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._compile_fn = compile_fn
        self._on_compiled = on_compiled
        self._clock = clock
        self._executor = ThreadPoolExecutor(
            limits.num_threads, thread_name_prefix="grammar-compile", initializer=_lower_priority
        )
        self._lock = threading.Lock()
        self._in_flight: dict[SpecKey, CompileTicket] = {}
        self._too_complex: OrderedDict[SpecKey, str] = OrderedDict()
        self.num_compiles = 0
        self.num_shared = 0  # submits that joined a compile already in flight
        self.num_timeouts = 0
        self.num_refused = 0  # over a size cap, remembered as too complex, or the pool full

    def submit(self, spec: StructuredOutput) -> CompileTicket:
        key, now = spec.cache_key, self._clock()
        with self._lock:
            known = self._too_complex.get(key)
            if known is not None:
                self.num_refused += 1
                return CompileTicket(key, now, CompileFailed(ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX, known))
            ticket = self._in_flight.get(key)
            if ticket is not None:
                self.num_shared += 1
                return ticket
            reason = too_complex(spec, self.limits)
            if reason is not None:
                self.num_refused += 1
                return CompileTicket(key, now, CompileFailed(ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX, reason))
            if len(self._in_flight) >= self.limits.max_pending:
                self.num_refused += 1
                message = (
                    f"{len(self._in_flight)} structured-output grammars are compiling or queued on this "
                    f"worker, the limit (structured_max_pending_compiles); retry later"
                )
                return CompileTicket(key, now, CompileFailed(ErrorCode.QUEUE_FULL, message))
            ticket = self._in_flight[key] = CompileTicket(key, now)
            ticket.future = self._executor.submit(self._run, ticket, spec)
            return ticket

    def _run(self, ticket: CompileTicket, spec: StructuredOutput) -> Any:
        with self._lock:
            if ticket.is_abandoned:
                return None
            ticket.started_at = self._clock()
            self.num_compiles += 1
        try:
            compiled = self._compile_fn(spec)
        finally:
            with self._lock:
                ticket.compile_s = self._clock() - ticket.started_at
                if self._in_flight.get(ticket.key) is ticket:
                    del self._in_flight[ticket.key]
        if ticket.compile_s > self.limits.timeout_s:
            self._remember_too_complex(ticket.key, self._over_budget(ticket.compile_s))
        elif self._on_compiled is not None:
            self._on_compiled(spec, compiled)
        return compiled

    def _over_budget(self, seconds: float) -> str:
        return (
            f"structured output did not compile within {self.limits.timeout_s:g} s "
            f"(structured_compile_timeout_s; {seconds:.1f} s so far)"
        )

    def _remember_too_complex(self, key: SpecKey, message: str) -> None:
        with self._lock:
            self._too_complex[key] = message
            self._too_complex.move_to_end(key)
            while len(self._too_complex) > MAX_REMEMBERED_FAILURES:
                self._too_complex.popitem(last=False)

    def poll(self, ticket: CompileTicket) -> Any | None:
        """The compiled grammar, None while it compiles (or waits for a thread); raises CompileFailed
        (too complex: over the budget; QUEUE_FULL: no thread in time; INVALID_REQUEST: rejected)."""
        if ticket.failure is not None:
            raise ticket.failure
        future = ticket.future
        if future is None:
            raise RuntimeError("a ticket with neither a future nor a failure")
        limit = self.limits.timeout_s
        if future.done():
            error = future.exception()
            if isinstance(error, ValueError):
                ticket.failure = CompileFailed(ErrorCode.INVALID_REQUEST, str(error))
                raise ticket.failure
            if error is not None:
                raise error
            if ticket.compile_s is not None and ticket.compile_s > limit:
                ticket.failure = CompileFailed(
                    ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX, self._over_budget(ticket.compile_s)
                )
                raise ticket.failure
            return future.result()
        now = self._clock()
        with self._lock:
            started = ticket.started_at
            if started is not None and now - started > limit:
                self.num_timeouts += 1
                message = self._over_budget(now - started)
                ticket.failure = CompileFailed(ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX, message)
            elif started is None and now - ticket.submitted_at > limit:
                ticket.is_abandoned = True
                if self._in_flight.get(ticket.key) is ticket:
                    del self._in_flight[ticket.key]
                ticket.failure = CompileFailed(
                    ErrorCode.QUEUE_FULL,
                    f"no structured-output compile thread came free within {limit:g} s "
                    f"(structured_compile_threads={self.limits.num_threads}); retry later",
                )
        if ticket.failure is not None:
            if ticket.failure.code is ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX:
                self._remember_too_complex(ticket.key, str(ticket.failure))
            raise ticket.failure
        return None

    def wait(self, tickets: Sequence[CompileTicket], timeout_s: float) -> None:
        """Block up to ``timeout_s`` until one of ``tickets`` finishes (an engine with nothing else to run)."""
        futures = [t.future for t in tickets if t.future is not None and t.failure is None]
        if len(futures) == len(tickets) and futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def result(self, ticket: CompileTicket) -> Any:
        """Block until ``ticket`` ends (bounded by the budget and the queue bound): the compiled grammar,
        or CompileFailed. For callers that may block (the offline API's validation)."""
        deadline = self._clock() + 2 * self.limits.timeout_s + 1.0
        while True:
            compiled = self.poll(ticket)
            if compiled is not None:
                return compiled
            if self._clock() > deadline:
                raise CompileFailed(
                    ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX, self._over_budget(self.limits.timeout_s)
                )
            self.wait([ticket], 0.05)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
