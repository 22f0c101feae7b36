"""A mock engine's host KV tier at its cost profile's host link (workers/host_kv.py ``PacedHostCopies``):
outputs equal without the tier, blocks come back from it carrying their signature words, each step's
copies wait exactly what the profile predicts for the whole blocks (a fake clock: no wall time is
asserted), and the load rule sees that rate."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cluster.config import EngineConfig
from cluster.cost_model import CostProfile, LinearStepCost, TransferCost
from cluster.protocol import SamplingParams
from cluster.tokenizer import Tokenizer
from deploy.planner.profiles import HARDWARE, ModelShape, roofline_profile
from tests.support.local_cluster import engine_config
from workers.engine import BUNDLED_MODEL, Engine
from workers.host_kv import HostKv, PacedHostCopies
from workers.host_tier import KvCopies
from workers.mock_runner import MockModel, MockTokens
from workers.models.arch import ArchConfig

LLAMA3_8B_CONFIG = str(Path(__file__).resolve().parents[2] / "bench" / "configs" / "llama-3-8b")
HOST_LINK = 2e9  # bytes/s: a bundled-model block (8 KiB) in 4.096 us, its 4 tokens' prefill in 400 us


def _profile(tmp_path: Path, host_link_bytes_per_s: float = HOST_LINK) -> str:
    step = LinearStepCost(
        base_s=1e-3,
        prefill_token_s=1e-4,
        prefill_seq_s=0.0,
        decode_seq_s=1e-4,
        context_token_s=0.0,
        attention_pair_s=0.0,
    )
    profile = CostProfile(
        "test", "test", step, TransferCost(1e-3, 1e9), 1024, host_link_bytes_per_s=host_link_bytes_per_s
    )
    path = tmp_path / f"profile-{host_link_bytes_per_s:g}.json"
    path.write_text(json.dumps(profile.to_dict()))
    return str(path)


def _engine(profile_path: str, **options: object) -> Engine:
    base = engine_config(BUNDLED_MODEL, load_format="mock", mock_cost_profile=profile_path)
    config: EngineConfig = replace(
        base,
        num_kv_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        **options,  # type: ignore[arg-type]
    )
    engine = Engine(config)
    model = engine.runner.model
    assert isinstance(model, MockModel)
    model.sleep = lambda s: None  # NOTE: the steps' own waits are test_mock_engine's; none here
    return engine


def _first_prompts() -> list[list[int]]:
    rng = random.Random(4)
    system = [rng.randrange(5, 400) for _ in range(16)]
    return [system + [rng.randrange(5, 400) for _ in range(rng.randrange(10, 20))] for _ in range(6)]


def _run_turns(engine: Engine, num_turns: int = 3) -> list[list[list[int]]]:
    """Six conversations of ``num_turns`` turns: each prompt is the history, the last answer and a new
    message (a shared 16-token system prompt first)."""
    histories = _first_prompts()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for turn in range(num_turns):
        for i, history in enumerate(histories):
            engine.add_request(f"t{turn}-{i}", history, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
        answers = [got[f"t{turn}-{i}"] for i in range(len(histories))]
        outputs.append(answers)
        histories = [h + a + [7 + turn] * 8 for h, a in zip(histories, answers, strict=True)]
    return outputs


def _signature_words(kv_cache: torch.Tensor, block: int) -> torch.Tensor:
    """``[num_layers, 2]``: the first word of a block's K and of its V in every layer."""
    num_layers, num_blocks = kv_cache.shape[:2]
    return kv_cache.view(num_layers, num_blocks, 2, -1).view(torch.int64)[:, block, :, 0].clone()


