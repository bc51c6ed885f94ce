#!/usr/bin/env bash
# Multi-GPU checks and the dispatch benchmark in one go, on a machine with 2 to 8 GPUs.
#
#   OUT=/some/dir bash tools/multi_gpu.sh
#
# Run from the repository root with the machine's python3 (torch with CUDA); the repository need
# not be installed. Installs nothing: a missing Python package is reported and the script stops.
# Writes $OUT/multi_gpu.log (everything printed) and $OUT/dispatch_ep<N>.json. Exits non-zero
# when a check fails; the benchmark runs even then, so one run gives all there is to see.
#   1. GPU layouts over NCCL give the one-GPU engine's greedy tokens (tests/distributed/test_layouts_gpu.py),
#      among them low-latency dispatch over symmetric memory (symm_mem) and decode CUDA graphs on every rank
#   2. low-latency dispatch -> experts -> combine replays from a CUDA graph (tests/distributed/test_ll_cuda_graph.py)
#   3. the symm_mem peer dispatcher across processes, eager and in CUDA graphs (tests/distributed/test_peer_ranks.py)
#   4. dispatch/combine bandwidth and latency of the torch and symm_mem backends, EP = every GPU (and EP = 2),
#      in BF16 and with FP8 dispatch

# NVLink multicast stays off everywhere, in every process started from here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail

OUT="${OUT:-$PWD/tmp/multi_gpu}"
PYTEST=(python3 -m pytest -p no:cacheprovider -q -x -rA --durations=15)
# wall-clock limits per step (seconds), so that 2 GPUs finish within 8 minutes even when a step
# hangs; SIGINT first, so pytest tears its rank processes down. The layouts get longer with more GPUs.
GRAPH_LIMIT="${GRAPH_LIMIT:-75}" BENCH_LIMIT="${BENCH_LIMIT:-90}"
read -ra BENCH_ARGS <<< "${BENCH_ARGS:-}"  # extra flags for the benchmark, e.g. BENCH_ARGS="--iters 100"

STEP_KILL_AFTER=15
# shellcheck source=tools/step.sh
source "$(dirname "$0")/step.sh"

environment() {
    echo "=== environment"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
    nvidia-smi topo -m || true
    env | grep -E '^(NCCL_|TORCH_SYMM_MEM_|NVSHMEM_|CUDA_VISIBLE_DEVICES)' | sort
    python3 - <<'EOF'
import importlib.metadata as md
import sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| NCCL", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
for name in ("triton", "transformers", "pyzmq", "pytest", "pytest-timeout"):
    try:
        print(f"{name} {md.version(name)}", end=" | ")
    except md.PackageNotFoundError:
        print(f"{name} MISSING", end=" | ")
print()
print("GPUs:", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
}

missing_modules() {  # what the tests and the benchmark import, beyond torch
    python3 - <<'EOF'
import importlib.util

need = {"zmq": "pyzmq", "tqdm": "tqdm", "numpy": "numpy", "safetensors": "safetensors", "tokenizers": "tokenizers",
        "transformers": "transformers", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
}

main() {
    status=0
    environment
    local gpus missing
    gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    if (( gpus < 2 )); then
        echo "needs at least 2 GPUs, found $gpus"; return 2
    fi
    missing=$(missing_modules)
    if [[ -n "$missing" ]]; then
        echo "missing Python packages: $missing"
        echo "carry their wheels and install them before this script, e.g."
        echo "  python3 -m pip install -q --no-index --no-deps --target /tmp/site WHEELS && export PYTHONPATH=/tmp/site"
        return 3
    fi
    local layout_limit="${LAYOUT_LIMIT:-$(( gpus > 2 ? 420 : 270 ))}"
    step "GPU layouts vs one GPU" "$layout_limit" "${PYTEST[@]}" --timeout 150 tests/distributed/test_layouts_gpu.py
    step "low-latency dispatch in a CUDA graph" "$GRAPH_LIMIT" "${PYTEST[@]}" --timeout 60 \
        tests/distributed/test_ll_cuda_graph.py
    step "symm_mem peer dispatch across processes" "$GRAPH_LIMIT" "${PYTEST[@]}" --timeout 60 \
        tests/distributed/test_peer_ranks.py
    local worlds=("$gpus")
    (( gpus > 2 )) && worlds+=(2)
    for n in "${worlds[@]}"; do
        step "dispatch benchmark, EP=$n" "$BENCH_LIMIT" python3 -m moeserve.bench.dispatch --world-size "$n" \
            --output-json "$OUT/dispatch_ep$n.json" "${BENCH_ARGS[@]}"
        step "dispatch benchmark, EP=$n, FP8 dispatch" "$BENCH_LIMIT" python3 -m moeserve.bench.dispatch \
            --world-size "$n" --fp8-dispatch --output-json "$OUT/dispatch_ep${n}_fp8.json" "${BENCH_ARGS[@]}"
    done
    echo; echo "=== done in ${SECONDS}s, exit $status"
    return "$status"
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/multi_gpu.log"
exit "${PIPESTATUS[0]}"
