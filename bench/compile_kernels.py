"""Compile, for an H100 (sm_90), every Triton kernel variant the model runner's warm-up launches.

    python bench/compile_kernels.py                                   # Gemma-2-2B shapes, bf16
    python bench/compile_kernels.py --model bench/configs/qwen3-0.6b

No GPU needed: the runner is built on CPU (random bf16 weights, 2 layers so both Gemma-2 layer kinds
appear, a 512-token vocabulary) with ``TRITON_INTERPRET=0``; its warm-up runs with every Triton launch
intercepted and not executed (``kernel_probe.probe_launches(launch=False)``), and each distinct variant
is compiled with Triton's bundled ptxas. Prints per variant: compile time, registers, and local memory
(spills) from ``cuobjdump --dump-resource-usage``. The warm-up's variants are all a run can use (see
``tests/workers/test_triton_specialization.py``), so this is the compile work of a first GPU contact.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import argparse
import json
import re
import subprocess
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.config import EngineConfig, ModelConfig
from workers.attention.kernel_probe import compile_for_sm90, probe_launches, specialization_key
from workers.attention.triton_backend import launch_config_for
from workers.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]
H100_NUM_SMS = 132


def resource_usage(cubin: bytes) -> str:
    """``REG:.. STACK:.. SHARED:.. LOCAL:..`` of a cubin (LOCAL > 0 means register spills)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:\d+.*", out.stdout)
    return found.group(0).strip() if found else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bench/configs/gemma-2-2b")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--require-no-spills", action="store_true", help="exit 1 if any variant spills")
    args = parser.parse_args()
    torch.backends.mkldnn.enabled = False  # NOTE: see layer_ops.py (bf16 oneDNN/AMX faults in some VMs)

    config = json.loads((ROOT / args.model / "config.json").read_text())
    config.update(num_hidden_layers=2, vocab_size=512)
    variants: dict[tuple[str, str], tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}

    def collect(name: str, kernel: Any, launch_args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        variants.setdefault(
            (name, specialization_key(kernel, launch_args, kwargs)), (kernel, launch_args, kwargs)
        )
        if name == "top_p_race_kernel":
            launch_args[3].zero_()  # NOTE: the winners feed a gather; unlaunched, they must be valid ids

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        engine_config = EngineConfig(
            model=ModelConfig(path=tmp, dtype="bfloat16", max_model_len=args.max_model_len), device="cpu",
            num_kv_blocks=args.max_model_len // 16 + 2, attention_backend="triton", load_format="dummy",
        )  # fmt: skip
        runner = ModelRunner(engine_config, tmp)
        # NOTE: the H100's launch configuration (132 SMs), so decode split-K is sized as it will be there.
        runner.backend.launch_config = launch_config_for(runner.arch.head_dim, H100_NUM_SMS)  # type: ignore[attr-defined]
        runner.sampler.use_triton = True  # the CUDA sampler: top-p race and seeded noise kernels
        with probe_launches(collect, launch=False):
            runner.warm_up_kernels()
    print(f"{args.model}: {len(variants)} variants from the warm-up (2 layers, bf16, sm_90)")
    total = 0.0
    num_spilling = 0
    for (name, _), (kernel, launch_args, kwargs) in sorted(variants.items(), key=lambda kv: kv[0][0]):
        t0 = time.perf_counter()
        compiled = compile_for_sm90(kernel, launch_args, kwargs)
        seconds = time.perf_counter() - t0
        total += seconds
        flags = {k: v for k, v in kwargs.items() if isinstance(v, bool)}
        usage = resource_usage(compiled.asm["cubin"])
        num_spilling += "LOCAL:0 " not in usage
        print(f"  {name:22s} {seconds:5.1f} s  {usage}  {flags}")
    print(f"total compile time {total:.1f} s")
    if args.require_no_spills and num_spilling:
        raise SystemExit(f"{num_spilling} variant(s) use local memory (register spills)")


if __name__ == "__main__":
    main()