class _CheckedHostKv(HostKv):
    """Records each step's number of copied blocks, and checks that every block loaded back carries the
    signature words it was offloaded with (and that those are the signature of the block's first slot)."""

    def __init__(
        self, kv_cache: torch.Tensor, num_slots: int, paced: PacedHostCopies, block_size: int
    ) -> None:
        super().__init__(kv_cache, num_slots, paced)
        self.block_size = block_size
        self.offloaded: dict[int, torch.Tensor] = {}
        self.blocks_per_apply: list[int] = []
        self.num_checked = 0

    def apply(self, kv_cache: torch.Tensor, copies: KvCopies) -> None:
        for block, slot in zip(copies.offload_blocks, copies.offload_slots, strict=True):
            words = _signature_words(kv_cache, block)
            _check_first_slot_signature(words, self.block_size)
            self.offloaded[slot] = words
        super().apply(kv_cache, copies)
        self.blocks_per_apply.append(len(copies.offload_blocks) + len(copies.load_blocks))
        for slot, block in zip(copies.load_slots, copies.load_blocks, strict=True):
            assert torch.equal(_signature_words(kv_cache, block), self.offloaded[slot])
            self.num_checked += 1


def _check_first_slot_signature(words: torch.Tensor, block_size: int) -> None:
    """``kv_signature`` of one (token, position) in every layer, K and V, the position a block's first."""
    num_layers = words.shape[0]
    high, token = words >> 32, words & 0xFFFFFFFF
    tags = torch.arange(num_layers).view(-1, 1) * 2 + torch.arange(2)
    assert torch.equal(high & 0xFF, tags)
    positions = high >> 8
    assert bool((positions == positions[0, 0]).all()) and int(positions[0, 0]) % block_size == 0
    assert bool((token == token[0, 0]).all()) and int(token[0, 0]) > 0


def _fake_link_time(paced: PacedHostCopies, tick_s: float = 0.0) -> list[float]:
    """The tier's waits into a list; its clock advances by each wait, and by ``tick_s`` a reading."""
    now = [0.0]
    sleeps: list[float] = []

    def clock() -> float:
        now[0] += tick_s
        return now[0]

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    paced.clock, paced.sleep = clock, sleep
    return sleeps


def _record_copies(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    rule = engine.load_rule
    assert rule is not None
    seen: list[tuple[int, float]] = []
    observe: Callable[[int, float], None] = rule.observe_copy

    def recording(num_bytes: int, seconds: float) -> None:
        seen.append((num_bytes, seconds))
        observe(num_bytes, seconds)

    monkeypatch.setattr(rule, "observe_copy", recording)
    return seen


@pytest.mark.parametrize("is_async", [False, True])
def test_a_mock_tier_moves_signatures_waits_the_host_link_and_keeps_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, is_async: bool
) -> None:
    path = _profile(tmp_path)
    plain = _engine(path, async_scheduling=is_async)
    expected = _run_turns(plain)
    plain.check_no_leaks()
    tiered = _engine(path, async_scheduling=is_async, kv_offload_gib=0.0005)
    host_kv = tiered.runner.host_kv
    assert host_kv is not None and host_kv.paced is not None
    # the tier as the GPU box holds it (65 whole blocks of 8 KiB), its bytes one word of each K and V
    assert (host_kv.num_slots, host_kv.bytes_per_block) == (65, 4 * 2 * 4 * 2 * 32 * 4)
    assert host_kv.slots.shape == (65, 4, 2, 1) and host_kv.slots.dtype == torch.int64
    checked = _CheckedHostKv(tiered.runner.kv_cache, host_kv.num_slots, host_kv.paced, block_size=4)
    tiered.runner.host_kv = checked
    assert checked.paced is not None
    sleeps = _fake_link_time(checked.paced)
    observed = _record_copies(tiered, monkeypatch)

    assert _run_turns(tiered) == expected
    rule = MockTokens.for_model(
        ArchConfig.from_pretrained(BUNDLED_MODEL), Tokenizer.from_pretrained(BUNDLED_MODEL)
    )
    assert expected[0] == [rule.continuation(p, 6) for p in _first_prompts()]
    st = tiered.stats()
    assert st.kv_offloaded_blocks > 0 and st.kv_loaded_blocks > 0
    assert checked.num_checked == st.kv_loaded_blocks
    assert st.num_prompt_tokens < plain.stats().num_prompt_tokens
    # each step's copies waited what the host link predicts for their whole blocks, nothing else
    per_block = checked.bytes_per_block
    profile = CostProfile.load(path)
    assert sleeps == [profile.host_copy_s(n * per_block) for n in checked.blocks_per_apply]
    assert sum(checked.blocks_per_apply) == st.kv_offloaded_blocks + st.kv_loaded_blocks
    assert checked.num_copied_bytes == sum(checked.blocks_per_apply) * per_block
    assert checked.paced_seconds == checked.waited_seconds == sum(sleeps)
    assert checked.paced_seconds == pytest.approx(checked.num_copied_bytes / HOST_LINK, rel=1e-12)
    assert checked.copy_seconds == pytest.approx(checked.paced_seconds, rel=1e-9)
    # the load rule sees the link's rate, once per step with copies
    assert [n for n, _ in observed] == [n * per_block for n in checked.blocks_per_apply]
    assert [n / s for n, s in observed] == pytest.approx([HOST_LINK] * len(observed), rel=1e-9)
    tiered.check_no_leaks()


