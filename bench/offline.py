"""Offline throughput: pdserve's engine vs transformers' strongest configuration, same requests, same run.

    pdserve bench offline [--num-requests 128] [--prompt-len 16 128] [--output-len 16 128] [--seed 0]
                          [--repeats 3] [--threads N] [--variant NAME:key=value,...] [--load-format dummy]
    pdserve bench offline --model bench/configs/llama-3-8b --load-format mock --gpu h100   # mock engine
    pdserve bench offline --repeats 0 --skip-hf --no-roofline --overhead-running 256 --overhead-steps 100 \
        --overhead-forward model null --variant sync:async_scheduling=false \
        --variant async:async_scheduling=true                 # host per decode step only, both schedulers

Requests: prompt and output lengths drawn uniformly from the ranges with the seed, random token ids,
EOS ignored (every request produces exactly its output length). Printed, all measured in this process:

* the CPU roofline: model FLOPs of the workload (``bench/roofline.py``) and the fp32 matmul rate at
  2048^3 and at the model's own weight shapes;
* pdserve: each ``--variant`` (LLM options, and SamplingParams fields such as ``repetition_penalty``;
  default: one variant with the defaults; ``--penalties``: each also with the three penalties on)
  ``--repeats`` times, variants interleaved round-robin so load drifts hit them alike; a fresh LLM per
  run (no prefix-cache hits from an earlier run), warmed up with a few other requests; median output
  tok/s and % of roofline; each run's minor page faults (the process's; see workers/host_memory.py);
* transformers (``bench/hf_peer.py``): static ``generate`` batches of every ``--hf-batch-sizes``, in
  arrival order and sorted by output length, then the best of them ``--repeats`` times in all (median);
  its continuous-batching manager when the installed version has one. It runs in this process after
  pdserve's runs, so it has the allocator policy a CPU engine sets (freed memory kept for reuse) too;
* host overhead per decode step with 64 and 256 requests running (see ``host_overhead``), with the
  model's forward in place and, with ``--overhead-forward null``, with it replaced by ``NullModel``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import random
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from bench import hf_peer
from bench.roofline import ModelFlops, measure_rates, workload_flops
from cluster.protocol import SamplingParams
from deploy.mock_profile import GPU_NAMES, write_gpu_profile
from workers.engine import BUNDLED_MODEL
from workers.llm import LLM
from workers.models.arch import ArchConfig


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def params(self, **sampling: Any) -> list[SamplingParams]:
        """Greedy, EOS ignored; ``sampling``: more SamplingParams fields (a variant's, e.g. penalties)."""
        return [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, **sampling)
            for m in self.output_lens
        ]


def make_workload(
    n: int, prompt_len: Sequence[int], output_len: Sequence[int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


@dataclass
class Variant:
    name: str
    options: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields of every request
    seconds: list[float] = field(default_factory=list)  # wall
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time, every thread
    minor_faults: list[int] = field(default_factory=list)  # this process's page faults, every thread
    steps: int = 0


def parse_variant(text: str) -> Variant:
    """``NAME:key=value,key=value`` (values as ``parse_value`` reads them). A key that names a
    SamplingParams field (``repetition_penalty``, ``presence_penalty``, ...) sets it on every request;
    any other is an LLM option."""
    name, _, rest = text.partition(":")
    options: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        key = key.strip()
        target = sampling if key in _SAMPLING_FIELDS else options
        target[key] = parse_value(raw)
    return Variant(name, options, sampling)


def parse_value(raw: str) -> Any:
    """A ``--variant`` value as a YAML config would give it (``true`` / ``false``, ``null`` / ``~``,
    ints, floats; a bare word is a string), so the config's type check sees a bool where a YAML file
    would have one. Python's spellings (``True``, ``None``, ``1e-3``, which YAML 1.1 reads as a string)
    are taken too."""
    text = raw.strip()
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if isinstance(value, str):
        with contextlib.suppress(ValueError, SyntaxError):
            value = ast.literal_eval(text)
    return value


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# NOTE: ``--penalties``: all three on, at values an API client would send
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}


def run_pdserve(
    model: str, options: dict[str, Any], w: Workload, seed: int, sampling: dict[str, Any] | None = None
) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, engine steps, minor page faults) of one generate() over the
    workload (its requests with the ``sampling`` fields) on a fresh, warmed-up LLM."""
    llm = LLM(model, **options)
    warm = make_workload(4, (8, 16), (4, 8), llm.engine.vocab_size, seed + 1000)
    llm.generate(warm.prompts, warm.params())
    steps_before = llm.stats().num_steps
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(w.prompts, w.params(**(sampling or {})))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    produced = sum(len(o.token_ids) for o in outs)
    if produced != w.num_output_tokens:
        raise RuntimeError(f"pdserve made {produced} tokens, {w.num_output_tokens} asked")
    steps = llm.stats().num_steps - steps_before
    llm.check_no_leaks()
    close = getattr(llm, "close", None)
    if close is not None:
        close()
    del llm
    gc.collect()
    return elapsed, cpu, steps, faults


class NullModel(torch.nn.Module):
    """Stands in for the model when host overhead is measured apart from the forward
    (``--overhead-forward null``): the hidden states and logits are constant zeros, so every row samples
    token 0 (the workload ignores EOS) and the step's host code runs exactly as with the model.

    Why: on this CPU box the forward streams the weights and the KV cache through the caches, so the host
    code after it runs on cold caches (about 2x slower than the same code warm). On a GPU host the
    forward runs on the device and leaves the CPU caches alone; this is that host's figure, less the
    forward's own launch cost."""

    def __init__(self, hidden_size: int, vocab_size: int, max_rows: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(max_rows, hidden_size)
        self.logits = torch.zeros(max_rows, vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor, raw: bool = False, fused: bool = False) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]

    def argmax_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every row's argmax of the zero logits: token 0 (a fresh tensor: the runner may keep it)."""
        return torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)


