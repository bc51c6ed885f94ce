#!/usr/bin/env bash
# Ready means warm, on one GPU: DeepSeek-V3 shapes, 4 layers, FP8, random weights (the model flags of
# tools/v32_gpu.sh, served from a config.json by tools/dsv3_config.py), started once with
# --skip-server-warmup and once without, each with an empty Triton cache of its own; each sent two
# waves of 64 concurrent requests of 128-token prompts and 16 output tokens (tools/warm_gpu.py). Prints
# each wave's median TTFT, the kernels compiled after the server said ready, and the start-up phases
# from the log:
#
#   OUT=/some/dir bash tools/warm_gpu.sh
#
# The image lacks the HTTP stack: carry cp312 wheels of fastapi, uvicorn, pyzmq, msgspec,
# prometheus_client, httpx and their dependencies (fastapi's telemetry module imports opentelemetry-api,
# which needs importlib-metadata and zipp) in tmp/wheels (`pip download --only-binary=:all:
# --python-version 3.12 -d tmp/wheels ...`); they are installed into /tmp/site.
#
# On an H100 (2026-12-06, 4 layers, FP8): without the warm-up the waves' median TTFT was 4,583 and
# 1,296 ms (5 kernels compiled after ready); with it 231 and 123 ms (none), the warm-up 13.7 s of
# 51 passes after 28 s of graph capture.
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -uo pipefail
OUT="${OUT:-$PWD/tmp/warm_gpu}"
status=0
# shellcheck source=tools/step.sh
source "$(dirname "$0")/step.sh"
gpu_setup warm_gpu.log
MODEL=/tmp/dsv3-4l
python3 tools/dsv3_config.py "$MODEL" --layers 4
echo "=== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1) $(git rev-parse --short HEAD 2>/dev/null)"
SERVER="--model-path $MODEL --load-format dummy --device cuda --quantization fp8 --context-length 8192 \
--max-running-requests 256 --chunked-prefill-size 8192 --mem-fraction-static 0.85 ${EXTRA_SERVER_ARGS:-}"
step warm "${LIMIT:-580}" python3 tools/warm_gpu.py --server-args "$SERVER" --log-dir "$OUT/logs" --disable-tqdm \
    --num-prompts "${PROMPTS:-64}" --random-input-len "${INPUT_LEN:-128}" --random-output-len "${OUTPUT_LEN:-16}" \
    --random-range-ratio 1 --output-json "$OUT/warm.json"
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "=== done, status $status"
exit $status