def test_copies_whose_real_part_outlasts_the_link_wait_nothing(tmp_path: Path) -> None:
    engine = _engine(_profile(tmp_path), kv_offload_gib=0.0005)
    host_kv = engine.runner.host_kv
    assert host_kv is not None and host_kv.paced is not None
    sleeps = _fake_link_time(host_kv.paced, tick_s=1.0)  # 1 s between readings: far past 4 us a block
    # NOTE: copies that take seconds would make the load rule recompute instead: it is not under test here
    engine.scheduler.kv.load_rule = None
    _run_turns(engine)
    assert engine.stats().kv_loaded_blocks > 0
    assert sleeps == [] and host_kv.waited_seconds == 0.0
    assert host_kv.paced_seconds == pytest.approx(host_kv.num_copied_bytes / HOST_LINK, rel=1e-12)
    assert host_kv.copy_seconds > host_kv.paced_seconds


def test_a_profile_without_a_host_link_copies_every_byte_unpaced(tmp_path: Path) -> None:
    engine = _engine(_profile(tmp_path, host_link_bytes_per_s=0.0), kv_offload_gib=0.0005)
    host_kv = engine.runner.host_kv
    assert host_kv is not None and host_kv.paced is None
    assert host_kv.slots.shape == (65, 4, 2, 4, 2, 32) and host_kv.slots.dtype == torch.float32
    _run_turns(engine)
    assert engine.stats().kv_loaded_blocks > 0
    assert host_kv.paced_seconds == host_kv.waited_seconds == 0.0
    with pytest.raises(ValueError, match="names no host link"):
        PacedHostCopies(CostProfile.load(_profile(tmp_path, host_link_bytes_per_s=0.0)))


def test_gpu_estimates_name_their_pcie_link_and_old_profiles_none(tmp_path: Path) -> None:
    shape = ModelShape.from_config(LLAMA3_8B_CONFIG)
    h100 = roofline_profile(HARDWARE["h100"], shape)
    assert h100.host_link_bytes_per_s == 50e9  # PCIe Gen5 x16
    assert roofline_profile(HARDWARE["a100"], shape).host_link_bytes_per_s == 25e9  # Gen4 x16
    assert CostProfile.from_dict(json.loads(json.dumps(h100.to_dict()))) == h100
    data = h100.to_dict()
    del data["host_link_bytes_per_s"]  # a profile saved before the field
    assert CostProfile.from_dict(data).host_link_bytes_per_s == 0.0
    # an 8B's 16-token block (2 MiB) over the link: 41.9 us; its prefill at the roofline: ~0.45 ms
    block = 16 * shape.kv_bytes_per_token
    assert block == 2 << 20
    assert h100.host_copy_s(block) == pytest.approx(41.94e-6, rel=1e-3)
