"""Our models over the paged torch backend vs transformers' own logits (float32, CPU)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.support.hf_models import ARCHS, PagedRunner, hf_greedy, make_random_hf_model
from workers.models import MODEL_REGISTRY
from workers.models.arch import ArchConfig
from workers.models.layers import rope_inv_freq
from workers.models.loader import build_random_model, load_model

ATOL = 1e-4
RTOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_random_hf_model(arch, root, seed=i) for i, arch in enumerate(ARCHS)}


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(model_dir: pathlib.Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [hf(torch.tensor([seq])).logits[0].float() for seq in sequences]


def _ours(model_dir: pathlib.Path, block_size: int) -> PagedRunner:
    model, arch = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    return PagedRunner(model, arch, block_size=block_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_chunked_and_decode_match_hf(arch: str, checkpoints: dict[str, pathlib.Path]) -> None:
    # Three prompts of different lengths (the longest well past Gemma2's 32-token window), each followed
    # by a teacher-forced continuation fed as decode steps.
    prompts = [_tokens(1, 70), _tokens(2, 9), _tokens(3, 41)]
    continuations = [_tokens(10 + i, 6) for i in range(3)]
    chunked_prompt = _tokens(4, 90)
    full = [p + c for p, c in zip(prompts, continuations, strict=True)]
    expected = _hf_logits(checkpoints[arch], [*full, chunked_prompt])

    runner = _ours(checkpoints[arch], block_size=4)
    # (a) one ragged prefill batch of three sequences, plus two padding tokens (slot -1).
    got = runner.step([(i, p) for i, p in enumerate(prompts)], num_padding=2)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(got[i], expected[i][: len(prompt)], atol=ATOL, rtol=RTOL)
    # (b) chunked prefill of sequence 3 interleaved with (c) decode steps of sequences 0-2 (decodes first).
    chunks = [(0, 17), (17, 50), (50, 51), (51, 90)]
    for step, (lo, hi) in enumerate(chunks):
        decodes = [(i, [continuations[i][step]]) for i in range(3)]
        got = runner.step([*decodes, (3, chunked_prompt[lo:hi])])
        for i in range(3):
            pos = len(prompts[i]) + step
            torch.testing.assert_close(got[i][0], expected[i][pos], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got[3], expected[3][lo:hi], atol=ATOL, rtol=RTOL)
    # Remaining decode steps alone (a pure-decode batch).
    for step in range(len(chunks), 6):
        got = runner.step([(i, [continuations[i][step]]) for i in range(3)])
        for i in range(3):
            torch.testing.assert_close(got[i][0], expected[i][len(prompts[i]) + step], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch: str, checkpoints: dict[str, pathlib.Path]) -> None:
    prompt, num_new = _tokens(7, 40), 10
    [expected] = hf_greedy(checkpoints[arch], [prompt], [num_new])
    assert len(set(expected)) > 3, f"random {arch} model is degenerate: {expected}"
    runner = _ours(checkpoints[arch], block_size=16)
    logits = runner.step([(0, prompt)])[0]
    generated: list[int] = []
    for _ in range(num_new):
        generated.append(int(logits[-1].argmax()))
        logits = runner.step([(0, generated[-1:])])[0]
    assert generated == expected


def test_tied_checkpoint_without_lm_head_loads(tmp_path: pathlib.Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    seq = _tokens(5, 20)
    seq = [t % 128 for t in seq]
    [expected] = _hf_logits(tmp_path, [seq])
    model, arch = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert arch.tie_word_embeddings
    got = PagedRunner(model, arch, block_size=8).step([(0, seq)])[0]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_untied_checkpoint_missing_lm_head_errors(
    tmp_path: pathlib.Path, checkpoints: dict[str, pathlib.Path]
) -> None:
    src = checkpoints["qwen2"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights for \['lm_head.weight'\]"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_unsupported_architecture_and_rope_errors(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 8}))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ArchConfig.from_pretrained(str(tmp_path))
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    with pytest.raises(ValueError, match=r"unsupported rope type 'yarn'.*llama3"):
        ArchConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 2.0}})


def test_arch_config_parsing(checkpoints: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    gemma = ArchConfig.from_pretrained(str(checkpoints["gemma2"]))
    assert [gemma.layer_sliding_window(i) for i in range(4)] == [32, None, 32, None]
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (5.0, 10.0)
    assert gemma.attn_scale == 24**-0.5 and gemma.hidden_act == "gelu_pytorch_tanh"
    qwen2 = ArchConfig.from_pretrained(str(checkpoints["qwen2"]))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.has_qk_norm, qwen2.rope_theta) == (True, False, False, 1e6)
    assert ArchConfig.from_pretrained(str(checkpoints["qwen3"])).has_qk_norm
    llama = ArchConfig.from_pretrained(str(checkpoints["llama"]))
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.layer_types == ("full_attention",) * 3 and llama.sliding_window is None
    # Old-style keys + eos union with generation_config.json.
    old = {"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 2, "num_attention_heads": 2, "rope_theta": 5e5, "sliding_window": 16,
           "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [2, 7], "torch_dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    mistral = ArchConfig.from_pretrained(str(tmp_path))
    assert mistral.eos_token_ids == (2, 7, 9) and mistral.torch_dtype == "bfloat16"
    assert mistral.rope_theta == 5e5 and mistral.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [16, 16] and mistral.head_dim == 4


@pytest.mark.parametrize("rope", ["linear", "llama3"])
def test_rope_scaling_matches_transformers(rope: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope, "rope_theta": 5e5, "factor": 8.0}
    if rope == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512)
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS[rope](config, torch.device("cpu"))
    ours = rope_inv_freq(ArchConfig.from_dict({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_build_random_model(dtype: torch.dtype, checkpoints: dict[str, pathlib.Path]) -> None:
    arch = ArchConfig.from_pretrained(str(checkpoints["gemma2"]))
    model = build_random_model(arch, dtype, torch.device("cpu"), seed=3)
    again = build_random_model(arch, dtype, torch.device("cpu"), seed=3)
    assert isinstance(model, MODEL_REGISTRY["Gemma2ForCausalLM"])
    for (name, param), (_, other) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert param.dtype == dtype and torch.equal(param, other), name
        if "norm" in name:
            assert torch.count_nonzero(param) == 0, name
        else:
            assert 0.015 < float(param.float().std()) < 0.025, name
    logits = PagedRunner(model.float(), arch, block_size=4).step([(0, _tokens(1, 12))])[0]
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_build_random_model_on_gpu(checkpoints: dict[str, pathlib.Path]) -> None:
    arch = ArchConfig.from_pretrained(str(checkpoints["llama"]))
    model = build_random_model(arch, torch.bfloat16, torch.device("cuda"), seed=0)
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(b.is_cuda and b.dtype == torch.float32 for b in model.buffers())
