#!/usr/bin/env bash
# DeepSeek-V3.2 (sparse attention) beside DeepSeek-V3 (dense MLA) on one GPU, in steps (JSON and
# logs under $OUT):
#
#   OUT=/some/dir STEPS="tests decode prefill" bash tools/v32_gpu.sh
#
#   tests    the GPU tests of the indexer, sparse MLA, the MLA kernels and the V3.2 model
#   decode   bench rank, one decode step (4 layers, FP8, EP72 share + 32 redundant) for both
#            models at 32 x 4K, 256 x 4K, 256 x 32K and 32 x 128K sequences x cached tokens
#   prefill  bench one-batch, one prompt of 4K, 32K and 128K tokens (4 layers, FP8, chunks of
#            16K tokens) for both models
#   json     bench one-batch, DeepSeek-V3 (4 layers, FP8), decode at 64 and 256 sequences with 0 and
#            half of the batch held to a JSON schema (xgrammar, through the engine's sampler)
#   deploy   bench deployment (61 layers), decode at the reference's layout, both models, as many
#            sequences a GPU as V3.2 fits on an 80 GB card: 224 over 2K (the reference: 256), 12 over 32K
# Run from the repository root with the machine's python3 (torch with CUDA, Triton). The image lacks
# the HTTP stack the CLI imports: carry cp312 wheels of fastapi, uvicorn, pyzmq, msgspec,
# prometheus_client, httpx (and xgrammar with apache-tvm-ffi for the json step) in tmp/wheels (`pip download --only-binary=:all: --python-version 3.12
# -d tmp/wheels ...`); they are installed into /tmp/site.
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/v32_gpu}"
REPEATS="${REPEATS:-10}"
DECODE_SHAPES="${DECODE_SHAPES:-32x4096 256x4096 256x32768 32x131072}"
PROMPTS="${PROMPTS:-4096 32768 131072}"
M="python3 -m moeserve.server.cli"
status=0
# shellcheck source=tools/step.sh
source "$(dirname "$0")/step.sh"
gpu_setup v32_gpu.log
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for s in ${*:-${STEPS:-tests decode prefill}}; do
    case $s in
    tests)
        # shellcheck disable=SC2086
        step tests "${TESTS_LIMIT:-300}" python3 -m pytest -p no:cacheprovider -q -rfE -m gpu --durations=10 \
            ${TESTS:-tests/kernels/test_indexer.py tests/models/test_v32.py tests/kernels/test_triton_mla.py \
            tests/executor/test_cuda_graph.py} ;;
    decode)
        for shape in $DECODE_SHAPES; do
            for preset in dsv3 dsv32; do
                step "decode-$preset-$shape" "${BENCH_LIMIT:-240}" $M bench rank --preset "$preset" --num-layers 4 \
                    --quantization fp8 --role decode --ep-size 72 --redundant 32 --batch-per-rank "${shape%x*}" \
                    --context "${shape#*x}" --repeats "$REPEATS" --json "$OUT/decode_${preset}_$shape.json"
            done
        done ;;
    prefill)
        for n in $PROMPTS; do
            for preset in dsv3 dsv32; do
                step "prefill-$preset-$n" "${BENCH_LIMIT:-240}" $M bench one-batch --preset "$preset" --num-layers 4 \
                    --quantization fp8 --batch-size 1 --input-len "$n" --output-len 1 --max-prefill-tokens 16384 \
                    --max-total-tokens $((n + 65536)) --json "$OUT/prefill_${preset}_$n.json"
            done
        done ;;
    json)
        step json "${BENCH_LIMIT:-240}" $M bench one-batch --preset dsv3 --num-layers 4 --quantization fp8 \
            --batch-size 64 256 --input-len 128 --output-len 64 --json-schema-share 0 0.5 \
            --json "$OUT/json_schema.json" ;;
    deploy)
        for preset in dsv3 dsv32; do
            step "deploy-$preset-2k" "${DEPLOY_LIMIT:-200}" $M bench deployment --preset "$preset" --roles decode \
                --overlap on --repeats 2 --batch-per-rank "${DEPLOY_BATCH_2K:-224}" --json "$OUT/deploy_${preset}_2k.json"
            step "deploy-$preset-32k" "${DEPLOY_LIMIT:-200}" $M bench deployment --preset "$preset" --roles decode \
                --overlap on --repeats 2 --context 32768 --batch-per-rank "${DEPLOY_BATCH_32K:-12}" \
                --json "$OUT/deploy_${preset}_32k.json"
        done ;;
    *) echo "unknown step $s"; status=1 ;;
    esac
done
exit $status
