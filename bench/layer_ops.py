"""Kernels per decoder layer, per step kind, for each attention backend (the torch profiler counts them).

    python bench/layer_ops.py                  # CPU: Triton under its interpreter; counts, not timings
    python bench/layer_ops.py --by-name        # also the per-operator breakdown of one layer

Each architecture of ``bench/configs`` keeps its features (soft-capping, sliding window, q/k norm, GeGLU)
at tiny sizes with random bf16 weights. One layer's count is ``(count with 3 layers - count with 1
layer) / 2``, so Gemma-2's alternating sliding/full layers are averaged and everything outside the
layers (embedding, final norm, logits, sampling, input upload) cancels; that rest is printed apart.
See ``kernel_count.py`` for what a CPU count means (a leaf operator that would launch a GPU kernel).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# NOTE: before anything imports triton: on CPU the Triton kernels can only run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import json
import tempfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_count import KernelCount, count_kernels
from cluster.config import EngineConfig, ModelConfig
from cluster.protocol import SamplingParams
from workers.model_runner import ModelRunner
from workers.scheduler import ScheduledRequest, SchedulerOutput

CONFIGS = Path(__file__).resolve().parent / "configs"
ARCHS = {"gemma-2-2b": "Gemma2", "llama-3-8b": "Llama", "qwen3-0.6b": "Qwen3"}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 1024}  # fmt: skip
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 16


def _steps() -> dict[str, SchedulerOutput]:
    """Three step kinds over consecutive blocks: 8 decodes (40-token contexts), 2 prompts of 32 tokens,
    and both together."""
    decodes, prompts, next_block = [], [], 1
    for i in range(8):
        decodes.append(ScheduledRequest(f"d{i}", [5], 40, [next_block, next_block + 1, next_block + 2],
                                        True, True, GREEDY, 1))  # fmt: skip
        next_block += 3
    for i in range(2):
        prompts.append(ScheduledRequest(f"p{i}", list(range(3, 35)), 0, [next_block, next_block + 1],
                                        True, False, GREEDY, 0))  # fmt: skip
        next_block += 2
    return {
        "decode (8 seqs)": SchedulerOutput(decodes, 8),
        "prefill (2 x 32)": SchedulerOutput(prompts, 64),
        "mixed (8 + 2 x 32)": SchedulerOutput(decodes + prompts, 72),
    }


def _runner(config_name: str, num_layers: int, backend: str, work_dir: Path) -> ModelRunner:
    config = json.loads((CONFIGS / config_name / "config.json").read_text())
    config.update(TINY, num_hidden_layers=num_layers)
    model_dir = work_dir / f"{config_name}-{num_layers}"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    engine_config = EngineConfig(
        model=ModelConfig(path=str(model_dir), dtype="bfloat16", max_model_len=256), device="cpu",
        block_size=BLOCK_SIZE, num_kv_blocks=64, attention_backend=backend, load_format="dummy",
    )  # fmt: skip
    return ModelRunner(engine_config, str(model_dir))


def _step_count(runner: ModelRunner, out: SchedulerOutput) -> KernelCount:
    runner.execute(out)  # once outside the profiler (first-call work is not a per-step cost)
    return count_kernels(lambda: runner.execute(out), runner.device)[1]


def main() -> None:
    # NOTE: oneDNN's bf16 matmuls use AMX where the CPU has it, and AMX faults (SIGILL) in VMs that do not
    # enable it; torch's own bf16 kernels run everywhere and decompose linear as a GPU does (one GEMM).
    torch.backends.mkldnn.enabled = False
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--by-name", action="store_true", help="per-operator breakdown of one layer")
    parser.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=("torch", "triton"))
    args = parser.parse_args()
    steps = _steps()
    print("kernels per decoder layer (bf16, torch profiler on CPU: leaf ops that launch a GPU kernel + "
          "Triton launches); 'rest' = the step outside the layers")  # fmt: skip
    print(f"{'model':12s} {'backend':8s} " + " ".join(f"{name:>24s}" for name in steps))
    with tempfile.TemporaryDirectory() as tmp:
        for config_name, label in ARCHS.items():
            for backend in args.backends:
                one, three = (_runner(config_name, n, backend, Path(tmp)) for n in (1, 3))
                cells, breakdowns = [], []
                for name, out in steps.items():
                    c1, c3 = _step_count(one, out), _step_count(three, out)
                    per_layer = (c3 - c1).total / 2
                    cells.append(f"{per_layer:7.1f} (rest {c1.total - per_layer:5.1f})")
                    breakdowns.append((name, c3 - c1))
                print(f"{label:12s} {backend:8s} " + " ".join(f"{c:>24s}" for c in cells))
                if args.by_name:
                    for name, diff in breakdowns:
                        ops = ", ".join(f"{op} {n / 2:g}" for op, n in sorted(diff.by_name.items()))
                        print(f"    {name}: {ops}")


if __name__ == "__main__":
    main()
