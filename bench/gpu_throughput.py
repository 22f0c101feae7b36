"""Offline throughput of the paged-KV engine against the device's physical floor.

    python bench/gpu_throughput.py --model bench/configs/gemma-2-2b          # the issue's H100 workload
    python bench/gpu_throughput.py --all                                     # Gemma-2-2B, Qwen3-0.6B, Llama-3-8B
    python bench/gpu_throughput.py --no-async-scheduling                     # host and GPU in turn (async: the CUDA default)
    python bench/gpu_throughput.py --device cpu --tiny                       # CPU smoke run (numbers meaningless)

Workload: ``--num-requests`` requests, prompt lengths uniform in [32, 512], new tokens uniform in [128, 512],
token ids drawn with ``--seed``, EOS ignored, greedy, random weights (``load_format="dummy"``), at most
``--max-num-seqs`` running, a KV pool of ``--num-kv-tokens // block_size`` blocks.

Per step it reports, by step kind (decode-only / other): the wall time, the host time (wall minus the
time the host was blocked waiting for the step's tokens), the device time (CUDA events around the step's
forward, logits and sampling) and the kernels launched (torch profiler over ``--profile-steps`` steps
before the timed run: device kernels and host launch calls on CUDA; the CPU proxy of
``bench/kernel_count.py`` on CPU). It also reports how many Triton variants compiled during the timed
run (the runner's warm-up should leave none to compile).

``--tiny``: Gemma-2 architecture at toy sizes, a dozen short requests: the whole script in seconds on a
CPU (``tests/deploy/test_bench_smoke.py`` runs it), so it cannot rot before the first GPU run.

Both ceilings are measured in the same run: bf16 matmul TFLOP/s (a large ``torch.matmul``) and device copy
bandwidth (a large tensor copy; read + write bytes). The floor of a step is
``max(FLOPs / matmul rate, (weight bytes + KV bytes read and written) / bandwidth)``; the report gives the
run's time over the sum of the step floors. Logits traffic and sliding windows are left out of the floor
(so it stays a lower bound).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# NOTE: before anything imports triton: on CPU the Triton kernels can only run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_count import count_kernels
from cluster.protocol import SamplingParams
from workers.attention.kernel_probe import count_compiled_variants
from workers.engine import Engine
from workers.llm import LLM
from workers.model_runner import MaskSource, ModelRunner, PendingStep
from workers.models.arch import ArchConfig
from workers.scheduler import SchedulerOutput

ALL_MODELS = ("bench/configs/gemma-2-2b", "bench/configs/qwen3-0.6b", "bench/configs/llama-3-8b")
TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 512, "num_hidden_layers": 2, "sliding_window": 32}  # fmt: skip
TINY_WORKLOAD = {"num_requests": 12, "max_num_seqs": 4, "num_kv_tokens": 4096, "max_num_batched_tokens": 64,
                 "min_prompt": 8, "max_prompt": 40, "min_new": 4, "max_new": 16, "profile_steps": 4}  # fmt: skip


def seconds_per_call(fn: Any, device: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / seconds_per_call(lambda: torch.matmul(a, b), device, 20 if device.type == "cuda" else 3)


def copy_bytes_per_s(device: torch.device) -> float:
    """Read + write bytes per second of a large device-to-device copy."""
    numel = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(numel, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * numel / seconds_per_call(lambda: dst.copy_(src), device, 20 if device.type == "cuda" else 3)


@dataclass
class ModelCost:
    """Per-token FLOPs / bytes of one architecture in the engine's dtype."""

    linear_flops_per_token: float  # 2 x every decoder-layer matmul weight
    head_flops_per_row: float  # 2 x lm_head, per sampled row
    attn_flops_per_key: float  # q.k and p.v over all layers, per (query token, visible key)
    weight_bytes: float  # decoder-layer matmul weights + lm_head, read once per step
    kv_bytes_per_token: float

    @classmethod
    def of(cls, arch: ArchConfig, elem: int) -> ModelCost:
        h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
        layer_params = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
        num_layers = arch.num_hidden_layers
        head_params = arch.vocab_size * h
        return cls(
            linear_flops_per_token=2.0 * num_layers * layer_params,
            head_flops_per_row=2.0 * head_params,
            attn_flops_per_key=4.0 * num_layers * arch.num_attention_heads * arch.head_dim,
            weight_bytes=float((num_layers * layer_params + head_params) * elem),
            kv_bytes_per_token=float(2 * num_layers * kv * elem),
        )

    def floor_s(self, out: SchedulerOutput, flops_per_s: float, bytes_per_s: float) -> float:
        num_tokens = keys = kv_read = num_rows = 0
        for s in out.scheduled:
            n, ctx = len(s.token_ids), s.start_position
            num_tokens += n
            keys += n * ctx + n * (n + 1) // 2
            kv_read += ctx + n
            num_rows += s.needs_sample
        flops = (
            num_tokens * self.linear_flops_per_token
            + num_rows * self.head_flops_per_row
            + keys * self.attn_flops_per_key
        )
        bytes_moved = self.weight_bytes + (kv_read + num_tokens) * self.kv_bytes_per_token
        return max(flops / flops_per_s, bytes_moved / bytes_per_s)


