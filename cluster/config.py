"""Frozen configuration dataclasses.

Every value a user sets lives here; values discovered at run time (resolved dtype, device, number of KV
blocks sized from memory) live on the engine, never back on a config. Unknown keys are an error.
This module imports nothing of the project.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("torch", "triton")
LOAD_FORMATS = ("auto", "dummy", "mock")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
METRICS_COMPAT = ("none", "vllm")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen")  # cluster/http/tool_parsers.py's names

T = TypeVar("T")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# NOTE: the structured-output caps' defaults: the engine checks them before compiling, and the HTTP edge
# refuses a spec over them before queueing (cluster/http/output_constraints.py), so a bomb reaches no queue.
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024
MAX_GRAMMAR_RULES = 2000


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to serve and how.

    path: a Hugging Face checkpoint directory (config.json + *.safetensors [+ tokenizer.json]) or a
    Hugging Face repo id (``org/name``, resolved through the hub cache by ``cluster/hub.py`` before any
    worker starts); empty means the bundled tiny model. revision: the repo's branch, tag or commit
    (repo ids only). dtype "auto" takes the checkpoint's torch_dtype on CUDA and float32 on CPU.
    max_model_len None means the model's max_position_embeddings.
    """

    path: str = ""
    dtype: str = "auto"
    max_model_len: int | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and KV-cache settings of one paged-KV engine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = "auto"
    block_size: int = 16
    # None: sized from memory (gpu_memory_utilization on CUDA, cpu_kv_cache_bytes on CPU).
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"
    # CUDA graphs for decode-only steps (CUDA + triton backend): batch sizes 1, 2, 4, 8, 16, ... up to
    # min(max_num_seqs, cuda_graph_max_batch_size); enforce_eager turns them off.
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int = 256
    seed: int = 0
    # "auto": weights from the checkpoint's *.safetensors; "dummy": random weights built on the device
    # from config.json alone (benchmarks; vLLM's name for it); "mock": no weights and no forward: on the
    # host, each step waits the time mock_cost_profile predicts for it and samples a deterministic token
    # (workers/mock_runner.py).
    load_format: str = "auto"
    # load_format mock: the cost profile JSON whose step time a mock step waits (a path, or "default":
    # where `pdserve plan calibrate` writes it); "": steps wait nothing
    mock_cost_profile: str = ""
    # Schedule and prepare step N+1 while step N runs on the device (outputs are the same either way).
    # None: on for CUDA, off on CPU (there the host is the device: nothing to overlap).
    async_scheduling: bool | None = None
    # CPU device: glibc keeps freed memory for the next step's activations instead of returning it to
    # the kernel and faulting it back in (workers/host_memory.py; process-wide, set when the engine starts).
    retain_host_memory: bool = True
    # Structured outputs (workers/structured_compile.py): grammars compile on this many helper threads,
    # never on the step thread; a compile over the timeout fails its requests (400
    # structured_output_too_complex); a spec over the character or rule cap fails before compiling;
    # at most max_pending_compiles distinct specs are queued or compiling (over it: 429).
    structured_compile_threads: int = 2
    structured_compile_timeout_s: float = 5.0
    structured_max_pending_compiles: int = 64
    structured_max_spec_chars: int = MAX_STRUCTURED_SPEC_CHARS
    structured_max_grammar_rules: int = MAX_GRAMMAR_RULES

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(
            self.structured_compile_threads >= 1,
            f"structured_compile_threads must be >= 1, got {self.structured_compile_threads}",
        )
        _require(
            self.structured_compile_timeout_s > 0,
            f"structured_compile_timeout_s must be > 0, got {self.structured_compile_timeout_s}",
        )
        _require(
            min(
                self.structured_max_pending_compiles,
                self.structured_max_spec_chars,
                self.structured_max_grammar_rules,
            )
            >= 1,
            "structured_max_pending_compiles, structured_max_spec_chars and structured_max_grammar_rules "
            "must be >= 1",
        )
        _require(1 <= self.block_size <= 1024, f"block_size must be in [1, 1024], got {self.block_size}")
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _require(
            self.cuda_graph_max_batch_size >= 1,
            f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}",
        )
        _require(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}",
        )
        _require(
            self.load_format != "mock" or self.device != "cuda",
            "load_format mock runs on the host: device must be auto or cpu, got 'cuda'",
        )
        _require(
            not self.mock_cost_profile or self.load_format == "mock",
            f"mock_cost_profile is read by load_format mock only, got load_format {self.load_format!r}",
        )

    def uses_async_scheduling(self, device_type: str) -> bool:
        """``async_scheduling`` as set, or (unset) whether the engine runs on CUDA."""
        return device_type == "cuda" if self.async_scheduling is None else self.async_scheduling

    def max_model_len(self, max_position_embeddings: int, num_kv_blocks: int | None = None) -> int:
        """The longest sequence (prompt + output) an engine of this config serves: ``model.max_model_len``
        (None: the checkpoint's ``max_position_embeddings``), capped by what ``num_kv_blocks`` hold when
        given. The one place this is derived (the model runner, hence the engine, and ``pdserve plan``)."""
        limit = self.model.max_model_len or max_position_embeddings
        if num_kv_blocks is None:
            return limit
        # NOTE: a sequence can never outgrow the KV pool (block 0 is reserved), so the pool caps it too.
        return min(limit, (num_kv_blocks - 1) * self.block_size)

    @classmethod
    def from_options(cls, model: str = "", **options: Any) -> EngineConfig:
        """Build from flat keyword options (the offline API's `LLM(model, **options)`)."""
        model_keys = {f.name for f in dataclasses.fields(ModelConfig)} - {"path"}
        model_opts = {k: options.pop(k) for k in list(options) if k in model_keys}
        return from_dict(cls, {**options, "model": ModelConfig(path=model, **model_opts)})


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Construct dataclass `cls` from a mapping. Unknown keys and values of the wrong type raise
    ValueError naming the key (``where``: the mapping's own path in the YAML, e.g. ``engine``)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__} must be a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {where or cls.__name__} option(s) {unknown}; known: {sorted(names)}")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        _check_type(f"{where}.{key}" if where else key, value, hints[key])
    try:
        return cls(**data)
    except ValueError as e:
        raise ValueError(_with_path(str(e), where, names)) from None


def _with_path(message: str, where: str, names: set[str]) -> str:
    """A constructor's check names its field first (``max_num_seqs must be >= 1``): prefix the mapping's
    path, so the message names the key as the YAML spells it (``pools.decode.engine.max_num_seqs``)."""
    first = message.split(" ", 1)[0]
    return f"{where}.{message}" if where and first in names else message


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:  # NOTE: YAML's `true` is a bool, which Python counts as an int; refuse it here
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, tp)


