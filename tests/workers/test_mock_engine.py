"""The mock engine (``load_format: mock``, workers/mock_runner.py): its tokens are the rule's, the same
offline, colocated and disaggregated; each step waits what the cost profile predicts for the step's
shape; its KV cache has the real model's layout, and a handoff moves the rule's bytes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import transfer.ring
from cluster.config import ClusterConfig, EngineConfig, RouterConfig
from cluster.cost_model import CostProfile, LinearStepCost, TransferCost, shape_of
from cluster.protocol import FinishReason, SamplingParams
from cluster.tokenizer import Tokenizer
from deploy.cli import build_parser
from deploy.cli_args import build_config
from deploy.planner.profiles import HARDWARE, ModelShape, roofline_profile
from tests.support.local_cluster import LocalCluster, engine_config
from transfer.channel import layout_of
from transfer.staging import ChunkPlan
from workers.engine import BUNDLED_MODEL, Engine
from workers.llm import LLM
from workers.mock_runner import MockModel, MockTokens, kv_signature, load_mock_profile
from workers.model_runner import ModelRunner
from workers.models.arch import ArchConfig

QWEN3_CONFIG = str(Path(__file__).resolve().parents[2] / "bench" / "configs" / "qwen3-0.6b")
BLOCK_SIZE = 4
# lengths with and without a partial last block; distinct first blocks (no prefix hit between them)
PROMPTS = [[40 + i, *range(100 + 7 * i, 100 + 7 * i + n - 1)] for i, n in enumerate([5, 8, 3, 13])]
MAX_TOKENS = [6, 3, 7, 5]


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)  # type: ignore[arg-type]


def rule_output(tokens: MockTokens, prompt: list[int], max_tokens: int) -> list[int]:
    """What the rule generates after ``prompt``: each token from the one before it and its position."""
    return tokens.continuation(prompt, max_tokens)


@pytest.fixture(scope="module")
def rule() -> MockTokens:
    return MockTokens.for_model(
        ArchConfig.from_pretrained(BUNDLED_MODEL), Tokenizer.from_pretrained(BUNDLED_MODEL)
    )


def mock_config(**options: object) -> EngineConfig:
    return replace(engine_config(BUNDLED_MODEL, load_format="mock"), **options)  # type: ignore[arg-type]


def mock_llm(**options: Any) -> LLM:
    return LLM(
        BUNDLED_MODEL, load_format="mock", device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=256, **options
    )


def test_the_rule_gives_no_eos_or_special_token_and_is_pinned(rule: MockTokens) -> None:
    # the bundled tokenizer: <pad> <s> </s> <|im_start|> <|im_end|> are ids 0-4 (</s> and <|im_end|> end)
    assert rule.allowed_ids == list(range(5, 1229))
    # a change of the rule changes every mock output: pinned
    assert rule_output(rule, [5, 6, 7, 8, 9], 6) == [773, 255, 695, 456, 1100, 646]
    vectorized = rule.next_tokens(torch.tensor([9, 773, 0, 1228]), torch.tensor([4, 5, 0, 99999]))
    assert vectorized.tolist() == [773, 255, rule.next_token(0, 0), rule.next_token(1228, 99999)]


def test_offline_mock_output_is_the_rule_whatever_the_batching(rule: MockTokens) -> None:
    expected = [rule_output(rule, p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    params = [greedy(m) for m in MAX_TOKENS]
    for options in (
        {},
        {"max_num_batched_tokens": 6, "enable_prefix_caching": False},  # prompts in chunks
        {"async_scheduling": True},
    ):
        llm = mock_llm(**options)
        for _ in range(2):  # the second pass hits the prefix cache
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, options
        llm.check_no_leaks()
    # a seeded sample with logprobs takes the sampler's path (logits built): the same tokens
    sampled = llm.generate(PROMPTS[:1], [SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=1)])
    assert sampled[0].token_ids == expected[0]


def test_mock_honours_stop_tokens_and_min_tokens(rule: MockTokens) -> None:
    llm = mock_llm()
    prompt = PROMPTS[0]
    t = rule_output(rule, prompt, 6)
    (stopped,) = llm.generate([prompt], [greedy(6, stop_token_ids=[t[2]])])
    assert (stopped.token_ids, stopped.finish_reason) == (t[:3], FinishReason.STOP)
    # under min_tokens a stop token is banned: the row falls back to the lowest allowed id (5), and the
    # rule goes on from there
    (held,) = llm.generate([prompt], [greedy(6, stop_token_ids=[t[1]], min_tokens=3)])
    after = rule_output(rule, [*prompt, t[0], 5], 4)
    assert (held.token_ids, held.finish_reason) == ([t[0], 5, *after], FinishReason.LENGTH)
    llm.check_no_leaks()


def test_mock_options_are_checked_and_flags_name_one_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="load_format mock runs on the host: device must be auto or cpu"):
        EngineConfig(load_format="mock", device="cuda")
    with pytest.raises(ValueError, match="mock_cost_profile is read by load_format mock only"):
        EngineConfig(mock_cost_profile="p.json")

    def serve(*flags: str) -> ClusterConfig:
        return build_config(build_parser().parse_args(["serve", *flags]))

    with pytest.raises(
        ValueError, match="--gpu sets a mock engine's step times: give --load-format mock too"
    ):
        serve("--gpu", "h100")
    with pytest.raises(ValueError, match="--gpu and --cost-profile both name the mock's cost profile"):
        serve("--load-format", "mock", "--gpu", "h100", "--cost-profile", "p.json")
    cfg = serve("--load-format", "mock", "--cost-profile", "p.json")
    assert (cfg.engine["mock_cost_profile"], cfg.router.cost_profile) == ("p.json", "p.json")
    # --gpu: the bundled model's estimate (the packaged YAML's float32), beside $PDSERVE_PROFILE
    monkeypatch.setenv("PDSERVE_PROFILE", str(tmp_path / "cpu-profile.json"))
    cfg = serve("--load-format", "mock", "--gpu", "a100")
    (written,) = (tmp_path / "mock").iterdir()
    assert cfg.engine_config("decode").mock_cost_profile == cfg.router.cost_profile == str(written)
    shape = ModelShape.from_config(BUNDLED_MODEL, "float32")
    # ... its handoffs over the A100's NVLink inside a node, its NIC (25 GB/s) between nodes
    estimate = roofline_profile(HARDWARE["a100"], shape)
    nic = TransferCost(estimate.transfer.latency_s, estimate.transfer.bytes_per_s, 25e9)
    assert CostProfile.load(written) == replace(estimate, transfer=nic)
    # "default": where `pdserve plan calibrate` writes ($PDSERVE_PROFILE); "": no wait
    (tmp_path / "cpu-profile.json").write_bytes(written.read_bytes())
    assert load_mock_profile("default") == CostProfile.load(written)
    assert load_mock_profile("") is None


def _profile(tmp_path: Path) -> str:
    """A linear profile whose every term is distinct and non-zero, saved as JSON."""
    step = LinearStepCost(
        base_s=0.01,
        prefill_token_s=1e-4,
        prefill_seq_s=2e-3,
        decode_seq_s=3e-4,
        context_token_s=1e-6,
        attention_pair_s=1e-7,
        padded_context_token_s=2e-7,
        prefill_step_s=5e-3,
    )
    profile = CostProfile("test", "test", step, TransferCost(1e-3, 1e9), 1024, step_scale=1.5)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    return str(path)


def _fake_time(engine: Engine, tick_s: float) -> list[float]:
    """The engine's mock waits into a list; its clock advances ``tick_s`` a reading."""
    model = engine.runner.model
    assert isinstance(model, MockModel)
    sleeps: list[float] = []
    readings = iter(range(10**6))
    model.clock = lambda: next(readings) * tick_s
    model.sleep = sleeps.append
    return sleeps


