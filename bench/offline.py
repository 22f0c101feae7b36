"""Offline throughput: pdserve's engine vs transformers `generate` on the same requests, same run.

    pdserve bench offline [--num-requests 128] [--prompt-len 16 128] [--output-len 16 128] [--seed 0]

Requests: prompt and output lengths drawn uniformly from the ranges with the seed, random token ids,
EOS ignored (every request produces exactly its output length). transformers runs static batches of
`--hf-batch-size` (left-padded, each batch runs to its longest request; only requested tokens count).
Also prints the engine's host overhead per step (scheduling + input preparation, forward excluded) with
64 and 256 requests running.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from cluster.protocol import SamplingParams
from workers.engine import BUNDLED_MODEL
from workers.llm import LLM


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, prompt_len: Sequence[int], output_len: Sequence[int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


def run_pdserve(llm: LLM, w: Workload) -> float:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in w.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    assert sum(len(o.token_ids) for o in outs) == w.num_output_tokens
    return elapsed


def run_transformers(model_dir: str, w: Workload, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = 0
    t0 = time.perf_counter()
    for start in tqdm(range(0, len(w.prompts), batch_size), desc="transformers"):
        batch = w.prompts[start : start + batch_size]
        longest = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
        new = max(w.output_lens[start : start + batch_size])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad,
                eos_token_id=None,
            )
    return time.perf_counter() - t0


def host_overhead_ms(
    model_dir: str, num_running: int, num_steps: int, seed: int
) -> tuple[float, float, float]:
    """Median per-step host times in ms with `num_running` decoding: schedule+update, input prep, and
    (reported apart: not scheduling) detokenization."""
    llm = LLM(model_dir, max_num_seqs=num_running, max_num_batched_tokens=max(2048, num_running * 16))
    engine = llm.engine
    w = make_workload(num_running, (16, 16), (num_steps + 8, num_steps + 8), engine.vocab_size, seed)
    for i, p in enumerate(w.prompts):
        engine.add_request(
            f"h{i}", p, SamplingParams(max_tokens=w.output_lens[i], temperature=0.0, ignore_eos=True)
        )
    engine.step()  # all prefills in one step
    sched, prep, detok = [], [], []
    for _ in range(num_steps):
        before = engine.stats()
        engine.step()
        after = engine.stats()
        sched.append(after.schedule_time_s - before.schedule_time_s)
        prep.append(after.prepare_time_s - before.prepare_time_s)
        detok.append(after.detokenize_time_s - before.detokenize_time_s)
    for i in range(num_running):
        engine.abort(f"h{i}")
    return statistics.median(sched) * 1e3, statistics.median(prep) * 1e3, statistics.median(detok) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=BUNDLED_MODEL)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--overhead-steps", type=int, default=20)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs)
    w = make_workload(args.num_requests, args.prompt_len, args.output_len, llm.engine.vocab_size, args.seed)
    print(
        f"workload: {args.num_requests} requests, prompt {args.prompt_len}, output {args.output_len}, "
        f"seed {args.seed}; {w.num_output_tokens} output tokens; torch threads {torch.get_num_threads()}"
    )
    t_pd = run_pdserve(llm, w)
    st = llm.stats()
    print(
        f"pdserve      : {w.num_output_tokens / t_pd:9.1f} output tok/s ({t_pd:.2f} s, {st.num_steps} steps, "
        f"{st.num_mixed_steps} mixed, {st.num_preemptions} preemptions)"
    )
    if not args.skip_hf:
        t_hf = run_transformers(args.model, w, args.hf_batch_size)
        print(
            f"transformers : {w.num_output_tokens / t_hf:9.1f} output tok/s ({t_hf:.2f} s, static batches "
            f"of {args.hf_batch_size})"
        )
        print(f"ratio        : {t_hf / t_pd:.2f}x")
    for n in (64, 256):
        sched_ms, prep_ms, detok_ms = host_overhead_ms(args.model, n, args.overhead_steps, args.seed)
        print(
            f"host overhead, {n:3d} running: {sched_ms + prep_ms:.3f} ms/step median "
            f"(schedule+update {sched_ms:.3f}, input prep {prep_ms:.3f}); detokenize {detok_ms:.3f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
