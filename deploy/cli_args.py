"""``pdserve serve`` / ``demo`` flags, named as ``vllm serve`` names them, layered over the YAML config.

Precedence: flag > environment (``PDSERVE_API_KEY``) > YAML (``--config``, default the packaged
``cpu-disagg.yaml``) > the config dataclasses' defaults. Flags are written into the YAML's mapping
before ``ClusterConfig.from_dict`` checks it, so a flag and a YAML key fail the same way: the key named,
its expected type and the value given. Engine flags set the shared ``engine:`` section, which a pool's
own ``engine:`` keys override; the pool-scoped flags (``--decode-max-num-seqs``) set the pool's own.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from cluster.config import (
    ADMISSION_POLICIES,
    LOG_FORMATS,
    LOG_LEVELS,
    METRICS_COMPAT,
    PREFIX_ROUTING,
    ROUTER_MODES,
    TOOL_CALL_PARSERS,
    ClusterConfig,
)
from deploy.mock_profile import GPU_NAMES, with_mock_profile

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = "cpu-disagg.yaml"
API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"

# (flag, YAML section, key, argparse type, help); an "engine" / "POOL.engine" key is an EngineConfig field.
_VALUE_FLAGS: list[tuple[str, str, str, Any, str]] = [
    ("--revision", "model", "revision", str, "hub repo branch, tag or commit (repo ids only)"),
    ("--dtype", "model", "dtype", str, "auto | float32 | float16 | bfloat16"),
    ("--max-model-len", "model", "max_model_len", int, "context length (default: the model's)"),
    ("--max-num-seqs", "engine", "max_num_seqs", int, "requests in one worker's batch"),
    ("--max-num-batched-tokens", "engine", "max_num_batched_tokens", int, "tokens in one step"),
    ("--block-size", "engine", "block_size", int, "tokens per KV block"),
    ("--num-kv-blocks", "engine", "num_kv_blocks", int, "KV blocks per worker (default: sized from memory)"),
    (
        "--kv-offload-gib",
        "engine",
        "kv_offload_gib",
        float,
        "host-memory KV tier per worker rank, GiB (0: off); YAML per pool: pools.<pool>.engine",
    ),
    ("--gpu-memory-utilization", "engine", "gpu_memory_utilization", float, "fraction of GPU memory"),
    ("--attention-backend", "engine", "attention_backend", str, "torch | triton"),
    ("--device", "engine", "device", str, "auto | cpu | cuda"),
    (
        "--load-format",
        "engine",
        "load_format",
        str,
        "auto | dummy (random weights) | mock (no forward: steps wait the cost profile's time)",
    ),
    (
        "--prefill-max-num-seqs",
        "pools.prefill.engine",
        "max_num_seqs",
        int,
        "the prefill pool's --max-num-seqs",
    ),
    ("--decode-max-num-seqs", "pools.decode.engine", "max_num_seqs", int, "the decode pool's --max-num-seqs"),
    (
        "--prefill-max-num-batched-tokens",
        "pools.prefill.engine",
        "max_num_batched_tokens",
        int,
        "the prefill pool's --max-num-batched-tokens",
    ),
    (
        "--decode-max-num-batched-tokens",
        "pools.decode.engine",
        "max_num_batched_tokens",
        int,
        "the decode pool's --max-num-batched-tokens",
    ),
    ("--mode", "router", "mode", str, f"{' | '.join(ROUTER_MODES)}"),
    (
        "--admission",
        "router",
        "admission",
        str,
        f"{' | '.join(ADMISSION_POLICIES)}: refuse (429) requests predicted to miss their TTFT SLO",
    ),
    (
        "--prefix-routing",
        "router",
        "prefix_routing",
        str,
        f"{' | '.join(PREFIX_ROUTING)}: place prompts by the workers' reported KV blocks, or by a first-block hash",
    ),
    ("--ttft-slo-ms", "router", "ttft_slo_ms", float, "TTFT SLO for --admission slo (per request: header)"),
    ("--tbt-slo-ms", "router", "tbt_slo_ms", float, "TBT bound on conditional mode's local prefills"),
    (
        "--cost-profile",
        "router",
        "cost_profile",
        str,
        "cost profile JSON (`pdserve plan calibrate`); with --load-format mock, the mock's step times too",
    ),
    ("--num-prefill-workers", "pools.prefill", "num_workers", int, "prefill pool size"),
    ("--num-decode-workers", "pools.decode", "num_workers", int, "decode pool size"),
    (
        "--num-colocated-workers",
        "pools.colocated",
        "num_workers",
        int,
        "colocated pool size (--mode colocated)",
    ),
    (
        "--prefill-tensor-parallel-size",
        "pools.prefill",
        "tensor_parallel_size",
        int,
        "ranks per prefill worker (overrides --tensor-parallel-size)",
    ),
    (
        "--decode-tensor-parallel-size",
        "pools.decode",
        "tensor_parallel_size",
        int,
        "ranks per decode worker (overrides --tensor-parallel-size)",
    ),
    ("--host", "server", "host", str, "bind address (default 127.0.0.1)"),
    ("--port", "server", "port", int, "HTTP port (default 8000)"),
    (
        "--api-server-count",
        "server",
        "replicas",
        int,
        "front-end replicas (HTTP edge + router processes) sharing the port (default 1)",
    ),
    ("--metrics-port", "server", "metrics_port", int, "with replicas: replica i's own port is this + i"),
    ("--served-model-name", "server", "served_model_name", str, "name clients use (default: MODEL)"),
    ("--api-keys-file", "server", "api_keys_file", str, "tenants' keys, one a line: name:key or key"),
    ("--admin-key-file", "server", "admin_key_file", str, "the admin routes' key (or $PDSERVE_ADMIN_KEY)"),
    ("--max-requests-per-key", "server", "max_requests_per_key", int, "requests in flight per key (0: off)"),
    ("--max-tokens-per-key", "server", "max_tokens_per_key", int, "queued tokens per key (0: off)"),
    ("--max-connections", "server", "max_connections", int, "open HTTP connections (0: no cap)"),
    ("--header-timeout", "server", "header_timeout_s", float, "seconds to receive a request head"),
    ("--body-timeout", "server", "body_timeout_s", float, "seconds to receive a request body"),
    ("--keep-alive-timeout", "server", "keep_alive_timeout_s", float, "idle seconds between requests"),
    (
        "--metrics-compat",
        "server",
        "metrics_compat",
        str,
        f"{' | '.join(METRICS_COMPAT)}: also export vllm:*",
    ),
    (
        "--stream-stall-timeout",
        "server",
        "stream_stall_timeout_s",
        float,
        "abort a stream whose client read nothing this many seconds (default 30)",
    ),
    ("--stream-buffer-bytes", "server", "stream_buffer_bytes", int, "a stream's edge buffer bound (1 MiB)"),
    (
        "--tool-call-parser",
        "server",
        "tool_call_parser",
        str,
        f"{' | '.join(TOOL_CALL_PARSERS)}: the model's tool-call format (--enable-auto-tool-choice)",
    ),
    ("--log-level", "log", "level", str.upper, f"{' | '.join(LOG_LEVELS)}"),
    ("--log-format", "log", "format", str, f"{' | '.join(LOG_FORMATS)}"),
    ("--stats-interval", "log", "stats_interval_s", float, "seconds between worker stats lines (0: off)"),
]
_BOOL_FLAGS: list[tuple[str, str, str, str]] = [
    ("--enable-prefix-caching", "engine", "enable_prefix_caching", "prefix caching (--no-... turns it off)"),
    ("--enforce-eager", "engine", "enforce_eager", "no CUDA graphs"),
    (
        "--allow-unauthenticated",
        "server",
        "allow_unauthenticated",
        "serve a non-loopback host without an API key",
    ),
    (
        "--enable-auto-tool-choice",
        "server",
        "enable_auto_tool_choice",
        'tool_choice "auto": find tool calls in the text with --tool-call-parser',
    ),
]


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The model positional, ``--config``, ``--api-key``, ``--ray-address`` and every override flag."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint directory or Hugging Face repo id (default: the config's model.path)",
    )
    parser.add_argument("--model", default=None, help="the same as MODEL")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="ranks per worker in every pool (one device each, on one node)",
    )
    parser.add_argument(
        "--config", default=None, help=f"ClusterConfig YAML (default: packaged {DEFAULT_CONFIG})"
    )
    parser.add_argument("--api-key", default=None, help=f"require this bearer key (default: ${API_KEY_ENV})")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: RAY_ADDRESS)")
    parser.add_argument(
        "--gpu",
        default=None,
        choices=GPU_NAMES,
        help="with --load-format mock: mock steps (and the router's predictions) take this GPU's roofline "
        "estimate for MODEL (deploy/planner/profiles.py)",
    )
    group = parser.add_argument_group("overrides of the YAML config")
    for flag, _, _, tp, help_ in _VALUE_FLAGS:
        group.add_argument(flag, type=tp, default=None, help=help_)
    for flag, _, _, help_ in _BOOL_FLAGS:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)


def config_path(given: str | None) -> Path:
    """``given`` as a path, else relative to the installed ``deploy`` package (``deploy/x.yaml`` and
    ``x.yaml`` both work from any directory); None: the packaged default."""
    if given is None:
        return PACKAGE_DIR / DEFAULT_CONFIG
    path = Path(given)
    if path.exists():
        return path
    for candidate in (PACKAGE_DIR.parent / given, PACKAGE_DIR / given):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"config file {given!r} not found (nor among the packaged configs in {PACKAGE_DIR})"
    )


def load_config_data(path: Path) -> dict[str, Any]:
    import yaml

    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data


def _section(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The mapping at ``path`` (``pools.decode.engine``: one key per level), copied into ``data`` so the
    caller's mapping is never modified; missing levels are created."""
    where = ""
    for name in path.split("."):
        where = f"{where}.{name}" if where else name
        value = data.get(name)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}"[:200])
        section = dict(value or {})
        data[name] = section
        data = section
    return data


