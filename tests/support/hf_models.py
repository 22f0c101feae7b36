"""Test utilities (not a test module): tiny random-weight transformers checkpoints and an HF greedy oracle.

``make_random_hf_model(arch, out_dir)`` saves a small float32 model with ``save_pretrained`` (safetensors);
``hf_greedy(model_dir, prompts, max_tokens)`` runs transformers' own ``generate(do_sample=False)`` on it,
one prompt at a time, without EOS stopping. transformers is used only here and in tests.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from workers.models import ArchConfig, CausalLM

ARCHS = ("llama", "qwen2", "qwen3", "gemma2")

VOCAB_SIZE = 512
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # NOTE: a wide init makes greedy continuations vary; at 0.02 a random model repeats one token.
    "initializer_range": 0.3,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": 0,
}


def _config(arch: str) -> Any:
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            **_COMMON,
            num_hidden_layers=3,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **_COMMON, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters={"rope_theta": 1e6}
        )
    if arch == "qwen3":
        return transformers.Qwen3Config(
            **_COMMON, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters={"rope_theta": 1e6}
        )
    if arch == "gemma2":
        return transformers.Gemma2Config(
            **_COMMON,
            num_hidden_layers=4,
            tie_word_embeddings=False,
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            query_pre_attn_scalar=24,
        )
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def make_random_hf_model(arch: str, out_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Builds a small random float32 ``arch`` model and saves it (config + safetensors) under ``out_dir``.

    Returns the checkpoint directory (``out_dir / arch``). Gemma2 has soft-capping and a 32-token window
    on alternating layers; Llama uses llama3 RoPE scaling; all use GQA (4 query heads, 2 KV heads).
    """
    import transformers

    config = _config(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                # NOTE: non-trivial norm weights so a wrong norm formula cannot pass by accident.
                low = -0.5 if arch == "gemma2" else 0.5
                param.uniform_(low, low + 1.0)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    path = out_dir / arch
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(
    model_dir: pathlib.Path | str, prompts: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    """Greedy continuations from transformers (eager attention, float32, CPU), exactly ``max_tokens`` each.

    EOS never stops generation (the model's generation config loses its eos_token_id in memory).
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    outputs: list[list[int]] = []
    for prompt, num_new in zip(prompts, max_tokens, strict=True):
        input_ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=num_new,
                eos_token_id=None,
                pad_token_id=0,
            )
        new_tokens = generated[0, len(prompt) :].tolist()
        if len(new_tokens) != num_new:
            raise RuntimeError(f"HF generated {len(new_tokens)} tokens, expected {num_new}")
        outputs.append(new_tokens)
    return outputs


class PagedRunner:
    """A minimal stand-in for the engine's model runner: paged KV caches + metadata for given steps.

    Blocks are handed out from a shuffled free list (block 0 stays reserved) so block tables are not
    trivially contiguous. ``step`` runs one flat ragged batch; callers put decode-like sequences first.
    """

    def __init__(self, model: CausalLM, arch: ArchConfig, block_size: int, num_blocks: int = 64) -> None:
        from workers.attention.torch_backend import TorchAttentionBackend

        self.model, self.block_size = model, block_size
        shape = (num_blocks, 2, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
        generator = torch.Generator().manual_seed(1234)
        self.free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.backend = TorchAttentionBackend()

    def step(self, batch: list[tuple[int, list[int]]], num_padding: int = 0) -> list[torch.Tensor]:
        """Feeds ``(seq_id, new_token_ids)`` pairs; returns float32 logits [len(new), vocab] per entry."""
        from workers.attention.base import AttentionMetadata
        from workers.forward_context import ForwardContext, forward_context

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for seq_id, tokens in batch:
            table = self.tables.setdefault(seq_id, [])
            start = self.lens.get(seq_id, 0)
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size >= len(table):
                    table.append(self.free_blocks.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids.extend(tokens)
            self.lens[seq_id] = start + len(tokens)
            starts.append(len(ids))
        ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding
        seq_lens = [self.lens[seq_id] for seq_id, _ in batch]
        width = max(len(self.tables[seq_id]) for seq_id, _ in batch)
        tables = [self.tables[seq_id] + [0] * (width - len(self.tables[seq_id])) for seq_id, _ in batch]
        query_lens = [len(tokens) for _, tokens in batch]
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        ctx = ForwardContext(attn_metadata=meta, kv_caches=self.kv_caches, backend=self.backend)
        with torch.no_grad(), forward_context(ctx):
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)
            )
            logits = self.model.compute_logits(hidden)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(batch))]