def make_workload(args: argparse.Namespace, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_requests)
    new_tokens = rng.integers(args.min_new, args.max_new + 1, args.num_requests)
    return [
        (rng.integers(0, vocab_size, int(n)).tolist(), int(m))
        for n, m in zip(prompt_lens, new_tokens, strict=True)
    ]


@dataclass
class StepLog:
    """What the instrumented runner saw per launched step (in launch order)."""

    floors: list[float] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)
    is_graphed: list[bool] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # seconds the host blocked on the step's tokens


def instrument(
    runner: ModelRunner, log: StepLog, cost: ModelCost, flops_per_s: float, bytes_per_s: float
) -> Any:
    """Wraps ``runner.launch`` to log every step; returns the original to restore."""
    launch = runner.launch

    def logged(out: SchedulerOutput, mask_for: MaskSource | None = None) -> PendingStep:
        log.floors.append(cost.floor_s(out, flops_per_s, bytes_per_s))
        is_decode = all(len(s.token_ids) == 1 for s in out.scheduled)
        log.is_decode.append(is_decode)
        log.is_graphed.append(
            runner.graphs is not None and is_decode and len(out.scheduled) <= max(runner.graph_sizes)
        )
        pending = launch(out, mask_for)
        result = pending.result

        def timed_result() -> Any:
            t0 = time.perf_counter()
            tokens = result()
            log.waits.append(time.perf_counter() - t0)
            return tokens

        pending.result = timed_result  # type: ignore[method-assign]
        return pending

    runner.launch = logged  # type: ignore[method-assign]
    return launch


def count_step_kernels(engine: Engine, log: StepLog, num_steps: int) -> dict[bool, list[tuple[int, int]]]:
    """Profiles ``num_steps`` engine steps one by one: (kernels, launch calls) per step, by decode-only."""
    counts: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for _ in range(num_steps):
        if not engine.has_unfinished():
            break
        before = len(log.is_decode)
        _, count = count_kernels(engine.step, engine.runner.device)
        if len(log.is_decode) > before:
            counts[log.is_decode[-1]].append((count.total, count.launch_calls))
    return counts


def tiny_model_dir(work_dir: Path) -> str:
    config = json.loads(
        (Path(__file__).resolve().parent / "configs" / "gemma-2-2b" / "config.json").read_text()
    )
    config.update(TINY_SIZES)
    (work_dir / "config.json").write_text(json.dumps(config))
    return str(work_dir)


def print_host_profile(profiler: cProfile.Profile, num_calls: int, top: int = 25) -> None:
    """Where the host's time goes per ``engine.step()`` call (cProfile's own overhead included): the
    functions with the most time of their own, so a call that waits for the device stands out."""
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    print(
        f"--- host profile over {num_calls} engine.step() calls (tottime; divide by the calls for per step)"
    )
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-6000:])


