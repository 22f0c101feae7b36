"""The configs of the services around the engines: ``TransferConfig`` (KV movement), ``RouterConfig``
(the request path), ``ServerConfig`` (the HTTP edge) and ``LogConfig`` (every process's logs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config.checking import require

ROUTER_MODES = ("disaggregated", "colocated", "conditional")
ADMISSION_POLICIES = ("off", "slo")
PREFIX_ROUTING = ("index", "affinity")
TRANSFER_BACKENDS = ("auto", "gloo", "nccl")
FAILURE_POLICIES = ("fail", "recompute")
TRANSFER_INTEGRITY = ("mac", "digest", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
METRICS_COMPAT = ("none", "vllm")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen")  # cluster/http/tool_parsers.py's names


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "auto"  # auto: nccl when every worker has a GPU, else gloo
    timeout_s: float = 30.0  # bound on one transfer, handshake to ack
    lease_s: float = 60.0  # prefill side frees held blocks after this long without a transfer
    failure_policy: str = "fail"  # fail: error to the client; recompute: decode worker prefills it
    # KV chunk check: mac (keyed with the cluster secret: a peer without it cannot forge KV), digest
    # (XXH3 / device polynomial keyed by the nonce: catches accidents only), off (no check)
    integrity: str = "mac"

    def __post_init__(self) -> None:
        require(self.backend in TRANSFER_BACKENDS, f"transfer backend must be one of {TRANSFER_BACKENDS}")
        require(self.timeout_s > 0, f"transfer timeout_s must be > 0, got {self.timeout_s}")
        require(self.lease_s > 0, f"lease_s must be > 0, got {self.lease_s}")
        require(
            self.failure_policy in FAILURE_POLICIES,
            f"failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}",
        )
        require(
            self.integrity in TRANSFER_INTEGRITY,
            f"transfer integrity must be one of {TRANSFER_INTEGRITY}, got {self.integrity!r}",
        )


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "disaggregated"
    # conditional mode: prompts of at most this many tokens are prefilled on the decode worker
    conditional_max_prompt_tokens: int = 64
    request_timeout_s: float = 300.0  # default deadline when the caller gives none
    max_pending_requests: int = 1024  # beyond this the router answers QueueFull (HTTP 429)
    health_interval_s: float = 0.5  # worker stats / liveness poll period
    health_timeout_s: float = 5.0  # a worker silent this long is treated as dead
    # prefix affinity: keep a prompt's first block on the same prefill worker unless that worker has
    # this many more outstanding prompt tokens than the least loaded one
    affinity_slack_tokens: int = 4096
    # how a prompt's prefill (or colocated) worker is picked: "index" by what every worker's KV tiers
    # report holding (KvEvents into cluster/router/kv_index.py), the fewest tokens left to compute plus
    # the worker's queue; "affinity" by the guess above (kept to compare the two)
    prefix_routing: str = "index"
    # the index's bounds: block hashes per worker (~150 B each; past it the oldest go) and workers
    kv_index_max_blocks_per_worker: int = 1 << 20
    kv_index_max_workers: int = 1024
    # a request whose worker dies is dispatched again (prompt + tokens so far) at most this many times
    max_migrations: int = 3
    # with one pool empty, the other pool's workers serve whole requests
    colocated_fallback: bool = True
    # scale-down: how long a draining worker's requests may take before they migrate
    drain_timeout_s: float = 30.0
    # "slo": refuse (429 + Retry-After) a request whose predicted TTFT misses its SLO (ttft_slo_ms, or the
    # request's x-pdserve-ttft-slo-ms header); predictions come from the cost profile (cluster/router/admission.py)
    admission: str = "off"
    ttft_slo_ms: float | None = None
    # conditional mode: a local prefill must not stall the decode worker's batch past this (None: no bound)
    tbt_slo_ms: float | None = None
    # cost profile JSON for conditional routing by predicted cost, admission and live advice: a path, or
    # "default" ($PDSERVE_PROFILE, else where `pdserve plan calibrate` writes it); "": none (conditional
    # mode then goes by conditional_max_prompt_tokens)
    cost_profile: str = ""
    # live advice (/v1/pdserve/advice): the planner replays the traffic of this many recent seconds
    advice_window_s: float = 300.0
    # early decode admission: the decode worker is chosen with the prefill worker and reserves blocks and
    # posts its KV fetch while the prefill runs, so the transfer starts the moment the KV is offered
    early_decode_admission: bool = True
    # a worker frees the requests of a router (a front-end replica) it has not heard from this long:
    # the router renews it every health_interval_s, so it must be well above that
    router_lease_s: float = 10.0
    # prefix pulls (cluster/router/pulls.py): the prefill worker pulls the device blocks of a prompt's
    # prefix another worker holds when they are at least this many more than its own (0: off) and, with a
    # cost profile, their transfer beats their prefill; the prompt waits at most pull_timeout_s for it.
    # NOTE: off by default: measured (bench/results/multiturn-mock-2026-11-29.md), the rule does not weigh
    # a pull's control hops, and beside a host tier pulls cost more TTFT than they save
    pull_min_blocks: int = 0
    pull_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        require(self.mode in ROUTER_MODES, f"router mode must be one of {ROUTER_MODES}, got {self.mode!r}")
        require(
            self.admission in ADMISSION_POLICIES,
            f"router admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}",
        )
        require(
            self.prefix_routing in PREFIX_ROUTING,
            f"router prefix_routing must be one of {PREFIX_ROUTING}, got {self.prefix_routing!r}",
        )
        for name in ("kv_index_max_blocks_per_worker", "kv_index_max_workers"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ttft_slo_ms", "tbt_slo_ms"):
            value = getattr(self, name)
            require(value is None or 0 < value < 1e9, f"{name} must be > 0 (milliseconds), got {value}")
        require(self.advice_window_s > 0, f"advice_window_s must be > 0, got {self.advice_window_s}")
        require(self.request_timeout_s > 0, f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        require(self.max_pending_requests >= 1, "max_pending_requests must be >= 1")
        require(self.health_interval_s > 0, "health_interval_s must be > 0")
        require(self.pull_min_blocks >= 0, f"pull_min_blocks must be >= 0, got {self.pull_min_blocks}")
        require(self.pull_timeout_s > 0, f"pull_timeout_s must be > 0, got {self.pull_timeout_s}")
        require(self.max_migrations >= 0, f"max_migrations must be >= 0, got {self.max_migrations}")
        require(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        require(
            self.router_lease_s >= 4 * self.health_interval_s,
            f"router_lease_s must be >= 4 x health_interval_s ({4 * self.health_interval_s:g}), "
            f"got {self.router_lease_s}",
        )


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP edge. metrics_compat "vllm" also exports the ``vllm:*`` metric names pdserve shares."""

    host: str = "127.0.0.1"
    port: int = 8000
    # NOTE: keys never appear in a repr (logs, errors); the edge keeps only their digests
    api_key: str | None = field(default=None, repr=False)
    served_model_name: str | None = None
    max_body_bytes: int = 1 << 20
    metrics_compat: str = "none"
    # tenants: one key per line, `name:key` or `key` (cluster/http/auth.py); each key's limits are its own
    api_keys_file: str | None = None
    # the admin routes (/v1/pdserve/*) take this key only; without one they answer 404
    admin_key: str | None = field(default=None, repr=False)
    admin_key_file: str | None = None
    # a non-loopback host without an API key is refused unless this is set (then logged as a warning)
    allow_unauthenticated: bool = False
    # per tenant (API key; client address without keys): router requests in flight (n counts n) and
    # queued tokens (prompt + max_tokens each); over: 429 naming the limit. 0: no limit
    max_requests_per_key: int = 256
    max_tokens_per_key: int = 1 << 22
    # connections (cluster/http/connections.py): open-connection cap (0: none), deadlines for a request
    # head and for its body, idle time between requests
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    # the one byte bound of a stream: what its client has not read, counted once (the output its router
    # stream holds while the connection's buffer is full, protocol.delta_nbytes each, plus the bytes in
    # that buffer); past it the request is aborted on its workers (generation cannot pause), KV freed
    stream_buffer_bytes: int = 1 << 20
    # a stream whose connection's buffer has stayed full this long (its client reads nothing) ends: its
    # requests are aborted everywhere and its connection closed
    stream_stall_timeout_s: float = 30.0
    # tool_choice "auto" (vLLM's --enable-auto-tool-choice): the output's tool calls are found by
    # tool_call_parser (--tool-call-parser), which must match the model's chat template
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # front-end replicas (vLLM's --api-server-count): processes, each an HTTP edge + router over the same
    # workers, sharing the port (SO_REUSEPORT); 1 serves from the launching process itself
    replicas: int = 1
    # with replicas > 1: replica i also serves its own /metrics (and /health) on metrics_port + i, for
    # Prometheus to scrape each (the shared port reaches whichever replica the kernel picks); 0: none
    metrics_port: int = 0

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, f"server port must be in [0, 65535], got {self.port}")
        require(1 <= self.replicas <= 64, f"server replicas must be in [1, 64], got {self.replicas}")
        require(
            self.metrics_port == 0 or 1 <= self.metrics_port <= 65535 - self.replicas,
            f"server metrics_port must be 0 or in [1, {65535 - self.replicas}], got {self.metrics_port}",
        )
        for name in ("max_requests_per_key", "max_tokens_per_key", "max_connections"):
            value = getattr(self, name)
            require(value >= 0, f"{name} must be >= 0 (0: no limit), got {value}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        require(
            self.stream_buffer_bytes >= 4096,
            f"stream_buffer_bytes must be >= 4096, got {self.stream_buffer_bytes}",
        )
        require(
            0 < self.stream_stall_timeout_s <= 3600,
            f"stream_stall_timeout_s must be in (0, 3600], got {self.stream_stall_timeout_s}",
        )
        require(
            self.metrics_compat in METRICS_COMPAT,
            f"metrics_compat must be one of {METRICS_COMPAT}, got {self.metrics_compat!r}",
        )
        require(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}",
        )
        require(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice needs tool_call_parser: --enable-auto-tool-choice needs "
            f"--tool-call-parser (one of {TOOL_CALL_PARSERS})",
        )


@dataclass(frozen=True)
class LogConfig:
    """Logging of the driver and every actor: level, format (text | json), and how often each worker
    logs its stats line (0 turns that line off)."""

    level: str = "INFO"
    format: str = "text"
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        require(self.level in LOG_LEVELS, f"log level must be one of {LOG_LEVELS}, got {self.level!r}")
        require(self.format in LOG_FORMATS, f"log format must be one of {LOG_FORMATS}, got {self.format!r}")
        require(self.stats_interval_s >= 0, f"stats_interval_s must be >= 0, got {self.stats_interval_s}")