def test_each_step_waits_the_profiles_time_for_its_shape_less_its_own_work(tmp_path: Path) -> None:
    path = _profile(tmp_path)
    profile = CostProfile.load(path)
    engine = Engine(mock_config(max_num_batched_tokens=12, mock_cost_profile=path))
    sleeps = _fake_time(engine, 0.001)  # each step reads the clock twice: 1 ms of its own work
    engine.add_request("a", list(range(10, 20)), greedy(3))
    engine.add_request("b", list(range(30, 37)), greedy(3))
    for _ in range(5):
        engine.step()
    assert not engine.has_unfinished()
    # (start position, tokens, is decode): a whole + b's first 2 under the 12-token budget; a decodes
    # beside b's last 5; both decode; b decodes its last
    shapes = [
        shape_of([(0, 10, False), (0, 2, False)]),
        shape_of([(10, 1, True), (2, 5, False)]),
        shape_of([(11, 1, True), (7, 1, True)]),
        shape_of([(8, 1, True)]),
    ]
    expected = [profile.step_s(s) for s in shapes]
    assert sleeps == [s - 0.001 for s in expected]
    model = engine.runner.model
    assert isinstance(model, MockModel)
    assert (model.num_waits, model.waited_s) == (4, sum(expected))
    # a step whose own work outlasts its predicted time does not wait at all
    sleeps = _fake_time(engine, 10.0)
    engine.add_request("c", [1, 2, 3], greedy(1))
    engine.step()
    assert sleeps == [] and model.num_waits == 5


