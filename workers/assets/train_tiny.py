"""Build the bundled tiny checkpoint: a byte-level BPE tokenizer and a small Llama trained on CPU.

    python -m workers.assets.train_tiny [--out DIR] [--minutes M] [--seed S] [--steps N]

Everything comes from `workers.assets.corpus` (text generated from a seed), so nothing is downloaded.
The output directory is a real Hugging Face checkpoint: config.json, model.safetensors,
generation_config.json, tokenizer.json and tokenizer_config.json (with a ChatML chat template).

Reproducibility: the corpus, the tokenizer, the initial weights and the data order depend only on the
seed. With --steps the run is fixed-length (the cosine schedule runs over that many steps) and
bit-for-bit repeatable on one machine; without it the schedule follows the wall-clock budget, so the
number of steps (printed at the end) and the exact weights depend on the machine's speed and load.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from workers.assets.corpus import generate_documents

DEFAULT_OUT = Path(__file__).resolve().parent / "pdserve-tiny"
PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
SAMPLE_PROMPTS = (
    "Once upon a time, there was a",
    'Tom said, "Do you want to play',
    "A cow says moo. A duck",
)


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a token the tokenizer must know (the special tokens)."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
    return found


def build_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE whose post-processor puts BOS before every encoded text, like Llama's."""
    tokenizer = Tokenizer(models.BPE())
    # NOTE: no prefix space and no offset trimming: byte-level BPE then round-trips any string exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    bos_id = token_id(tokenizer, BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_model(tokenizer: Tokenizer, args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=token_id(tokenizer, BOS),
        eos_token_id=token_id(tokenizer, EOS),
        pad_token_id=token_id(tokenizer, PAD),
        dtype="float32",
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def make_windows(tokenizer: Tokenizer, documents: list[str], context: int) -> torch.Tensor:
    """[num_windows, context + 1] token ids: BOS doc EOS BOS doc EOS ... cut into equal windows."""
    eos_id = token_id(tokenizer, EOS)
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        stream.extend(encoding.ids)
        stream.append(eos_id)
    num_windows = len(stream) // (context + 1)
    return torch.tensor(stream[: num_windows * (context + 1)]).view(num_windows, context + 1)


def lr_at(progress: float, step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (0.1 + 0.9 * cosine)


def batch_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def train(model: LlamaForCausalLM, windows: torch.Tensor, args: argparse.Namespace, budget_s: float) -> int:
    """Train in place; returns the number of optimizer steps taken."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed))
    model.train()
    start = time.monotonic()
    step, smoothed = 0, 0.0
    while True:
        elapsed = time.monotonic() - start
        progress = step / args.steps if args.steps else elapsed / budget_s
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress, step, args)
        first = (step * args.batch) % (len(order) - args.batch + 1)
        loss = batch_loss(model, windows[order[first : first + args.batch]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if step == 0 else 0.95 * smoothed + 0.05 * loss.item()
        step += 1
        if step % args.log_every == 0:
            print(
                f"step {step:5d}  {elapsed:6.0f}s  lr {optimizer.param_groups[0]['lr']:.2e}  loss {smoothed:.3f}",
                flush=True,
            )
    return step


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [batch_loss(model, windows[i : i + batch]).item() for i in range(0, len(windows), batch)]
    return sum(losses) / len(losses)


def save_checkpoint(model: LlamaForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        (out / name).unlink(missing_ok=True)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    # NOTE: transformers 5 writes "dtype" and nests rope_theta under "rope_parameters"; the classic
    # keys are added too so loaders written against transformers 4.x layouts read the same values.
    config["torch_dtype"] = "float32"
    config["rope_theta"] = 10000.0
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = GenerationConfig(
        bos_token_id=token_id(tokenizer, BOS),
        eos_token_id=[token_id(tokenizer, EOS), token_id(tokenizer, IM_END)],
        pad_token_id=token_id(tokenizer, PAD),
    )
    generation.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def print_samples(out: Path) -> None:
    """Reload the saved directory with transformers and print greedy continuations."""
    model = LlamaForCausalLM.from_pretrained(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    model.eval()
    for prompt in SAMPLE_PROMPTS:
        input_ids = torch.tensor([tokenizer.encode(prompt).ids])
        # NOTE: some transformers versions annotate generate()'s `self` with a protocol mypy cannot match
        output = cast(Any, model).generate(input_ids, max_new_tokens=40, do_sample=False)
        text = tokenizer.decode(output[0, input_ids.shape[1] :].tolist())
        print(f"{prompt!r} -> {text!r}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget for the whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="fixed step count (0: fill the budget)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--corpus-chars", type=int, default=6_000_000)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=25)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.monotonic()
    torch.set_num_threads(args.threads)
    documents = generate_documents(args.corpus_chars, args.seed)
    tokenizer = build_tokenizer(documents, args.vocab_size)
    windows = make_windows(tokenizer, documents, args.context)
    held_out = make_windows(tokenizer, generate_documents(100_000, args.seed + 1), args.context)
    model = build_model(tokenizer, args)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"vocab {tokenizer.get_vocab_size()}  params {num_params:,}  windows {len(windows)} x {args.context + 1}"
        f"  setup {time.monotonic() - start:.0f}s"
    )
    # NOTE: keep ~40 s of the budget for evaluation, saving and the samples.
    budget_s = max(args.minutes * 60.0 - (time.monotonic() - start) - 40.0, 1.0)
    steps = train(model, windows, args, budget_s)
    train_s = time.monotonic() - start
    eval_loss = evaluate(model, held_out[:32], args.batch)
    print(f"steps {steps}  tokens {steps * args.batch * args.context:,}  held-out loss {eval_loss:.3f}")
    save_checkpoint(model, tokenizer, args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"saved {args.out} ({size / 1e6:.1f} MB) after {train_s:.0f}s of setup+training")
    print_samples(args.out)
    print(f"total {time.monotonic() - start:.0f}s")


if __name__ == "__main__":
    main()
