"""Every Triton kernel variant the runner's warm-up launches compiles for an H100 (sm_90), without spills.

The interpreter (how every other CPU test runs the kernels) accepts code the compiler rejects, so this
compiles for real: ``bench/compile_kernels.py`` in a subprocess with ``TRITON_INTERPRET=0`` and a fresh
Triton cache, at Gemma-2-2B shapes (soft-capping, sliding window, split-K decode, sandwich norms,
GeGLU) and Qwen3-0.6B shapes (q/k norm in the rotary kernel, SiLU, plain norms).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemma-2-2b", "qwen3-0.6b"])
def test_warm_up_variants_compile_for_sm90_without_spills(model: str, tmp_path: pathlib.Path) -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    result = subprocess.run(
        [sys.executable, "bench/compile_kernels.py", "--model", f"bench/configs/{model}", "--require-no-spills"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    compiled = [line for line in lines if "REG:" in line]
    expected = {"decode_kernel", "decode_reduce_kernel", "prefill_kernel", "kv_write_kernel",
                "rms_norm_kernel", "rotary_kernel", "gated_act_kernel", "logits_kernel",
                "seeded_noise_kernel", "top_p_race_kernel"}  # fmt: skip
    assert {line.split()[0] for line in compiled} == expected
    assert all("LOCAL:0 " in line for line in compiled)