def test_mock_kv_cache_has_the_real_models_layout(tmp_path: Path) -> None:
    for options in ({"num_kv_blocks": 64}, {"num_kv_blocks": None, "cpu_kv_cache_bytes": 1 << 20}):
        base = engine_config(BUNDLED_MODEL, max_num_batched_tokens=16, **options)  # a short warm-up
        real = ModelRunner(replace(base, load_format="dummy"), BUNDLED_MODEL)
        mock = ModelRunner(replace(base, load_format="mock"), BUNDLED_MODEL)
        assert isinstance(mock.model, MockModel) and not isinstance(real.model, MockModel)
        assert (mock.kv_cache.shape, mock.kv_cache.dtype) == (real.kv_cache.shape, real.kv_cache.dtype)
        assert mock.bytes_per_block == real.bytes_per_block == 4 * 2 * BLOCK_SIZE * 2 * 32 * 4
        assert layout_of(mock.kv_cache) == layout_of(real.kv_cache)
    # no weights: an 8-KV-head, 28-layer config's mock holds its KV in the checkpoint's bf16, as a GPU would
    big = ModelRunner(
        EngineConfig.from_options(QWEN3_CONFIG, load_format="mock", num_kv_blocks=8), QWEN3_CONFIG
    )
    assert (tuple(big.kv_cache.shape), big.kv_cache.dtype) == ((28, 8, 2, 16, 8, 128), torch.bfloat16)
    assert big.bytes_per_block == 28 * 2 * 16 * 8 * 128 * 2


def _expected_block(prompt: list[int], block: int, layer: int, words_per_row: int) -> torch.Tensor:
    """The int64 words of one layer of a moved block: per slot, K rows then V rows, the signature in
    each row's first word, zeros elsewhere (and in the slots past the prompt: its blocks were fresh)."""
    rows = torch.zeros(2, BLOCK_SIZE, words_per_row, dtype=torch.int64)
    for offset in range(BLOCK_SIZE):
        position = block * BLOCK_SIZE + offset
        if position < len(prompt):
            for kv in (0, 1):
                rows[kv, offset, 0] = kv_signature(prompt[position], position, layer, kv)
    return rows.view(-1)


def test_colocated_and_disaggregated_mock_equal_the_rule_and_handoffs_move_its_bytes(
    rule: MockTokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = [rule_output(rule, p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    params = [greedy(m) for m in MAX_TOKENS]
    colocated = LocalCluster(
        mock_config(),
        {"colocated": 1},
        router=RouterConfig(mode="colocated", health_interval_s=0.1, health_timeout_s=10.0),
    )
    try:
        outs = colocated.generate(PROMPTS, params)
        assert [[t for d in deltas for t in d.token_ids] for deltas in outs] == expected
    finally:
        colocated.close()

    # every chunk the decode side scatters: (layer, decode-side block id, the block's words)
    received: list[tuple[int, int, torch.Tensor]] = []
    scatter = transfer.ring.scatter_rows

    def recording(
        rows: torch.Tensor, index: torch.Tensor, plan: ChunkPlan, chunk: int, src: torch.Tensor
    ) -> None:
        for layer, first, last, row in plan.segments(chunk):
            for i, block_id in enumerate(index[first:last].tolist()):
                received.append((layer, block_id, src[row + i].clone()))
        scatter(rows, index, plan, chunk, src)

    monkeypatch.setattr(transfer.ring, "scatter_rows", recording)
    disaggregated = LocalCluster(mock_config(), {"prefill": 1, "decode": 1})
    try:
        real = ModelRunner(
            replace(mock_config(), load_format="dummy", max_num_batched_tokens=16), BUNDLED_MODEL
        )
        decode_kv = disaggregated.workers["decode-0"].engine.runner.kv_cache
        assert layout_of(decode_kv) == layout_of(real.kv_cache)
        num_layers = real.arch.num_hidden_layers
        words_per_row = real.bytes_per_block // num_layers // 2 // BLOCK_SIZE // 8
        for prompt, max_tokens, want in zip(PROMPTS, MAX_TOKENS, expected, strict=True):
            received.clear()
            (deltas,) = disaggregated.generate([prompt], [greedy(max_tokens)])
            assert [t for d in deltas for t in d.token_ids] == want
            # one handoff: every block of the prompt, each layer once, layer-major, blocks in order
            num_blocks = -(-len(prompt) // BLOCK_SIZE)
            assert [layer for layer, _, _ in received] == [
                i // num_blocks for i in range(num_layers * num_blocks)
            ]
            for i, (layer, _, words) in enumerate(received):
                assert words.numel() * 8 * num_layers == real.bytes_per_block
                assert torch.equal(words, _expected_block(prompt, i % num_blocks, layer, words_per_row)), (
                    i,
                    layer,
                )
        disaggregated.wait_until_quiet()
        assert disaggregated.fatal == []
    finally:
        disaggregated.close()