def _check_type(key: str, value: Any, tp: Any) -> None:
    if not _matches(value, tp):
        raise ValueError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})"[:300])


def _check_keys(data: dict[str, Any], where: str, known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {where} option(s) {unknown}; known: {sorted(known)}")


_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}  # model: its own section

ROUTER_MODES = ("disaggregated", "colocated", "conditional")
ADMISSION_POLICIES = ("off", "slo")
TRANSFER_BACKENDS = ("auto", "gloo", "nccl")
FAILURE_POLICIES = ("fail", "recompute")
TRANSFER_INTEGRITY = ("mac", "digest", "off")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD")
NETWORKS = ("auto", "loopback", "node")


POOLS = ("prefill", "decode", "colocated")
DEFAULT_MAX_RESTARTS = 3  # restarts of one worker over its life (Ray's max_restarts): PoolConfig
# KV blocks move between pools, and the router hashes prompts in blocks: one block size for every pool
CLUSTER_WIDE_ENGINE_KEYS = ("block_size",)


@dataclass(frozen=True)
class PoolConfig:
    """One pool of identical workers. num_gpus 0 runs on CPU; 1 pins each worker to its own GPU.
    engine: this pool's engine settings over the cluster's shared ``engine:`` section (EngineConfig
    fields except model and block_size), e.g. a decode pool's ``max_num_seqs``; checked by ClusterConfig,
    which knows the shared section (``ClusterConfig.engine_config(pool)`` gives the merged EngineConfig)."""

    num_workers: int = 1
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    torch_threads: int = 1  # CPU workers: threads per worker (2 workers on 2 cores: 1 each)
    # NOTE: a dead worker is replaced by default (a deployment must not stay half-dead after its first
    # crash), but not forever: Ray's per-actor count over the worker's life, so one that keeps crashing
    # stays dead after its last restart (its requests migrate; `scale` adds a fresh one). 0: never
    # restarted; -1: always.
    max_restarts: int = DEFAULT_MAX_RESTARTS
    # custom Ray resources each worker needs, e.g. {"host_b": 1} pins the pool to nodes that offer it
    resources: dict[str, float] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, f"num_workers must be >= 0, got {self.num_workers}")
        _require(
            self.num_gpus in (0, 0.0, 1, 1.0), f"num_gpus must be 0 or 1 per worker, got {self.num_gpus}"
        )
        _require(self.num_cpus >= 0, f"num_cpus must be >= 0, got {self.num_cpus}")
        _require(self.torch_threads >= 1, f"torch_threads must be >= 1, got {self.torch_threads}")
        _require(self.max_restarts >= -1, f"max_restarts must be >= -1 (-1: always), got {self.max_restarts}")


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
        _require(self.backend in TRANSFER_BACKENDS, f"transfer backend must be one of {TRANSFER_BACKENDS}")
        _require(self.timeout_s > 0, f"transfer timeout_s must be > 0, got {self.timeout_s}")
        _require(self.lease_s > 0, f"lease_s must be > 0, got {self.lease_s}")
        _require(
            self.failure_policy in FAILURE_POLICIES,
            f"failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}",
        )
        _require(
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
    # a request's events the router holds for a caller that has not taken them (estimated bytes, see
    # protocol.delta_nbytes); past it the request is aborted on its workers (generation cannot pause)
    request_buffer_bytes: int = 256 << 10
    # a worker frees the requests of a router (a front-end replica) it has not heard from this long:
    # the router renews it every health_interval_s, so it must be well above that
    router_lease_s: float = 10.0

    def __post_init__(self) -> None:
        _require(self.mode in ROUTER_MODES, f"router mode must be one of {ROUTER_MODES}, got {self.mode!r}")
        _require(
            self.admission in ADMISSION_POLICIES,
            f"router admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}",
        )
        for name in ("ttft_slo_ms", "tbt_slo_ms"):
            value = getattr(self, name)
            _require(value is None or 0 < value < 1e9, f"{name} must be > 0 (milliseconds), got {value}")
        _require(self.advice_window_s > 0, f"advice_window_s must be > 0, got {self.advice_window_s}")
        _require(self.request_timeout_s > 0, f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        _require(self.max_pending_requests >= 1, "max_pending_requests must be >= 1")
        _require(self.health_interval_s > 0, "health_interval_s must be > 0")
        _require(self.max_migrations >= 0, f"max_migrations must be >= 0, got {self.max_migrations}")
        _require(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _require(
            self.request_buffer_bytes >= 4096,
            f"request_buffer_bytes must be >= 4096, got {self.request_buffer_bytes}",
        )
        _require(
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
    # a stream's events not yet written to its client (estimated bytes): at the bound the edge stops
    # taking the stream's tokens from the router (whose own buffer, router.request_buffer_bytes, is next)
    stream_buffer_bytes: int = 1 << 20
    # a stream whose client has read nothing (an ASGI send that does not return), or whose buffer has
    # stayed at its bound, this long is aborted everywhere (its KV freed) and its connection closed
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
        _require(0 <= self.port <= 65535, f"server port must be in [0, 65535], got {self.port}")
        _require(1 <= self.replicas <= 64, f"server replicas must be in [1, 64], got {self.replicas}")
        _require(
            self.metrics_port == 0 or 1 <= self.metrics_port <= 65535 - self.replicas,
            f"server metrics_port must be 0 or in [1, {65535 - self.replicas}], got {self.metrics_port}",
        )
        for name in ("max_requests_per_key", "max_tokens_per_key", "max_connections"):
            value = getattr(self, name)
            _require(value >= 0, f"{name} must be >= 0 (0: no limit), got {value}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(
            self.stream_buffer_bytes >= 4096,
            f"stream_buffer_bytes must be >= 4096, got {self.stream_buffer_bytes}",
        )
        _require(
            0 < self.stream_stall_timeout_s <= 3600,
            f"stream_stall_timeout_s must be in (0, 3600], got {self.stream_stall_timeout_s}",
        )
        _require(
            self.metrics_compat in METRICS_COMPAT,
            f"metrics_compat must be one of {METRICS_COMPAT}, got {self.metrics_compat!r}",
        )
        _require(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}",
        )
        _require(
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
        _require(self.level in LOG_LEVELS, f"log level must be one of {LOG_LEVELS}, got {self.level!r}")
        _require(self.format in LOG_FORMATS, f"log format must be one of {LOG_FORMATS}, got {self.format!r}")
        _require(self.stats_interval_s >= 0, f"stats_interval_s must be >= 0, got {self.stats_interval_s}")


@dataclass(frozen=True)
class ClusterConfig:
    """A whole deployment: the model, engine options shared by every worker, the pools, transfer,
    router and HTTP server. Pools: ``prefill`` + ``decode`` (disaggregated / conditional) or
    ``colocated``; each pool's own ``engine:`` keys override the shared ones (``engine_config(pool)``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields except model: every pool's
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    colocated: PoolConfig = field(default_factory=lambda: PoolConfig(num_workers=0))
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # PACK: Ray's default placement (fills a node first); SPREAD: spread workers over nodes
    placement_strategy: str = "PACK"
    ray_address: str | None = None  # None: join RAY_ADDRESS if set, else start a local cluster
    # which address every socket binds and advertises: loopback (one host), the node's own address
    # (several hosts), or auto (loopback when the Ray cluster has one node)
    network: str = "auto"
    # CPU workers on one host: pin worker k to CPU core k (round-robin over the driver's cores), so two
    # workers on two cores stand for two devices (benchmarks comparing modes on equal hardware)
    pin_cpu_cores: bool = False

    def __post_init__(self) -> None:
        # NOTE: the shared section alone first, so an error names the section its key is in
        _check_keys(self.engine, "engine", _ENGINE_KEYS)
        from_dict(EngineConfig, {**self.engine, "model": self.model}, "engine")
        for pool in POOLS:
            own = self.pool(pool).engine
            for key in CLUSTER_WIDE_ENGINE_KEYS:
                _require(
                    key not in own,
                    f"pools.{pool}.engine.{key} is one for every pool: set engine.{key} instead",
                )
            _check_keys(own, f"pools.{pool}.engine", _ENGINE_KEYS)
            self.engine_config(pool)
        _require(
            self.placement_strategy in PLACEMENT_STRATEGIES,
            f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}",
        )
        _require(self.network in NETWORKS, f"network must be one of {NETWORKS}, got {self.network!r}")
        if self.router.mode == "colocated":
            _require(
                self.colocated.num_workers >= 1,
                "router mode colocated needs pools.colocated.num_workers >= 1",
            )
        else:
            _require(
                self.prefill.num_workers >= 1,
                f"router mode {self.router.mode} needs pools.prefill.num_workers >= 1",
            )
            _require(
                self.decode.num_workers >= 1,
                f"router mode {self.router.mode} needs pools.decode.num_workers >= 1",
            )

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools the router mode runs: ``("colocated",)`` or ``("prefill", "decode")``."""
        return ("colocated",) if self.router.mode == "colocated" else ("prefill", "decode")

    @property
    def prefill_pool(self) -> str:
        """The pool that prefills prompts (the router predicts TTFT with its token budget)."""
        return self.pool_names[0]

    @property
    def decode_pool(self) -> str:
        """The pool that decodes, holding each request's KV to its end."""
        return self.pool_names[-1]

    def pool(self, name: str) -> PoolConfig:
        _require(name in POOLS, f"pool must be one of {POOLS}, got {name!r}")
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[name]

    def engine_config(self, pool: str) -> EngineConfig:
        """``pool``'s workers' engine: the shared ``engine:`` section, the pool's own ``engine:`` over it."""
        merged = {**self.engine, **self.pool(pool).engine, "model": self.model}
        return from_dict(EngineConfig, merged, f"pools.{pool}.engine")

    def engine_configs(self) -> dict[str, EngineConfig]:
        """The engine of every pool the router mode runs, by pool."""
        return {pool: self.engine_config(pool) for pool in self.pool_names}

    def to_dict(self) -> dict[str, Any]:
        """The YAML's mapping of this config (``from_dict(to_dict())`` equals it; plain JSON types)."""
        data = dataclasses.asdict(self)
        data["pools"] = {name: data.pop(name) for name in POOLS}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        """From the YAML's mapping: the pools under ``pools:`` (``pools.decode.engine.max_num_seqs``), every
        other section at the top; each value is checked and an error names its key's full path."""
        nested: dict[str, type] = {
            "model": ModelConfig,
            "transfer": TransferConfig,
            "router": RouterConfig,
            "server": ServerConfig,
            "log": LogConfig,
        }
        misplaced = sorted(set(data) & set(POOLS))
        _require(
            not misplaced, f"{misplaced} must be under pools: (e.g. pools.{(misplaced or ['decode'])[0]})"
        )
        pools = data.get("pools") or {}
        _check_type("pools", pools, dict[str, Any])
        _check_keys(pools, "pools", set(POOLS))
        parsed = {
            k: from_dict(nested[k], v or {}, k) if k in nested else v for k, v in data.items() if k != "pools"
        }
        for name, pool in pools.items():
            parsed[name] = from_dict(PoolConfig, pool or {}, f"pools.{name}")
        return from_dict(cls, parsed)

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        return cls.from_dict(data)