def apply_overrides(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The YAML mapping with every flag that was given written in (``data`` is not modified)."""
    data = dict(data)
    model = args.model_tag if args.model_tag is not None else args.model
    if args.model_tag is not None and args.model is not None and args.model != args.model_tag:
        raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one")
    if model is not None:
        _section(data, "model")["path"] = model
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None:  # every pool's; the per-pool flags below override it
        pools = _section(data, "pools")
        # NOTE: a colocated pool made from the decode pool's shape below takes the decode pool's
        for pool in ("prefill", "decode", *(["colocated"] if pools.get("colocated") else [])):
            _section(pools, pool)["tensor_parallel_size"] = tp
    for flag, section, key, _, _ in _VALUE_FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            _section(data, section)[key] = value
    for flag, section, key, _ in _BOOL_FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            _section(data, section)[key] = value
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None:
        _section(data, "server")["api_key"] = api_key
    admin_key = os.environ.get(ADMIN_KEY_ENV) or None  # NOTE: no flag: a flag's value shows in `ps`
    if admin_key is not None:
        _section(data, "server")["admin_key"] = admin_key
    if args.ray_address is not None:
        data["ray_address"] = args.ray_address
    data = with_mock_profile(data, getattr(args, "gpu", None), args.cost_profile)
    router = data.get("router") or {}
    pools = _section(data, "pools")
    colocated = pools.get("colocated") or {}
    if isinstance(router, dict) and router.get("mode") == "colocated" and not colocated.get("num_workers"):
        # NOTE: a disaggregated YAML switched to colocated: one worker shaped like a decode worker.
        decode = pools.get("decode") or {}
        _section(pools, "colocated").update({**decode, "num_workers": colocated.get("num_workers") or 1})
    return data


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """ClusterConfig from ``--config`` plus the flags; raises ValueError naming the key on bad values."""
    path = config_path(args.config)
    return ClusterConfig.from_dict(apply_overrides(load_config_data(path), args))
