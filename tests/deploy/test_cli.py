"""``pdserve serve`` like ``vllm serve``: flags over the YAML, config errors naming the key, the CUDA check,
logging formats, the worker stats line, and one real ``pdserve serve REPO_ID`` from a hub cache."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from cluster.config import ClusterConfig, LogConfig, ModelConfig, PoolConfig, RouterConfig, ServerConfig
from cluster.protocol import EngineStats, SamplingParams, TransferStats, WorkerStats
from deploy.cli import build_parser, main
from deploy.cli_args import build_config
from deploy.logs import configure_logging
from tests.support.cluster_utils import wait_for
from tests.support.hf_models import make_random_hf_model
from tests.support.hub_cache import make_hub_cache
from workers.stats_log import StatsLine, format_stats_line

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _config(argv: list[str]) -> ClusterConfig:
    return build_config(build_parser().parse_args(argv))


def test_flags_override_the_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    flags = (
        "org/model --revision v2 --dtype bfloat16 --max-model-len 256 --max-num-seqs 8 "
        "--max-num-batched-tokens 512 --block-size 32 --gpu-memory-utilization 0.5 --no-enable-prefix-caching "
        "--enforce-eager --num-prefill-workers 2 --num-decode-workers 3 --mode conditional --host 0.0.0.0 "
        "--port 9000 --served-model-name m --api-key s --metrics-compat vllm --log-level debug "
        "--log-format json --stats-interval 2"
    )
    cfg = _config(["serve", *flags.split()])
    assert cfg.model == ModelConfig(path="org/model", dtype="bfloat16", max_model_len=256, revision="v2")
    engine = cfg.engine_config("decode")
    assert cfg.engine_config("prefill") == engine  # a shared flag sets every pool's (no pool of its own here)
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.block_size) == (8, 512, 32)
    assert (engine.gpu_memory_utilization, engine.enable_prefix_caching, engine.enforce_eager) == (
        0.5,
        False,
        True,
    )
    assert engine.num_kv_blocks == 2048  # untouched YAML value (packaged cpu-disagg.yaml)
    assert cfg.prefill == PoolConfig(num_workers=2, num_cpus=1, torch_threads=1)
    assert cfg.decode.num_workers == 3 and cfg.router == RouterConfig(
        mode="conditional", request_timeout_s=300
    )
    assert cfg.server == ServerConfig("0.0.0.0", 9000, "s", "m", metrics_compat="vllm")
    assert cfg.log == LogConfig(level="DEBUG", format="json", stats_interval_s=2.0)
    default = _config(["serve"])
    assert default.model.path == "" and default.engine_config("decode").enable_prefix_caching is True


def test_api_key_from_the_environment_and_colocated_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert _config(["serve"]).server.api_key == "from-env"
    assert _config(["serve", "--api-key", "flag"]).server.api_key == "flag"
    cfg = _config(["serve", "--mode", "colocated", "--config", "deploy/cpu-disagg.yaml"])
    assert cfg.colocated == PoolConfig(num_workers=1, num_cpus=1, torch_threads=1)
    assert (
        _config(["serve", "--mode", "colocated", "--num-colocated-workers", "2"]).colocated.num_workers == 2
    )


BAD_VALUES = [
    ("engine:\n  max_num_seqs: '64'\n", "engine.max_num_seqs must be int, got '64' (str)"),
    ("model:\n  max_model_len: 1.5\n", "model.max_model_len must be int or null, got 1.5 (float)"),
    ("pools:\n  prefill:\n    num_workers: true\n", "pools.prefill.num_workers must be int, got True (bool)"),
    ("router:\n  request_timeout_s: soon\n", "router.request_timeout_s must be float, got 'soon' (str)"),
    ("server:\n  port: '80'\n", "server.port must be int, got '80' (str)"),
    ("engine:\n  max_num_seqs: 0\n", "engine.max_num_seqs must be >= 1, got 0"),
    (
        "pools:\n  decode:\n    engine:\n      max_num_seqs: 0\n",
        "pools.decode.engine.max_num_seqs must be >= 1, got 0",
    ),
    (
        "pools:\n  prefill:\n    engine:\n      max_num_seqs: 1.5\n",
        "pools.prefill.engine.max_num_seqs must be int, got 1.5 (float)",
    ),
    ("engine:\n  blocksize: 16\n", "unknown engine option(s) ['blocksize']"),
    ("log:\n  format: xml\n", "log format must be one of ('text', 'json'), got 'xml'"),
]


@pytest.mark.parametrize(("yaml_text", "message"), BAD_VALUES, ids=[m[:30] for _, m in BAD_VALUES])
def test_config_errors_name_the_key_in_one_logged_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None, yaml_text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f" ERROR pdserve: {message}" in err[0], err
    time.strptime(err[0][:19], "%Y-%m-%d %H:%M:%S")
    assert main(["serve", "--max-num-seqs", "0"]) == 2  # a flag is checked the same way


def test_pool_flags_over_the_pools_own_yaml_keys_over_the_shared_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(
        "engine: {max_num_seqs: 8, max_num_batched_tokens: 512, num_kv_blocks: 64}\n"
        "pools: {prefill: {engine: {max_num_batched_tokens: 2048}}, decode: {engine: {max_num_seqs: 32}}}\n"
    )

    def seats_and_budgets(argv: list[str]) -> dict[str, tuple[int, int]]:
        engines = _config(["serve", "--config", str(path), *argv]).engine_configs()
        return {pool: (e.max_num_seqs, e.max_num_batched_tokens) for pool, e in engines.items()}

    assert seats_and_budgets([]) == {"prefill": (8, 2048), "decode": (32, 512)}
    # a shared flag sets the shared section: a pool's own YAML key still wins over it
    assert seats_and_budgets(["--max-num-seqs", "4", "--max-num-batched-tokens", "256"]) == {
        "prefill": (4, 2048),
        "decode": (32, 256),
    }
    pool_flags = "--prefill-max-num-seqs 2 --decode-max-num-seqs 128 --decode-max-num-batched-tokens 128"
    assert seats_and_budgets(pool_flags.split()) == {"prefill": (2, 2048), "decode": (128, 128)}
    assert seats_and_budgets(["--prefill-max-num-batched-tokens", "1024"])["prefill"] == (8, 1024)
    assert main(["serve", "--config", str(path), "--decode-max-num-seqs", "0"]) == 2
    assert " ERROR pdserve: pools.decode.engine.max_num_seqs must be >= 1, got 0" in capsys.readouterr().err


def test_pdserve_bench_runs_what_bench_registers(capsys: pytest.CaptureFixture[str]) -> None:
    """`pdserve bench NAME` finds each benchmark through the pdserve.benchmarks entry points (deploy/cli.py
    imports nothing of bench/, which sits above it), and an unknown name is refused naming the known ones."""
    import bench.admission
    import bench.frontend
    import bench.multiturn
    import bench.offline
    import bench.serve
    import bench.soak
    from deploy.cli import _benchmarks

    found = {name: ep.load() for name, ep in _benchmarks().items()}
    assert found == {
        "admission": bench.admission.main,
        "frontend": bench.frontend.main,
        "multiturn": bench.multiturn.main,
        "offline": bench.offline.main,
        "serve": bench.serve.main,
        "soak": bench.soak.main,
    }
    with pytest.raises(SystemExit) as refused:
        main(["bench", "nope"])
    assert (
        str(refused.value)
        == "unknown benchmark 'nope'; registered: admission, frontend, multiturn, offline, serve, soak"
    )
    with pytest.raises(SystemExit) as helped:
        main(["bench", "offline", "--help"])
    assert helped.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA: nothing to refuse")
def test_gpu_pool_on_a_cpu_torch_fails_at_startup_saying_what_to_install(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    assert main(["serve", "--config", "deploy/gpu-disagg.yaml", "--model", ""]) == 2
    err = capsys.readouterr().err
    assert f"pool(s) ['prefill', 'decode'] ask for GPUs (num_gpus: 1) but torch {torch.__version__}" in err
    assert "is a CPU-only build (torch.version.cuda is None)" in err
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu128" in err
    assert "README: 'Install on a GPU machine'" in err


def test_json_log_lines(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogConfig(level="INFO", format="json"))
    logging.getLogger("pdserve.test").info("hello %s", "world", extra={"worker": "decode-0"})
    logging.getLogger("pdserve.test").debug("not shown")
    (line,) = capsys.readouterr().err.strip().splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"], record["message"]) == ("INFO", "pdserve.test", "hello world")
    assert record["worker"] == "decode-0" and record["ts"].endswith("+00:00")


_RAY_INITS = """
import logging, ray
from deploy import logs
for _ in range(2):
    before = list(logging.getLogger().handlers)
    ray.init(num_cpus=1, include_dashboard=False, logging_config=ray.LoggingConfig(log_level="INFO"))
    logs.after_ray_init(before)
    logging.getLogger("pdserve.test").warning("said once")
    ray.shutdown()
