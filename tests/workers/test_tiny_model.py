"""The bundled tiny checkpoint: complete, small, GQA Llama, and it writes corpus English."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from workers.assets.corpus import VOCABULARY, generate_corpus, generate_documents

TINY_DIR = Path(__file__).resolve().parents[2] / "workers" / "assets" / "pdserve-tiny"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _words(text: str) -> list[str]:
    return [w.strip(string.punctuation).lower() for w in text.split() if w.strip(string.punctuation)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))


def test_checkpoint_files_and_size() -> None:
    names = {p.name for p in TINY_DIR.iterdir()}
    assert set(REQUIRED_FILES) <= names
    assert sum(p.stat().st_size for p in TINY_DIR.iterdir()) <= 20 * 1024 * 1024


def test_config_is_gqa_llama() -> None:
    config = json.loads((TINY_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is True


def test_tokenizer_config_matches_tokenizer(tokenizer: Tokenizer) -> None:
    tokenizer_config = json.loads((TINY_DIR / "tokenizer_config.json").read_text())
    generation = json.loads((TINY_DIR / "generation_config.json").read_text())
    config = json.loads((TINY_DIR / "config.json").read_text())
    bos_id = tokenizer.token_to_id(tokenizer_config["bos_token"])
    eos_id = tokenizer.token_to_id(tokenizer_config["eos_token"])
    assert tokenizer_config["add_bos_token"] is True
    assert (generation["bos_token_id"], config["bos_token_id"]) == (bos_id, bos_id)
    assert generation["eos_token_id"] == [eos_id, tokenizer.token_to_id("<|im_end|>")]
    assert config["eos_token_id"] == eos_id
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_tokenizer_round_trip_and_bos(tokenizer: Tokenizer) -> None:
    text = 'Once upon a time, Lily said, "Hello, Tom!"\n  Two plus three is five.'
    ids = tokenizer.encode(text).ids
    bos_id = tokenizer.token_to_id("<s>")
    assert bos_id is not None
    assert ids[0] == bos_id
    assert ids.count(bos_id) == 1
    assert tokenizer.decode(ids) == text
    # NOTE: unseen bytes still round-trip: the BPE is byte-level.
    odd = "Zebra café 42 ½ 🙂"
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd
    chat = "<|im_start|>user\nHello!<|im_end|>"
    chat_ids = tokenizer.encode(chat, add_special_tokens=False).ids
    assert chat_ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert chat_ids[-1] == tokenizer.token_to_id("<|im_end|>")


def test_corpus_is_deterministic_and_closed() -> None:
    assert generate_corpus(20_000, seed=7) == generate_corpus(20_000, seed=7)
    assert generate_corpus(20_000, seed=7) != generate_corpus(20_000, seed=8)
    documents = generate_documents(50_000, seed=3)
    text = " ".join(documents).replace("<|im_start|>", " ").replace("<|im_end|>", " ")
    words = set(_words(text))
    assert words <= VOCABULARY
    assert len(VOCABULARY) >= 300


def test_greedy_continuation_is_corpus_english(tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(TINY_DIR)
    model.eval()
    for prompt in ("Once upon a time, there was a", 'Mia said, "Where are you going?"\nTom'):
        input_ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            output = model.generate(input_ids, max_new_tokens=30, do_sample=False, min_new_tokens=30)
        new_ids = output[0, input_ids.shape[1] :].tolist()
        assert len(new_ids) == 30
        words = _words(tokenizer.decode(new_ids, skip_special_tokens=True))
        assert len(words) >= 15
        assert [w for w in words if w not in VOCABULARY] == []
