"""Two hosts on one machine (bench/netns_lab.py): prefill on host A, decode on host B, KV over the veth.
Skipped, with the reason printed, only where `ip netns add` is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.netns_lab import Lab, netns_refusal, two_host_lab
from cluster.protocol import SamplingParams
from tests.support.cluster_utils import greedy, shared_prefix_prompts, submit_job
from tests.support.replica_streams import check_streams, rule_outputs, slow_profile
from workers.llm import LLM

# NOTE: the first test also pays the lab's bring-up (two Ray nodes), hence a longer bound than the suite's
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REFUSAL = netns_refusal()
VOCAB = 1229  # the bundled model's
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    if REFUSAL is not None:
        pytest.skip(f"two-host lab unavailable here: {REFUSAL}")
    with two_host_lab() as lab:
        yield lab


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(device="cpu", block_size=4)


def drive(lab: Lab, scenario: str, args: dict[str, Any], timeout_s: float = 900) -> dict[str, Any]:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.two_host_driver", lab.address, lab.ip_a, scenario, json.dumps(args)],
        capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, f"driver failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    result: dict[str, Any] = json.loads(results[-1][len("RESULT ") :])
    return result


def workload(offline: LLM, seed: int) -> tuple[list[list[int]], list[int], list[list[int]]]:
    prompts = shared_prefix_prompts(24, seed=seed, vocab=VOCAB)
    prompts[3] = prompts[3] + shared_prefix_prompts(1, seed=seed + 1, vocab=VOCAB)[0] * 3  # 300+ tokens
    prompts[7] = (prompts[7] * 6)[:360]
    max_tokens = [8 + i % 5 * 4 for i in range(len(prompts))]
    reference = [o.token_ids for o in offline.generate(prompts, [greedy(m) for m in max_tokens])]
    return prompts, max_tokens, reference


def test_prefill_on_host_a_decode_on_host_b_kv_crosses_the_link(lab: Lab, offline: LLM) -> None:
    prompts, max_tokens, reference = workload(offline, seed=21)
    assert max(len(p) for p in prompts) >= 300
    before = lab.link_bytes()
    result = drive(lab, "disagg", {"prompts": prompts, "max_tokens": max_tokens})
    received, sent = (b - a for a, b in zip(before, lab.link_bytes(), strict=True))
    assert result["outputs"] == reference
    assert result["placement"] == {"prefill-0": lab.ip_a, "decode-0": lab.ip_b}
    moved = result["transfers"]["decode-0"]
    assert moved["ok"] == len(prompts)
    # NOTE: the KV flows A -> B, so host A's end of the veth sent at least every transferred byte
    assert sent >= moved["bytes"] > 0 and received > 0
    assert result["leaks"] == {"prefill-0": None, "decode-0": None}


def test_link_down_mid_transfer_then_the_pair_works_again(lab: Lab, offline: LLM) -> None:
    prompts, max_tokens, reference = workload(offline, seed=22)
    config = {"transfer": {"timeout_s": 2.0, "failure_policy": "recompute"}}
    args = {"prompts": prompts, "max_tokens": max_tokens, "veth": lab.veth_a, "down_s": 3.0, "config": config}
    result = drive(lab, "link_flap", args)
    # affected requests recompute on the decode side (policy), within the transfer timeout; others untouched
    assert result["first"] == reference
    assert result["second"] == reference
    moved = result["transfers"]["decode-0"]
    assert moved["ok"] >= len(prompts)  # the pair carried the second wave's KV after the link came back
    assert result["leaks"] == {"prefill-0": None, "decode-0": None}


def test_kill_9_of_a_front_end_replica_with_workers_on_both_hosts(lab: Lab, tmp_path: Path) -> None:
    """Two front-end replicas on host A, the prefill worker on A and the decode worker on B: kill -9 of
    replica 1 mid-stream loses only its streams; no KV is held on either host after its lease; it is
    restarted and serves again."""
    result = drive(lab, "replicas", {"profile": slow_profile(tmp_path / "profile.json")})
    assert result["placement"] == {"prefill-0": lab.ip_a, "decode-0": lab.ip_b}
    assert all(e.startswith(f"tcp://{lab.ip_a}:") for e in result["endpoints"]), result["endpoints"]
    check_streams(result["streams"], rule_outputs(), killed=1)
    assert result["leaks"] == {"prefill-0": None, "decode-0": None}
    # NOTE: freed for the lease (or its successor's), not by finishing: each outlives the lease
    assert result["freed"]["decode-0"] == sum(1 for s in result["streams"] if s["replica"] == 1)
    assert result["restarted"] and result["served"] == [0, 1]


def test_ray_job_submit_onto_the_two_node_cluster(lab: Lab, offline: LLM, tmp_path: Path) -> None:
    config = tmp_path / "two-host.yaml"
    config.write_text(
        "model: {path: ''}\n"
        "engine: {block_size: 4, num_kv_blocks: 512, max_num_batched_tokens: 256}\n"
        "pools:\n"
        "  prefill: {num_workers: 1, resources: {host_a: 1}}\n"
        "  decode: {num_workers: 1, resources: {host_b: 1}}\n"
    )
    prompt = "Once upon a time"
    expected = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": lab.dashboard_url}
    done = submit_job(
        [str(Path(sys.executable).with_name("ray")), "job", "submit", "--working-dir", str(ROOT),
         "--", sys.executable, "-m", "deploy.launch", "--config", str(config), "--prompt", prompt, "--max-tokens", "12"],
        env=env, timeout_s=900, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"OUTPUT {expected!r}" in done.stdout