"""


def test_a_driver_that_starts_ray_twice_prints_each_line_once() -> None:
    """Every ray.init with a logging config adds a root handler; after_ray_init keeps only the newest
    (without it the second round's line is printed twice: 3 lines, not 2)."""
    out = subprocess.run(
        [sys.executable, "-c", _RAY_INITS], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stderr.count("said once") == 2, out.stderr[-2000:]


def _stats(prompt: int, gen: int, queries: int, hits: int, ok: int, nbytes: int) -> WorkerStats:
    engine = EngineStats(
        num_prompt_tokens=prompt,
        num_generation_tokens=gen,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_free_blocks=75,
        num_total_blocks=100,
        num_running=3,
        num_waiting=1,
    )
    return WorkerStats(
        "decode-0", "decode", num_waiting_for_kv=2, engine=engine, transfer=TransferStats(ok, 0, nbytes, 1.0)
    )


def test_stats_line_rates_over_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    line = StatsLine(interval_s=10.0)
    assert line.maybe_log(_stats(0, 0, 0, 0, 0, 0), now=100.0) is None  # the first snapshot is the base
    assert line.maybe_log(_stats(500, 50, 100, 40, 2, 4_000_000), now=105.0) is None
    with caplog.at_level(logging.INFO, logger="workers.stats"):
        got = line.maybe_log(_stats(1000, 200, 200, 50, 4, 8_000_000), now=110.0)
    expected = (
        "decode-0 (decode): prompt 100.0 tok/s, generation 20.0 tok/s, running 3, waiting 1, waiting for KV 2, "
        "KV usage 25.0%, prefix hit rate 25.0%, transfers 4 ok / 0 failed (0.8 MB/s), preemptions 0"
    )
    assert got == expected and [r.getMessage() for r in caplog.records] == [expected]
    assert format_stats_line(_stats(1, 1, 0, 0, 0, 0), _stats(1, 1, 0, 0, 0, 0), 1.0).count("hit rate -") == 1
    assert StatsLine(0.0).maybe_log(_stats(0, 0, 0, 0, 0, 0), now=1e9) is None


REPO_ID = "pdserve-test/cli-qwen3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_serve_a_repo_id_from_the_hub_cache_offline(tmp_path: Path) -> None:
    source = make_random_hf_model("qwen3", tmp_path / "src", seed=3)
    snapshot = make_hub_cache(tmp_path / "hf", REPO_ID, source, "c" * 40)
    port = _free_port()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PDSERVE_API_KEY": "sk-test"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    log = (tmp_path / "serve.log").open("w+")
    argv = [sys.executable, "-m", "deploy.cli", "serve", REPO_ID, "--port", str(port), "--mode", "colocated"]
    argv += ["--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "4", "--log-format", "json"]
    argv += ["--stats-interval", "0.5"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-test"}
    try:

        def healthy() -> bool:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, timeout_s=240, what="pdserve serve healthy")
        listing = httpx.get(f"{url}/v1/models", headers=auth)
        models = listing.json()["data"]
        assert [m["id"] for m in models] == [REPO_ID] and models[0]["root"] == REPO_ID
        assert str(snapshot) not in listing.text  # issue 31 row 10: no filesystem path
        body = {
            "model": REPO_ID,
            "prompt": [5, 17, 42, 99],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        out = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60).json()
        from workers.llm import LLM

        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        reference = LLM(str(source), device="cpu", num_kv_blocks=64, block_size=8).generate(
            [[5, 17, 42, 99]], params
        )
        assert out["choices"][0]["token_ids"] == reference[0].token_ids
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401

        def stats_logged() -> bool:
            # NOTE: each record's JSON object from where its line starts: uvicorn's own stderr lines share
            # the file, and a write of theirs can land right after a record, before its newline
            decoder = json.JSONDecoder()
            records = []
            for ln in Path(log.name).read_text().splitlines():
                with contextlib.suppress(ValueError):
                    records.append(decoder.raw_decode(ln)[0] if ln.startswith("{") else {})
            return any("colocated-0 (colocated): prompt" in r.get("message", "") for r in records)

        wait_for(stats_logged, timeout_s=30, what="a worker stats line in JSON")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, Path(log.name).read_text()[-3000:]


def test_uvicorns_access_log_is_on_at_debug_only(restore_logging: None) -> None:
    """One access line per request costs the edge's loop ~40 us: on only when pdserve logs at DEBUG (as
    deploy/logs.py says), whatever uvicorn's own log level."""
    from cluster.http.app import create_app, create_server
    from tests.support.stub_router import StubRouter

    app = create_app(StubRouter(), None)
    configure_logging(LogConfig(level="INFO", format="text"))
    assert create_server(app, log_level="info").config.access_log is False
    configure_logging(LogConfig(level="DEBUG", format="text"))
    assert create_server(app, log_level="info").config.access_log is True
    assert create_server(app, log_level="info", access_log=False).config.access_log is False
