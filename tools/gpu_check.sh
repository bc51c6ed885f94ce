#!/usr/bin/env bash
# One-GPU checks and benchmarks of the fast path, in one go:
#
#   OUT=/some/dir STEPS="tests sweep kernels engine" bash tools/gpu_check.sh
#
# Run from the repository root with the machine's python3 (torch with CUDA, Triton); the
# repository need not be installed. Steps (default: all, in this order):
#   tests   the GPU tests (kernels against torch references, CUDA graphs, FP8 weights)
#   sweep   launch-config sweeps of the GEMM, MLA and elementwise kernels (SWEEP_ONLY filters)
#   kernels every kernel microbenchmark against the copy / matmul ceilings -> $OUT/kernels.json
#   engine  bench compare-hf (DeepSeek-V3 shapes, 4 layers, moeserve vs transformers, roofline)
#           and bench one-batch with FP8 weights -> $OUT/compare_hf.json, $OUT/one_batch_fp8.json
# Writes everything printed to $OUT/gpu_check.log; exits non-zero when a step fails.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/gpu_check}"
STEPS="${STEPS:-tests sweep kernels engine}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
status=0

# shellcheck source=tools/step.sh
source "$(dirname "$0")/step.sh"

echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for s in $STEPS; do
    case $s in
    tests)
        # shellcheck disable=SC2086
        step tests "${TESTS_LIMIT:-300}" python3 -m pytest -p no:cacheprovider -q -rfE -m gpu --durations=10 \
            ${TEST_PATHS:-tests/kernels tests/executor tests/models} ;;
    sweep)
        for area in gemm mla elementwise; do
            step "sweep-$area" "${SWEEP_LIMIT:-200}" python3 -c \
                "from moeserve.bench.kernel_cases.$area import sweep; sweep(${SWEEP_ONLY:+'$SWEEP_ONLY'})"
        done ;;
    kernels)
        step kernels "${KERNELS_LIMIT:-200}" python3 -m moeserve.server.cli bench kernels --json "$OUT/kernels.json" ;;
    engine)
        step compare-hf "${ENGINE_LIMIT:-420}" python3 -m moeserve.server.cli bench compare-hf \
            --cuda-graph-max-bs 128 --json "$OUT/compare_hf.json"
        step one-batch-fp8 "${FP8_LIMIT:-150}" python3 -m moeserve.server.cli bench one-batch --preset dsv3 \
            --num-layers 4 --batch-size 32 128 --input-len 256 --output-len 16 --quantization fp8 --cuda-graph-max-bs 128 \
            --json "$OUT/one_batch_fp8.json" ;;
    *) echo "unknown step $s"; status=2 ;;
    esac
done
echo "=== done, status $status"
exit $status
