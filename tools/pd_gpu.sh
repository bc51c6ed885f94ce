#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU: KV transfer bandwidth of the torch backend, then a
# monolithic server against a prefill server + a decode server + the router (both on this one
# GPU, memory split between them) under the same mixed load, DeepSeek-V3 shapes, 4 layers, FP8,
# random weights:
#
#   OUT=/some/dir [RUNS="mixed burst"] [CHECKS=0] bash tools/pd_gpu.sh
#
# CHECKS=0 skips the transfer bandwidth and the GPU transfer test; RUNS picks the workloads.
# The image lacks the HTTP stack (fastapi, uvicorn, pyzmq, msgspec): carry their cp312 wheels in
# tmp/wheels (`pip download --only-binary=:all: --python-version 3.12 -d tmp/wheels fastapi uvicorn
# pyzmq msgspec`); they are installed into /tmp/site. Writes $OUT/pd_gpu.log and JSON / PNG files.
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/pd_gpu}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/pd_gpu.log") 2>&1
source "$(dirname "$0")/step.sh"
status=0
if [ -d tmp/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site tmp/wheels/*.whl || status=1
fi
MODEL=/tmp/dsv3-4l
python3 tools/dsv3_config.py "$MODEL" --layers 4
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
[[ ${CHECKS:-1} == 1 ]] && step transfer "${TRANSFER_LIMIT:-120}" python3 -m moeserve.server.cli bench transfer --backend torch --device cuda \
    --json "$OUT/transfer_gpu.json"
[[ ${CHECKS:-1} == 1 ]] && step gpu-tests "${TESTS_LIMIT:-120}" python3 -m pytest -p no:cacheprovider -q -rfE -m gpu tests/disagg/test_backends.py
SERVER="--model-path $MODEL --load-format dummy --device cuda --quantization fp8 --context-length 8192 \
--max-running-requests 256 --cuda-graph-max-bs 256 --chunked-prefill-size 8192 --max-queued-requests 4096"
RUNS="${RUNS:-mixed burst}"
pd() {  # NAME LIMIT WORKLOAD...: one side-by-side run
    local name=$1 limit=$2
    shift 2
    step "pd-$name" "$limit" python3 -m moeserve.server.cli bench pd --server-args "$SERVER" \
        --monolithic-args "--mem-fraction-static 0.85" --prefill-args "--mem-fraction-static 0.42" \
        --decode-args "--mem-fraction-static 0.85" --transfer-backend torch --log-dir "$OUT/$name" --disable-tqdm \
        --output-json "$OUT/pd_$name.json" --plot "$OUT/pd_$name.png" "$@"
}
# long prompts arriving while others decode
[[ $RUNS == *mixed* ]] && pd mixed "${PD_LIMIT:-300}" --dataset mixed --num-prompts 256 --request-rate 16 --random-input-len 256 \
    --random-output-len 256 --random-range-ratio 0.5 --mixed-long-fraction 0.2 --mixed-long-input-len 4096
# the burst of the report that asked for PD: 512 requests of up to 1024 prompt tokens at once
[[ $RUNS == *burst* ]] && pd burst "${PD_LIMIT:-300}" --dataset random --num-prompts 512 --request-rate inf --random-input-len 1024 \
    --random-output-len 128 --random-range-ratio 0.1
# shellcheck disable=SC2086
tar -czf "$OUT/logs.tgz" -C "$OUT" $RUNS && (cd "$OUT" && rm -rf $RUNS)
echo "=== done, status $status"
exit $status
