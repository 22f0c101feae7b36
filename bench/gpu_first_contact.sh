#!/usr/bin/env bash
# One device call on a bare lent GPU machine (no Ray, no network; Python 3.12, torch + CUDA, Triton,
# transformers), at most 9 minutes, every figure and log under $OUT:
#
#   bench/gpu_first_contact.sh            # on the GPU machine, from the repository root
#   bench/gpu_first_contact.sh --dry-run  # anywhere (CI runs it): collects, prints the plan, runs nothing on a GPU
#
# Steps, in order, each under its own time cap (caps plus a 15 s kill grace each: 540 s, 9 minutes):
#   1. env         20 s   carried wheels (.whl/, see README "GPU first contact") installed to /tmp/site;
#                         nvidia-smi, python, torch, CUDA, Triton, transformers, which optional packages are there
#   2. async       85 s   Gemma-2-2B throughput workload (bench/gpu_throughput.py), async scheduling (the CUDA
#                         default): out tok/s, kernels per step, host/device time per step, time over the floor
#   3. tests      160 s   every `gpu`-marked test (pytest -m gpu: compiled Triton, bf16 agreement, CUDA graphs,
#                         KV sizing, the CUDA IPC transfer between two processes on one GPU, the device digest)
#   4. sync        70 s   the same workload with --no-async-scheduling
#   5. digest      15 s   the transfer's device digest (bench/device_digest.py), GB/s against device copies
#   6. profile     45 s   256 requests of the workload, async, under cProfile: where the host's time per step goes
#   7. tp          40 s   with 2+ GPUs: bench/tp_step.py --tp 1 2 (tensor parallelism over NCCL: ranks, step
#                         broadcast, all-reduces, the LM head's gather; ms a step, outputs against TP=1);
#                         one GPU: says so (NCCL refuses two ranks on one device)
# A step that fails or runs past its cap is reported and the next one runs. Output: $OUT/summary.txt (the
# table printed last), $OUT/{env,async,tests,sync,digest,profile,tp}.log (eight files:
# the device tool brings back at most eight).
set -u
cd "$(dirname "$0")/.."
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
# (--env-report: step 1 alone, as the script runs it under its cap)
OUT="${OUT:-out/gpu_first_contact}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
[[ "${1:-}" == "--env-report" ]] || : >"$SUMMARY"
GEMMA=(bench/gpu_throughput.py --model bench/configs/gemma-2-2b)

step() {  # step NAME CAP_S COMMAND...
    local name=$1 cap=$2
    shift 2
    if ((DRY_RUN)); then
        printf '%-6s %4ss  would run: %s\n' "$name" "$cap" "$*" | tee -a "$SUMMARY"
        return 0
    fi
    local t0=$SECONDS rc
    echo "=== $name (cap ${cap} s): $*"
    timeout -s INT -k 15 "$cap" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$name.log"
    local figure
    figure=$(grep -E "output tokens/s|passed|failed|error|GB/s" "$OUT/$name.log" | tail -n 1 | cut -c1-110)
    printf '%-6s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$figure" >>"$SUMMARY"
}

env_report() {
    if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        echo "carried wheels installed: $(ls .whl | wc -l)"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
    "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count)
for name in ("triton", "transformers", "zmq", "ray", "xgrammar", "fastapi", "cryptography"):
    try:
        print(name, getattr(__import__(name), "__version__", "present"))
    except ImportError as e:
        print(name, "absent:", e)
EOF
}

if [[ -d .whl ]]; then export PYTHONPATH="/tmp/site:$PYTHONPATH"; fi
if [[ "${1:-}" == "--env-report" ]]; then
    env_report
    exit
fi
if ((DRY_RUN)); then
    echo "dry run: the plan, then a collection of the gpu tests (no GPU work)"
    "$PY" -m pytest -q -m gpu --collect-only tests | tail -n 1 | tee -a "$SUMMARY"
fi
step env 20 bash "$0" --env-report
step async 85 "$PY" "${GEMMA[@]}"
step tests 160 "$PY" -m pytest -m gpu -q -rsP --continue-on-collection-errors --timeout 150 -p no:randomly tests
step sync 70 "$PY" "${GEMMA[@]}" --no-async-scheduling
step digest 15 "$PY" bench/device_digest.py
step profile 45 "$PY" "${GEMMA[@]}" --num-requests 256 --profile-steps 2 --cprofile
step tp 40 bash -c 'if (( $(nvidia-smi -L | wc -l) >= 2 )); then '"$PY"' bench/tp_step.py --tp 1 2 --repeats 2;
    else echo "one GPU: NCCL refuses two ranks on one device; tensor parallelism not run"; fi'
if ((!DRY_RUN)); then
    echo "=== summary"
    cat "$SUMMARY"
fi