def run_model(args: argparse.Namespace, model: str, flops_per_s: float, bytes_per_s: float) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    backend = args.attention_backend or ("triton" if device.type == "cuda" else "torch")
    dtype = args.dtype if device.type == "cuda" else "float32"
    t_load = time.perf_counter()
    llm = LLM(
        model,
        load_format=args.load_format,
        dtype=dtype,
        device=device.type,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_tokens // args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_prompt + args.max_new,
        attention_backend=backend,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
        async_scheduling=args.async_scheduling,
    )
    engine: Engine = llm.engine
    runner = engine.runner
    load_s = time.perf_counter() - t_load
    cost = ModelCost.of(engine.arch, torch.empty((), dtype=runner.dtype).element_size())

    # Warm-up (the runner compiled its Triton variants at start-up), then a kernel count of a few steps.
    warm = make_workload(args, engine.vocab_size, args.seed + 1)[: min(32, args.num_requests)]
    llm.generate([p for p, _ in warm], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    log = StepLog()
    launch = instrument(runner, log, cost, flops_per_s, bytes_per_s)
    greedy = SamplingParams(max_tokens=args.max_new, temperature=0.0, ignore_eos=True)
    for i, (prompt, _) in enumerate(warm[: args.max_num_seqs]):
        engine.add_request(f"count-{i}", prompt, greedy)
    kernel_counts = count_step_kernels(engine, log, args.profile_steps)
    for i in range(len(warm[: args.max_num_seqs])):
        engine.abort(f"count-{i}")
    while engine.has_unfinished():
        engine.step()
    log = StepLog()
    runner.launch = launch  # type: ignore[method-assign]
    launch = instrument(runner, log, cost, flops_per_s, bytes_per_s)

    variants_before = count_compiled_variants() if backend == "triton" else 0
    runner.forward_events = [] if device.type == "cuda" else None
    workload = make_workload(args, engine.vocab_size, args.seed)
    for i, (prompt, max_tokens) in enumerate(workload):
        engine.add_request(
            f"bench-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
    stats0 = engine.stats()
    step_walls: list[float] = []
    num_out = 0
    profiler = cProfile.Profile() if args.cprofile else None
    t_start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        num_out += len(engine.step())
        step_walls.append(time.perf_counter() - t0)
    total_s = time.perf_counter() - t_start
    if profiler is not None:
        profiler.disable()
        print_host_profile(profiler, len(step_walls))
    stats = engine.stats()
    runner.launch = launch  # type: ignore[method-assign]
    new_variants = (count_compiled_variants() - variants_before) if backend == "triton" else 0

    # NOTE: async: call k launches step k and waits for step k-1, so step k's wait is in call k+1.
    num_steps = len(log.is_decode)
    walls = np.array(step_walls[-num_steps:] if runner.is_async else step_walls[:num_steps])
    waits = np.array(log.waits)
    if runner.forward_events is not None:
        torch.cuda.synchronize(device)
        device_s = np.array([a.elapsed_time(b) / 1e3 for a, b in runner.forward_events])
        device_label = "device (CUDA events: forward + logits + sampling)"
    else:
        device_s = np.zeros(num_steps)
        device_label = "device (not measured on CPU)"
    runner.forward_events = None
    decode = np.array(log.is_decode)
    floor = np.array(log.floors)
    num_prompt = sum(len(p) for p, _ in workload)

    print(f"\n=== {model}  ({engine.arch.architecture}, {runner.dtype}, {device}, backend {backend}, "
          f"async scheduling {'on' if runner.is_async else 'off'}) ===")  # fmt: skip
    if device.type == "cpu":
        print(
            "NOTE: CPU run: a smoke test of the script; the numbers below say nothing about GPU throughput."
        )
    graphs = (
        f"{len(runner.graph_sizes)} sizes up to {max(runner.graph_sizes)}" if runner.graph_sizes else "off"
    )
    print(f"load + KV alloc + warm-up + graph capture: {load_s:.1f} s; KV blocks {runner.num_blocks}; "
          f"CUDA graphs {graphs}")  # fmt: skip
    print(f"requests {len(workload)}; prompt tokens {num_prompt}; output tokens {num_out}; "
          f"steps {num_steps} ({int(decode.sum())} decode-only, {sum(log.is_graphed)} on CUDA graphs); "
          f"preemptions {stats.num_preemptions - stats0.num_preemptions}")  # fmt: skip
    print(f"output tokens/s {num_out / total_s:,.0f}   total tokens/s {(num_out + num_prompt) / total_s:,.0f}   "
          f"wall {total_s:.2f} s")  # fmt: skip
    print(f"Triton variants compiled during the timed run: {new_variants}")
    for label, mask in (
        ("all steps", np.ones_like(decode)),
        ("decode-only steps", decode),
        ("other steps", ~decode),
    ):
        if mask.any():
            w, b, d = walls[mask].mean() * 1e3, waits[mask].mean() * 1e3, device_s[mask].mean() * 1e3
            print(f"  {label:18s} wall {w:7.3f} ms: host {w - b:7.3f} ms + blocked on device {b:7.3f} ms; "
                  f"{device_label} {d:7.3f} ms")  # fmt: skip
    for is_decode, label in ((True, "decode-only"), (False, "other")):
        rows = kernel_counts[is_decode]
        if rows:
            kernels, calls = np.array(rows).mean(axis=0)
            print(f"  kernels per {label} step: {kernels:.0f} ({calls:.0f} host launch calls; "
                  f"{len(rows)} steps profiled)")  # fmt: skip
    host = {
        k: getattr(stats, k) - getattr(stats0, k)
        for k in ("schedule_time_s", "prepare_time_s", "detokenize_time_s")
    }
    print("  host per step: " + ", ".join(f"{k[:-7]} {v / num_steps * 1e3:.3f} ms" for k, v in host.items()))
    print(
        f"ceilings: matmul {flops_per_s / 1e12:.1f} TFLOP/s, copy {bytes_per_s / 1e9:.0f} GB/s (read+write)"
    )
    print(f"floor: {floor.sum():.2f} s (decode-only steps {floor[decode].sum():.2f} s); "
          f"achieved / floor = {walls.sum() / floor.sum():.2f}x "
          f"(decode-only {walls[decode].sum() / max(floor[decode].sum(), 1e-12):.2f}x)")  # fmt: skip
    engine.check_no_leaks()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=ALL_MODELS[0], help="checkpoint dir (config.json is enough with dummy)"
    )
    parser.add_argument("--all", action="store_true", help="run Gemma-2-2B, Qwen3-0.6B and Llama-3-8B shapes")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-kv-tokens", type=int, default=140000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-new", type=int, default=128)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", help="CUDA only; the CPU run uses float32")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--attention-backend", default=None, choices=("torch", "triton"))
    parser.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="prepare step N+1 while step N runs (default: on for CUDA, off on CPU)")  # fmt: skip
    parser.add_argument("--profile-steps", type=int, default=16, help="steps profiled for kernel counts")
    parser.add_argument(
        "--cprofile", action="store_true", help="profile the host over the timed run (slower)"
    )
    parser.add_argument("--tiny", action="store_true", help="toy Gemma-2 sizes and workload (smoke run)")
    args = parser.parse_args()
    if args.tiny:
        for key, value in TINY_WORKLOAD.items():
            setattr(args, key, value)

    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flops_per_s, bytes_per_s = matmul_flops_per_s(device, dtype), copy_bytes_per_s(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        models = [tiny_model_dir(Path(tmp))] if args.tiny else ALL_MODELS if args.all else [args.model]
        for model in models:
            run_model(args, model, flops_per_s, bytes_per_s)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
