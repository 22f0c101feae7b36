"""CPU checks of the CUDA-graph decode path: the batch-size ladder, bucket choice, decode-only detection,
the exact padded contents of the static input buffers, that a padded decode forward (with the split
count a graph is captured with) matches the unpadded reference, and the random-weight load path."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from cluster.config import EngineConfig, ModelConfig
from cluster.protocol import SamplingParams
from workers.attention.torch_backend import TorchAttentionBackend
from workers.cuda_graphs import (
    DecodeGraphs,
    InputBuffers,
    graph_batch_sizes,
    is_decode_only,
    pick_graph_batch_size,
)
from workers.engine import BUNDLED_MODEL
from workers.forward_context import ForwardContext, forward_context
from workers.llm import LLM
from workers.model_runner import ModelRunner, build_step_arrays
from workers.scheduler import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _sched(request_id: str, token_ids: list[int], start: int, block_ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id, token_ids, start, block_ids, True, start > 0, GREEDY, 0)


def test_ladder() -> None:
    assert graph_batch_sizes(256, 256) == [1, 2, 4, *range(8, 257, 8)]
    assert graph_batch_sizes(256, 100) == [1, 2, 4, *range(8, 97, 8), 100]
    assert graph_batch_sizes(20, 512) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3, 256) == [1, 2, 3]
    assert graph_batch_sizes(8, 256) == [1, 2, 4, 8]
    assert graph_batch_sizes(1, 256) == [1]


def test_bucket_choice() -> None:
    sizes = graph_batch_sizes(20, 256)
    picked = [pick_graph_batch_size(sizes, n) for n in range(1, 23)]
    expected = [1, 2, 4, 4, 8, 8, 8, 8, *[16] * 8, *[20] * 4, None, None]
    assert picked == expected


def test_decode_only_detection() -> None:
    decode = [_sched("a", [5], 7, [1, 2]), _sched("b", [6], 3, [3])]
    assert is_decode_only(SchedulerOutput(decode, 2))
    # A one-token prompt chunk counts: the kernels treat every one-query sequence alike.
    assert is_decode_only(SchedulerOutput([_sched("c", [9], 0, [4])], 1))
    assert not is_decode_only(SchedulerOutput([*decode, _sched("c", [1, 2], 0, [4])], 4))
    assert not is_decode_only(SchedulerOutput([_sched("c", [1, 2], 0, [4]), *decode], 4))
    assert not is_decode_only(SchedulerOutput([], 0))


def test_static_buffers_padded_contents_and_used_width_upload() -> None:
    block_size, max_blocks = 4, 5
    buffers = InputBuffers(
        max_tokens=8, max_seqs=8, max_blocks_per_seq=max_blocks, device=torch.device("cpu")
    )
    # First a full step of 8 sequences so every later padding entry is overwritten stale data.
    big = [_sched(f"r{i}", [100 + i], 18, [9, 8, 7, 6, 5]) for i in range(8)]
    a = build_step_arrays(big, block_size)
    buffers.fill_decode_graph(a.input_ids, a.positions, a.slots, a.seq_lens, a.block_tables, 8)
    buffers.upload_decode_graph(8)
    assert buffers.num_uploaded_table_entries == 8 * 5

    step = [_sched("a", [11], 5, [3, 7]), _sched("b", [12], 0, [2]), _sched("c", [13], 12, [4, 1, 6, 9])]
    a = build_step_arrays(step, block_size)
    buffers.fill_decode_graph(a.input_ids, a.positions, a.slots, a.seq_lens, a.block_tables, 4)
    buffers.upload_decode_graph(4)
    assert buffers.input_ids.np[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions.np[:4].tolist() == [5, 0, 12, 0]
    # a: position 5 -> block 7 offset 1; b: block 2 offset 0; c: position 12 -> block 9 offset 0.
    assert buffers.slot_mapping.np[:4].tolist() == [29, 8, 36, -1]
    assert buffers.seq_lens.np[:4].tolist() == [6, 1, 13, 1]
    assert buffers.query_start_loc.np[:5].tolist() == [0, 1, 2, 3, 4]
    # Only the step's [3, 4] table went up (not [4 graph rows, 5]); the rest keeps the big step's ids,
    # which no sequence reads (a: 2 blocks, b: 1, c: 4; the padding row reads column 0).
    assert buffers.num_uploaded_table_entries == 3 * 4
    tables = buffers.graph_block_tables[:4].tolist()
    assert tables == [[3, 7, 0, 0, 5], [2, 0, 0, 0, 5], [4, 1, 6, 9, 5], [9, 8, 7, 6, 5]]
    assert a.logits_indices.tolist() == [0, 1, 2]


@pytest.fixture(scope="module")
def prefilled_runner() -> tuple[ModelRunner, list[ScheduledRequest]]:
    """The bundled model (fp32, CPU) with three sequences of lengths 19, 5 and 40 in its KV cache."""
    config = EngineConfig(model=ModelConfig(path=BUNDLED_MODEL), device="cpu", block_size=4, num_kv_blocks=40)
    runner = ModelRunner(config, BUNDLED_MODEL)
    rng = np.random.default_rng(0)
    lens, blocks = (19, 5, 40), ([5, 9, 2, 7, 11, 3], [1, 4], list(range(12, 23)))
    prompts = [rng.integers(3, runner.arch.vocab_size, n).tolist() for n in lens]
    prefill = [_sched(f"s{i}", p, 0, b) for i, (p, b) in enumerate(zip(prompts, blocks, strict=True))]
    runner.execute(SchedulerOutput(prefill, sum(lens)))
    decode = [
        _sched(f"s{i}", [int(t)], n, b)
        for i, (t, n, b) in enumerate(zip((7, 8, 9), lens, blocks, strict=True))
    ]
    return runner, decode


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_padded_decode_forward_matches_unpadded(
    prefilled_runner: tuple[ModelRunner, list[ScheduledRequest]], backend_name: str
) -> None:
    runner, decode = prefilled_runner
    out = SchedulerOutput(decode, len(decode))
    arrays = build_step_arrays(decode, runner.block_size)
    reference_inputs = runner.fresh_inputs(arrays, out)
    assert reference_inputs.meta is not None
    kv_before = runner.kv_cache.clone()
    with (
        torch.inference_mode(),
        forward_context(ForwardContext(reference_inputs.meta, runner.kv_caches, TorchAttentionBackend())),
    ):
        reference = runner.model(reference_inputs.input_ids, reference_inputs.positions)
    kv_reference = runner.kv_cache.clone()

    if backend_name == "triton":
        from workers.attention.triton_backend import TritonAttentionBackend, TritonLaunchConfig

        # NOTE: many splits over a 256-token max_model_len: the replay's sequences (<= 41 keys) leave most
        # splits empty, the case the graph path relies on.
        launch = TritonLaunchConfig(decode_block_n=16, min_kv_per_split=16, target_programs=1024)
        backend: torch.nn.Module | object = TritonAttentionBackend(launch)
        assert launch.num_decode_splits(8, runner.arch.num_key_value_heads, 256) == 16
    else:
        backend = TorchAttentionBackend()
    buffers = InputBuffers(8, 8, -(-256 // runner.block_size), torch.device("cpu"))
    # Stale block ids everywhere (valid ones: 1..39) that this step's upload does not overwrite.
    buffers.graph_block_tables.copy_(torch.randint(1, 40, buffers.graph_block_tables.shape))
    # The Triton graph also runs the fused layer kernels, as the runner's graphs do.
    fused = backend_name == "triton"
    graphs = DecodeGraphs(
        runner.model, buffers, runner.kv_caches, backend, [4, 8], 256, runner.block_size, fused
    )  # type: ignore[arg-type]
    runner.kv_cache.copy_(kv_before)
    buffers.fill_decode_graph(
        arrays.input_ids, arrays.positions, arrays.slots, arrays.seq_lens, arrays.block_tables, 8
    )
    buffers.upload_decode_graph(8)
    with torch.inference_mode():
        padded = graphs.forward(8)
    assert padded.shape[0] == 8
    torch.testing.assert_close(padded[:3], reference, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded).all()
    # Padding rows wrote nothing (slot -1): the cache equals the reference's, null block 0 included.
    torch.testing.assert_close(runner.kv_cache, kv_reference, rtol=1e-5, atol=1e-6)
    assert not runner.kv_cache[:, 0].any()


def test_runner_on_cpu_has_no_buffers_or_graphs(
    prefilled_runner: tuple[ModelRunner, list[ScheduledRequest]],
) -> None:
    runner, _ = prefilled_runner
    assert runner.buffers is None and runner.graphs is None and runner.graph_sizes == []


def test_load_format_validated() -> None:
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(load_format="safetensors")
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size must be >= 1"):
        EngineConfig(cuda_graph_max_batch_size=0)


def test_dummy_load_needs_only_config_json(tmp_path: pathlib.Path) -> None:
    model_dir = tmp_path / "shape-only"
    model_dir.mkdir()
    config = json.loads((pathlib.Path(BUNDLED_MODEL) / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = [[5, 6, 7], list(range(10, 40)), [3]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 3, 7)]

    def run(seed: int) -> tuple[list[list[int]], torch.Tensor]:
        llm = LLM(str(model_dir), load_format="dummy", device="cpu", seed=seed, num_kv_blocks=32)
        outs = llm.generate(prompts, params)
        llm.check_no_leaks()
        weight = llm.engine.runner.model.model.embed_tokens.weight.detach().clone()
        return [o.token_ids for o in outs], weight

    tokens, weight = run(0)
    assert [len(t) for t in tokens] == [5, 3, 7]
    assert all(0 <= t < config["vocab_size"] for seq in tokens for t in seq)
    again, weight_again = run(0)
    assert again == tokens
    assert torch.equal(weight, weight_again)
    _, other_weight = run(1)
    assert not torch.equal(weight, other_weight)
    assert abs(float(weight.std()) - 0.02) < 0.002  # N(0, 0.02) init, not the checkpoint
