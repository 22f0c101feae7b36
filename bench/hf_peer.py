"""The in-Python peer of ``pdserve bench offline``: transformers on the same requests, greedy, fp32, CPU.

* static batches (``generate``): left-padded, each batch runs to its longest request (only requested
  tokens are counted), swept over batch sizes, in arrival order and sorted by output length;
* continuous batching (``generate_batch``'s manager, transformers >= 5): every request with its own
  ``max_new_tokens``, EOS disabled, when the installed version has it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

# NOTE: stop-at-EOS is off on both sides, so every request produces exactly its output length.
_PAD = 0


@dataclass(frozen=True)
class StaticRun:
    batch_size: int
    order: str  # "arrival" | "sorted"
    seconds: float
    cpu_seconds: float


def load_model(model_dir: str, dummy: bool) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        config = AutoConfig.from_pretrained(model_dir)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def order_requests(output_lens: Sequence[int], order: str) -> list[int]:
    indices = list(range(len(output_lens)))
    if order == "sorted":
        indices.sort(key=lambda i: output_lens[i])
    return indices


def run_static(
    model: Any, prompts: Sequence[list[int]], output_lens: Sequence[int], batch_size: int, order: str
) -> tuple[float, float]:
    """(wall, process CPU) seconds for every request in static batches of ``batch_size`` in ``order``."""
    indices = order_requests(output_lens, order)
    t0, c0 = time.perf_counter(), time.process_time()
    for start in tqdm(
        range(0, len(indices), batch_size), desc=f"transformers b{batch_size} {order}", leave=False
    ):
        rows = indices[start : start + batch_size]
        batch = [prompts[i] for i in rows]
        longest = max(len(p) for p in batch)
        ids = torch.tensor([[_PAD] * (longest - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
        new = max(output_lens[i] for i in rows)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=_PAD,
                eos_token_id=None,
            )
    return time.perf_counter() - t0, time.process_time() - c0


def sweep_static(
    model: Any, prompts: Sequence[list[int]], output_lens: Sequence[int], batch_sizes: Sequence[int]
) -> list[StaticRun]:
    return [
        StaticRun(b, order, *run_static(model, prompts, output_lens, b, order))
        for b in batch_sizes
        for order in ("arrival", "sorted")
    ]


def has_continuous_batching(model: Any) -> bool:
    return hasattr(model, "init_continuous_batching") and hasattr(model, "generate_batch")


def run_continuous(
    model: Any,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    max_batch_tokens: int,
    max_requests: int,
    page_size: int,
    timeout_s: float,
) -> tuple[float, float]:
    """(wall, process CPU) seconds for every request through transformers' continuous-batching manager
    (which runs on its own thread)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    longest = max(len(p) + o for p, o in zip(prompts, output_lens, strict=True))
    num_blocks = len(prompts) * -(-longest // page_size) + 1
    gen_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=_PAD, max_new_tokens=max(output_lens)
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )
    deadline = time.monotonic() + timeout_s
    t0, c0 = time.perf_counter(), time.process_time()
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        warmup=False,
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=o, eos_token_id=-1)
            for p, o in zip(prompts, output_lens, strict=True)
        ]
        done: dict[str, int] = {}
        while len(done) < len(ids):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"transformers continuous batching: {len(done)}/{len(ids)} in {timeout_s} s"
                )
            result = manager.get_result(timeout=min(remaining, 5.0))
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers continuous batching: {result.error}")
                done[result.request_id] = len(result.generated_tokens)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    produced = sum(done.values())
    if produced != sum(output_lens):
        raise RuntimeError(
            f"transformers continuous batching made {produced} tokens, {sum(output_lens)} asked"
        )
    return elapsed, cpu