def host_overhead(
    model: str,
    options: dict[str, Any],
    num_running: int,
    num_steps: int,
    seed: int,
    null_forward: bool = False,
    sampling: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Per decode-only step with ``num_running`` requests running, on the step thread, in ms:

    * ``host`` / ``host_cpu``: the wall / thread CPU time of ``Engine.step()`` minus that of the
      runner's forward, logits and sampling (``forward_time_total_s`` / ``forward_cpu_total_s``). What
      is left: scheduling, input preparation (numpy arrays, tensors, attention metadata), turning the
      sampled tokens into request updates, stop checks and each request's output (``TokenDelta``
      objects where detokenization runs on the step thread; with a stage, ``Engine.step_output()``, as
      a worker's step thread runs it: the stage builds the deltas), the engine's bookkeeping, and
      detokenization where it runs on the step thread. Medians, and the CPU minimum;
    * ``forward``: the runner's forward, logits and sampling (logits processors included), wall median;
    * ``schedule+update``, ``prepare``, ``detokenize``: the engine's own split (EngineStats);
    * ``stage``: with detokenization off the step thread, a ``DetokenizerStage`` thread is fed each
      step's output as a worker and the offline LLM do: its CPU time per step, building the deltas and
      their text (on its own thread, not in ``host``).
    """
    opts = {**options, "max_num_seqs": num_running, "max_num_batched_tokens": max(2048, num_running * 16)}
    llm = LLM(model, **opts)
    engine = llm.engine
    runner = engine.runner
    w = make_workload(num_running, (16, 16), (num_steps + 8, num_steps + 8), engine.vocab_size, seed)
    stage = None
    if not getattr(engine, "detokenize", True) and engine.tokenizer is not None:
        from workers.detokenizer import DetokenizerStage

        stage = DetokenizerStage(engine.tokenizer, lambda deltas: None, name="bench-detokenizer")
    params = w.params(**(sampling or {}))
    for i, p in enumerate(w.prompts):
        engine.add_request(f"h{i}", p, params[i])
        if stage is not None:
            stage.add_request(f"h{i}", p, params[i])
    for _ in range(2):  # every prefill in one step, then one decode step
        deltas = engine.step()
        if stage is not None:
            stage.submit(deltas)
    if stage is not None:
        stage.flush(60.0)
    if null_forward:
        runner.model = NullModel(engine.arch.hidden_size, engine.vocab_size, opts["max_num_batched_tokens"])
    stage_before = stage.busy_time_s if stage is not None else 0.0
    split: dict[str, list[float]] = {
        k: [] for k in ("host", "host_cpu", "forward", "schedule+update", "prepare", "detokenize")
    }
    for _ in range(num_steps):
        before = engine.stats()
        fwd, fwd_cpu = (
            getattr(runner, "forward_time_total_s", 0.0),
            getattr(runner, "forward_cpu_total_s", 0.0),
        )
        t0, c0 = time.perf_counter(), time.thread_time()
        if stage is not None:  # NOTE: as a worker's step thread: the stage builds the deltas
            output = engine.step_output()
        else:
            engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if stage is not None:
            stage.submit(output)
        after = engine.stats()
        if hasattr(runner, "forward_time_total_s"):
            split["host"].append(wall - (runner.forward_time_total_s - fwd))
            split["forward"].append(runner.forward_time_total_s - fwd)
            split["host_cpu"].append(cpu - (runner.forward_cpu_total_s - fwd_cpu))
        else:  # an engine without the runner's counters: its forward_time_s includes more than forward
            split["host"].append(wall - (after.forward_time_s - before.forward_time_s))
        split["schedule+update"].append(after.schedule_time_s - before.schedule_time_s)
        split["prepare"].append(after.prepare_time_s - before.prepare_time_s)
        split["detokenize"].append(after.detokenize_time_s - before.detokenize_time_s)
    result = {k: statistics.median(v) * 1e3 for k, v in split.items() if v}
    if split["host_cpu"]:
        result["host_cpu_min"] = min(split["host_cpu"]) * 1e3
    if stage is not None:
        stage.flush(60.0)
        result["stage"] = (stage.busy_time_s - stage_before) / num_steps * 1e3
        stage.close(60.0)
    for i in range(num_running):
        engine.abort(f"h{i}")
    return result


def _pct(flops: ModelFlops, seconds: float, gflops: float) -> float:
    return 100.0 * flops.total / seconds / (gflops * 1e9)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=BUNDLED_MODEL)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy", "mock"])
    ap.add_argument("--cost-profile", default="", help="--load-format mock: the profile its steps wait by")
    ap.add_argument("--gpu", default=None, choices=GPU_NAMES, help="--load-format mock: this GPU's estimate")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...")
    ap.add_argument(
        "--penalties",
        action="store_true",
        help=f"also run each variant with {PENALTIES} on every request (the cost of the penalties)",
    )
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-hf-cb", action="store_true")
    ap.add_argument("--hf-cb-timeout", type=float, default=900.0)
    ap.add_argument("--overhead-running", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--overhead-steps", type=int, default=20)
    ap.add_argument(
        "--overhead-forward",
        choices=["model", "null"],
        nargs="+",
        default=["model"],
        help="host overhead with the model's forward, and/or with a constant one (see NullModel)",
    )
    ap.add_argument("--no-roofline", action="store_true", help="skip the matmul-rate measurement")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dummy, mock = args.load_format == "dummy", args.load_format == "mock"
    variants = [parse_variant(v) for v in args.variant] or [Variant("pdserve", {})]
    if args.penalties:  # NOTE: interleaved with the variants they copy, so load drifts hit both alike
        variants += [
            Variant(f"{v.name}+penalties", dict(v.options), {**v.sampling, **PENALTIES}) for v in variants
        ]
    mock_profile = str(write_gpu_profile(args.gpu, args.model)) if args.gpu else args.cost_profile
    for v in variants:
        if dummy:
            v.options.setdefault("load_format", "dummy")
        if mock:
            v.options.setdefault("load_format", "mock")
            v.options.setdefault("mock_cost_profile", mock_profile)
    if mock:  # NOTE: no weights: no transformers peer; this CPU's matmul rate says nothing of a mock
        args.skip_hf = args.no_roofline = True
    arch = ArchConfig.from_pretrained(args.model)
    w = make_workload(args.num_requests, args.prompt_len, args.output_len, arch.vocab_size, args.seed)
    flops = workload_flops(arch, [len(p) for p in w.prompts], w.output_lens)
    print(
        f"model {args.model} ({arch.architecture}, {'random' if dummy else 'no' if mock else 'checkpoint'} "
        f"weights{f'; mock steps wait {mock_profile or 0}' if mock else ''}); "
        f"torch threads {torch.get_num_threads()}, load average at start {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"workload: {args.num_requests} requests, prompt {tuple(args.prompt_len)}, output "
        f"{tuple(args.output_len)}, seed {args.seed}: {w.num_prompt_tokens} prompt + {w.num_output_tokens} "
        f"output tokens; model math {flops.total / 1e9:.1f} GFLOP (layers {flops.layers / 1e9:.1f}, "
        f"attention {flops.attention / 1e9:.1f}, logits {flops.logits / 1e9:.1f})"
    )
    rates = [] if args.no_roofline else measure_rates(arch)
    for r in rates:
        print(f"fp32 matmul, {r.label:26s}: {r.best_gflops:7.1f} GFLOP/s best, {r.median_gflops:7.1f} median")
    roof = max((r.best_gflops for r in rates), default=float("nan"))
    print(f"roofline: {roof:.1f} GFLOP/s (the best of the above)")

    n_out = w.num_output_tokens
    for _ in range(args.repeats):
        for v in variants:
            seconds, cpu, v.steps, faults = run_pdserve(args.model, v.options, w, args.seed, v.sampling)
            v.seconds.append(seconds)
            v.cpu_seconds.append(cpu)
            v.minor_faults.append(faults)
            print(
                f"  run {v.name:16s}: {n_out / seconds:9.1f} output tok/s ({seconds:.2f} s, CPU {cpu:.2f} s, "
                f"{faults} minor page faults)",
                flush=True,
            )
    results: dict[str, Any] = {"roofline_gflops": roof, "variants": {}}
    print(
        "output tok/s per wall second (median and each run) and per CPU second (median); % of the roofline "
        "from the wall-time median"
    )
    for v in variants if args.repeats else []:
        runs = [n_out / s for s in v.seconds]
        results["variants"][v.name] = {
            "options": v.options,
            "sampling": v.sampling,
            "tok_s": runs,
            "cpu_tok_s": [n_out / s for s in v.cpu_seconds],
            "minor_faults": v.minor_faults,
        }
        print(
            f"pdserve {v.name:20s}: {statistics.median(runs):8.1f} [{' '.join(f'{r:.0f}' for r in runs)}]  "
            f"CPU {n_out / statistics.median(v.cpu_seconds):8.1f}  "
            f"{_pct(flops, statistics.median(v.seconds), roof):5.1f}% of roofline  ({v.steps} steps; {v.options}"
            f"{f'; sampling {v.sampling}' if v.sampling else ''})"
        )
    if args.repeats and not args.skip_hf:
        best_pd = min(statistics.median(v.seconds) for v in variants)
        best_pd_cpu = min(statistics.median(v.cpu_seconds) for v in variants)
        model = hf_peer.load_model(args.model, dummy)
        hf_peer.run_static(model, w.prompts[:4], [4] * 4, 4, "arrival")  # warm-up
        sweep = hf_peer.sweep_static(model, w.prompts, w.output_lens, args.hf_batch_sizes)
        for run in sweep:
            print(
                f"transformers static b{run.batch_size:<4d} {run.order:8s}: {n_out / run.seconds:8.1f} output "
                f"tok/s ({run.seconds:.2f} s), CPU {n_out / run.cpu_seconds:8.1f}"
            )
        best = min(sweep, key=lambda r: r.seconds)
        reruns = [
            hf_peer.run_static(model, w.prompts, w.output_lens, best.batch_size, best.order)
            for _ in range(args.repeats - 1)
        ]
        best_s = [best.seconds] + [r[0] for r in reruns]
        best_cpu = [best.cpu_seconds] + [r[1] for r in reruns]
        hf_s, hf_cpu = statistics.median(best_s), statistics.median(best_cpu)
        print(
            f"transformers best (static b{best.batch_size} {best.order}): {n_out / hf_s:8.1f} "
            f"[{' '.join(f'{n_out / s:.0f}' for s in best_s)}]  CPU {n_out / hf_cpu:8.1f}  "
            f"{_pct(flops, hf_s, roof):5.1f}% of roofline"
        )
        results["transformers_static"] = {f"b{r.batch_size}-{r.order}": n_out / r.seconds for r in sweep}
        results["transformers_best"] = {
            "tok_s": [n_out / s for s in best_s],
            "cpu_tok_s": [n_out / s for s in best_cpu],
        }
        for v in variants:
            print(
                f"ratio pdserve {v.name} / transformers best: {hf_s / statistics.median(v.seconds):.2f}x wall, "
                f"{hf_cpu / statistics.median(v.cpu_seconds):.2f}x CPU"
            )
        if not args.skip_hf_cb and hf_peer.has_continuous_batching(model):
            cb_s, cb_cpu = hf_peer.run_continuous(
                model, w.prompts, w.output_lens, 2048, min(256, len(w.prompts)), 16, args.hf_cb_timeout
            )
            results["transformers_cb"] = {"tok_s": n_out / cb_s, "cpu_tok_s": n_out / cb_cpu}
            print(
                f"transformers continuous batching (page 16, 2048 tokens/batch): {n_out / cb_s:8.1f} output "
                f"tok/s ({cb_s:.2f} s), CPU {n_out / cb_cpu:8.1f}; pdserve best / it: {cb_s / best_pd:.2f}x wall, "
                f"{cb_cpu / best_pd_cpu:.2f}x CPU"
            )
        elif not args.skip_hf_cb:
            print("transformers continuous batching: not in the installed transformers")
        del model
        gc.collect()

    for v, n, fwd in itertools.product(variants, args.overhead_running, args.overhead_forward):
        o = host_overhead(args.model, v.options, n, args.overhead_steps, args.seed, fwd == "null", v.sampling)
        key = f"host_ms_{n}" if fwd == "model" else f"host_ms_{n}_null_forward"
        results["variants"].setdefault(v.name, {})[key] = o
        cpu_note = (
            f"; thread CPU {o['host_cpu']:.3f} median, {o['host_cpu_min']:.3f} min" if "host_cpu" in o else ""
        )
        stage = f"; detokenizer thread {o['stage']:.3f} ms/step of its own CPU" if "stage" in o else ""
        if "forward" in o:
            stage += f"; forward, logits and sampling {o['forward']:.3f} ms/step wall median"
        print(
            f"host overhead {v.name}, {n:3d} running, {fwd} forward: {o['host']:.3f} ms/step wall median{cpu_note}, forward "
            f"excluded (engine split: schedule+update {o['schedule+update']:.3f}, input prep "
            f"{o['prepare']:.3f}, detokenize on the step thread {o['detokenize']:.3f}){stage}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
